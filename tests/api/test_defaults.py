"""What a user gets by default (issue 33): the fidelity selection with budget-aware successors and
the EAGLE-3 confidence fallback resolved for the drafter, ``KvConfig.fast()`` as the opt-in, the
device and dtype picked (or checked) by one function, fresh seeds per call, output text without
special tokens; and the audit's in-process findings 2-4 (a raising ``stop`` leaks nothing, a
device that cannot run is a typed error, ignored or bad arguments are refused)."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig, LLMEngine, SamplingParams, errors
from oasiskv.config import FAST_SELECTION, FIDELITY_SELECTION, auto_successor_blocks
from oasiskv.devices import resolve_device
from oasiskv.models.config import ModelConfig
from oasiskv.models.transformer import CausalLM
from support.fakes import tiny

# Private names read here: ``LLMEngine._by_id`` (its table of live requests, no public view): a stop
# callback that raises must leave that table empty.

torch.set_num_threads(2)

SPARSE = dict(block_size=8, top_k_blocks=6, fetch_cap=2, sparse_threshold=48)


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def smollm2():
    return oasiskv.LLM("smollm2", device="cpu", kv=KvConfig(top_k_blocks=8, sparse_threshold=64))


# ---------------------------------------------------------------- the selection


def test_the_default_selection_is_the_fidelity_selection():
    kv = KvConfig()
    assert {k: getattr(kv, k) for k in FIDELITY_SELECTION} == FIDELITY_SELECTION
    assert kv.lookahead_min_confidence == "auto"
    assert KvConfig.fidelity() == kv and KvConfig.fidelity(top_k_blocks=64) == KvConfig(top_k_blocks=64)
    fast = KvConfig.fast()
    assert {k: getattr(fast, k) for k in FAST_SELECTION} == FAST_SELECTION
    # The "auto" fields follow block_score: the Quest bound alone is the fast selection.
    assert KvConfig(block_score="quest") == fast
    assert KvConfig.fast(top_k_blocks=32, block_score="codes").score_candidates is None
    # Two stages need select_queries="lookahead": the two-query mode ranks every block.
    cur = KvConfig(select_queries="lookahead+current")
    assert cur.score_candidates is None and not cur.sticky_candidates and cur.lookahead_min_confidence is None


@pytest.mark.parametrize(
    "k, sink, pin, want",
    [(128, 0, 0, 8), (96, 0, 0, 8), (32, 0, 0, 8), (31, 0, 0, 7), (16, 0, 0, 4), (9, 0, 0, 2), (8, 0, 0, 2)]
    + [(4, 0, 0, 1), (3, 0, 0, 0), (1, 0, 0, 0), (16, 2, 2, 3), (8, 4, 3, 0)],
)
def test_default_successor_blocks_are_budget_aware(k, sink, pin, want):
    """8 successors at the usual budgets, at most a quarter of the free slots below that, so every
    budget is valid by default (the fidelity preset used to refuse K < 9)."""
    assert auto_successor_blocks(k, sink, pin) == want
    kv = KvConfig(top_k_blocks=k, sink_blocks=sink, pin_blocks=pin)
    assert kv.successor_blocks == want
    # Per-layer budgets: the smallest bounds it.
    assert KvConfig(top_k_blocks=64, layer_blocks=(64, 12, 40)).successor_blocks == 3


def test_an_explicit_successor_count_keeps_its_validation():
    assert KvConfig(top_k_blocks=12, successor_blocks=8).successor_blocks == 8
    with pytest.raises(errors.ConfigError, match=r"successor_blocks=8 is above 3.*lower successor_blocks"):
        KvConfig(top_k_blocks=4, successor_blocks=8)
    with pytest.raises(errors.ConfigError, match="successor_blocks"):
        KvConfig(successor_blocks="many")


@pytest.mark.parametrize(
    "drafter, want", [("ngram", None), ("previous-query", None), (None, None), ("eagle3", 0.5)]
)
def test_the_confidence_fallback_is_on_exactly_with_a_drafter_that_reports_one(drafter, want):
    """``lookahead_min_confidence="auto"`` resolves when the engine knows its drafter: 0.5 with
    EAGLE-3, off otherwise (the dense backend has no drafter at all)."""
    backend = "dense" if drafter is None else "oasis"
    eng = LLMEngine("smollm2", device="cpu", kv=KvConfig(**SPARSE), backend=backend, drafter=drafter)
    assert eng.kv.lookahead_min_confidence == want
    assert eng.kv.block_score == "codes" and eng.kv.successor_blocks == 1


def test_an_explicit_confidence_with_a_drafter_that_reports_none_is_refused(model):
    with pytest.raises(errors.ConfigError, match="eagle3"):
        LLMEngine(model, kv=KvConfig(**SPARSE, lookahead_min_confidence=0.5), drafter="ngram")
    with pytest.raises(errors.ConfigError, match="eagle3"):
        LLMEngine(model, kv=KvConfig(**SPARSE, lookahead_min_confidence=0.5), backend="dense", drafter=None)


def test_the_codes_need_head_dim_divisible_by_4_and_the_message_names_fast():
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=97,
        hidden_size=36,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=6,
        max_position_embeddings=256,
    )
    odd = CausalLM.random(cfg, seed=3)
    with pytest.raises(errors.ConfigError, match=r"head_dim divisible by 4, got 6.*KvConfig\.fast\(\)"):
        LLMEngine(odd, kv=KvConfig(**SPARSE))
    eng = LLMEngine(odd, kv=KvConfig.fast(**SPARSE))
    rid = eng.add_request(list(range(1, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
    out = eng.run_to_completion([rid])[rid]
    assert len(out.token_ids) == 4 and out.metrics.sparse_steps > 0


def test_the_default_selection_decodes_sparse(model):
    eng = LLMEngine(model, kv=KvConfig(**SPARSE))
    rid = eng.add_request(list(range(1, 120)), SamplingParams(max_tokens=6, ignore_eos=True))
    out = eng.run_to_completion([rid])[rid]
    assert out.metrics.sparse_steps == out.metrics.steps > 0


# ---------------------------------------------------------------- device, dtype, graphs


def test_auto_is_the_cpu_without_a_gpu_and_the_cpu_keeps_float32(model):
    eng = LLMEngine(model)
    assert eng.device == next(model.parameters()).device and not eng.cuda_graphs
    if not torch.cuda.is_available():
        assert resolve_device("auto") == "cpu"
        llm = oasiskv.LLM("smollm2")
        assert llm.llm_engine.device.type == "cpu" and next(llm.model.parameters()).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_a_gpu_on_a_machine_without_one_is_cuda_unavailable(device):
    """Audit 3: the project's CudaUnavailableError (an OasisError), not a builtin RuntimeError."""
    with pytest.raises(errors.CudaUnavailableError, match="device='auto'"):
        LLMEngine("smollm2", device=device)
    with pytest.raises(errors.CudaUnavailableError):
        oasiskv.LLM("smollm2", device=device)


@pytest.mark.parametrize("device", ["tpu", "meta", "mps", "xla", "gpu", 3])
def test_an_unsupported_device_is_a_config_error_naming_the_supported_ones(device):
    with pytest.raises(errors.ConfigError, match="cpu, cuda|'auto', 'cpu', 'cuda'"):
        LLMEngine("smollm2", device=device)


def test_a_model_object_is_not_moved_or_cast_silently(model):
    """Audit 4: device and dtype with a model object must be the model's own, else ConfigError."""
    LLMEngine(model, device="cpu", dtype=torch.float32)  # its own: fine
    with pytest.raises(errors.ConfigError, match=r"in torch.float32 but dtype=torch.bfloat16.*model.to"):
        LLMEngine(model, dtype=torch.bfloat16)
    with pytest.raises(errors.ConfigError, match="dtype must be None"):
        LLMEngine(model, dtype="bf16")
    if torch.cuda.is_available():
        with pytest.raises(errors.ConfigError, match=r"the model is on cpu but device='cuda'"):
            LLMEngine(model, device="cuda")
    else:
        with pytest.raises(errors.CudaUnavailableError):
            LLMEngine(model, device="cuda")


@pytest.mark.parametrize("seed", [-1, 1.5, True, "0", 2**63])
def test_bad_engine_seeds_are_refused(model, seed):
    """Audit 4: LLMEngine(seed=-1) and seed=1.5 used to be accepted."""
    with pytest.raises(errors.ConfigError, match="seed must be None"):
        LLMEngine(model, seed=seed)


# ---------------------------------------------------------------- text and seeds


def test_text_skips_special_tokens_and_the_tokens_keep_them(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    (res,) = smollm2.generate(prompt, max_new_tokens=48)
    end = tok.encode("<|im_end|>")
    assert res.finish_reason == "stop" and res.tokens[-1] in end
    assert "<|im_end|>" not in res.text and res.text.strip()
    (raw,) = smollm2.generate(prompt, max_new_tokens=48, skip_special_tokens=False)
    assert raw.tokens == res.tokens and raw.text.endswith("<|im_end|>")
    assert raw.text.removesuffix("<|im_end|>") == res.text
    eng = smollm2.llm_engine
    rid = eng.add_request(prompt, SamplingParams(max_tokens=48, skip_special_tokens=False))
    assert eng.result(eng.run_to_completion([rid])[rid], skip_special_tokens=False).text == raw.text


def test_sampled_calls_differ_without_a_seed_and_repeat_with_one(smollm2):
    kw = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    fresh = [tuple(smollm2.generate("Once upon a time", **kw)[0].tokens) for _ in range(3)]
    assert len(set(fresh)) == 3
    seeded = [tuple(smollm2.generate("Once upon a time", seed=11, **kw)[0].tokens) for _ in range(3)]
    assert len(set(seeded)) == 1
    with pytest.raises(errors.ConfigError, match="seed must be None"):
        smollm2.generate("x", seed=-2)


def test_an_engine_seed_makes_unseeded_requests_reproducible(model):
    def run(seed):
        eng = LLMEngine(model, seed=seed)
        rids = [eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0)) for _ in range(2)]
        outs = eng.run_to_completion(rids)
        return [outs[r].token_ids for r in rids]

    assert run(5) == run(5)
    assert run(None) != run(None)  # fresh seeds: two runs of 2 x 8 tokens over 301 differ


# ---------------------------------------------------------------- audit 2


def test_a_raising_stop_callback_leaves_nothing_in_the_engine(model):
    llm = oasiskv.LLM(model, kv=KvConfig(**SPARSE), drafter="ngram")
    le = llm.llm_engine

    def stop(i, generated):
        if i == 1 and len(generated) == 3:
            raise RuntimeError("the caller's bug")
        return False

    for _ in range(3):
        with pytest.raises(RuntimeError, match="the caller's bug"):
            llm.generate([[1, 2, 3] * 30, [4, 5, 6] * 20], max_new_tokens=8, stop=stop, ignore_eos=True)
        assert le._by_id == {} and not le.has_unfinished_requests()
        assert le.get_num_unfinished_requests() == 0 and le.step() == []
    # The engine goes on: a later call runs and still holds nothing after.
    (res,) = llm.generate([1, 2, 3] * 30, max_new_tokens=4, ignore_eos=True)
    assert len(res.tokens) == 4 and le._by_id == {}


@pytest.mark.parametrize("backend, want", [("oasis", 0.5), ("dense", None)])
def test_serve_builds_the_default_selection_with_eagle3(backend, want):
    """``oasis serve --drafter eagle3`` (default ``--selection fidelity``) builds its engine with the
    same defaults as ``LLMEngine``: the confidence fallback where EAGLE-3 drafts, none on the dense
    backend (no drafter); ``--enforce-eager`` reaches the engine, and contradicting
    ``--cuda-graph`` is a message."""
    import argparse

    from oasiskv.serve.cli import add_arguments, engine_from_args, engine_kwargs

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["smollm2", "--drafter", "eagle3", "--backend", backend, "--device", "cpu"])
    eng = engine_from_args(args.model, args)
    assert eng.kv.lookahead_min_confidence == want and eng.kv.block_score == "codes"
    assert not eng.cuda_graphs and not eng.enforce_eager
    assert engine_kwargs(ap.parse_args(["smollm2", "--enforce-eager"]))["enforce_eager"] is True
    with pytest.raises(errors.ConfigError, match="contradicts"):
        engine_kwargs(ap.parse_args(["smollm2", "--enforce-eager", "--cuda-graph"]))


def test_the_eval_names_the_default_selection_fidelity():
    """``oasis eval --drafters eagle3+fidelity``: KvConfig's default selection (its confidence
    fallback resolved by the engine for the drafter); a bare name stays the Quest selection; the
    suffixes the preset sets cannot follow it."""
    from oasiskv.eval.teacher import kv_budget_kwargs, parse_drafter

    kv = KvConfig(**kv_budget_kwargs(parse_drafter("eagle3+fidelity"), 96, 16))
    assert kv == KvConfig(top_k_blocks=96)
    assert kv.resolve(reports_confidence=True).lookahead_min_confidence == 0.5
    assert KvConfig(**kv_budget_kwargs(parse_drafter("ngram+fidelity+sink2"), 8, 16)).successor_blocks == 1
    assert KvConfig(**kv_budget_kwargs(parse_drafter("eagle3"), 96, 16)) == KvConfig.fast(top_k_blocks=96)
    for bad in (
        "eagle3+fidelity+codes",
        "eagle3+fidelity+succ8",
        "eagle3+fidelity+conf0.5",
        "eagle3+codes+fidelity",
    ):
        with pytest.raises(ValueError, match="unknown drafter"):
            parse_drafter(bad)


def test_replace_resolves_the_auto_fields_again():
    """``dataclasses.replace`` of a default config re-resolves its "auto" fields for the new values
    (a smaller budget gets fewer successors, the Quest score drops the two stages) instead of
    validating the old budget's resolved values as explicit ones; explicit values stay explicit."""
    import dataclasses

    kv = KvConfig()
    small = dataclasses.replace(kv, top_k_blocks=4)
    assert (small.successor_blocks, kv.successor_blocks) == (1, 8)
    assert dataclasses.replace(small, top_k_blocks=128).successor_blocks == 8
    assert dataclasses.replace(kv, block_score="quest") == KvConfig.fast()
    assert dataclasses.replace(kv, successor_blocks=2, top_k_blocks=64).successor_blocks == 2
    with pytest.raises(errors.ConfigError, match="successor_blocks=8"):
        dataclasses.replace(KvConfig(successor_blocks=8), top_k_blocks=4)
    assert KvConfig() == KvConfig.fidelity() and hash(KvConfig()) == hash(KvConfig.fidelity())
