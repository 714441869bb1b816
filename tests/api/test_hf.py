"""oasiskv.hf: ``model.generate(...)`` of a transformers model decoding with OasisKV.

Each test asserts tokens: with a budget covering the context OasisKV gives transformers' own dense
tokens; with a smaller one (sparse decoding, checked through the cache's counters) it gives
``oasiskv.LLM``'s tokens with the same KvConfig, on SmolLM2 loaded by transformers from the
bundled GGUF and on a tiny random Qwen3 built by transformers. Refused modes raise the typed error.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import oasiskv  # noqa: E402
from oasiskv import hf as ohf  # noqa: E402
from oasiskv.errors import ConfigError  # noqa: E402
from oasiskv.models.loader import smollm2_gguf_path  # noqa: E402

NEW = 16  # tokens generated per call


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on 2 shared cores two spinning OpenMP threads made every small decode
    matmul about 10x slower (15 s against 1.7 s of CPU for an 8-token SmolLM2 generate)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def kv_config(top_k_blocks: int, **kw) -> oasiskv.KvConfig:
    """Every selection field explicit, so the tests do not follow KvConfig()'s defaults."""
    base = dict(
        block_size=16,
        top_k_blocks=top_k_blocks,
        fetch_cap=1,
        sparse_threshold=None,
        block_score="quest",
        select_queries="lookahead",
        measure_recall=True,
        recall_every=1,
        lookahead_min_confidence=None,
    )
    base.update(kw)
    return oasiskv.KvConfig(**base)


#: A budget covering every context of these tests (threshold 64 x 16 = 1024 tokens): dense.
WIDE = kv_config(64)
#: 2 blocks per KV head plus the local block (threshold 32 tokens): sparse from the prefill on.
NARROW = kv_config(2)


def new_tokens(out, prompt_len: int) -> list[int]:
    return out[0, prompt_len:].tolist()


def assert_sparse(cache: ohf.OasisKVCache, steps: int) -> None:
    """Sparse decoding really happened: every decode step sparse, blocks fetched into the working
    set, and the resident KV below the full KV."""
    (m,) = cache.metrics
    (r,) = cache.requests
    assert r.sparse
    assert m.steps == steps and m.sparse_steps == steps
    assert m.fetched_bytes_total > 0
    assert m.resident_kv_bytes < m.full_kv_bytes
    assert m.lookahead_recall is not None


# --------------------------------------------------------------------------- SmolLM2 (GGUF)
@pytest.fixture(scope="module")
def smol_hf():
    """SmolLM2-135M-Instruct as transformers loads it from the bundled GGUF (dequantised, float32)."""
    pytest.importorskip("gguf")  # a dependency of oasiskv; absent only on the GPU machine
    p = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name).eval()
    assert model.dtype == torch.float32
    assert model.config.model_type == "llama"
    yield model
    ohf.disable(model)


@pytest.fixture(scope="module")
def smol_llm():
    """oasiskv.LLM over the same GGUF with the NARROW budget (its tokenizer makes the prompts)."""
    return oasiskv.LLM("smollm2", kv=NARROW, drafter="ngram", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def smol_prompt(smol_llm):
    text = (
        "OasisKV keeps the full KV cache of a long request in host memory and a small working set "
        "on the GPU. Each step a draft token runs through the same forward pass; its query ranks "
        "per-block key summaries and the next step's blocks are fetched before that step needs "
        "them. At most a capped number of new blocks enters the working set per step, so the "
        "traffic over PCIe stays bounded however long the context grows. Prefill is dense: the "
        "prompt runs once, its KV moves to the host pool, and the last prompt token's query picks "
        "the first working set. Summaries are per-channel key minima and maxima of each block, "
        "and a block ranks by the Quest upper bound of its attention logit.\n"
        "Question: where does the full KV cache of a long request live? Answer:"
    )
    ids = smol_llm.tokenizer.encode(text)
    assert len(ids) > 3 * NARROW.threshold_tokens  # sparse from the prefill on
    return torch.tensor([ids])


def test_smollm2_wide_budget_equals_transformers_dense_greedy(smol_hf, smol_prompt):
    ohf.disable(smol_hf)
    dense = smol_hf.generate(smol_prompt, max_new_tokens=NEW, do_sample=False)
    ohf.enable(smol_hf, kv=WIDE, drafter="ngram")
    out = smol_hf.generate(smol_prompt, max_new_tokens=NEW, do_sample=False)
    cache = ohf.last_cache(smol_hf)
    assert isinstance(cache, ohf.OasisKVCache) and cache.kv == WIDE
    (r,) = cache.requests
    assert not r.sparse  # the budget holds the context: dense attention through the engine
    assert cache.metrics[0].steps == out.shape[1] - smol_prompt.shape[1] - 1
    assert out.tolist() == dense.tolist()


def test_smollm2_narrow_budget_equals_oasiskv_llm(smol_hf, smol_llm, smol_prompt):
    ohf.enable(smol_hf)
    cache = ohf.OasisKVCache(smol_hf, NARROW, drafter="ngram")
    out = smol_hf.generate(smol_prompt, max_new_tokens=NEW, do_sample=False, cache=cache)
    n = smol_prompt.shape[1]
    got = new_tokens(out, n)
    ref = smol_llm.generate(smol_prompt[0].tolist(), max_new_tokens=NEW, temperature=0.0)[0]
    assert got == ref.tokens
    steps = len(got) - 1
    assert_sparse(cache, steps)
    # The same selection as the engine's own run: the same blocks fetched, the same recall.
    assert cache.metrics[0].fetched_bytes_total == ref.metrics.fetched_bytes_total
    assert cache.metrics[0].lookahead_recall == pytest.approx(ref.metrics.lookahead_recall)
    # Two blocks per KV head change some of SmolLM2's tokens here: the equality above is the
    # selection's, not dense attention's.
    ohf.disable(smol_hf)
    assert new_tokens(smol_hf.generate(smol_prompt, max_new_tokens=NEW, do_sample=False), n) != got


# --------------------------------------------------------------------------- tiny random Qwen3
QWEN_VOCAB = 384


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3 built by transformers (seeded), and a directory oasiskv loads it from."""
    cfg = transformers.Qwen3Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,  # sharper logits than the default 0.02: no near-ties in greedy
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    yield model, path
    ohf.disable(model)


def qwen_prompt(n: int, seed: int) -> torch.Tensor:
    """Random ids with repeats (the n-gram drafter finds matches)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, QWEN_VOCAB, (n // 3,), generator=g)
    return torch.cat([base, base, torch.randint(1, QWEN_VOCAB, (n - 2 * (n // 3),), generator=g)])[None]


def test_qwen3_wide_budget_equals_transformers_dense_greedy(qwen):
    model, _ = qwen
    prompt = qwen_prompt(200, 1)
    ohf.disable(model)
    dense = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    cache = ohf.OasisKVCache(model, WIDE, drafter="ngram")
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert not cache.requests[0].sparse
    assert out.tolist() == dense.tolist()


#: The fidelity selection's fields (two-stage codes score, sticky candidates, successors) at a
#: budget of 4 blocks, spelled out (KvConfig.fidelity()'s may change).
CODES = kv_config(
    4, block_score="codes", score_candidates=1.25, sticky_candidates=True, successor_blocks=1, fetch_cap=2
)


@pytest.mark.parametrize("kv", [NARROW, CODES], ids=["quest", "codes"])
def test_qwen3_narrow_budget_equals_oasiskv_llm(qwen, kv):
    model, path = qwen
    prompt = qwen_prompt(200, 2)
    cache = ohf.OasisKVCache(model, kv, drafter="ngram")
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache=cache)
    got = new_tokens(out, prompt.shape[1])
    llm = oasiskv.LLM(str(path), kv=kv, drafter="ngram", device="cpu", dtype=torch.float32)
    ref = llm.generate(prompt[0].tolist(), max_new_tokens=NEW, temperature=0.0, ignore_eos=True)[0]
    assert got == ref.tokens
    assert_sparse(cache, NEW - 1)
    assert cache.metrics[0].fetched_bytes_total == ref.metrics.fetched_bytes_total
    # The narrow working set changes this model's tokens: the equality above is the selection's.
    ohf.disable(model)
    assert new_tokens(model.generate(prompt, max_new_tokens=NEW, do_sample=False), prompt.shape[1]) != got


def test_qwen3_sampling_wide_budget_equals_transformers_dense_sampling(qwen):
    model, _ = qwen
    prompt = qwen_prompt(120, 3)
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    ohf.disable(model)
    torch.manual_seed(7)
    dense = model.generate(prompt, **kw)
    torch.manual_seed(7)
    out = ohf.generate(model, prompt, WIDE, drafter="ngram", **kw)
    assert out.tolist() == dense.tolist()


def test_qwen3_sampling_narrow_budget_is_sparse_and_seeded(qwen):
    model, _ = qwen
    prompt = qwen_prompt(150, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        cache = ohf.OasisKVCache(model, NARROW)
        runs.append(model.generate(prompt, max_new_tokens=NEW, do_sample=True, temperature=1.0, cache=cache))
        assert_sparse(cache, NEW - 1)
    assert runs[0].tolist() == runs[1].tolist()
    assert runs[0].shape[1] == prompt.shape[1] + NEW


def test_qwen3_batch_rows_equal_their_own_runs(qwen):
    """Left-padded prompts of different lengths: each row is its own engine request, and its tokens
    are those it gets alone."""
    model, _ = qwen
    a, b = qwen_prompt(180, 5)[0], qwen_prompt(130, 6)[0]
    alone = []
    for p in (a, b):
        cache = ohf.OasisKVCache(model, NARROW)
        alone.append(
            new_tokens(model.generate(p[None], max_new_tokens=NEW, do_sample=False, cache=cache), len(p))
        )
    width = len(a)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate((a, b)):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    cache = ohf.OasisKVCache(model, NARROW)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert [row[width:] for row in out.tolist()] == alone
    assert [r.prompt for r in cache.requests] == [a.tolist(), b.tolist()]
    assert all(r.sparse for r in cache.requests)


def test_qwen3_num_return_sequences_samples_one_request_per_row(qwen):
    model, _ = qwen
    prompt = qwen_prompt(100, 12)
    cache = ohf.OasisKVCache(model, NARROW)
    torch.manual_seed(3)
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=True, num_return_sequences=3, cache=cache)
    assert out.shape == (3, prompt.shape[1] + NEW)
    assert [r.prompt for r in cache.requests] == [prompt[0].tolist()] * 3
    assert [r.tokens[len(r.prompt) :] for r in cache.requests] == [
        row[prompt.shape[1] : -1] for row in out.tolist()
    ]
    assert len({tuple(row) for row in out.tolist()}) > 1  # the rows sample independently


# --------------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_beams=2), "beam_search"),
        (dict(num_beams=2, do_sample=True), "beam_sample"),
        (dict(prompt_lookup_num_tokens=3), "assisted_generation"),
        (dict(cache_implementation="static"), "cache_implementation"),
        (dict(use_cache=False), "use_cache"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    ],
    ids=["beam", "beam-sample", "assisted", "static-cache", "no-cache", "hidden-states"],
)
def test_unsupported_generate_modes_raise_the_typed_error(qwen, kwargs, words):
    model, _ = qwen
    ohf.enable(model, kv=NARROW)
    with pytest.raises(ohf.UnsupportedGenerateModeError, match=words) as e:
        model.generate(qwen_prompt(60, 8), max_new_tokens=2, **kwargs)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


def test_a_cache_serves_one_generation(qwen):
    model, _ = qwen
    prompt = qwen_prompt(60, 9)
    cache = ohf.OasisKVCache(model, NARROW)
    model.generate(prompt, max_new_tokens=2, do_sample=False, cache=cache)
    with pytest.raises(ohf.UnsupportedGenerateModeError, match="already served"):
        model.generate(prompt, max_new_tokens=2, do_sample=False, cache=cache)
    with pytest.raises(ohf.UnsupportedGenerateModeError, match="reorder"):
        cache.reorder_cache(torch.tensor([0]))


def test_other_caches_and_plain_forwards_run_as_transformers_does(qwen):
    model, _ = qwen
    prompt = qwen_prompt(40, 10)
    ohf.disable(model)
    want = model(prompt).logits
    dense = model.generate(prompt, max_new_tokens=4, do_sample=False)
    ohf.enable(model, kv=NARROW)
    assert torch.equal(model(prompt).logits, want)
    cache = transformers.DynamicCache(config=model.config)
    assert model.generate(prompt, max_new_tokens=4, do_sample=False, cache=cache).tolist() == dense.tolist()
    assert cache.get_seq_length() > 0  # transformers' own cache did the work


def test_drafters_that_read_hidden_states_are_refused(qwen):
    model, _ = qwen

    class Capturing(oasiskv.NgramDrafter):
        def capture_layers(self, num_layers):
            return (0, num_layers)

    with pytest.raises(ConfigError, match="hidden states"):
        ohf.OasisKVCache(model, NARROW, drafter=Capturing())


def test_unsupported_models_are_refused():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    with pytest.raises(ConfigError, match="model types"):
        ohf.enable(transformers.GPT2LMHeadModel(cfg))
    with pytest.raises(ConfigError, match="transformers causal LM"):
        ohf.enable(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", [NARROW, CODES], ids=["quest", "codes"])
def test_qwen3_on_cuda_equals_the_cpu_and_oasiskv_llm(qwen, kv):
    """The same model on the GPU: the wide budget gives transformers' dense tokens, the narrow
    one the CPU run's tokens and oasiskv.LLM's on the GPU (eager), with the same fetched bytes."""
    model, path = qwen
    prompt = qwen_prompt(300, 13)
    cpu = ohf.OasisKVCache(model, kv)
    want = new_tokens(model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache=cpu), prompt.shape[1])
    gpu_model = transformers.Qwen3ForCausalLM(model.config).eval()
    gpu_model.load_state_dict(model.state_dict())
    gpu_model = gpu_model.to("cuda")
    p = prompt.to("cuda")
    dense = gpu_model.generate(p, max_new_tokens=NEW, do_sample=False)
    wide = ohf.OasisKVCache(gpu_model, WIDE)
    assert gpu_model.generate(p, max_new_tokens=NEW, do_sample=False, cache=wide).tolist() == dense.tolist()
    cache = ohf.OasisKVCache(gpu_model, kv)
    got = new_tokens(gpu_model.generate(p, max_new_tokens=NEW, do_sample=False, cache=cache), prompt.shape[1])
    assert cache.engine.device.type == "cuda"
    assert_sparse(cache, NEW - 1)
    assert got == want
    llm = oasiskv.LLM(
        str(path), kv=kv, drafter="ngram", device="cuda", dtype=torch.float32, enforce_eager=True
    )
    ref = llm.generate(prompt[0].tolist(), max_new_tokens=NEW, temperature=0.0, ignore_eos=True)[0]
    assert got == ref.tokens
    assert cache.metrics[0].fetched_bytes_total == ref.metrics.fetched_bytes_total
