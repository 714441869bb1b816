"""Client conformance of ``oasis serve`` (issue 33, "Clients"): the official ``openai`` client and
``langchain-openai`` against a real server (uvicorn on a free loopback port, SmolLM2 on the CPU).

Each client is held to the same list: chat and completions, streamed and not; usage (with
``stream_options.include_usage`` when streaming); the finish reasons ``stop`` and ``length``;
a bad request raising the client's ``BadRequestError`` with the server's message; an unknown
model raising ``NotFoundError``. Both clients must also see the same text for the same greedy
request, so neither is fed a shape it silently papers over."""

from __future__ import annotations

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "openai", "langchain_openai"):
    pytest.importorskip(_mod)

import openai  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_openai import OpenAI as LangchainCompletions  # noqa: E402
from openai import OpenAI  # noqa: E402

from oasiskv import KvConfig, LLMEngine  # noqa: E402
from oasiskv.models.loader import load_model  # noqa: E402
from oasiskv.serve import ServeConfig, ServerThread, build_app  # noqa: E402

torch.set_num_threads(2)

KEY = "conformance-key"
PROMPT = "The capital of France is"
QUESTION = "Name three colours of the rainbow."
#: A question SmolLM2 answers greedily in a few tokens, then its end-of-turn token (finish "stop").
SHORT = "What is 2+2? Answer with a number only."
MAX = 8


@pytest.fixture(scope="module")
def server():
    model, tok = load_model("smollm2")
    kv = KvConfig(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
    eng = LLMEngine(model, tokenizer=tok, kv=kv, drafter="ngram", max_num_seqs=8, device="cpu")
    srv = ServerThread(build_app(eng, ServeConfig("smollm2", api_key=KEY))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stop_word(client) -> str:
    """A word the greedy completion of PROMPT contains, so a stop string surely ends it."""
    text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=MAX, temperature=0)
    words = [w for w in text.choices[0].text.split() if w.isalpha()]
    assert len(words) >= 2, text
    return words[1]


# ---------------------------------------------------------------------- the openai client
def test_openai_completions(client, stop_word):
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=MAX, temperature=0)
    full = client.completions.create(**kw)
    (ch,) = full.choices
    assert ch.finish_reason == "length" and full.usage.completion_tokens == MAX
    assert full.usage.total_tokens == full.usage.prompt_tokens + MAX

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == MAX

    stopped = client.completions.create(stop=[stop_word], **kw).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == ch.text[: ch.text.index(stop_word)]
    streamed = list(client.completions.create(stop=stop_word, stream=True, **kw))
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == stopped.text

    lp = client.completions.create(logprobs=2, **kw).choices[0].logprobs
    assert len(lp.tokens) == MAX and all(v <= 0 for v in lp.token_logprobs)


def test_openai_chat(client):
    messages = [{"role": "user", "content": QUESTION}]
    kw = dict(model="smollm2", messages=messages, temperature=0)
    r = client.chat.completions.create(max_tokens=MAX, **kw)
    (ch,) = r.choices
    assert ch.message.role == "assistant" and ch.message.content and ch.finish_reason == "length"
    assert r.usage.completion_tokens == MAX

    parts = list(
        client.chat.completions.create(
            max_completion_tokens=MAX, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ch.message.content
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert parts[-1].usage.completion_tokens == MAX and all(p.usage is None for p in parts[:-1])

    # Natural end: the model's end-of-turn token, within the budget, and not in the text.
    done = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": SHORT}], max_tokens=32, temperature=0
    )
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 32
    assert "4" in done.choices[0].message.content and "<|im_end|>" not in done.choices[0].message.content

    lp = client.chat.completions.create(max_tokens=3, logprobs=True, top_logprobs=2, **kw).choices[0].logprobs
    assert len(lp.content) == 3 and all(len(t.top_logprobs) == 2 for t in lp.content)

    two = client.chat.completions.create(max_tokens=3, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]


def test_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="lower max_tokens") as e:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=100_000)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    # (A lone surrogate cannot be sent through this client: it fails to encode the body itself.
    # The server's 400 for one is in tests/serve/test_serve_parity.py, over raw HTTP.)
    with pytest.raises(openai.BadRequestError, match="tool calling is not supported") as e:
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        )
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError, match="not served here") as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve("smollm2").id == "smollm2"


# ---------------------------------------------------------------------- langchain-openai
def _chat(server, **kw) -> ChatOpenAI:
    return ChatOpenAI(
        model="smollm2", base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw
    )


def test_langchain_chat(server, client):
    llm = _chat(server, temperature=0, max_tokens=MAX, stream_usage=True)
    msg = llm.invoke([HumanMessage(QUESTION)])
    want = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX, temperature=0
    )
    assert msg.content == want.choices[0].message.content
    assert msg.response_metadata["finish_reason"] == "length"
    assert msg.usage_metadata["output_tokens"] == MAX
    assert msg.usage_metadata["input_tokens"] == want.usage.prompt_tokens

    chunks = list(llm.stream([HumanMessage(QUESTION)]))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == msg.content
    assert total.response_metadata["finish_reason"] == "length"
    assert total.usage_metadata["output_tokens"] == MAX  # from the include_usage chunk

    done = _chat(server, temperature=0, max_tokens=32).invoke([HumanMessage(SHORT)])
    assert done.response_metadata["finish_reason"] == "stop" and done.usage_metadata["output_tokens"] < 32


def test_langchain_replays_a_tool_conversation(server):
    """LangChain's own tool-call history (an AIMessage with tool_calls and null content, then a
    ToolMessage) is accepted and answered."""
    history = [
        HumanMessage("What is the weather in Paris?"),
        AIMessage(
            content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]
        ),
        ToolMessage('{"temp_c": 21}', tool_call_id="call_1"),
    ]
    out = _chat(server, temperature=0, max_tokens=4).invoke(history)
    assert out.content and out.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_completions(server, client):
    llm = LangchainCompletions(
        model="smollm2",
        base_url=f"{server.url}/v1",
        api_key=KEY,
        max_retries=0,
        temperature=0,
        max_tokens=MAX,
    )
    want = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=MAX, temperature=0)
    assert llm.invoke(PROMPT) == want.choices[0].text
    assert "".join(llm.stream(PROMPT)) == want.choices[0].text
    res = llm.generate([PROMPT])
    assert res.generations[0][0].generation_info["finish_reason"] == "length"
    assert res.llm_output["token_usage"]["completion_tokens"] == MAX


def test_langchain_errors(server):
    # langchain sends the budget as max_completion_tokens; the message names the field it got
    with pytest.raises(openai.BadRequestError, match="lower max_completion_tokens"):
        _chat(server, max_tokens=100_000).invoke([HumanMessage(QUESTION)])
    with pytest.raises(openai.BadRequestError, match="structured output is not supported"):
        _chat(server, max_tokens=4, model_kwargs={"response_format": {"type": "json_object"}}).invoke(
            [HumanMessage(QUESTION)]
        )
    with pytest.raises(openai.NotFoundError, match="not served here"):
        ChatOpenAI(model="gpt-4o", base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).invoke(
            [HumanMessage(QUESTION)]
        )
