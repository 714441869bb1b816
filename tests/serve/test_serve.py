"""``oasis serve`` on SmolLM2 on the CPU, through the official ``openai`` client: completions and
chat (streaming and not), greedy output equal to ``LLM.generate``, 32 concurrent streams,
disconnects that free their blocks, the documented errors, the API key, overload, a bounded load
test, and the CLI's refusal to bind beyond loopback without a key.

Every server here is started by the test on 127.0.0.1 on a free port (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

# The server's stack is a test dependency of `make test` (Makefile PY_DEPS); the GPU machine has
# none of it, and these tests are CPU tests: skip the module there instead of failing collection.
for _mod in ("fastapi", "uvicorn", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from openai import AsyncOpenAI, OpenAI  # noqa: E402

from oasiskv import LLM, KvConfig, LLMEngine  # noqa: E402
from oasiskv.cli import main as oasis_main  # noqa: E402
from oasiskv.models.loader import load_model  # noqa: E402
from oasiskv.serve import ServeConfig, ServerThread, build_app  # noqa: E402
from oasiskv.serve.text import TextAssembler  # noqa: E402

torch.set_num_threads(2)

KV = dict(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The README's prompt: long enough (>64 tokens) that its request turns sparse.
LONG = "Paged attention stores the KV cache in fixed-size blocks. " * 12 + "In one sentence, why?"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2")


def make_server(smollm, **cfg) -> ServerThread:
    model, tok = smollm
    seqs = cfg.pop("max_num_seqs", 32)
    eng = LLMEngine(model, tokenizer=tok, kv=KvConfig(**KV), drafter="ngram", max_num_seqs=seqs, device="cpu")
    return ServerThread(build_app(eng, ServeConfig("smollm2", **cfg))).start()


@pytest.fixture(scope="module")
def server(smollm):
    srv = make_server(smollm, api_key=KEY, max_queue=64)
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def wait_pools_full(server, timeout: float = 30.0) -> dict:
    """Poll /health until no request is held and every block is back in its pool."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if h["pools_full"] and h["inflight"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"pools not full again: {h}"
        time.sleep(0.05)


def metric(server, name: str, default: float | None = None) -> float:
    """One sample of /metrics; ``name`` includes its labels (``x{reason="y"}``)."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    assert default is not None, f"{name} not in /metrics"
    return default


# ---------------------------------------------------------------------- the happy paths
def test_completions_and_chat_streaming_and_not(server, client):
    """Both endpoints, both modes: OpenAI shapes, usage, and the stream's deltas concatenated
    equal the non-streamed text (greedy)."""
    kw = dict(model="smollm2", max_tokens=12, temperature=0)
    c = client.completions.create(prompt="The capital of France is", **kw)
    assert c.id.startswith("cmpl-") and c.object == "text_completion" and c.model == "smollm2"
    (ch,) = c.choices
    assert ch.index == 0 and ch.logprobs is None and ch.finish_reason in ("stop", "length") and ch.text
    u = c.usage
    assert u.prompt_tokens == 5 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(
        client.completions.create(
            prompt="The capital of France is", stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert all(x.object == "text_completion" and x.id == chunks[0].id for x in chunks)
    assert "".join(x.choices[0].text for x in chunks if x.choices) == ch.text
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == ch.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens

    r = client.chat.completions.create(messages=CHAT, **kw)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and m.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10  # the chat template's tokens are counted

    parts = list(client.chat.completions.create(messages=CHAT, stream=True, **kw))
    assert all(x.object == "chat.completion.chunk" for x in parts)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in parts) == m.content
    assert parts[-1].choices[0].finish_reason == r.choices[0].finish_reason

    models = client.models.list()
    assert [x.id for x in models.data] == ["smollm2"]


def test_greedy_output_equals_llm_generate(smollm, server, client):
    """Temperature 0 through HTTP gives the tokens of ``LLM.generate`` with the same KvConfig and
    drafter, for a prompt long enough to turn sparse, and for a chat (the tokenizer's template)."""
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, kv=KvConfig(**KV), drafter="ngram", device="cpu")
    messages = [{"role": "user", "content": LONG}]
    for prompt, call in (
        (LONG, lambda: client.completions.create(model="smollm2", prompt=LONG, max_tokens=16, temperature=0)),
        (
            tok.apply_chat_template(messages),
            lambda: client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=16, temperature=0
            ),
        ),
    ):
        want = llm.generate(prompt, max_new_tokens=16)[0]
        got = call()
        ch = got.choices[0]
        text = ch.text if hasattr(ch, "text") else ch.message.content
        assert text == tok.decode(want.tokens, skip_special_tokens=True)
        assert got.usage.completion_tokens == len(want.tokens)
        assert got.usage.prompt_tokens == len(want.prompt_tokens)
        assert ch.finish_reason == want.finish_reason
        assert want.metrics.sparse_steps > 0 or prompt != LONG


def test_stop_strings_end_the_text_before_them(server, client):
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    want = full[: full.index(stop)]
    got = client.completions.create(stop=[stop, "never-appears"], **kw).choices[0]
    assert got.text == want and got.finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(x.choices[0].text for x in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_text_assembler_holds_back_stop_prefixes_and_split_characters(smollm):
    _, tok = smollm
    text = "Grüße 🌍 and more text: STOP here"
    ids = tok.encode(text)
    asm = TextAssembler(tok, ["STOP"])
    sent = ""
    for t in ids:  # one token per step, as the engine hands them out
        asm.push([t])
        piece = asm.delta()
        assert "\ufffd" not in piece
        sent += piece
        assert "STOP" not in sent and "STO" not in sent[-3:] or asm.stopped
    asm.finish()
    sent += asm.delta(final=True)
    assert asm.stopped and sent == "Grüße 🌍 and more text: "
    plain = TextAssembler(tok)
    for t in ids:
        plain.push([t])
    plain.finish()
    assert plain.text == text


# ---------------------------------------------------------------------- concurrency
def test_32_concurrent_streaming_clients(server):
    """32 streams at once all finish with exactly max_tokens tokens; the pools are full again."""

    async def one(ac: AsyncOpenAI, i: int) -> tuple[int, str, str]:
        stream = await ac.completions.create(
            model="smollm2",
            prompt=f"Request {i}: count to ten.",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        return usage.completion_tokens, finish, text

    async def main():
        ac = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(ac, i) for i in range(32)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert [(n, f) for n, f, _ in results] == [(8, "length")] * 32
    assert all(t for _, _, t in results)
    wait_pools_full(server)
    assert time.monotonic() - t0 < 60


def test_disconnect_mid_stream_frees_the_request(server):
    """A streaming client that goes away, and a non-streaming one that times out, each abort
    their request: nothing stays held and every block is back in its pool."""
    aborts = 'oasis:request_success_total{engine="0",finished_reason="abort",model_name="smollm2"}'
    before = metric(server, aborts, default=0)
    body = {"model": "smollm2", "prompt": LONG, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as hc:
        with hc.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break
        # the response is closed here, mid-stream
    assert events == 3
    wait_pools_full(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    wait_pools_full(server)
    assert metric(server, aborts) == before + 2


def test_overload_is_a_429_with_retry_after(smollm):
    """One seat and a queue of one: the third concurrent request is refused at once with 429 and
    Retry-After; once the first two are gone the server serves again and the pools are full."""
    srv = make_server(smollm, max_num_seqs=1, max_queue=1)
    try:
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as hc:
            streams = [hc.stream("POST", "/v1/completions", json=body) for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            try:
                assert [r.status_code for r in responses] == [200, 200]
                assert health(srv)["inflight"] == 2
                r = hc.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "server_busy"
                c = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    c.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        wait_pools_full(srv)
        c = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        assert c.completions.create(model="smollm2", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(smollm):
    """An engine step that raises (a bug, a device fault) finishes the running requests with an
    error -- a 500 body, or an error event in a stream -- frees their blocks, and the next
    request is served."""
    srv = make_server(smollm)
    eng = srv.server.config.app.state.engine_loop.llm_engine
    real_step, fail = eng.step, {"left": 0}

    def step():
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("injected fault")
        return real_step()

    eng.step = step  # an instance attribute: only this test's engine, from the engine thread
    try:
        c = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="smollm2", prompt="Hello", max_tokens=4)
        fail["left"] = 1
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            c.completions.create(**kw)
        fail["left"] = 1
        with pytest.raises(openai.APIError, match="injected fault"):
            list(c.completions.create(stream=True, **kw))
        wait_pools_full(srv)
        assert c.completions.create(**kw).usage.completion_tokens >= 1
        assert health(srv)["step_errors"] == 2
    finally:
        srv.stop()


# ---------------------------------------------------------------------- refusals
def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={**headers, "Content-Type": "application/json"},
        timeout=30,
    )


OK = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
OK_CHAT = {"model": "smollm2", "messages": CHAT, "max_tokens": 2}
BAD = [
    # (id, path, body, status, code, param)
    ("bad-json", "/v1/completions", b'{"model": "smollm2", "prompt": ', 400, "invalid_json", None),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, "invalid_json", None),
    ("unknown-field", "/v1/completions", {**OK, "tempreature": 0}, 400, "extra_forbidden", "tempreature"),
    ("wrong-type", "/v1/completions", {**OK, "max_tokens": "8"}, 400, "int_type", "max_tokens"),
    ("float-max-tokens", "/v1/completions", {**OK, "max_tokens": 8.0}, 400, "int_type", "max_tokens"),
    ("bad-temperature", "/v1/completions", {**OK, "temperature": "hot"}, 400, None, None),
    ("zero-max-tokens", "/v1/completions", {**OK, "max_tokens": 0}, 400, None, "max_tokens"),
    (
        "past-context",
        "/v1/completions",
        {**OK, "max_tokens": 9000},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "prompt-too-long",
        "/v1/completions",
        {**OK, "prompt": [7] * 8193},
        400,
        "context_length_exceeded",
        "prompt",
    ),
    ("empty-prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "invalid_prompt", "prompt"),
    ("id-out-of-vocab", "/v1/completions", {**OK, "prompt": [1, 10**9]}, 400, "invalid_prompt", "prompt"),
    ("n-too-many", "/v1/completions", {**OK, "n": 17}, 400, None, "n"),
    ("logprobs-too-many", "/v1/completions", {**OK, "logprobs": 21}, 400, None, "logprobs"),
    (
        "echo-with-logprobs",
        "/v1/completions",
        {**OK, "echo": True, "logprobs": 1},
        400,
        "unsupported_parameter",
        "echo",
    ),
    (
        "penalty",
        "/v1/completions",
        {**OK, "presence_penalty": 0.5},
        400,
        "unsupported_parameter",
        "presence_penalty",
    ),
    ("suffix", "/v1/completions", {**OK, "suffix": "!"}, 400, "unsupported_parameter", "suffix"),
    ("seed-negative", "/v1/completions", {**OK, "seed": -1}, 400, None, "seed"),
    ("top-p-zero", "/v1/completions", {**OK, "top_p": 0}, 400, None, "top_p"),
    ("missing-prompt", "/v1/completions", {"model": "smollm2"}, 400, "missing", "prompt"),
    ("wrong-model", "/v1/completions", {**OK, "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("chat-no-messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, None, "messages"),
    (
        "chat-tool-role",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "tool", "content": "x"}]},
        400,
        None,
        None,
    ),
    (
        "chat-image",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        None,
        None,
    ),
    (
        "chat-top-logprobs-alone",
        "/v1/chat/completions",
        {**OK_CHAT, "top_logprobs": 2},
        400,
        "unsupported_parameter",
        "top_logprobs",
    ),
    ("chat-tools", "/v1/chat/completions", {**OK_CHAT, "tools": []}, 400, "unsupported_parameter", "tools"),
]


@pytest.mark.parametrize("path,body,status,code,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, path, body, status, code, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in r.text and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


def test_the_server_goes_on_after_bad_requests(server, client):
    for _, path, body, *_ in BAD:
        _post(server, path, body)
    r = _post(server, "/v1/completions", b"x" * ((8 << 20) + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/v1/completions", headers=AUTH).status_code == 405
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, n=17)
    assert e.value.status_code == 400
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text
    wait_pools_full(server)


def test_a_wrong_api_key_is_refused(server):
    bad = OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401
    r = _post(server, "/v1/completions", OK, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # liveness probes need no key


def test_metrics_in_prometheus_text(server, client):
    client.completions.create(model="smollm2", prompt=LONG, max_tokens=8, temperature=0)  # turns sparse
    wait_pools_full(server)
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    for name in (  # vLLM's names under oasis: (tests/serve/test_metrics.py checks every series)
        "oasis:num_requests_running",
        "oasis:num_requests_waiting",
        "oasis:prompt_tokens_total",
        "oasis:generation_tokens_total",
        "oasis:time_to_first_token_seconds_bucket",
        "oasis:inter_token_latency_seconds_bucket",
        "oasis:kv_gpu_bytes",
        "oasis:kv_host_bytes",
        "oasis:kv_fetched_bytes_per_step_count",
        "oasis:lookahead_recall_count",
        "oasis:transfer_wait_seconds_total",
        "oasis:num_preemptions_total",
    ):
        assert f"\n{name}{{" in text, name
    labels = '{engine="0",model_name="smollm2"}'
    assert metric(server, f"oasis:kv_fetched_bytes_per_step_count{labels}") >= 1
    assert metric(server, f"oasis:time_to_first_token_seconds_count{labels}") >= 1
    assert metric(server, f"oasis:kv_gpu_bytes{labels}") == 0  # idle: every page is back
    assert metric(server, f"oasis:kv_pools_full{labels}") == 1
    assert metric(server, f"oasis:num_preemptions_total{labels}") == 0


# ---------------------------------------------------------------------- bounded load
def test_bounded_load_loses_and_duplicates_no_token(server):
    """A fixed load on loopback (48 requests, 12 at a time, bounded in time): every prompt is sent
    once streamed and once not; greedy, so the deltas concatenated must equal the final text, and
    the token counts must match. At the end nothing is held and the pools are full."""
    n_prompts, concurrency, budget_s = 24, 12, 90

    async def call(ac: AsyncOpenAI, i: int, stream: bool):
        kw = dict(
            model="smollm2",
            prompt=f"Item {i}: the {i % 7}th thing about caches is",
            max_tokens=4 + i % 9,
            temperature=0,
        )
        if not stream:
            r = await ac.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
        s = await ac.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        text, n, finish = "", None, None
        async for ch in s:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                n = ch.usage.completion_tokens
        return text, n, finish

    async def main():
        ac = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=budget_s)
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i, stream):
            async with sem:
                return await call(ac, i, stream)

        jobs = [bounded(i, s) for i in range(n_prompts) for s in (True, False)]
        return await asyncio.wait_for(asyncio.gather(*jobs), budget_s)

    results = asyncio.run(main())
    for i in range(n_prompts):
        streamed, plain = results[2 * i], results[2 * i + 1]
        assert streamed == plain, (i, streamed, plain)
        assert 1 <= plain[1] <= 4 + i % 9 and plain[2] in ("stop", "length")
        assert plain[2] == "stop" or plain[1] == 4 + i % 9
    wait_pools_full(server)


# ---------------------------------------------------------------------- the CLI
def test_cli_refuses_a_non_loopback_bind_without_a_key(capsys, monkeypatch):
    monkeypatch.delenv("OASIS_API_KEY", raising=False)
    assert oasis_main(["serve", "smollm2", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oasis serve: error:") and "--api-key" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_and_stops_on_sigint(tmp_path):
    """``oasis serve`` as a user runs it: a non-loopback bind without a key exits 2 with one
    line; on loopback it serves, and Ctrl-C stops it cleanly."""
    env = {k: v for k, v in os.environ.items() if k != "OASIS_API_KEY"}
    cmd = [sys.executable, "-m", "oasiskv.cli", "serve", "smollm2"]
    r = subprocess.run([*cmd, "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    port = _free_port()
    flags = ["--port", str(port), "--top-k-blocks", "8", "--sparse-threshold", "64", "--log-level", "warning"]
    proc = subprocess.Popen([*cmd, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "oasis serve did not come up"
            time.sleep(0.2)
        c = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert c.completions.create(model="smollm2", prompt="Hi", max_tokens=3).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
    assert rc == 0, proc.stderr.read().decode()


# ---------------------------------------------------------------------- the benchmark
def test_bench_serve_http_and_in_process(server, tmp_path, capsys):
    """``python -m oasiskv.bench.serve``: the same small sweep in-process and through HTTP, each
    writing its JSON; the HTTP run's table carries the ratio to the in-process baseline."""
    from oasiskv.bench import serve as bench

    sweep = ["--concurrency", "1,2", "--requests", "2", "--prompt-tokens", "24", "--max-tokens", "4"]
    engine = ["--top-k-blocks", "8", "--sparse-threshold", "64", "--fetch-cap", "0.25"]
    base = tmp_path / "in_process.json"
    assert bench.main(["--in-process", "smollm2", *sweep, *engine, "--json", str(base)]) == 0
    http = tmp_path / "http.json"
    args = ["--endpoint", server.url, "--api-key", KEY, *sweep, "--json", str(http), "--baseline", str(base)]
    assert bench.main(args) == 0
    assert "x baseline" in capsys.readouterr().out
    for path, mode in ((base, "in-process"), (http, "http")):
        rep = json.loads(path.read_text())
        assert rep["mode"] == mode and [r["concurrency"] for r in rep["rows"]] == [1, 2]
        for r in rep["rows"]:
            assert r["requests"] == 2 and r["output_tokens"] == 8 and r["tokens_per_s"] > 0
            assert r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0
    wait_pools_full(server)


def test_bench_serve_in_process_speculative_reports_acceptance(tmp_path, capsys):
    """``--in-process smollm2 --drafter eagle3 --speculative``: the bundled EAGLE-3 head drafts,
    and every row carries tokens per step and the acceptance rate (the engine's spec_stats over
    that concurrency level); ``--backend dense --speculative`` keeps the drafter's lookahead row."""
    from oasiskv.bench import serve as bench

    sweep = ["--concurrency", "2", "--requests", "2", "--prompt-tokens", "24", "--max-tokens", "4"]
    engine = ["--top-k-blocks", "8", "--sparse-threshold", "64", "--fetch-cap", "0.25", "--device", "cpu"]
    path = tmp_path / "spec.json"
    spec = ["--drafter", "eagle3", "--speculative", "--json", str(path)]
    assert bench.main(["--in-process", "smollm2", *sweep, *engine, *spec]) == 0
    assert "tok/step  accept" in capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["speculative"] is True and rep["drafter"] == "eagle3"
    for r in rep["rows"]:
        assert r["output_tokens"] == 8 and r["drafts"] > 0
        assert 1.0 <= r["tokens_per_step"] <= 2.0 and 0.0 <= r["acceptance_rate"] <= 1.0
    args = [
        "--in-process",
        "tiny",
        *sweep,
        *engine,
        "--backend",
        "dense",
        "--speculative",
        "--json",
        str(path),
    ]
    assert bench.main(args) == 0
    rep = json.loads(path.read_text())
    assert rep["backend"] == "dense" and rep["drafter"] == "ngram" and rep["rows"][0]["drafts"] > 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--endpoint", "http://127.0.0.1:9", "--speculative"], "oasis serve ... --speculative"),
        (["--in-process", "tiny", "--speculative", "--draft-acceptance", "0.4"], "--fig11"),
        (["--in-process", "tiny", "--speculative", "--drafter", "previous-query"], "lookahead row"),
    ],
)
def test_bench_serve_speculative_flags_misused_are_a_message(args, says, capsys):
    from oasiskv.bench import serve as bench

    assert bench.main([*args, "--device", "cpu", "--json", ""]) == 2
    assert says in capsys.readouterr().err


def test_a_preset_is_served_with_random_weights_to_token_id_prompts(capsys):
    """``oasis serve qwen3-8b`` (the benchmark's server): a preset name loads that shape with
    random weights and no tokenizer; token-id prompts complete, text prompts get a 400."""
    import argparse

    from oasiskv.serve.cli import add_arguments, engine_from_args, served_model

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["tiny", "--device", "cpu", "--top-k-blocks", "4", "--sparse-threshold", "32"])
    model = served_model(args)
    assert "preset" in capsys.readouterr().err
    assert isinstance(model, torch.nn.Module) and model.config.num_hidden_layers == 2
    # A real path or 'smollm2' passes through untouched (the engine loads it).
    assert served_model(ap.parse_args(["smollm2"])) == "smollm2"
    srv = ServerThread(build_app(engine_from_args(model, args), ServeConfig("tiny"))).start()
    try:
        c = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = c.completions.create(
            model="tiny", prompt=list(range(3, 60)), max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.usage.prompt_tokens == 57 and out.usage.completion_tokens == 5
        ids = [int(x) for x in out.choices[0].text.split()]  # no tokenizer: the ids as text
        assert len(ids) == 5 and all(0 <= i < model.config.vocab_size for i in ids)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "text", "max_tokens": 2})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    finally:
        srv.stop()
