"""OpenAI parity of ``oasis serve`` (issue 33, audit findings 1 and 5), on SmolLM2 on the CPU.

Finding 1: a lone UTF-16 surrogate in any text input is a 400 with an OpenAI error body over HTTP
(completions, a list prompt, chat content, streaming; the connection stays usable) and a typed
:class:`~oasiskv.errors.InvalidTextError` in-process (``Tokenizer.encode``,
``LLMEngine.add_request``, ``LLM.generate``).

Finding 5: ``"usage": null`` on the non-final chunks with ``include_usage``; ``GET
/v1/models/{id}``; ``unsupported_parameter`` for tools, structured output and the like (their
no-op values accepted); tool conversations replayed through the chat template; a bounded default
for ``max_tokens``; ``logprobs`` / ``top_logprobs``, ``n``, ``echo``, ``max_completion_tokens``
and ``--served-model-name``.

Raw HTTP (``httpx``) here, so the wire format itself is checked; the clients' view is in
tests/serve/test_openai_conformance.py."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from oasiskv import LLM, KvConfig, LLMEngine, SamplingParams  # noqa: E402
from oasiskv.errors import ConfigError, InvalidTextError, OasisError  # noqa: E402
from oasiskv.models.loader import load_model  # noqa: E402
from oasiskv.serve import ServeConfig, ServerThread, build_app  # noqa: E402

torch.set_num_threads(2)

KV = dict(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
#: The server's default budget here: small, so a request without max_tokens is quick.
DEFAULT_MAX = 5


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2")


def engine(smollm, **kw) -> LLMEngine:
    model, tok = smollm
    return LLMEngine(model, tokenizer=tok, kv=KvConfig(**KV), drafter="ngram", device="cpu", **kw)


@pytest.fixture(scope="module")
def server(smollm):
    cfg = ServeConfig("smollm2", model_aliases=("smol",), max_tokens_default=DEFAULT_MAX)
    srv = ServerThread(build_app(engine(smollm, max_num_seqs=16), cfg)).start()
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as "\ud800", exactly what a client sends on the wire.
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def sse(r: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent-events body (``[DONE]`` must end it)."""
    lines = [ln[len("data: ") :] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text[-300:]
    return [json.loads(x) for x in lines[:-1]]


def assert_error(r: httpx.Response, status: int, code: str | None, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and "Traceback" not in r.text
    assert err["code"] == code and err["param"] == param, err
    return err


# ---------------------------------------------------------------------- finding 1: surrogates
SURROGATE = [
    ("completions", "/v1/completions", {"model": "smollm2", "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    (
        "list-prompt",
        "/v1/completions",
        {"model": "smollm2", "prompt": ["a\udfffb"], "max_tokens": 2},
        "prompt",
    ),
    (
        "streaming",
        "/v1/completions",
        {"model": "smollm2", "prompt": "a\ud800b", "max_tokens": 2, "stream": True},
        "prompt",
    ),
    (
        "chat",
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi \ud83d"}], "max_tokens": 2},
        "messages",
    ),
    (
        "chat-parts-streaming",
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "x\udc00"}]},
            ],
            "max_tokens": 2,
            "stream": True,
        },
        "messages",
    ),
]


@pytest.mark.parametrize("path,body,param", [s[1:] for s in SURROGATE], ids=[s[0] for s in SURROGATE])
def test_a_lone_surrogate_is_a_400_and_the_connection_goes_on(http, path, body, param):
    r = post(http, path, body)
    err = assert_error(r, 400, "invalid_text", param)
    assert "surrogate" in err["message"] and "remove it" in err["message"]
    if path.endswith("chat/completions"):
        # names the message: the second of two, or the only one
        assert "messages[1].content" in err["message"] or "messages[0].content" in err["message"]
    assert r.headers.get("connection") != "close"
    # the same connection serves the next request
    ok = post(http, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_surrogate_pair_is_one_character_and_is_served(http):
    r = post(http, "/v1/completions", {"model": "smollm2", "prompt": "I like \U0001f600", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_surrogate_in_process_is_a_typed_error(smollm):
    _, tok = smollm
    with pytest.raises(InvalidTextError, match=r"\\ud800 at character 1") as e:
        tok.encode("a\ud800b")
    assert isinstance(e.value, OasisError) and isinstance(e.value, ValueError)
    assert e.value.index == 1 and e.value.char == "\ud800"
    eng = engine(smollm)
    with pytest.raises(InvalidTextError, match="surrogate"):
        eng.add_request("a\ud800b", SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests()
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, kv=KvConfig(**KV), device="cpu")
    with pytest.raises(InvalidTextError):
        llm.generate(["fine", "not \udc80 fine"], max_new_tokens=2)
    with pytest.raises(TypeError):  # not text at all stays the tokenizer's TypeError
        tok.encode(None)


# ---------------------------------------------------------------------- finding 5
def test_include_usage_puts_a_null_usage_on_every_chunk_but_the_last(http):
    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        body = {
            "model": "smollm2",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = sse(post(http, path, {**body, **extra}))
        assert len(events) >= 3
        assert all("usage" in e and e["usage"] is None for e in events[:-1])
        last = events[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        # without include_usage, no usage key at all (as OpenAI)
        plain = sse(post(http, path, {**body, **extra, "stream_options": None}))
        assert all("usage" not in e for e in plain)


def test_models_by_id(http):
    listed = http.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["smollm2", "smol"]
    for name in ("smollm2", "smol"):
        r = http.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == name and r.json()["object"] == "model"
    r = http.get("/v1/models/gpt-4o")
    assert_error(r, 404, "model_not_found", "model")
    assert "smollm2" in r.json()["error"]["message"]
    assert_error(http.get("/v1/models/org/name"), 404, "model_not_found", "model")


def test_served_model_names_answer_with_the_name_asked(http):
    r = post(http, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "smol"
    assert_error(
        post(http, "/v1/completions", {"model": "smo", "prompt": "Hi"}), 404, "model_not_found", "model"
    )


def test_served_model_name_flag_takes_several_names():
    import argparse

    from oasiskv.serve.cli import DEFAULT_MAX_TOKENS, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["smollm2", "--served-model-name", "a", "b/c", "--max-tokens-default", "64"])
    assert args.served_model_name == ["a", "b/c"] and args.max_tokens_default == 64
    args = p.parse_args(["smollm2"])
    assert args.served_model_name is None and args.max_tokens_default == DEFAULT_MAX_TOKENS


UNSUPPORTED = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("functions", {"functions": [{"name": "f"}]}),
    ("logit_bias", {"logit_bias": {"1": 5}}),
    ("frequency_penalty", {"frequency_penalty": 1.0}),
    ("presence_penalty", {"presence_penalty": True}),
    ("store", {"store": True}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
]


@pytest.mark.parametrize("param,extra", UNSUPPORTED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(UNSUPPORTED)])
def test_unimplemented_openai_fields_are_unsupported_parameter(http, param, extra):
    r = post(http, "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 2, **extra})
    err = assert_error(r, 400, "unsupported_parameter", param)
    assert param in err["message"]


def test_no_op_values_of_unimplemented_fields_are_accepted(http):
    noop = {
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "store": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "service_tier": "auto",
        "user": "u1",
    }
    r = post(http, "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 2, **noop})
    assert r.status_code == 200, r.text
    # a field OpenAI does not define stays a typo: refused by name
    assert_error(
        post(http, "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "temprature": 0}),
        400,
        "extra_forbidden",
        "temprature",
    )


TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def test_a_recorded_tool_conversation_replays_through_the_chat_template(smollm, http):
    _, tok = smollm
    r = post(
        http, "/v1/chat/completions", {"model": "smollm2", "messages": TOOL_CONVERSATION, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    # The prompt is the template's rendering: null content as "", the tool message as itself.
    rendered = tok.apply_chat_template(
        [
            TOOL_CONVERSATION[0],
            {"role": "assistant", "content": "", "tool_calls": TOOL_CONVERSATION[1]["tool_calls"]},
            {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"},
        ]
    )
    assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>' in rendered
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(rendered))
    for bad, why in (
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "user", "content": None}, "needs content"),
        ({"role": "user", "content": "x", "tool_calls": TOOL_CONVERSATION[1]["tool_calls"]}, "tool_calls"),
        ({"role": "function", "content": "x", "name": "f"}, None),
    ):
        r = post(http, "/v1/chat/completions", {"model": "smollm2", "messages": [bad], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0"), r.text
        assert why is None or why in r.json()["error"]["message"]


def test_max_tokens_null_or_absent_is_the_bounded_default(http):
    kw = {"model": "smollm2", "ignore_eos": True, "temperature": 0}
    chat = post(http, "/v1/chat/completions", {**kw, "messages": CHAT})
    assert chat.json()["usage"]["completion_tokens"] == DEFAULT_MAX
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    null = post(http, "/v1/chat/completions", {**kw, "messages": CHAT, "max_tokens": None})
    assert null.json()["usage"]["completion_tokens"] == DEFAULT_MAX
    cmpl = post(http, "/v1/completions", {**kw, "prompt": PROMPT, "max_tokens": None})
    assert cmpl.json()["usage"]["completion_tokens"] == DEFAULT_MAX
    # absent in completions: OpenAI's (and vLLM's) 16
    assert post(http, "/v1/completions", {**kw, "prompt": PROMPT}).json()["usage"]["completion_tokens"] == 16


def test_max_completion_tokens(http):
    kw = {"model": "smollm2", "messages": CHAT, "ignore_eos": True}
    r = post(http, "/v1/chat/completions", {**kw, "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    both = post(http, "/v1/chat/completions", {**kw, "max_completion_tokens": 3, "max_tokens": 3})
    assert_error(both, 400, "unsupported_parameter", "max_completion_tokens")
    far = post(http, "/v1/chat/completions", {**kw, "max_completion_tokens": 9000})
    assert_error(far, 400, "context_length_exceeded", "max_completion_tokens")


def test_completion_logprobs_are_the_models_distribution(smollm, http):
    """Greedy: each token is its position's most likely one, its logprob the first of the top
    list; the first equals the log-softmax of the prefill's logits, computed apart here."""
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    r = post(http, "/v1/completions", body).json()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    for tok_text, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 3 <= len(top) <= 4 and v <= 0
        assert math.isclose(v, max(top.values()), abs_tol=1e-5) and top[tok_text] == v
        assert sum(math.exp(x) for x in top.values()) <= 1 + 1e-4
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]

    # The first token's log-probability, from the logits a recorder sees at the prefill.
    eng = engine(smollm)
    seen = []

    class Rec:
        def on_step(self, info):
            if info.kind == "prefill":
                seen.append(torch.log_softmax(info.logits[0].float(), -1))

    eng.recorder = Rec()
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=1))
    first = eng.run_to_completion([rid])[rid].token_ids[0]
    assert math.isclose(lp["token_logprobs"][0], float(seen[0][first]), abs_tol=1e-4)
    top3 = torch.topk(seen[0], 3)
    want = {smollm[1].decode([int(i)]): float(v) for v, i in zip(top3.values, top3.indices, strict=True)}
    assert set(lp["top_logprobs"][0]) == set(want)

    # logprobs=0: the sampled token alone
    zero = post(http, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert all(len(t) == 1 for t in zero["top_logprobs"]) and zero["token_logprobs"] == lp["token_logprobs"]


def test_chat_logprobs_streamed_and_not(http):
    body = {
        "model": "smollm2",
        "messages": CHAT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    r = post(http, "/v1/chat/completions", body).json()
    ch = r["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 6
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["bytes"] == list(e["token"].encode()) or "\ufffd" in e["token"]
        assert math.isclose(e["logprob"], e["top_logprobs"][0]["logprob"], abs_tol=1e-5)
    text = bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")
    assert text.replace("<|im_end|>", "").startswith(ch["message"]["content"])
    events = sse(post(http, "/v1/chat/completions", {**body, "stream": True}))
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert all(
        math.isclose(a["logprob"], b["logprob"], abs_tol=1e-5) for a, b in zip(streamed, content, strict=True)
    )
    # without logprobs: null
    assert (
        post(http, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0}).json()["choices"][
            0
        ]["logprobs"]
        is None
    )


def test_n_choices_seeded_streamed_and_not(http):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    a = post(http, "/v1/completions", body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in a["choices"]}) > 1  # seed + i per choice: not three copies
    assert post(http, "/v1/completions", body).json()["choices"] == a["choices"]  # reproducible
    events = sse(
        post(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    texts = {i: "" for i in range(3)}
    finishes = {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in a["choices"]]
    assert finishes == {c["index"]: c["finish_reason"] for c in a["choices"]}
    assert events[-1]["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    assert a["usage"]["prompt_tokens"] == 5  # counted once, as OpenAI does
    chat = post(http, "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 3, "n": 2})
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]


def test_echo(smollm, http):
    _, tok = smollm
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = post(http, "/v1/completions", body).json()["choices"][0]["text"]
    echoed = post(http, "/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == PROMPT + plain
    ids = tok.encode(PROMPT)
    by_ids = post(http, "/v1/completions", {**body, "prompt": ids, "echo": True}).json()["choices"][0]["text"]
    assert by_ids == PROMPT + plain
    events = sse(post(http, "/v1/completions", {**body, "echo": True, "stream": True}))
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events) == echoed


def test_the_engine_seam_for_logprobs(smollm):
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=True)
    eng = engine(smollm)
    a = eng.add_request(PROMPT, SamplingParams(max_tokens=3, logprobs=2))
    b = eng.add_request(PROMPT, SamplingParams(max_tokens=3))
    got: dict[str, list] = {a: [], b: []}
    toks: dict[str, list] = {a: [], b: []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.new_logprobs is not None:
                assert len(o.new_logprobs) == len(o.new_token_ids)
                got[o.request_id] += o.new_logprobs
            else:
                assert o.request_id == b
    assert len(got[a]) == 3 and got[b] == []
    for t, d in zip(toks[a], got[a], strict=True):
        assert (
            t in d and 2 <= len(d) <= 3 and list(d.values())[:2] == sorted(list(d.values())[:2], reverse=True)
        )


# ---------------------------------------------------------------------- a tiny context
@pytest.fixture(scope="module")
def tiny_server():
    """A random-weight "tiny" model with a 96-token context, no tokenizer, two seats and no
    queue: the default budget's cap by the context, and ``n`` against the capacity."""
    import dataclasses

    from oasiskv.models.config import PRESETS
    from oasiskv.models.random_weights import random_model

    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=96)
    model = random_model(cfg, torch.float32, "cpu")
    kv = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=32)
    eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_seqs=2, device="cpu")
    srv = ServerThread(build_app(eng, ServeConfig("tiny", max_queue=0, max_tokens_default=1000))).start()
    yield srv
    srv.stop()


def test_the_default_budget_is_capped_by_the_context(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        body = {"model": "tiny", "prompt": list(range(3, 93)), "max_tokens": None, "ignore_eos": True}
        r = post(c, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 90, "completion_tokens": 7, "total_tokens": 97}
        err = assert_error(
            post(c, "/v1/completions", {**body, "max_tokens": 8}),
            400,
            "context_length_exceeded",
            "max_tokens",
        )
        assert "at most 7" in err["message"]


def test_n_past_the_capacity(tiny_server):
    """More choices than the server holds at once is a 400 naming ``n``; choices refused midway
    (a 429: another request holds a seat) free the ones already queued."""
    eng = tiny_server.server.config.app.state.engine_loop.llm_engine
    real_step = eng.step

    def slow_step():  # so the long request below is surely running while n=2 arrives:
        # 80 steps of at least 0.2 s (CI saw 80 of 0.02 s end first on a loaded machine); it is
        # cancelled as soon as the n=2 answer is in (its stream closes).
        time.sleep(0.2)
        return real_step()

    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
        assert_error(post(c, "/v1/completions", {**body, "n": 3}), 400, "invalid_value", "n")
        eng.step = slow_step  # an instance attribute: only this engine, from the engine thread
        try:
            long = {**body, "max_tokens": 80, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=long) as s:
                assert s.status_code == 200
                next(s.iter_lines())
                # Its first line can come before the engine thread admits it (a slow, loaded
                # machine): wait until it holds its seat, so n=2 surely finds one seat free.
                until = time.monotonic() + 30
                while eng.num_running < 1 and time.monotonic() < until:
                    time.sleep(0.005)
                assert eng.num_running == 1
                r = post(c, "/v1/completions", {**body, "n": 2})
                assert r.status_code == 429 and r.json()["error"]["code"] == "server_busy"
        finally:
            eng.step = real_step
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            h = c.get("/health").json()
            if h["inflight"] == 0 and h["pools_full"]:
                break
            time.sleep(0.05)
        assert h["inflight"] == 0 and h["pools_full"], h
        ok = post(c, "/v1/completions", {**body, "n": 2, "temperature": 0})
        assert ok.status_code == 200 and [ch["index"] for ch in ok.json()["choices"]] == [0, 1]
        # no tokenizer: each token reads as its id and a space, echo included
        echo = post(c, "/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
        assert echo.startswith("5 6 7 ") and len(echo.split()) == 5


def test_a_surrogate_anywhere_else_is_never_a_500(http):
    """In a field name, the model name or a stop string: the usual answer, and a body that is
    valid UTF-8 (the surrogate escaped in the message)."""
    base = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    r = post(http, "/v1/completions", {**base, "x\ud800": 1})
    assert_error(r, 400, "string_unicode", None)  # pydantic refuses the key itself
    r = post(http, "/v1/completions", {**base, "model": "m\udfff"})
    assert_error(r, 404, "model_not_found", "model")
    assert "\\udfff" in r.json()["error"]["message"]
    r = post(http, "/v1/completions", {**base, "stop": ["\ud800"]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_token_pieces_give_exact_bytes_for_split_characters(smollm):
    """A byte-level token that holds part of a character still has its exact bytes, so the
    logprobs entries' bytes joined are the text's UTF-8; a tokenizer without a ``tokenizers``
    backend is read through ``decode``."""
    from oasiskv.serve.text import TokenPieces

    _, tok = smollm
    text = "Grüße 🌍 and 日本"
    ids = tok.encode(text)
    pieces = TokenPieces(tok)
    got = [pieces(t) for t in ids]
    assert b"".join(bytes(b) for _, b in got) == text.encode()
    assert any("\ufffd" in s for s, _ in got)  # some token is a piece of a character
    assert pieces(tok.eos_token_ids[0]) == ("<|im_end|>", list(b"<|im_end|>"))
    assert pieces.is_special(tok.eos_token_ids[0]) and not pieces.is_special(ids[0])

    class DecodeOnly:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(0x61 + i % 26) for i in ids)

    assert TokenPieces(DecodeOnly())(3) == ("d", [0x64])
    assert TokenPieces(None)(42) == ("42 ", list(b"42 "))
