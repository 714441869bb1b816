"""The `oasis` CLI: JSON output, errors as exit codes with a message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def oasis(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "oasiskv.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_on_smollm2():
    p = oasis(
        "generate",
        "smollm2",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "4",
        "--backend",
        "dense",
        "--cuda-graph",  # ignored on the CPU, but it must reach the engine
        "--json",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert "Paris" in out["text"] and out["metrics"]["generated_tokens"] <= 4


def test_bad_input_is_a_message_not_a_traceback(tmp_path):
    p = oasis("generate", str(tmp_path / "nope"), "--prompt", "hi")
    assert p.returncode == 2
    assert "oasis generate: error:" in p.stderr and "Traceback" not in p.stderr
    p = oasis("generate", "smollm2", "--prompt", "hi", "--top-k-blocks", "0")
    assert p.returncode == 2 and "top_k_blocks" in p.stderr


def test_generate_takes_the_selection_flags():
    """--block-score, --score-candidates, --sticky-candidates, --sink-blocks, --pin-blocks,
    --successor-blocks and --layer-blocks reach KvConfig: a sparse run with the two-stage codes
    score, a sink, a pinned block and the bundled EAGLE-3 head, one with sticky candidates, one
    with a successor block, one with per-layer budgets, and a bad combination is a message."""
    common = ["generate", "smollm2", "--prompt", "The capital of France is the city of", "--json"]
    sparse = ["--block-size", "4", "--top-k-blocks", "3", "--sparse-threshold", "8", "--max-new-tokens", "4"]
    staged = [
        "--block-score",
        "codes",
        "--score-candidates",
        "2",
        "--sink-blocks",
        "1",
        "--pin-blocks",
        "1",
        "--drafter",
        "eagle3",
    ]
    p = oasis(*common, *sparse, *staged)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["metrics"]["generated_tokens"] <= 4 and out["metrics"]["sparse_steps"] > 0
    p = oasis(*common, "--block-score", "quest", "--score-candidates", "2")
    assert p.returncode == 2 and "block_score='codes'" in p.stderr and "Traceback" not in p.stderr
    p = oasis(*common, *sparse, *staged[:4], "--sticky-candidates", "--drafter", "ngram")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, "--selection", "fast", "--block-score", "codes", "--sticky-candidates")
    assert p.returncode == 2 and "needs score_candidates" in p.stderr and "Traceback" not in p.stderr
    p = oasis(*common, *sparse, "--lookahead-min-confidence", "0.3", "--drafter", "eagle3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, *sparse, "--lookahead-min-confidence", "0.3", "--drafter", "ngram")
    assert p.returncode == 2 and "eagle3" in p.stderr and "Traceback" not in p.stderr
    p = oasis(*common, *sparse, "--sink-blocks", "1", "--pin-blocks", "2")
    assert p.returncode == 2 and "pin_blocks=2 is above 1" in p.stderr and "Traceback" not in p.stderr
    p = oasis(*common, *sparse, "--sink-blocks", "1", "--successor-blocks", "1", "--drafter", "ngram")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, *sparse, "--sink-blocks", "1", "--pin-blocks", "1", "--successor-blocks", "1")
    assert p.returncode == 2 and "successor_blocks=1 is above 0" in p.stderr and "Traceback" not in p.stderr
    budgets = ",".join(str(1 + i % 3) for i in range(30))  # SmolLM2: 30 layers
    p = oasis(*common, *sparse, "--layer-blocks", budgets, "--drafter", "ngram")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, *sparse, "--layer-blocks", "2,3")
    assert p.returncode == 2 and "has 2 budgets but the model has 30 layers" in p.stderr
    assert "Traceback" not in p.stderr
    p = oasis(*common, *sparse, "--layer-blocks", "2,x")
    assert p.returncode == 2 and "comma-separated ints" in p.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--drafters", "previous-query+current"], "unknown drafter"),
        (["--attn-mass-every", "-1"], "--attn-mass-every"),
        (["--sections", "teacher,speed"], "unknown section"),
    ],
)
def test_eval_bad_arguments_are_a_message_not_a_traceback(tmp_path, args, says):
    p = oasis("eval", "--out", str(tmp_path), "--contexts", "256", *args)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "oasis eval: error:" in p.stderr and says in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_demo_json_end_to_end():
    p = oasis("demo", "--json", "--prompt-tokens", "6144", "--max-new-tokens", "16", timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["dense"]["prompt_tokens"] >= 6000
    assert r["oasis"]["resident_kv_bytes"] < r["dense"]["resident_kv_bytes"] / 2
    assert r["oasis"]["sparse_steps"] == r["oasis"]["steps"]
    assert 0.0 <= r["oasis"]["lookahead_recall"] <= 1.0


def test_selection_preset_and_explicit_flags_over_it():
    """The default ``--selection`` is ``fidelity``: KvConfig's own defaults, whose confidence
    fallback the engine resolves for its drafter; ``fast`` (and its old name ``quest``) is
    :meth:`KvConfig.fast`; a flag given as well wins."""
    import argparse

    from oasiskv import KvConfig
    from oasiskv.config import FIDELITY_SELECTION
    from oasiskv.serve.cli import add_engine_arguments, selection_kwargs

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)

    def kw(*argv):
        return selection_kwargs(ap.parse_args(list(argv)))

    plain = KvConfig(**kw())
    assert plain == KvConfig() == KvConfig.fidelity() == KvConfig(**kw("--selection", "fidelity"))
    assert {k: getattr(plain, k) for k in FIDELITY_SELECTION} == FIDELITY_SELECTION
    eagle = KvConfig(**kw("--drafter", "eagle3"))
    assert eagle.lookahead_min_confidence == "auto"
    assert eagle.resolve(reports_confidence=True).lookahead_min_confidence == 0.5
    assert eagle.resolve(reports_confidence=False).lookahead_min_confidence is None
    assert KvConfig(**kw("--selection", "fast")) == KvConfig.fast() == KvConfig(**kw("--selection", "quest"))
    assert KvConfig.fast().block_score == "quest" and KvConfig.fast().successor_blocks == 0
    over = kw(
        "--drafter",
        "eagle3",
        "--no-sticky-candidates",
        "--successor-blocks",
        "2",
        "--lookahead-min-confidence",
        "0.25",
        "--score-candidates",
        "2",
    )
    assert over["sticky_candidates"] is False and over["successor_blocks"] == 2
    assert over["lookahead_min_confidence"] == 0.25 and over["score_candidates"] == 2.0
    assert KvConfig(**over).block_score == "codes"
    fast_codes = KvConfig(**kw("--selection", "fast", "--block-score", "codes"))
    assert fast_codes.block_score == "codes" and fast_codes.score_candidates is None
    assert KvConfig(**kw("--block-score", "quest")) == KvConfig.fast()


def test_generate_with_the_fidelity_selection():
    """``--selection fidelity`` reaches the engine (a sparse run, with EAGLE-3's confidence
    fallback); its successors shrink with a small budget (K = 4 runs), and an explicit count too
    large for the budget is a message that says which flag to lower."""
    common = ["generate", "smollm2", "--prompt", "The capital of France is the city of", "--json"]
    sparse = [
        "--block-size",
        "2",
        "--sparse-threshold",
        "8",
        "--max-new-tokens",
        "4",
        "--selection",
        "fidelity",
    ]
    p = oasis(*common, *sparse, "--top-k-blocks", "10", "--drafter", "eagle3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, *sparse, "--top-k-blocks", "4")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["metrics"]["sparse_steps"] > 0
    p = oasis(*common, *sparse, "--top-k-blocks", "4", "--successor-blocks", "8")
    assert p.returncode == 2 and "successor_blocks" in p.stderr and "Traceback" not in p.stderr
