"""``oasis bench serve --base-url`` (``vllm bench serve``'s run) against ``oasis serve`` on SmolLM2
on the CPU: a ShareGPT-format file the test writes, the random long-context set, both OpenAI
endpoints; the report's counts, tokens (checked against the server's own ``/metrics``),
percentiles in order and the saved result file; the datasets and metrics on their own."""

from __future__ import annotations

import json

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx", "prometheus_client"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from oasiskv import KvConfig, LLMEngine  # noqa: E402
from oasiskv.bench import endpoint as ep  # noqa: E402
from oasiskv.bench import serve as bench  # noqa: E402
from oasiskv.errors import ConfigError  # noqa: E402
from oasiskv.models.loader import load_model  # noqa: E402
from oasiskv.serve import ServeConfig, ServerThread, build_app  # noqa: E402

torch.set_num_threads(2)

KEY = "bench-key"
#: (human, gpt) pairs; the answers' token counts become max_tokens.
EXCHANGES = [
    ("What is a KV cache in a transformer?", "It stores the keys and values of past tokens."),
    ("Name a planet of the solar system.", "Mars is the fourth planet from the Sun."),
    ("Why do long prompts need more memory?", "Each token adds keys and values in every layer."),
    ("Give me a colour of the rainbow please.", "Green is one of the colours of the rainbow."),
    ("Say something about paged attention.", "Paged attention keeps the cache in fixed blocks."),
]


def sharegpt_file(tmp_path):
    data = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}
        for i, (h, g) in enumerate(EXCHANGES)
    ]
    system_first = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Tell me about blocks in memory."},
        {"from": "gpt", "value": "Blocks are fixed-size pieces of memory."},
    ]
    data += [
        {"id": "lone", "conversations": [{"from": "human", "value": "A question nobody answered?"}]},
        {  # an answer under 4 tokens
            "id": "short",
            "conversations": [{"from": "human", "value": "Hello there!"}, {"from": "gpt", "value": "Fine."}],
        },
        {"id": "system-first", "conversations": system_first},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def server(smollm):
    model, tok = smollm
    kv = KvConfig(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
    eng = LLMEngine(model, tokenizer=tok, kv=kv, drafter="ngram", max_num_seqs=4)
    srv = ServerThread(build_app(eng, ServeConfig("smollm2", api_key=KEY))).start()
    yield srv
    srv.stop()


def counters(server) -> dict[str, float]:
    """The unlabelled-but-for-model series of /metrics (counters and gauges), by sample name."""
    auth = {"Authorization": f"Bearer {KEY}"}
    text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels.keys() - {"model_name", "engine"}:
                out[s.name] = s.value
    return out


def check_latencies(rep: dict, pcts: list[str]) -> None:
    """Every metric's percentiles in order, the median between them, all non-negative."""
    for m in ep.METRIC_KEYS:
        vals = [rep[f"p{p}_{m}_ms"] for p in pcts]
        assert vals == sorted(vals), (m, vals)
        assert 0 <= rep[f"median_{m}_ms"] <= rep[f"p{pcts[-1]}_{m}_ms"] and rep[f"std_{m}_ms"] >= 0
        assert rep[f"p{pcts[0]}_{m}_ms"] <= rep[f"mean_{m}_ms"] * 10  # sane scale, not garbage
    assert rep["mean_ttft_ms"] > 0 and rep["mean_e2el_ms"] >= rep["mean_ttft_ms"]


def test_sharegpt_against_oasis_serve(server, smollm, tmp_path, capsys):
    _, tok = smollm
    path = sharegpt_file(tmp_path)
    before = counters(server)
    args = [
        "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
        "--num-prompts", "3", "--max-concurrency", "2", "--model", "smollm2", "--api-key", KEY,
        "--ignore-eos", "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "run.json", "--seed", "3",
    ]  # fmt: skip
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 TTFT (ms):" in out and "Mean ITL (ms):" in out
    rep = json.loads((tmp_path / "run.json").read_text())
    assert rep["completed"] == 3 and rep["failed"] == 0 and rep["errors"] == [""] * 3
    assert rep["backend"] == "openai" and rep["model_id"] == "smollm2" and rep["dataset_name"] == "sharegpt"
    # The prompts are first human turns and max_tokens their gpt turn's token count (ignore_eos: the
    # server generates exactly that many), as the tokenizer counts them, in the seed's order.
    want = ep.sample_sharegpt(path, 3, tok, seed=3)
    assert rep["input_lens"] == [len(tok.encode(r.prompt)) for r in want]
    assert rep["output_lens"] == rep["expected_output_lens"] == [r.expected_output_len for r in want]
    answers = {h: len(tok.encode(g)) for h, g in EXCHANGES}
    answers["Tell me about blocks in memory."] = len(tok.encode("Blocks are fixed-size pieces of memory."))
    assert [answers[r.prompt] for r in want] == rep["output_lens"]
    assert rep["total_input_tokens"] == sum(rep["input_lens"])
    assert rep["total_output_tokens"] == sum(rep["output_lens"])
    # One gap between consecutive chunks: at most one chunk per token (the server's detokeniser may
    # hold a token back until the text it starts is complete, then send both in one chunk).
    assert all(1 <= len(itl) <= n - 1 for itl, n in zip(rep["itls"], rep["output_lens"], strict=True)), (
        [len(x) for x in rep["itls"]],
        rep["output_lens"],
    )
    check_latencies(rep, ["50", "90", "99"])
    assert rep["request_throughput"] == pytest.approx(3 / rep["duration"])
    assert rep["output_throughput"] == pytest.approx(rep["total_output_tokens"] / rep["duration"])
    # The server counted the same tokens (plus the unmeasured warm-up: the first request again).
    after = counters(server)
    warm_in, warm_out = rep["input_lens"][0], rep["output_lens"][0]
    prompt_delta = after["oasis:prompt_tokens_total"] - before["oasis:prompt_tokens_total"]
    gen_delta = after["oasis:generation_tokens_total"] - before["oasis:generation_tokens_total"]
    assert prompt_delta == rep["total_input_tokens"] + warm_in
    assert gen_delta == rep["total_output_tokens"] + warm_out


def test_random_long_context_and_chat(server, tmp_path):
    """The random set through /v1/completions (token ids: the server sees exactly that many) at a
    Poisson rate, and a ShareGPT run through /v1/chat/completions (--json PATH)."""
    out = tmp_path / "random.json"
    args = [
        "--base-url", server.url, "--dataset-name", "random", "--random-input-len", "96",
        "--random-output-len", "4", "--num-prompts", "2", "--request-rate", "20", "--api-key", KEY,
        "--ignore-eos", "--json", str(out), "--no-warmup",
    ]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 2 and rep["input_lens"] == [96] * 2 and rep["output_lens"] == [4] * 2
    assert rep["model_id"] == "smollm2"  # picked from /v1/models
    check_latencies(rep, ["99"])

    out = tmp_path / "chat.json"
    args = [
        "--base-url", server.url, "--endpoint", "/v1/chat/completions", "--dataset-path",
        str(sharegpt_file(tmp_path)), "--num-prompts", "1", "--tokenizer", "smollm2", "--api-key", KEY,
        "--ignore-eos", "--json", str(out), "--no-warmup",
    ]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["backend"] == "openai-chat" and rep["completed"] == 1
    assert rep["output_lens"] == rep["expected_output_lens"] and all(rep["generated_texts"])


def test_a_wrong_key_fails_the_warm_up(server, tmp_path, capsys):
    args = ["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "1", "--api-key", "no"]
    assert (
        bench.main([*args, "--model", "smollm2", "--random-input-len", "8", "--random-output-len", "2"]) == 2
    )
    assert "HTTP 401" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--base-url", "http://x", "--in-process", "tiny"], "exactly one of"),
        ([], "exactly one of"),
        (["--endpoint", "/v1/completions"], "use it with --base-url"),
        (["--base-url", "http://x", "--endpoint", "v1/completions"], "API path"),
        (["--base-url", "http://x", "--model", "m"], "needs --dataset-path"),
        (["--base-url", "http://x", "--metric-percentiles", "0,50"], "--metric-percentiles"),
        (["--base-url", "http://x", "--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
        (["--base-url", "http://x", "--request-rate", "0"], "--request-rate"),
        (["--base-url", "http://x", "--speculative"], "oasis serve ... --speculative"),
    ],
)
def test_misused_flags_are_a_message(args, says, capsys):
    assert bench.main(args) == 2
    assert says in capsys.readouterr().err


# ---------------------------------------------------------------------- datasets and metrics
def test_sharegpt_sampling(smollm, tmp_path):
    _, tok = smollm
    path = sharegpt_file(tmp_path)
    reqs = ep.sample_sharegpt(path, 100, tok, seed=0)
    assert len(reqs) == 6  # 5 exchanges + the one after a system turn; the lone and short skipped
    assert {r.prompt for r in reqs} >= {h for h, _ in EXCHANGES}
    assert all(r.prompt_len == len(tok.encode(r.prompt)) for r in reqs)
    assert [r.prompt for r in ep.sample_sharegpt(path, 100, tok, seed=0)] == [r.prompt for r in reqs]
    assert [r.prompt for r in ep.sample_sharegpt(path, 100, tok, seed=1)] != [r.prompt for r in reqs]
    fixed = ep.sample_sharegpt(path, 3, tok, output_len=7)
    assert len(fixed) == 3 and {r.expected_output_len for r in fixed} == {7}
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ConfigError, match="JSON list"):
        ep.sample_sharegpt(bad, 1, tok)
    bad.write_text("[]")
    with pytest.raises(ConfigError, match="no conversation"):
        ep.sample_sharegpt(bad, 1, tok)


def test_random_sampling():
    reqs = ep.sample_random(20, 1000, 50, range_ratio=0.5, seed=1)
    assert all(500 <= r.prompt_len <= 1500 and 25 <= r.expected_output_len <= 75 for r in reqs)
    assert all(r.prompt_len == len(r.prompt) and min(r.prompt) >= 256 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1
    assert [r.prompt_len for r in ep.sample_random(3, 64, 4)] == [64] * 3
    with pytest.raises(ConfigError, match="range-ratio"):
        ep.sample_random(1, 8, 8, range_ratio=1.0)
    with pytest.raises(ConfigError, match="tokenizer"):
        ep.sample_random(1, 8, 8, as_text=True)


def test_metrics_follow_vllms_definitions():
    """TPOT excludes the first token; ITLs pool over requests; failures count apart."""
    a = ep.RequestResult(True, 10, 5, "x", ttft=0.1, latency=0.5, itl=[0.1] * 4)
    b = ep.RequestResult(True, 20, 1, "y", ttft=0.2, latency=0.2, itl=[])
    c = ep.RequestResult(False, 30, error="HTTP 500")
    m = ep.calculate_metrics([a, b, c], 2.0, [50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert (
        m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 18
    )
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; b has no second token
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0) and m["mean_e2el_ms"] == pytest.approx(350.0)
    assert m["p99_ttft_ms"] == pytest.approx(199.0)  # linear interpolation, as numpy's percentile
