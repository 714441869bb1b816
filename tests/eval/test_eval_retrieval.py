"""The retrieval section of ``oasis eval`` on a tiny random model: generation stops once the score
is decided without changing it, batches give what one-at-a-time gives, every prompt is prefilled
once for all variants, and ``--time-limit-min`` stops between trial batches with partial records
that ``--resume`` completes into what an uninterrupted run writes."""

from __future__ import annotations

import json
import random

import pytest
import torch

import oasiskv.llm as llm_mod
from oasiskv.eval import corpus, harness, report, retrieval
from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import CausalLM
from support.configs import LLAMA_EVAL
from support.fakes import AsciiTokenizer

# Private names read here: ``harness._fill_preset`` (the CLI's preset defaults, applied to the
# test's arguments as ``main`` applies them).

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny():
    return CausalLM.random(LLAMA_EVAL, seed=2)  # its greedy output depends on the prompt


@pytest.fixture(scope="module")
def head(tiny):
    return Eagle3Head.random(tiny.config, 64, seed=2).attach_target(tiny)


@pytest.fixture(scope="module")
def files():
    return corpus.list_files(source="stdlib")


def _args(out, *extra):
    args = harness.build_parser().parse_args(
        [
            "--out",
            str(out),
            "--batch-size",
            "4",
            "--block-size",
            "8",
            "--retrieval-trials",
            "6",
            "--retrieval-tasks",
            "passkey,kv",
            "--depths",
            "0.2,0.8",
            "--retrieval-budgets",
            "1/4",
            "--retrieval-contexts",
            "600",
            *extra,
        ]
    )
    harness._fill_preset(args)
    return args


def _run(out, model, head, files, *extra) -> dict:
    res = harness.Results(out)
    harness.run_retrieval(_args(out, *extra), model, AsciiTokenizer(), head, res, files, progress=False)
    return {(r["task"], r["policy"]): r for r in json.loads((out / "results.json").read_text())["records"]}


@pytest.fixture
def generations(monkeypatch):
    """(variant, prompt) -> generated tokens of every LLM.generate call."""
    log: dict = {}
    orig = llm_mod.LLM.generate

    def gen(self, prompts, *a, **kw):
        out = orig(self, prompts, *a, **kw)
        var = (type(self.model).__name__, self.engine.backend)
        for p, r in zip(prompts, out, strict=True):
            log[(var, tuple(p))] = list(r.tokens)
        return out

    monkeypatch.setattr(llm_mod.LLM, "generate", gen)
    return log


def test_decided_never_changes_the_score():
    assert retrieval.decided("passkey", "12345", " 12345.")
    assert not retrieval.decided("passkey", "12345", " 12345")  # a 6th digit would change it
    assert retrieval.decided("passkey", "12345", " 13")  # no continuation makes it 12345
    assert not retrieval.decided("passkey", "12345", " The")
    assert retrieval.decided("kv", "0a1b2c3d", ' "0a1b2c3d')
    assert not retrieval.decided("kv", "0a1b2c3d", ' "0a1b')
    assert retrieval.decided("kv", "0a1b2c3d", ' "0b')
    assert not retrieval.decided("kv", "0a1b2c3d", "12\ufffd")  # may be a partial character
    assert retrieval.decided("kv", "0a1b2c3d", "\ufffd2")  # that one was not
    rng = random.Random(0)
    pieces = list("0123456789abcdef \n\"'.x") + ["12345", "0a1b2c3d", "\u00a0", "\ufffd"]
    for _ in range(20000):
        task, answer = rng.choice([("passkey", "12345"), ("needle", "1234567"), ("kv", "0a1b2c3d")])
        g = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        if retrieval.decided(task, answer, g):
            for _ in range(4):
                x = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
                assert retrieval.score(task, answer, g + x) == retrieval.score(task, answer, g), (task, g, x)


def test_batches_and_early_stop_give_the_outcomes_of_one_at_a_time(
    tiny, head, files, tmp_path, generations, monkeypatch
):
    batched = _run(tmp_path / "b", tiny, head, files)
    got = dict(generations)
    generations.clear()
    single = _run(tmp_path / "s", tiny, head, files, "--batch-size", "1")
    assert got == generations  # the same tokens, prompt by prompt, in every variant
    generations.clear()
    monkeypatch.setattr(retrieval, "decided", lambda *a: False)  # always the full max_new_tokens
    full = _run(tmp_path / "f", tiny, head, files, "--batch-size", "1")
    assert len(batched) == len(single) == len(full) == 2 * 3  # passkey, kv x dense, oasis, quest
    for k, r in batched.items():
        assert r["trials"] == 6 and not r["partial"] and r["trials_planned"] == 6
        for other in (single[k], full[k]):
            assert (r["outcomes"], r["accuracy"], r["per_depth"]) == (
                other["outcomes"],
                other["accuracy"],
                other["per_depth"],
            )
        assert r["generated_tokens_mean"] <= full[k]["generated_tokens_mean"]
    # Early stop cut some answers short, each a prefix of the full generation.
    stopped = 0
    for key, toks in got.items():
        assert generations[key][: len(toks)] == toks
        stopped += len(toks) < len(generations[key])
    assert stopped > 0


def test_each_prompt_is_prefilled_once_for_all_variants(tiny, head, files, tmp_path, monkeypatch):
    prefills = []
    orig = tiny.forward

    def forward(ids, pos, *a, **kw):
        if ids.numel() > 64:  # decode steps feed at most 2 rows x 4 requests
            prefills.append(ids.numel())
        return orig(ids, pos, *a, **kw)

    monkeypatch.setattr(tiny, "forward", forward)
    recs = _run(tmp_path, tiny, head, files)
    # dense, OasisKV with the EAGLE-3 drafter (captures features) and Quest-like (wraps the model)
    assert {p for _, p in recs} == {"dense", "oasis", "quest"}
    assert len(prefills) == 2 * 6


class _Checks:
    """A deadline that passes after ``n`` checks."""

    def __init__(self, n: int) -> None:
        self.n = n

    def passed(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_time_limit_stops_between_batches_and_resume_completes(tiny, files, tmp_path, monkeypatch):
    full = _run(tmp_path / "full", tiny, None, files, "--no-quest")
    out = tmp_path / "cut"
    # Checks: before the context, before passkey's first batch, before its second: stop there.
    monkeypatch.setattr(harness, "deadline", _Checks(2))
    cut = _run(out, tiny, None, files, "--no-quest")
    assert set(cut) == {("passkey", "dense"), ("passkey", "oasis")}
    for r in cut.values():
        assert r["partial"] and r["trials"] == 4 and r["trials_planned"] == 6
        assert r["outcomes"] == full[("passkey", r["policy"])]["outcomes"][:4]
    md = report.render_markdown(json.loads((out / "results.json").read_text()))
    assert "(4/6)" in md
    # Without --resume a later run starts over; with it, the partial records continue.
    monkeypatch.setattr(harness, "deadline", harness.Deadline(None))
    done = _run(out, tiny, None, files, "--no-quest", "--resume")
    assert set(done) == set(full)
    for k, r in done.items():
        assert not r["partial"] and r["trials"] == 6
        for f in ("outcomes", "accuracy", "per_depth", "examples", "prompt_tokens_mean"):
            assert r[f] == full[k][f], (k, f)
    # --resume skips complete records.
    before = (out / "results.json").read_text()
    _run(out, tiny, None, files, "--no-quest", "--resume")
    assert (out / "results.json").read_text() == before
