"""Prometheus metrics of the server, through ``prometheus_client``, under vLLM's names.

Every series a vLLM dashboard reads is here with ``oasis:`` in place of ``vllm:`` and vLLM's
types, labels (``model_name``, ``engine``) and buckets, so a dashboard or alert written for vLLM
works by replacing the prefix. Each server has its own :class:`~prometheus_client.CollectorRegistry`
(never the process-global one), so several servers can run in one process (the tests do).

vLLM's names:

- gauges: ``oasis:num_requests_running`` (admitted: prefilling or decoding),
  ``oasis:num_requests_waiting`` (queued, not admitted yet), ``oasis:kv_cache_usage_perc`` (GPU
  KV pages held over the GPU pool's cap, 0-1);
- counters: ``oasis:prompt_tokens_total`` (of admitted requests), ``oasis:generation_tokens_total``,
  ``oasis:request_success_total{finished_reason}``, ``oasis:num_preemptions_total`` (always 0:
  admission reserves each request's peak KV need), ``oasis:spec_decode_num_drafts_total``,
  ``oasis:spec_decode_num_draft_tokens_total`` (one token per draft: the lookahead token) and
  ``oasis:spec_decode_num_accepted_tokens_total`` (``LLMEngine(speculative=True)``; 0 otherwise);
- histograms: ``oasis:time_to_first_token_seconds`` (arrival to first token),
  ``oasis:inter_token_latency_seconds`` (between consecutive outputs of a request),
  ``oasis:request_time_per_output_token_seconds`` (per request: (last - first token) / (n - 1)),
  ``oasis:e2e_request_latency_seconds`` (arrival to finish) and
  ``oasis:request_queue_time_seconds`` (arrival to admission).

OasisKV's own (the host tier and the lookahead have no vLLM counterpart):

- ``oasis:kv_host_usage_perc`` (host blocks held / the host pool's cap), ``oasis:kv_gpu_bytes`` and
  ``oasis:kv_host_bytes`` (bytes held by requests), ``oasis:kv_gpu_pool_bytes`` /
  ``oasis:kv_host_pool_bytes`` (allocated), ``oasis:kv_reserved_blocks{tier}`` (the admitted
  requests' peak need), ``oasis:kv_pools_full`` (1 when every block is back in its pool);
- ``oasis:kv_fetched_bytes_total`` and the histogram ``oasis:kv_fetched_bytes_per_step``: KV bytes
  read from the host pool, from each finished request's :class:`~oasiskv.RequestMetrics`;
- ``oasis:lookahead_recall``: each finished request's recall (predicted blocks against the next
  step's exact top-K), where it was measured;
- ``oasis:transfer_wait_seconds_total``: the time the compute stream waited on the background
  selection chain and its host-to-GPU transfers (:meth:`~oasiskv.engine.Engine.transfer_wait`:
  device clocks around each wait, read by the engine thread at most twice a second; 0 on the CPU,
  where the chain runs inline);
- ``oasis:requests_rejected_total{reason}``, ``oasis:engine_steps_total``,
  ``oasis:engine_step_errors_total``.

What is measured where: latencies and token counts by the engine thread as it hands each step's
outputs to the requests (they time the engine and its queue, not the HTTP client); gauges and the
engine-wide counters from the :class:`~oasiskv.serve.engine_loop.EngineSnapshot` the engine thread
publishes after every step, read at scrape time by a custom collector.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ..llm_engine import FINISH_REASONS

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile reads the same on both.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# OasisKV's own; arbitrary, spanning what the CPU and the H200 runs showed.
FETCH_BUCKETS = tuple(float(1024 * 4**i) for i in range(11))  # 1 KiB .. 1 GiB per step
RECALL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)

#: Every vLLM-named series the server exposes (as a scrape names its samples).
VLLM_NAMES = (
    "oasis:num_requests_running",
    "oasis:num_requests_waiting",
    "oasis:kv_cache_usage_perc",
    "oasis:prompt_tokens_total",
    "oasis:generation_tokens_total",
    "oasis:request_success_total",
    "oasis:num_preemptions_total",
    "oasis:time_to_first_token_seconds",
    "oasis:inter_token_latency_seconds",
    "oasis:request_time_per_output_token_seconds",
    "oasis:e2e_request_latency_seconds",
    "oasis:request_queue_time_seconds",
    "oasis:spec_decode_num_drafts_total",
    "oasis:spec_decode_num_draft_tokens_total",
    "oasis:spec_decode_num_accepted_tokens_total",
)
#: OasisKV's own series.
OASIS_NAMES = (
    "oasis:kv_host_usage_perc",
    "oasis:kv_gpu_bytes",
    "oasis:kv_host_bytes",
    "oasis:kv_gpu_pool_bytes",
    "oasis:kv_host_pool_bytes",
    "oasis:kv_reserved_blocks",
    "oasis:kv_pools_full",
    "oasis:kv_fetched_bytes_total",
    "oasis:kv_fetched_bytes_per_step",
    "oasis:lookahead_recall",
    "oasis:transfer_wait_seconds_total",
    "oasis:requests_rejected_total",
    "oasis:engine_steps_total",
    "oasis:engine_step_errors_total",
)
#: The histograms among them (a scrape shows their ``_bucket``, ``_sum`` and ``_count``).
HISTOGRAMS = frozenset(
    {
        "oasis:time_to_first_token_seconds",
        "oasis:inter_token_latency_seconds",
        "oasis:request_time_per_output_token_seconds",
        "oasis:e2e_request_latency_seconds",
        "oasis:request_queue_time_seconds",
        "oasis:kv_fetched_bytes_per_step",
        "oasis:lookahead_recall",
    }
)
LABELS = ("model_name", "engine")
#: Why the HTTP side refused a request before the engine saw it (``reject``'s reasons).
REJECT_REASONS = ("unauthorized", "bad_request", "overload")


def _observe(hist, value: float) -> None:
    """Observe ``value`` unless it is NaN (a NaN would poison the histogram's sum for good)."""
    if not math.isnan(value):
        hist.observe(value)


class _SnapshotCollector:
    """Reads the engine thread's latest snapshot at scrape time: the gauges, and the counters the
    engine keeps itself (steps, transfer wait, speculative drafts)."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.source: Callable[[], object] | None = None

    def describe(self):  # no samples at registration: the source is bound later
        return []

    def _fam(self, cls, name: str, help_: str, value: float, extra: dict[str, str] | None = None):
        names = list(LABELS) + list(extra or {})
        fam = cls(name, help_, labels=names)
        fam.add_metric(self.labels + list((extra or {}).values()), float(value))
        return fam

    def collect(self):
        snap = self.source() if self.source is not None else None
        if snap is None:
            return
        per, per_row = snap.page_bytes, snap.host_row_bytes or snap.page_bytes
        g_used, h_used = snap.gpu_pages - snap.gpu_free, snap.host_blocks - snap.host_free
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield self._fam(
            G, "oasis:num_requests_running", "Admitted requests (prefilling or decoding).", snap.running
        )
        yield self._fam(G, "oasis:num_requests_waiting", "Requests queued, not admitted yet.", snap.waiting)
        yield self._fam(
            G,
            "oasis:kv_cache_usage_perc",
            "GPU KV cache usage: pages held by requests over the GPU pool's cap (1 = full).",
            g_used / snap.gpu_cap if snap.gpu_cap else 0.0,
        )
        yield self._fam(
            G,
            "oasis:kv_host_usage_perc",
            "Host-tier KV usage: host blocks held by requests over the host pool's cap (1 = full).",
            h_used / snap.host_cap if snap.host_cap else 0.0,
        )
        yield self._fam(G, "oasis:kv_gpu_bytes", "Bytes of GPU KV pages held by requests.", g_used * per)
        yield self._fam(
            G, "oasis:kv_host_bytes", "Bytes of host KV blocks held by requests.", h_used * per_row
        )
        yield self._fam(
            G, "oasis:kv_gpu_pool_bytes", "Bytes of the GPU page pool (allocated).", snap.gpu_pages * per
        )
        yield self._fam(
            G,
            "oasis:kv_host_pool_bytes",
            "Bytes of the host block pool (allocated).",
            snap.host_blocks * per_row,
        )
        fam = GaugeMetricFamily(
            "oasis:kv_reserved_blocks",
            "Blocks reserved by admitted requests (their peak need), per tier.",
            labels=[*LABELS, "tier"],
        )
        fam.add_metric([*self.labels, "gpu"], snap.gpu_reserved)
        fam.add_metric([*self.labels, "host"], snap.host_reserved)
        yield fam
        yield self._fam(
            G,
            "oasis:kv_pools_full",
            "1 when no request holds or reserves a block (every block is back in its pool).",
            1 if snap.pools_full else 0,
        )
        yield self._fam(
            C,
            "oasis:transfer_wait_seconds",
            "Time the compute stream waited on the KV selection chain and its transfers "
            "(0 on the CPU, where the chain runs inline).",
            snap.transfer_wait_s,
        )
        yield self._fam(
            C,
            "oasis:num_preemptions",
            "Preempted requests. Always 0: admission reserves the peak KV need.",
            0,
        )
        yield self._fam(C, "oasis:engine_steps", "Engine steps run.", snap.steps)
        yield self._fam(
            C,
            "oasis:engine_step_errors",
            "Steps that raised (their requests finished with an error).",
            snap.step_errors,
        )
        drafts = "Speculative decoding: drafts verified (LLMEngine(speculative=True); 0 otherwise)."
        yield self._fam(C, "oasis:spec_decode_num_drafts", drafts, snap.spec_drafts)
        yield self._fam(
            C,
            "oasis:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified (one per draft: the lookahead token).",
            snap.spec_drafts,
        )
        yield self._fam(
            C,
            "oasis:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            snap.spec_accepted,
        )


class ServerMetrics:
    """Every metric of one server, in its own registry. Thread-safe: the engine thread records,
    the HTTP side renders (``prometheus_client``'s instruments lock themselves).

    Args:
        model_name: the ``model_name`` label (the id clients pass as ``model``).
        engine: the ``engine`` label (vLLM's data-parallel index; one engine here).
    """

    def __init__(self, model_name: str = "oasiskv", engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        lv = (model_name, engine)
        r = self.registry

        def counter(name, help_, extra=()):
            return Counter(name, help_, [*LABELS, *extra], registry=r)

        def histogram(name, help_, buckets):
            return Histogram(name, help_, list(LABELS), buckets=buckets, registry=r).labels(*lv)

        self._lv = lv
        self._prompt = counter("oasis:prompt_tokens", "Prompt tokens of admitted requests.").labels(*lv)
        self._generation = counter("oasis:generation_tokens", "Tokens generated.").labels(*lv)
        self._success = counter(
            "oasis:request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self._rejected = counter(
            "oasis:requests_rejected", "Requests refused before reaching the engine, by reason.", ("reason",)
        )
        # Every label value exists from the start (as vLLM does for finish reasons), so a rate()
        # over a reason that has not happened yet reads 0, not "no data".
        for reason in FINISH_REASONS:
            self._success.labels(*lv, reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(*lv, reason)
        self._fetched = counter(
            "oasis:kv_fetched_bytes", "KV bytes fetched from the host pool, by finished requests."
        ).labels(*lv)
        self.ttft = histogram(
            "oasis:time_to_first_token_seconds", "Arrival to first token, per request.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "oasis:inter_token_latency_seconds",
            "Time between consecutive outputs of a request (a speculative step's two tokens are one).",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "oasis:request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "oasis:e2e_request_latency_seconds", "Arrival to finish, per request.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "oasis:request_queue_time_seconds",
            "Arrival to admission (time spent waiting), per request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.fetch = histogram(
            "oasis:kv_fetched_bytes_per_step",
            "KV bytes fetched from the host pool per decode step, per finished sparse request.",
            FETCH_BUCKETS,
        )
        self.recall = histogram(
            "oasis:lookahead_recall",
            "Lookahead recall (predicted blocks against the next step's exact top-K), per finished "
            "request that measured it.",
            RECALL_BUCKETS,
        )
        self._snapshots = _SnapshotCollector(lv)
        r.register(self._snapshots)
        self._lock = threading.Lock()

    def watch(self, source: Callable[[], object]) -> None:
        """Read gauges from ``source()`` (an :class:`~oasiskv.serve.engine_loop.EngineSnapshot`)
        at every scrape."""
        self._snapshots.source = source

    # ------------------------------------------------------------------ recording
    def reject(self, reason: str) -> None:
        self._rejected.labels(*self._lv, reason).inc()

    def add_prompt(self, n: int) -> None:
        self._prompt.inc(n)

    def add_tokens(self, n: int) -> None:
        self._generation.inc(n)

    def first_token(self, seconds: float) -> None:
        _observe(self.ttft, seconds)

    def inter_token(self, seconds: float) -> None:
        _observe(self.itl, seconds)

    def queued(self, seconds: float) -> None:
        _observe(self.queue, seconds)

    def finish(self, reason: str, e2e_s: float, tpot_s: float | None, metrics) -> None:
        """A request finished: its reason, latency, mean TPOT and its engine metrics."""
        self._success.labels(*self._lv, reason).inc()
        _observe(self.e2e, e2e_s)
        if tpot_s is not None:
            _observe(self.tpot, tpot_s)
        if metrics is None:
            return
        self._fetched.inc(int(metrics.fetched_bytes_total))
        if metrics.sparse_steps:
            _observe(self.fetch, float(metrics.fetched_bytes_per_step))
        if metrics.lookahead_recall is not None:
            _observe(self.recall, float(metrics.lookahead_recall))

    # ------------------------------------------------------------------ rendering
    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition (body, content type) in the format ``accept`` asks for (the Prometheus
        text format unless it asks for OpenMetrics)."""
        encoder, content_type = choose_encoder(accept or "")
        with self._lock:
            return encoder(self.registry), content_type
