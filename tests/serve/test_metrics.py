"""``GET /metrics`` of ``oasis serve`` (SmolLM2 on the CPU): vLLM's series under ``oasis:``
parsed with ``prometheus_client``'s own parser, values that moved with the requests made, the API
key, one registry per server, and the Grafana dashboard in ``examples/`` naming only series the
server exposes."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx", "prometheus_client"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from oasiskv import KvConfig, LLMEngine  # noqa: E402
from oasiskv.models.loader import load_model  # noqa: E402
from oasiskv.serve import ServeConfig, ServerThread, build_app  # noqa: E402
from oasiskv.serve.metrics import HISTOGRAMS, OASIS_NAMES, VLLM_NAMES, ServerMetrics  # noqa: E402

torch.set_num_threads(2)

KV = dict(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64, recall_every=2)
KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Long enough (>64 tokens) to turn sparse, repetitive enough for the n-gram drafter to draft.
LONG = "Paged attention stores the KV cache in fixed-size blocks. " * 12 + "In one sentence, why?"
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json"
#: The names the issue lists (vLLM's, with oasis: for vllm:).
ISSUE_NAMES = (
    "oasis:num_requests_running",
    "oasis:num_requests_waiting",
    "oasis:kv_cache_usage_perc",
    "oasis:prompt_tokens_total",
    "oasis:generation_tokens_total",
    "oasis:time_to_first_token_seconds",
    "oasis:inter_token_latency_seconds",
    "oasis:e2e_request_latency_seconds",
    "oasis:request_queue_time_seconds",
    "oasis:spec_decode_num_draft_tokens_total",
    "oasis:spec_decode_num_accepted_tokens_total",
)


@pytest.fixture(scope="module")
def server():
    model, tok = load_model("smollm2")
    # One seat, so of two concurrent requests one waits (a queue time above 0); speculative, so the
    # drafts are verified and counted.
    eng = LLMEngine(
        model, tokenizer=tok, kv=KvConfig(**KV), drafter="ngram", max_num_seqs=1, speculative=True
    )
    srv = ServerThread(build_app(eng, ServeConfig("smollm2", api_key=KEY))).start()
    yield srv
    srv.stop()


def scrape(server, accept: str | None = None) -> dict[str, list]:
    """Every sample of one scrape by sample name (``x_bucket``, ``x_total``, ...)."""
    headers = dict(AUTH, **({"Accept": accept} if accept else {}))
    r = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples, name: str, **labels) -> float:
    got = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, samples.get(name))
    return got[0]


def wait_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{server.url}/health", timeout=10).json()
        if h["pools_full"] and h["inflight"] == 0:
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


@pytest.fixture(scope="module")
def after_requests(server):
    """Two concurrent completions (one waits for the single seat), scraped every 20 ms while they
    run (``seen``: running, waiting, GPU and host KV usage of each scrape), then once idle."""
    before = scrape(server)
    results, seen = [], []

    def call(i: int):
        body = {"model": "smollm2", "prompt": f"{LONG} ({i})", "max_tokens": 10, "temperature": 0}
        results.append(httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=300))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        s = scrape(server)
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_host_usage_perc")
        seen.append(tuple(value(s, f"oasis:{n}") for n in names))
        time.sleep(0.02)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    wait_idle(server)
    return before, scrape(server), [r.json()["usage"] for r in results], seen


def test_every_listed_name_is_exposed_with_vllm_labels(after_requests):
    after = after_requests[1]
    for name in (*ISSUE_NAMES, *VLLM_NAMES, *OASIS_NAMES):
        names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if name in HISTOGRAMS else [name]
        for n in names:
            assert n in after, f"{n} not in /metrics"
    for s in after["oasis:num_requests_running"] + after["oasis:time_to_first_token_seconds_count"]:
        assert s.labels["model_name"] == "smollm2" and s.labels["engine"] == "0"
    # vLLM's TTFT buckets, so histogram_quantile reads the same on both servers.
    les = [s.labels["le"] for s in after["oasis:time_to_first_token_seconds_bucket"]]
    assert les[:3] == ["0.001", "0.005", "0.01"] and les[-1] == "+Inf"


def test_values_moved_with_the_requests(after_requests):
    before, after, usages, _ = after_requests

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("oasis:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("oasis:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for h in (
        "oasis:time_to_first_token_seconds",
        "oasis:e2e_request_latency_seconds",
        "oasis:request_queue_time_seconds",
        "oasis:request_time_per_output_token_seconds",
    ):
        assert delta(f"{h}_count") == 2, h
    assert delta("oasis:inter_token_latency_seconds_count") >= 2
    assert delta("oasis:e2e_request_latency_seconds_sum") > 0
    # One of the two waited for the seat while the other ran: its queue time is at least the
    # other's time to its first token.
    assert delta("oasis:request_queue_time_seconds_sum") > 0
    finished = sum(delta("oasis:request_success_total", finished_reason=r) for r in ("length", "stop"))
    assert finished == 2
    # Speculative: the n-gram drafts of the repetitive prompt were verified, some accepted.
    assert delta("oasis:spec_decode_num_draft_tokens_total") > 0
    assert delta("oasis:spec_decode_num_drafts_total") == delta("oasis:spec_decode_num_draft_tokens_total")
    acc = delta("oasis:spec_decode_num_accepted_tokens_total")
    assert 0 <= acc <= delta("oasis:spec_decode_num_draft_tokens_total")
    # OasisKV's own: both requests ran sparse, fetched from the host pool, measured recall.
    assert delta("oasis:kv_fetched_bytes_per_step_count") == 2
    assert delta("oasis:kv_fetched_bytes_total") > 0
    assert delta("oasis:lookahead_recall_count") == 2
    assert 0 <= value(after, "oasis:lookahead_recall_sum") <= value(after, "oasis:lookahead_recall_count")
    assert delta("oasis:engine_steps_total") > 0
    # Idle now: gauges back to zero, every block back in its pool.
    assert value(after, "oasis:num_requests_running") == 0 and value(after, "oasis:num_requests_waiting") == 0
    assert value(after, "oasis:kv_cache_usage_perc") == 0 and value(after, "oasis:kv_host_usage_perc") == 0
    assert value(after, "oasis:kv_pools_full") == 1
    assert value(after, "oasis:num_preemptions_total") == 0
    assert value(after, "oasis:transfer_wait_seconds_total") == 0  # the CPU runs the chain inline


def test_gauges_while_requests_run(after_requests):
    """One seat, two requests: a scrape saw one running and one waiting, with the KV usage
    fractions above 0 and at most 1."""
    seen = after_requests[3]
    assert any(run == 1 and wait == 1 for run, wait, _, _ in seen), seen
    busy = [(gpu, host) for run, _, gpu, host in seen if run == 1]
    assert busy and all(0 <= g <= 1 and 0 <= h <= 1 for g, h in busy)
    assert max(g for g, _ in busy) > 0 and max(h for _, h in busy) > 0


def test_metrics_need_the_api_key(server):
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert httpx.get(f"{server.url}/metrics", headers=bad, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).status_code == 200


def test_openmetrics_on_request(server):
    r = httpx.get(
        f"{server.url}/metrics", headers=dict(AUTH, Accept="application/openmetrics-text"), timeout=10
    )
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


def test_each_server_has_its_own_registry():
    """Two servers in one process do not share (or clash over) series."""
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.add_tokens(5)
    a.first_token(0.2)
    text_a, text_b = a.render()[0].decode(), b.render()[0].decode()
    assert 'oasis:generation_tokens_total{engine="0",model_name="a"} 5.0' in text_a
    assert 'oasis:generation_tokens_total{engine="0",model_name="b"} 0.0' in text_b
    b.first_token(float("nan"))  # ignored, not a poisoned sum
    assert 'oasis:time_to_first_token_seconds_count{engine="0",model_name="b"} 0.0' in b.render()[0].decode()


# ---------------------------------------------------------------------- the Grafana dashboard
#: PromQL words that are not series names.
PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "le", "without", "avg", "max",
    "min", "clamp_min", "clamp_max", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "offset", "count", "delta", "deriv", "vector", "scalar", "bool", "topk", "bottomk",
    "abs", "time", "model_name", "engine", "finished_reason", "tier", "reason", "interval",
    "rate_interval", "__rate_interval", "__interval", "job", "instance",
}  # fmt: skip


def series_in(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers outside label matchers and strings, that
    are not PromQL functions, keywords or durations."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"(?<![A-Za-z0-9_:])\d+(\.\d*)?([eE][-+]?\d+)?", "", expr)  # numbers (1e-9)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS and not n.startswith("$")}


def exposed_series(samples: dict) -> set[str]:
    """What a query may name: every sample name of a scrape."""
    return set(samples)


def dashboard_panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_dashboard_queries_name_exposed_series(after_requests):
    after = after_requests[1]
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exposed = exposed_series(after)
    panels = [p for p in dashboard_panels(doc) if p.get("type") != "row"]
    assert len(panels) >= 8
    named = set()
    for p in panels:
        exprs = [t["expr"] for t in p.get("targets", [])]
        assert exprs, f"panel {p.get('title')!r} has no query"
        for e in exprs:
            names = series_in(e)
            assert names, (p["title"], e)
            missing = names - exposed
            assert not missing, f"panel {p['title']!r} reads {sorted(missing)} which /metrics does not expose"
            named |= names
    # The panels the issue asks for: throughput, latency percentiles, running/waiting, KV usage,
    # host tier, fetched bytes, recall, speculative acceptance.
    for want in (
        "oasis:generation_tokens_total",
        "oasis:time_to_first_token_seconds_bucket",
        "oasis:inter_token_latency_seconds_bucket",
        "oasis:e2e_request_latency_seconds_bucket",
        "oasis:num_requests_running",
        "oasis:num_requests_waiting",
        "oasis:kv_cache_usage_perc",
        "oasis:kv_host_usage_perc",
        "oasis:kv_fetched_bytes_total",
        "oasis:lookahead_recall_sum",
        "oasis:spec_decode_num_accepted_tokens_total",
    ):
        assert want in named, want
    assert any("histogram_quantile" in t["expr"] for p in panels for t in p.get("targets", []))


def test_the_name_parser_sees_through_promql():
    e = (
        "histogram_quantile(0.99, sum by (le) (rate(oasis:e2e_request_latency_seconds_bucket"
        '{model_name=~"$model"}[$__rate_interval])))'
    )
    assert series_in(e) == {"oasis:e2e_request_latency_seconds_bucket"}
    e = "rate(a:x_total[5m]) / clamp_min(rate(b_total[5m]), 1e-9)"
    assert series_in(e) == {"a:x_total", "b_total"}
