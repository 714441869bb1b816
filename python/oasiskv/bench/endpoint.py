"""Load against any OpenAI-compatible endpoint, measured as ``vllm bench serve`` measures it.

What ``python -m oasiskv.bench.serve --base-url URL --dataset-name ...`` runs (flags: that
module): one tool to compare ``oasis serve`` with vLLM, SGLang or any server speaking
``/v1/completions`` or ``/v1/chat/completions`` with streaming.

**Datasets** (:func:`sample_sharegpt`, :func:`sample_random`):

- ``sharegpt``: a JSON list of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}`` (the ShareGPT_V3 format). The prompt is the first human
  turn, the request's ``max_tokens`` the token count of the gpt turn after it (or
  ``--sharegpt-output-len``); conversations without such a pair, or with a prompt or an answer
  under 4 tokens, are skipped (vLLM's minimum). The order is shuffled with ``--seed``.
- ``random``: ``--random-input-len`` token ids per prompt (times ``1 ± --random-range-ratio``) and
  ``--random-output-len`` new tokens; long contexts are one flag away. ``/v1/completions`` is sent
  the ids themselves, so the server sees exactly that many tokens; the chat endpoint gets their
  text (decoded with the tokenizer).

**Arrivals.** Requests start at ``--request-rate`` per second (a Poisson process, or a gamma
process with ``--burstiness`` below 1 for burstier traffic; ``inf``: all at once), at most
``--max-concurrency`` in flight. One unmeasured request (the first prompt) runs before the
clock starts: it checks the endpoint and warms it up.

**Metrics** (vLLM's definitions; :func:`calculate_metrics`): per request, TTFT (send to the first
streamed content), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (the gaps between streamed
chunks, pooled over all requests) and E2EL (send to the last chunk); each reported as mean,
median, standard deviation and the ``--metric-percentiles`` (default 99), in milliseconds. Output
tokens are the server's ``usage.completion_tokens`` (``stream_options.include_usage``), else the
tokenizer's count of the generated text. Throughputs divide by the wall time of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: vLLM's minimum prompt and output length of a ShareGPT request.
SHAREGPT_MIN_LEN = 4
#: Random prompt ids are drawn from [lo, hi): past the special tokens, inside every real vocabulary.
RANDOM_ID_RANGE = (256, 16000)
METRIC_KEYS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class SampleRequest:
    """One request of a dataset: its prompt (text, or token ids for ``/v1/completions``), the
    prompt's length in tokens and the tokens to generate (``max_tokens``)."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------------- tokenizers
class _HFTokenizerAdapter:
    """A ``transformers`` tokenizer behind :class:`~oasiskv.models.tokenizer.Tokenizer`'s calls."""

    def __init__(self, tok) -> None:
        self.tok = tok

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(spec: str):
    """The tokenizer of ``spec``: ``smollm2``, a ``.gguf`` file, a directory with a
    ``tokenizer.json``, or a name ``transformers`` finds in its local cache (no download)."""
    from ..errors import ConfigError
    from ..models.tokenizer import Tokenizer

    path = Path(spec)
    gguf_path = None
    if spec.lower() in ("smollm2", "smollm2-135m-instruct"):
        from ..models.loader import smollm2_gguf_path

        gguf_path = smollm2_gguf_path()
    elif path.suffix.lower() == ".gguf" and path.is_file():
        gguf_path = path
    if gguf_path is not None:
        from gguf import GGUFReader

        from ..models.loader import gguf_metadata

        return Tokenizer.from_gguf_metadata(gguf_metadata(GGUFReader(str(gguf_path))))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    try:
        from transformers import AutoTokenizer

        return _HFTokenizerAdapter(AutoTokenizer.from_pretrained(spec, local_files_only=True))
    except Exception as e:
        raise ConfigError(
            f"no tokenizer for {spec!r}: pass --tokenizer as 'smollm2', a .gguf file, a directory "
            f"with tokenizer.json, or a Hugging Face name in the local cache ({type(e).__name__}: {e})"
        ) from e


# ---------------------------------------------------------------------- datasets
def _first_exchange(conv) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it, or None."""
    if not isinstance(conv, dict) or not isinstance(conv.get("conversations"), list):
        return None
    turns = conv["conversations"]
    for i, t in enumerate(turns):
        if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str):
            for u in turns[i + 1 :]:
                if isinstance(u, dict) and u.get("from") == "gpt" and isinstance(u.get("value"), str):
                    return t["value"], u["value"]
            return None
    return None


def sample_sharegpt(
    path: str | Path, num_prompts: int, tokenizer, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """Up to ``num_prompts`` requests from a ShareGPT-format file (see the module docstring)."""
    from ..errors import ConfigError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--dataset-path {path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {path}: expected a JSON list of {{'conversations': [...]}}")
    pairs = [p for p in map(_first_exchange, data) if p is not None]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, answer in pairs:
        if len(out) == num_prompts:
            break
        n_prompt = len(tokenizer.encode(prompt))
        n_out = len(tokenizer.encode(answer)) if output_len is None else output_len
        if n_prompt < SHAREGPT_MIN_LEN or (output_len is None and n_out < SHAREGPT_MIN_LEN):
            continue
        out.append(SampleRequest(prompt, n_prompt, n_out))
    if not out:
        raise ConfigError(
            f"--dataset-path {path}: no conversation with a human turn and a gpt answer of at least "
            f"{SHAREGPT_MIN_LEN} tokens each"
        )
    return out


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer=None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of about ``input_len`` random token ids (``1 ± range_ratio``),
    each asking for about ``output_len`` tokens; ``as_text``: the ids decoded (for chat)."""
    from ..errors import ConfigError

    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ConfigError("--random-input-len and --random-output-len must be >= 1")
    if as_text and tokenizer is None:
        raise ConfigError("a random dataset for the chat endpoint needs --tokenizer (its prompts are text)")
    lo, hi = RANDOM_ID_RANGE
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and vocab < hi:
        lo, hi = 0, vocab
    rnd = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rnd.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        ids = [rnd.randrange(lo, hi) for _ in range(length(input_len))]
        n_out = length(output_len)
        if as_text:
            text = tokenizer.decode(ids)
            out.append(SampleRequest(text, len(tokenizer.encode(text)), n_out))
        else:
            out.append(SampleRequest(ids, len(ids), n_out))
    return out


# ---------------------------------------------------------------------- the client
def _body(model: str, req: SampleRequest, chat: bool, ignore_eos: bool, temperature: float) -> dict:
    body = {
        "model": model,
        "max_tokens": req.expected_output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and oasis serve's extension
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(client, endpoint: str, body: dict, prompt_len: int, tokenizer=None) -> RequestResult:
    """Stream one request; time its chunks (see the module docstring)."""
    chat = "messages" in body
    res = RequestResult(prompt_len=prompt_len)
    text: list[str] = []
    usage_tokens = None
    chunks = 0
    st = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    res.error = f"the server failed the request: {ev['error']}"
                    return res
                if ev.get("usage"):
                    usage_tokens = ev["usage"].get("completion_tokens")
                choices = ev.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                text.append(piece)
    except Exception as e:  # a connection reset or a timeout fails this request, not the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    if chunks == 0:
        res.error = "the stream carried no content"
        return res
    res.generated_text = "".join(text)
    if usage_tokens is not None:
        res.output_tokens = int(usage_tokens)
    elif tokenizer is not None:
        res.output_tokens = len(tokenizer.encode(res.generated_text))
    else:
        res.output_tokens = chunks
    res.latency = last - st
    res.success = True
    return res


def _intervals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: 0 at an infinite rate, else gamma(burstiness) with mean 1/rate
    (burstiness 1: a Poisson process)."""
    if rate == float("inf"):
        return [0.0] * n
    rnd = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rnd.gammavariate(burstiness, theta) for _ in range(n)]


async def run_benchmark(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[SampleRequest],
    *,
    api_key: str | None = None,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    tokenizer=None,
    timeout: float = 600.0,
    seed: int = 0,
    warmup: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (see the module docstring); each one's result, and the wall time."""
    import httpx

    chat = endpoint.rstrip("/").endswith("chat/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        if warmup:
            first = requests[0]
            res = await send_request(
                client,
                endpoint,
                _body(model, first, chat, ignore_eos, temperature),
                first.prompt_len,
                tokenizer,
            )
            if not res.success:
                raise RuntimeError(f"the first (warm-up) request failed: {res.error}")
        sem = asyncio.Semaphore(limit)

        async def one(req: SampleRequest) -> RequestResult:
            async with sem:
                body = _body(model, req, chat, ignore_eos, temperature)
                return await send_request(client, endpoint, body, req.prompt_len, tokenizer)

        tasks = []
        t0 = time.perf_counter()
        for req, gap in zip(requests, _intervals(len(requests), request_rate, burstiness, seed), strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------- metrics
def _stats(name: str, xs_s: list[float], percentiles: Sequence[float]) -> dict:
    """Mean, median, std and percentiles of ``xs_s`` (seconds) in ms, keyed as vLLM keys them."""
    import numpy as np

    xs = np.asarray(xs_s or [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(xs.mean()),
        f"median_{name}_ms": float(np.median(xs)),
        f"std_{name}_ms": float(xs.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(xs, p))
    return out


def calculate_metrics(
    results: list[RequestResult], duration_s: float, percentiles: Sequence[float] = (99,)
) -> dict:
    """vLLM's summary of a run: counts, throughputs and the four latency metrics."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    out = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s if duration_s else None,
        "output_throughput": n_out / duration_s if duration_s else None,
        "total_token_throughput": (n_in + n_out) / duration_s if duration_s else None,
    }
    for name, xs in zip(METRIC_KEYS, (ttfts, tpots, itls, e2els), strict=True):
        out.update(_stats(name, xs, percentiles))
    return out


def result_json(metrics: dict, results: list[RequestResult], **info) -> dict:
    """What ``--save-result`` writes: the run's settings, the summary, and per request (in
    request order) its lengths, TTFT, ITLs, text and error, as vLLM's result files hold them."""
    per = [asdict(r) for r in results]
    return {
        **info,
        **metrics,
        "input_lens": [r["prompt_len"] for r in per],
        "output_lens": [r["output_tokens"] for r in per],
        "ttfts": [r["ttft"] for r in per],
        "itls": [r["itl"] for r in per],
        "generated_texts": [r["generated_text"] for r in per],
        "errors": [r["error"] for r in per],
    }


def format_report(metrics: dict, percentiles: Sequence[float], selected: Sequence[str]) -> str:
    """The summary as ``vllm bench serve`` prints it."""
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, v, fmt: str = ".2f") -> None:
        lines.append(f"{label:<40}{'-' if v is None else format(v, fmt):<10}")

    row("Successful requests:", metrics["completed"], "d")
    row("Failed requests:", metrics["failed"], "d")
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"], "d")
    row("Total generated tokens:", metrics["total_output_tokens"], "d")
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    for name in selected:
        lines.append("{s:{c}^50}".format(s=f" {titles[name]} ", c="-"))
        up = name.upper()
        row(f"Mean {up} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {up} (ms):", metrics[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {up} (ms):", metrics[f"p{p:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
