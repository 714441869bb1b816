"""The evaluation harness end to end (``oasis eval``): arguments and presets, the results file
(keys, merge, resume), the report, the fp8 runs beside the float ones, and the CLI on a tiny
model (fast) and on SmolLM2 (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from oasiskv.eval import corpus, harness, report, teacher
from oasiskv.eval.teacher import Policy, TeacherForcing, greedy_continuations, summarize
from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import greedy_generate
from support.fakes import ByteTokenizer
from support.texts import repetitive

# Private names read here: ``harness._fill_preset`` (the CLI's preset defaults, applied to test
# arguments), ``report._pct``/``report._by_setting`` (the report's rounding and grouping, checked),
# ``Engine._initial_selection``/``_kept`` (the sticky candidates a recorder sees).

torch.set_num_threads(2)

BLOCK = 8


# ------------------------------------------------------------------------------------------ harness
def _args(tmp_path, *extra):
    args = harness.build_parser().parse_args(
        [
            "--out",
            str(tmp_path),
            "--contexts",
            "192",
            "--steps",
            "6",
            "--texts",
            "2",
            "--batch-size",
            "2",
            "--block-size",
            str(BLOCK),
            "--budgets",
            "1/8,1/4",
            "--caps",
            "0.05,none",
            "--drafters",
            "eagle3,ngram,oracle,previous-query",
            "--retrieval-trials",
            "2",
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


def test_lookahead_binned_by_the_heads_confidence(tiny, head):
    texts = [repetitive(257, seed=s) for s in range(2)]
    tf = TeacherForcing(tiny, texts, 12, block_size=BLOCK, batch_size=2, eagle3_head=head, progress=False)
    dense = tf.run(Policy("dense"))
    la = summarize(tf.run(Policy("oasis", "eagle3", 4, None)), dense)["lookahead"]
    bins = la["by_confidence"]
    assert [b["lo"] for b in bins] == [0.0, 0.25, 0.5, 0.75]
    steps = sum(b["steps"] for b in bins)
    assert steps == la["n_matched"] + la["n_unmatched"] == 11 * 2
    assert sum(b["share"] for b in bins if b["share"]) == pytest.approx(1.0)
    # The bins partition the steps: their acceptances add up to the matched count.
    assert sum(b["accept"] * b["steps"] for b in bins if b["steps"]) == pytest.approx(la["n_matched"])
    assert all(0.0 <= b["overlap"] <= 1.0 for b in bins if b["steps"])
    # Drafters without a confidence get no bins.
    assert "by_confidence" not in summarize(tf.run(Policy("oasis", "ngram", 4, None)), dense)["lookahead"]


def test_greedy_continuation_is_what_dense_greedy_decoding_feeds(tiny):
    texts = [repetitive(161, seed=s) for s in range(2)]
    steps = 12
    cont = greedy_continuations(tiny, texts, steps, block_size=BLOCK, batch_size=2)
    prefix = 160 - steps
    for t, c in zip(texts, cont, strict=True):
        assert len(c) == len(t) and c[:prefix] == t[:prefix]
        assert c[prefix:] == greedy_generate(tiny, t[:prefix], steps + 1)
    # Teacher-forcing the continuation: dense's argmax at every step is the token fed next, so the
    # oracle draft is the model's own choice and dense's top-1 agrees with the text everywhere.
    tf = TeacherForcing(tiny, cont, steps, block_size=BLOCK, batch_size=2, progress=False)
    dense = tf.run(Policy("dense"))
    fed_next = torch.tensor([c[prefix + 1 :] for c in cont]).T  # [S, n]
    assert torch.equal(dense.top1.cpu(), fed_next)
    assert tf.run(Policy("oasis", "oracle", 4, None)).matched.all()


def _teacher_results(tiny, tmp_path, *extra) -> dict:
    """Run the teacher section with `_args(tmp_path, *extra)` on the tiny model; the results.json."""
    res = harness.Results(tmp_path)
    res.add_run({"argv": ["oasis", "eval", *extra], "model": "tiny"})
    harness.run_teacher(
        _args(tmp_path, *extra),
        tiny,
        ByteTokenizer(),
        None,
        res,
        corpus.list_files(source="stdlib"),
        progress=False,
    )
    return json.loads((tmp_path / "results.json").read_text())


def test_harness_greedy_continuation_records_and_report(tiny, tmp_path):
    data = _teacher_results(
        tiny, tmp_path, "--continuation", "greedy", "--drafters", "oracle", "--budgets", "1/4", "--no-quest"
    )
    teacher = [r for r in data["records"] if r["section"] == "teacher"]
    assert len(teacher) == 1 + 2 and all(r["continuation"] == "greedy" for r in teacher)
    assert all(r["lookahead"]["draft_accept"] == 1.0 for r in teacher if r["policy"] == "oasis")
    md = report.render_markdown(data)
    assert "### Context 192, greedy continuation" in md


def test_drafter_names_with_current_query():
    assert teacher.drafter_parts("eagle3") == ("eagle3", "lookahead")
    assert teacher.drafter_parts("ngram+current") == ("ngram", "lookahead+current")
    assert teacher.drafter_parts("ngram+current+codes") == ("ngram", "lookahead+current")
    assert teacher.block_score_of("oracle+codes") == ("oracle", "codes")
    assert teacher.block_score_of("oracle") == ("oracle", "quest")
    for bad in ("previous-query+current", "eagle3+prev", "medusa", "ngram+codes+current"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.drafter_parts(bad)


def test_harness_runs_a_drafter_with_the_current_query(tiny, tmp_path):
    data = _teacher_results(
        tiny,
        tmp_path,
        "--drafters",
        "ngram,ngram+current",
        "--budgets",
        "1/8",
        "--caps",
        "none",
        "--no-quest",
    )
    oasis = {r["drafter"]: r for r in data["records"] if r["policy"] == "oasis"}
    assert set(oasis) == {"ngram", "ngram+current"}
    # Same drafts, different selection: the working sets (and so the overlaps) differ.
    assert oasis["ngram"]["lookahead"]["draft_accept"] == oasis["ngram+current"]["lookahead"]["draft_accept"]
    assert oasis["ngram"]["lookahead"]["overlap"] != oasis["ngram+current"]["lookahead"]["overlap"]
    assert "ngram+current" in report.render_markdown(data)


def test_harness_runs_a_drafter_with_key_codes(tiny, tmp_path):
    drafters = "oracle,oracle+codes,oracle+codes1+b16"
    extra = ("--drafters", drafters, "--budgets", "1/8", "--caps", "none", "--no-quest")
    data = _teacher_results(tiny, tmp_path, *extra)
    oasis = {r["drafter"]: r for r in data["records"] if r["policy"] == "oasis"}
    assert set(oasis) == {"oracle", "oracle+codes", "oracle+codes1+b16"}
    # Same drafts, another block score: other blocks are read, so the logits differ. (The overlap
    # is judged under each run's own score, so a perfect draft overlaps alike.)
    assert oasis["oracle"]["nll"] != oasis["oracle+codes"]["nll"]
    # Two stages with F = 1 over the 16-bit summaries (+b16): the codes only reorder the Quest
    # bound's own top-K, so the blocks read are Quest's, and the logits are the Quest-scored run's.
    assert oasis["oracle+codes1+b16"]["nll"] == pytest.approx(oasis["oracle"]["nll"], rel=1e-9)


def test_harness_runs_a_drafter_with_per_layer_budgets(tiny, tmp_path):
    extra = ("--drafters", "oracle,oracle+layers", "--budgets", "1/8", "--caps", "none", "--no-quest")
    data = _teacher_results(tiny, tmp_path, *extra)
    oasis = {r["drafter"]: r for r in data["records"] if r["policy"] == "oasis"}
    uniform, fitted = oasis["oracle"], oasis["oracle+layers"]
    assert "layer_blocks" not in uniform
    alloc = fitted["layer_blocks"]
    k, layers = uniform["top_k_blocks"], len(alloc)
    # Fitted on train-split text with the uniform budget's total; the record keeps the uniform K.
    assert fitted["top_k_blocks"] == k and sum(alloc) <= k * layers and alloc != [k] * layers
    assert fitted["nll"] != uniform["nll"]


def test_report_computes_vs_quest_for_runs_merged_beside_the_reference(tiny, tmp_path):
    # A part run with --no-quest, merged into results that hold the Quest-like record of the same
    # budget, still gets its "vs Quest" cell.
    data = _teacher_results(tiny, tmp_path, "--drafters", "oracle", "--budgets", "1/4", "--caps", "none")
    (oasis,) = [r for r in data["records"] if r["policy"] == "oasis"]
    (quest,) = [r for r in data["records"] if r["policy"] == "quest"]
    want = report._pct(100.0 * (oasis["nll"] - quest["nll"]) / quest["nll"])
    assert want == report._pct(oasis["delta_vs_quest_pct"])
    del oasis["delta_vs_quest_pct"], oasis["nll_quest"]
    row = next(line for line in report.render_markdown(data).splitlines() if "OasisKV oracle" in line)
    assert row.split("|")[7].strip() == want


def test_results_key_tells_greedy_from_text_records(tmp_path):
    # A greedy run of the same configuration is a different record: merging or resuming one must
    # never drop or skip the other (a merge once lost the 8K text records this way).
    base = {
        "section": "teacher",
        "context": 8192,
        "policy": "oasis",
        "drafter": "eagle3",
        "budget": "1/4",
        "fetch_cap": 0.05,
        "block_size": 16,
        "steps": 128,
        "texts": 8,
    }
    text, greedy = dict(base, nll=1.0), dict(base, continuation="greedy", nll=0.3)
    res = harness.Results(tmp_path / "a")
    res.add(text)
    assert res.find(dict(base, continuation="greedy")) is None
    res.merge({"schema": harness.SCHEMA, "runs": [], "records": [greedy]})
    assert sorted(r["nll"] for r in res.data["records"]) == [0.3, 1.0]
    assert res.find(base)["nll"] == 1.0
    res.add(dict(base, nll=2.0))  # the same configuration still replaces
    assert sorted(r["nll"] for r in res.data["records"]) == [0.3, 2.0]


def test_harness_end_to_end_results_schema(tiny, head, tmp_path):
    tok = ByteTokenizer()
    args = _args(tmp_path)
    files = corpus.list_files(source="stdlib")
    res = harness.Results(tmp_path)
    res.add_run({"argv": ["oasis", "eval", "--contexts", "192"], "model": "tiny"})
    harness.run_teacher(args, tiny, tok, head, res, files, progress=False)
    harness.run_retrieval(args, tiny, tok, head, res, files, progress=False)
    written = report.write(tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema"] == harness.SCHEMA
    teacher = [r for r in data["records"] if r["section"] == "teacher"]
    # dense + 2 budgets x (quest + 2 caps x 4 drafters)
    assert len(teacher) == 1 + 2 * (1 + 2 * 4)
    L = tiny.config.num_hidden_layers
    for r in teacher:
        for k in ("context", "steps", "texts", "block_size", "policy", "nll", "ppl", "nll_per_text"):
            assert k in r, k
        if r["policy"] == "dense":
            continue
        for k in (
            "budget",
            "top_k_blocks",
            "delta_nll",
            "delta_nll_pct",
            "kl",
            "top1_agree",
            "fetched_bytes_per_step",
        ):
            assert k in r and r[k] is not None, k
        assert r["top_k_blocks"] == harness.budget_blocks(192, float(eval(r["budget"])), BLOCK)
        if r["policy"] == "oasis":
            la = r["lookahead"]
            for k in (
                "overlap",
                "overlap_per_layer",
                "overlap_min_layer",
                "resident_hit",
                "draft_accept",
                "overlap_matched",
                "overlap_unmatched",
                "overlap_per_step",
            ):
                assert k in la, k
            assert len(la["overlap_per_layer"]) == L
            assert "delta_vs_quest_pct" in r and "cap_blocks" in r
        else:
            assert "would_fetch_bytes_per_step" in r
    ret = [r for r in data["records"] if r["section"] == "retrieval"]
    assert {(r["task"], r["policy"]) for r in ret} == {
        (t, p) for t in ("passkey", "kv") for p in ("dense", "oasis", "quest")
    }
    for r in ret:
        assert r["trials"] == 2 and len(r["outcomes"]) == 2 and 0 <= r["accuracy"] <= 1
        assert set(r["per_depth"]) == {"0.2", "0.8"} and r["context"] == 600
    md = (tmp_path / "results.md").read_text()
    for heading in (
        "## Lookahead accuracy",
        "By the head's probability of its draft",
        "## Decode fidelity",
        "## Retrieval accuracy",
        "Quest-like",
    ):
        assert heading in md
    names = {p.name for p in written}
    try:
        import matplotlib  # noqa: F401

        assert {"lookahead_per_layer_C192.png", "fidelity_vs_bytes_C192.png", "retrieval_C600.png"} <= names
        assert all((tmp_path / n).stat().st_size > 1000 for n in names if n.endswith(".png"))
    except ImportError:
        pass
    # A second run into the same directory replaces records of the same configuration.
    n_before = len(data["records"])
    args2 = _args(tmp_path, "--budgets", "1/4", "--caps", "none", "--drafters", "oracle", "--no-quest")
    harness.run_teacher(args2, tiny, tok, head, res, files, progress=False)
    data2 = json.loads((tmp_path / "results.json").read_text())
    assert len(data2["records"]) == n_before
    # --resume finds every configuration done: nothing runs, nothing changes.
    before = (tmp_path / "results.json").read_text()
    harness.run_teacher(_args(tmp_path, "--resume"), tiny, tok, head, res, files, progress=False)
    harness.run_retrieval(_args(tmp_path, "--resume"), tiny, tok, head, res, files, progress=False)
    assert (tmp_path / "results.json").read_text() == before


def test_time_limit_and_merge(tiny, tmp_path, monkeypatch):
    tok = ByteTokenizer()
    files = corpus.list_files(source="stdlib")
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(harness, "deadline", harness.Deadline(1e-9))  # already passed
    res_a = harness.Results(a)
    harness.run_teacher(_args(a, "--drafters", "oracle"), tiny, tok, None, res_a, files, progress=False)
    assert [r["policy"] for r in res_a.data["records"]] == ["dense"]  # the reference always runs
    monkeypatch.setattr(harness, "deadline", harness.Deadline(None))
    res_b = harness.Results(b)
    harness.run_teacher(
        _args(b, "--drafters", "oracle", "--budgets", "1/4", "--caps", "none", "--no-quest"),
        tiny,
        tok,
        None,
        res_b,
        files,
        progress=False,
    )
    assert len(res_b.data["records"]) == 2
    args = harness.build_parser().parse_args(
        [
            "--report-only",
            "--out",
            str(tmp_path / "m"),
            "--merge",
            str(a / "results.json"),
            str(b / "results.json"),
        ]
    )
    assert harness.main(args) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert len(merged["records"]) == 2  # dense of a replaced by dense of b (same configuration)
    assert (tmp_path / "m" / "results.md").is_file()


def test_parse_helpers():
    assert harness.parse_fractions("1/16,1/8, 1/4") == [("1/16", 0.0625), ("1/8", 0.125), ("1/4", 0.25)]
    assert harness.parse_caps("0.05,none,4") == [0.05, None, 4]
    with pytest.raises(ValueError):
        harness.parse_fractions("3/2")
    assert harness.parse_fractions("20b,1/4") == [("20b", None), ("1/4", 0.25)]
    assert harness.budget_blocks(8192, None, 16, "20b") == 20
    with pytest.raises(ValueError, match="block count"):
        harness.parse_fractions("xb")
    assert harness.budget_blocks(8192, 1 / 16, 16) == 32 and harness.budget_blocks(512, 1 / 16, 16) == 2


def test_report_only_needs_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="results.json"):
        report.write(tmp_path)


@pytest.mark.slow
def test_oasis_eval_cli_on_smollm2(tmp_path):
    """The real CLI path on SmolLM2 at a small size (about a minute on 2 cores)."""
    from oasiskv.cli import main

    rc = main(
        [
            "eval",
            "--out",
            str(tmp_path),
            "--threads",
            "2",
            "--no-progress",
            "--contexts",
            "256",
            "--steps",
            "8",
            "--texts",
            "1",
            "--budgets",
            "1/4",
            "--caps",
            "0.05",
            "--drafters",
            "ngram,oracle,previous-query",
            "--retrieval-trials",
            "1",
            "--retrieval-tasks",
            "passkey",
            "--depths",
            "0.5",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    recs = {(r["section"], r["policy"], r.get("drafter")): r for r in data["records"]}
    oracle = recs[("teacher", "oasis", "oracle")]["lookahead"]["overlap"]
    prev = recs[("teacher", "oasis", "previous-query")]["lookahead"]["overlap"]
    assert oracle >= prev and not math.isnan(oracle)
    assert recs[("retrieval", "dense", None)]["trials"] == 1
    assert data["runs"][-1]["model_config"]["num_hidden_layers"] == 30
    assert (tmp_path / "results.md").is_file()


def _byte_tokenizer_json(d: Path) -> None:
    """A byte-level BPE with no merges (256 tokens + <|endoftext|>), as a HF ``tokenizer.json``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from oasiskv.models.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = 256
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>"])
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def test_oasis_eval_cli_on_a_local_hf_checkpoint_with_an_eagle3_head(tiny, tmp_path):
    """Build item 3 of the evaluation: any local HF Llama/Qwen3 directory plus an EAGLE-3 head in
    the public format runs through the same CLI."""
    from safetensors.torch import save_file

    from oasiskv.cli import main

    model_dir, head_dir, out = tmp_path / "model", tmp_path / "head", tmp_path / "out"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny.config.to_hf_dict()))
    save_file(tiny.hf_state_dict(), str(model_dir / "model.safetensors"))
    _byte_tokenizer_json(model_dir)
    Eagle3Head.random(tiny.config, 64, seed=3).save(head_dir)
    argv = ["eval", "--model", str(model_dir), "--eagle3", str(head_dir), "--out", str(out)]
    argv += ["--no-progress", "--threads", "2", "--block-size", str(BLOCK), "--contexts", "192"]
    argv += ["--steps", "6", "--texts", "1", "--budgets", "1/4", "--caps", "0.05", "--no-quest"]
    argv += ["--drafters", "eagle3,previous-query", "--retrieval-contexts", "400", "--retrieval-trials", "1"]
    argv += ["--retrieval-tasks", "passkey", "--depths", "0.5", "--retrieval-budgets", "1/4"]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    run = data["runs"][-1]
    assert run["model_config"]["num_hidden_layers"] == tiny.config.num_hidden_layers
    assert str(head_dir) in json.dumps(run["eagle3"])
    recs = {(r["section"], r["policy"], r.get("drafter")): r for r in data["records"]}
    eagle = recs[("teacher", "oasis", "eagle3")]["lookahead"]
    assert eagle["draft_accept"] is not None and 0.0 <= eagle["overlap"] <= 1.0
    assert recs[("retrieval", "dense", None)]["trials"] == 1
    assert ("retrieval", "oasis", "eagle3") in recs
    assert (out / "results.md").is_file()


def test_eval_kv_dtype_fp8_runs_beside_the_float_run(tiny, tmp_path):
    """``--kv-dtype fp8_e4m3``: every run (dense included) over fp8 pages; its records carry the
    dtype, so they stand beside the float run's in one results file (``--resume`` keeps both),
    and the dense NLL moves a little."""
    tok = ByteTokenizer()
    files = corpus.list_files(source="stdlib")
    res = harness.Results(tmp_path)
    small = ("--drafters", "ngram", "--budgets", "1/4", "--caps", "0.05", "--no-quest")
    small += ("--retrieval-tasks", "passkey", "--retrieval-budgets", "1/4")
    for extra in ((), ("--kv-dtype", "fp8_e4m3")):
        args = _args(tmp_path, *small, *extra)
        harness.run_teacher(args, tiny, tok, None, res, files, progress=False)
        harness.run_retrieval(args, tiny, tok, None, res, files, progress=False)
    recs = res.data["records"]
    dense = {r.get("kv_dtype"): r for r in recs if r["section"] == "teacher" and r["policy"] == "dense"}
    assert sorted(dense, key=str) == [None, "fp8_e4m3"]
    assert dense[None]["nll"] != dense["fp8_e4m3"]["nll"]
    assert abs(dense["fp8_e4m3"]["nll"] / dense[None]["nll"] - 1) < 0.05
    retrieval = [r for r in recs if r["section"] == "retrieval"]
    assert {r.get("kv_dtype") for r in retrieval} == {None, "fp8_e4m3"}
    md = report.render_markdown(res.data)
    assert "192, fp8_e4m3 KV" in md and "dense, fp8_e4m3 KV" in md  # groups and columns of their own
