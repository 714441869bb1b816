"""Prometheus metrics of the server, in the text exposition format (written by hand: no client
library needed for a handful of counters, gauges and histograms).

What is measured where:

- latency (TTFT, TPOT, end-to-end) and token counts: by the engine thread as it hands each step's
  outputs to the requests (so they time the engine and the queues, not the HTTP client);
- requests running / waiting and the pools' blocks: a snapshot the engine thread publishes after
  every step (:class:`~oasiskv.serve.engine_loop.EngineSnapshot`);
- bytes fetched per step and lookahead recall: from each finished request's
  :class:`~oasiskv.RequestMetrics`.

``oasis_transfer_wait_seconds_total`` (the time the compute stream waited on the background
selection chain and its host-to-GPU transfers) comes from :meth:`~oasiskv.engine.Engine.transfer_wait`:
device clocks read by two one-thread kernels around each wait, captured into CUDA graphs too; the
engine thread reads the counters at most twice a second; it stays 0 on the CPU, where the chain
runs inline. ``oasis_preemptions_total`` is exposed for dashboards to be complete but is always 0
because admission reserves each request's peak KV need, so nothing is ever preempted.
"""

from __future__ import annotations

import bisect
import math
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FETCH_BUCKETS = tuple(float(1024 * 4**i) for i in range(11))  # 1 KiB .. 1 GiB
RECALL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 1e15 else repr(v)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        if math.isnan(v):
            return
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for le, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            acc += c
            out.append(f'{self.name}_bucket{{le="{_fmt(le)}"}} {acc}')
        out.append(f"{self.name}_sum {_fmt(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


class ServerMetrics:
    """Every metric of one server. Thread-safe: the engine thread records, the HTTP side renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.fetched_bytes = 0
        self.ttft = Histogram(
            "oasis_time_to_first_token_seconds", "Arrival to first token, per request.", TTFT_BUCKETS
        )
        self.tpot = Histogram(
            "oasis_time_per_output_token_seconds",
            "Mean time between tokens after the first, per request.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram("oasis_request_latency_seconds", "Arrival to finish, per request.", E2E_BUCKETS)
        self.fetch = Histogram(
            "oasis_kv_fetched_bytes_per_step",
            "KV bytes fetched from the host pool per decode step, per finished sparse request.",
            FETCH_BUCKETS,
        )
        self.recall = Histogram(
            "oasis_lookahead_recall",
            "Lookahead recall (predicted blocks against the next step's exact top-K), per finished "
            "request that measured it.",
            RECALL_BUCKETS,
        )

    # ------------------------------------------------------------------ recording
    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def add_prompt(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def finish(self, reason: str, e2e_s: float, tpot_s: float | None, metrics) -> None:
        """A request finished: its reason, latency, mean TPOT and its engine metrics."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)
            if metrics is not None:
                self.fetched_bytes += int(metrics.fetched_bytes_total)
                if metrics.sparse_steps:
                    self.fetch.observe(float(metrics.fetched_bytes_per_step))
                if metrics.lookahead_recall is not None:
                    self.recall.observe(float(metrics.lookahead_recall))

    # ------------------------------------------------------------------ rendering
    def render(self, snap) -> str:
        """The exposition text; ``snap`` is the engine thread's latest
        :class:`~oasiskv.serve.engine_loop.EngineSnapshot`."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lines.append(f"{name}{labels} {_fmt(v)}")

        per = snap.page_bytes
        with self._lock:
            metric(
                "oasis_requests_running",
                "gauge",
                "Admitted requests (prefilling or decoding).",
                [("", snap.running)],
            )
            metric(
                "oasis_requests_waiting", "gauge", "Requests queued, not admitted yet.", [("", snap.waiting)]
            )
            metric(
                "oasis_prompt_tokens_total",
                "counter",
                "Prompt tokens of requests the engine accepted.",
                [("", self.prompt_tokens)],
            )
            metric(
                "oasis_generation_tokens_total",
                "counter",
                "Tokens generated.",
                [("", self.generation_tokens)],
            )
            metric(
                "oasis_requests_finished_total",
                "counter",
                "Finished requests by finish reason.",
                [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(self.finished.items())],
            )
            metric(
                "oasis_requests_rejected_total",
                "counter",
                "Requests refused before reaching the engine, by reason.",
                [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected.items())],
            )
            for h in (self.ttft, self.tpot, self.e2e):
                lines.extend(h.render())
            metric(
                "oasis_kv_gpu_pool_bytes",
                "gauge",
                "Bytes of the GPU page pool (allocated).",
                [("", snap.gpu_pages * per)],
            )
            metric(
                "oasis_kv_gpu_resident_bytes",
                "gauge",
                "Bytes of GPU pages held by requests.",
                [("", (snap.gpu_pages - snap.gpu_free) * per)],
            )
            metric(
                "oasis_kv_host_pool_bytes",
                "gauge",
                "Bytes of the host block pool (allocated).",
                [("", snap.host_blocks * per)],
            )
            metric(
                "oasis_kv_host_bytes",
                "gauge",
                "Bytes of host blocks held by requests.",
                [("", (snap.host_blocks - snap.host_free) * per)],
            )
            metric(
                "oasis_kv_reserved_blocks",
                "gauge",
                "Blocks reserved by admitted requests (their peak need), per tier.",
                [('{tier="gpu"}', snap.gpu_reserved), ('{tier="host"}', snap.host_reserved)],
            )
            metric(
                "oasis_kv_pools_full",
                "gauge",
                "1 when no request holds or reserves a block (every block is back in its pool).",
                [("", 1 if snap.pools_full else 0)],
            )
            metric(
                "oasis_kv_fetched_bytes_total",
                "counter",
                "KV bytes fetched from the host pool, by finished requests.",
                [("", self.fetched_bytes)],
            )
            lines.extend(self.fetch.render())
            lines.extend(self.recall.render())
            metric(
                "oasis_transfer_wait_seconds_total",
                "counter",
                "Time the compute stream waited on the KV selection chain and its transfers "
                "(0 on the CPU, where the chain runs inline).",
                [("", snap.transfer_wait_s)],
            )
            metric(
                "oasis_preemptions_total",
                "counter",
                "Preempted requests. Always 0: admission reserves each request's peak KV need.",
                [("", 0)],
            )
            metric("oasis_engine_steps_total", "counter", "Engine steps run.", [("", snap.steps)])
            metric(
                "oasis_engine_errors_total",
                "counter",
                "Steps that raised (their requests finished with an error).",
                [("", snap.step_errors)],
            )
        return "\n".join(lines) + "\n"
