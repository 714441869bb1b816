"""``python -m oasiskv.bench.serve --fig11`` on the tiny preset on the CPU: every mode and
concurrency runs, the report's numbers are there and positive, the modes make the same number of
tokens (the oracle the same tokens as oasis), and a budget too small for dense skips that row and
says where dense fills it. Speculative rows at a set acceptance: with forced verdicts (the
default) the accept column is the set rate in one round, and the report says the tokens are not
the model's; with ``--draft-verdicts reference`` the reference is iterated."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oasiskv.bench import serve as bench
from oasiskv.cli import main as oasis_main

torch.set_num_threads(2)

TINY = ["--fig11", "--preset", "tiny", "--contexts", "256", "--max-tokens", "4", "--device", "cpu"]
KV = ["--top-k-blocks", "4", "--fetch-cap", "0.5"]


def _files(tmp_path, name):
    paths = {ext: tmp_path / f"{name}.{ext}" for ext in ("json", "md", "png")}
    return paths, [x for ext, p in paths.items() for x in (f"--{ext}", str(p))]


def test_fig11_sweep_reports_every_mode_and_concurrency(tmp_path, capsys):
    paths, out = _files(tmp_path, "fig11")
    args = [*TINY, *KV, "--concurrency", "1,2", "--modes", "dense,oasis,oracle", *out]
    assert bench.main(args) == 0
    assert "| context | mode | conc |" in capsys.readouterr().out
    assert paths["md"].read_text().count("\n| 256 |") == 6 and paths["png"].stat().st_size > 0
    rep = json.loads(paths["json"].read_text())
    assert rep["mode"] == "fig11" and rep["ceilings"] is None  # no CUDA: no copy bandwidth
    assert rep["contexts"]["256"]["ttft_cold_s"] > 0
    assert rep["gpu_kv_budget"] == "auto" and rep["gpu_kv_budget_kind"] == "emulated h100"  # auto off an H100
    head = "| of roofline | binds | of HBM | of PCIe | of SM-read roofline | of d2d roofline |"
    assert head in paths["md"].read_text()
    rows = {(r["mode"], r["concurrency"]): r for r in rep["rows"]}
    assert sorted(rows) == [(m, c) for m in ("dense", "oasis", "oracle") for c in (1, 2)]
    for (mode, c), r in rows.items():
        assert r["status"] == "ok", r
        assert r["output_tokens"] == 4 * c and r["timed_steps"] >= 1
        for key in ("decode_tokens_per_s", "tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "gpu_kv_bytes"):
            assert r[key] > 0, (mode, c, key)
        assert r["step_read_bytes"] > 0 and r["roofline_fraction"] is None
        for key in (
            "roofline_tpot_s",
            "roofline_binds",
            "hbm_fraction",
            "pcie_fraction",
            "roofline_fraction_d2d",
        ):
            assert r[key] is None, (mode, c, key)  # no ceilings on the CPU
        assert (r["pcie_bytes_per_step"] > 0) == (
            mode == "oasis"
        )  # dense fetches nothing, the oracle no PCIe
        assert (
            r["gpu_kv_budget_kind"] == "emulated h100"
            and r["gpu_kv_budget_bytes"] == rep["gpu_kv_budget_bytes"]
        )
        assert (r["host_pool_bytes"] > 0) == (mode != "dense")
        assert r["fetched_bytes_per_step"] is None if mode == "dense" else r["fetched_bytes_per_step"] > 0
    for c in (1, 2):
        assert rows["oracle", c]["tokens_digest"] == rows["oasis", c]["tokens_digest"]
        assert rows["oracle", c]["fetched_bytes_per_step"] == rows["oasis", c]["fetched_bytes_per_step"]
        assert rows["oracle", c]["host_pool"] == "device" and rows["oasis", c]["host_pool"] == "pinned"


def test_fig11_skips_what_does_not_fit_and_says_where_dense_fills(tmp_path):
    """Through ``oasis bench serve``: one tiny request's KV is 139264 bytes (17 blocks of 8 KiB),
    so a 250000-byte budget holds one dense request, not two (278528); oasis (5 + 16 pages, and
    the summaries, key codes and 8-bit bound of every block) still runs two."""
    paths, out = _files(tmp_path, "small")
    args = [*TINY, *KV, "--concurrency", "1,2", "--modes", "dense,oasis", "--gpu-kv-budget", "250000", *out]
    assert oasis_main(["bench", "serve", *args]) == 0
    rep = json.loads(paths["json"].read_text())
    info = rep["contexts"]["256"]
    assert info["request_kv_bytes"] == 139264 and info["dense_fills_budget_at"] == 2
    status = {(r["mode"], r["concurrency"]): r["status"] for r in rep["rows"]}
    assert status == {("dense", 1): "ok", ("dense", 2): "skipped", ("oasis", 1): "ok", ("oasis", 2): "ok"}
    skipped = next(r for r in rep["rows"] if r["status"] == "skipped")
    assert "GPU KV budget" in skipped["reason"] and "skipped: dense KV" in paths["md"].read_text()


def test_fig11_concurrency_max_runs_each_mode_at_the_most_that_fit(tmp_path):
    """``--concurrency max``: each mode runs at the largest concurrency its budgets hold, the
    report's ``max_concurrency`` (dense 1 in 250000 bytes, as above; oasis as many as a 1 MiB host
    pool holds), and a level beside it still runs as given."""
    paths, out = _files(tmp_path, "max")
    budgets = ["--gpu-kv-budget", "250000", "--host-kv-budget", "1MiB"]
    args = [*TINY, *KV, "--concurrency", "max,1", "--modes", "dense,oasis", *budgets, *out]
    assert bench.main(args) == 0
    rep = json.loads(paths["json"].read_text())
    most = rep["contexts"]["256"]["max_concurrency"]
    assert most["dense"] == 1 and most["oasis"] > 1, most
    got = [(r["mode"], r["concurrency"], r["status"]) for r in rep["rows"]]
    assert got == [("dense", 1, "ok"), ("dense", 1, "ok"), ("oasis", most["oasis"], "ok"), ("oasis", 1, "ok")]


def test_fig11_concurrency_max_where_nothing_fits_is_a_skipped_row(tmp_path):
    """A budget below one request: the ``max`` level is a skipped row that says so, and the
    markdown still renders."""
    paths, out = _files(tmp_path, "none")
    args = [*TINY, *KV, "--concurrency", "max", "--modes", "dense", "--gpu-kv-budget", "1000", *out]
    assert bench.main(args) == 0
    (row,) = json.loads(paths["json"].read_text())["rows"]
    assert row["status"] == "skipped" and "not even one request fits" in row["reason"]
    assert "not even one request fits" in paths["md"].read_text()


def test_fig11_real_budget_is_the_free_memory_less_the_reserve_and_every_row_names_it(tmp_path):
    """``--gpu-kv-budget real`` on the CPU, where the engine's pools live in RAM: the budget is the
    context's free bytes less the activation reserve, named in the header, the context and every
    row and in the markdown."""
    paths, out = _files(tmp_path, "real")
    reserve = ["--activation-reserve", "1MiB"]
    args = [
        *TINY,
        *KV,
        "--concurrency",
        "1",
        "--modes",
        "dense,oasis",
        "--gpu-kv-budget",
        "real",
        *reserve,
        *out,
    ]
    assert bench.main(args) == 0
    rep = json.loads(paths["json"].read_text())
    info = rep["contexts"]["256"]
    assert (
        rep["gpu_kv_budget_kind"] == info["gpu_kv_budget_kind"] == "real"
        and rep["activation_reserve_bytes"] == 2**20
    )
    assert info["gpu_kv_budget_bytes"] == info["device_free_bytes"] - 2**20
    for r in rep["rows"]:
        assert r["status"] == "ok" and r["gpu_kv_budget_kind"] == "real", r
        assert r["gpu_kv_budget_bytes"] == info["gpu_kv_budget_bytes"]
    md = paths["md"].read_text()
    assert "real: the card's free memory" in md and "context 256: GPU KV budget" in md


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--modes", "oasis", "--top-k-blocks", "64"], "does not turn sparse"),
        (["--max-tokens", "2"], "--max-tokens >= 3"),
        (["--preset", "nope"], "unknown model preset"),
        (["--concurrency", "max,0"], "with --fig11 also 'max'"),
        (["--concurrency", "most"], "with --fig11 also 'max'"),
    ],
)
def test_fig11_bad_arguments_are_a_message(extra, says, capsys):
    assert bench.main([*TINY, "--json", "", "--md", "", "--png", "", *extra]) == 2
    assert says in capsys.readouterr().err


def test_fig11_speculative_rows_at_set_acceptance(tmp_path, capsys):
    """``--speculative --draft-acceptance --draft-verdicts reference``: after the oasis row, one
    oracle row per rate in the same table and JSON, with tokens per step, the measured acceptance,
    the fraction of tokens equal to the oasis row and how the reference iteration ended."""
    paths, out = _files(tmp_path, "spec")
    spec = [
        "--speculative",
        "--draft-acceptance",
        "0.5,1",
        "--draft-cost",
        "none",
        "--draft-verdicts",
        "reference",
    ]
    args = [*TINY, *KV, "--max-tokens", "6", "--concurrency", "2", "--modes", "oasis", *spec, *out]
    assert bench.main(args) == 0
    md = paths["md"].read_text()
    assert "| tok/step | accept | same tokens |" in md and "| oasis+spec@0.5 | 2 |" in md
    rep = json.loads(paths["json"].read_text())
    assert rep["speculative"]["modes"] == ["oasis+spec@0.5", "oasis+spec@1"]
    rows = {r["mode"]: r for r in rep["rows"]}
    assert list(rows) == ["oasis", "oasis+spec@0.5", "oasis+spec@1"]
    assert rows["oasis"]["speculative"] is False and "acceptance_rate" not in rows["oasis"]
    for mode in ("oasis+spec@0.5", "oasis+spec@1"):
        r = rows[mode]
        assert r["status"] == "ok" and r["speculative"] and r["drafter"] == "oracle", r
        assert r["output_tokens"] == 12 and r["decode_tokens_per_s"] > 0 and r["tpot_p50_s"] > 0
        assert r["draft_cost"] == "none" and 1 <= r["reference_rounds"] <= 16
        assert r["draft_verdicts"] == "reference" and "verdicts forced" not in md
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["tokens_per_step"] <= 2
        assert 0 <= r["tokens_match_base"] <= 1
        if r["reference_converged"]:
            assert r["off_reference_requests"] == 0
    r = rows["oasis+spec@1"]
    if r["reference_converged"]:  # every draft right: every verified draft accepted
        assert r["acceptance_rate"] == 1.0 and r["tokens_per_step"] > 1.5


def test_fig11_forced_verdicts_read_the_set_acceptance(tmp_path):
    """``--speculative --draft-acceptance 0,0.4,1`` (forced verdicts, the default) on a lossy
    working set (K = 4 blocks of 16, 256-token prompts), where verification against a reference
    accepted 0 of 84 drafts at 0.4 before the reference iteration: one round per row, and the
    accept column reads the set rate -- exactly at 0 and 1, within sampling error at 0.4 -- with
    tokens per step 1 + accepted / steps; the table and JSON say the tokens are forced."""
    paths, out = _files(tmp_path, "forced")
    spec = ["--speculative", "--draft-acceptance", "0,0.4,1", "--draft-cost", "none"]
    args = [*TINY, *KV, "--max-tokens", "48", "--concurrency", "4", "--modes", "oasis", *spec, *out]
    assert bench.main(args) == 0
    md = paths["md"].read_text()
    assert "verdicts are FORCED" in md and "NOT the model's greedy outputs" in md
    assert md.count("verdicts forced: tokens are not the model's") == 3
    rep = json.loads(paths["json"].read_text())
    assert rep["speculative"]["draft_verdicts"] == "forced" and rep["speculative"]["oracle_rounds"] is None
    rows = {r["mode"]: r for r in rep["rows"]}
    assert list(rows) == ["oasis", "oasis+spec@0", "oasis+spec@0.4", "oasis+spec@1"]
    for a in (0.0, 0.4, 1.0):
        r = rows[f"oasis+spec@{a:g}"]
        assert r["status"] == "ok" and r["draft_verdicts"] == "forced", r
        assert r["reference_rounds"] == 1 and r["reference_converged"] is None
        assert r["output_tokens"] == 4 * 48 and r["drafts"] >= 4 * 20
        n, acc = r["drafts"], r["acceptance_rate"]
        if a in (0.0, 1.0):
            assert acc == a, r
        else:
            assert abs(acc - a) <= 3 * math.sqrt(a * (1 - a) / n), r
        # Each request-step makes one token, two where its draft was accepted.
        assert r["tokens_per_step"] == pytest.approx(1 + acc * n / (4 * 47 - acc * n), rel=1e-9), r
    assert rows["oasis+spec@1"]["tokens_per_step"] > 1.9


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--speculative", "--draft-acceptance", "0.4", "--modes", "dense"], "add oasis to --modes"),
        (["--draft-acceptance", "0.4", "--modes", "oasis"], "add --speculative"),
        (["--speculative", "--draft-acceptance", "0.4", "--modes", "oasis"], "pass --draft-cost none"),
        (["--speculative", "--modes", "oasis", "--oracle-rounds", "0"], "--oracle-rounds must be >= 1"),
    ],
)
def test_fig11_bad_speculative_arguments_are_a_message(extra, says, capsys):
    assert bench.main([*TINY, *KV, "--json", "", "--md", "", "--png", "", *extra]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1.5", "-0.1", "x", ""])
def test_fig11_draft_acceptance_outside_0_1_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([*TINY, "--speculative", "--draft-acceptance", value])
    assert e.value.code == 2
    assert "acceptance rates in [0, 1]" in capsys.readouterr().err


def test_fig11_eagle3_drafter_on_random_weights_is_a_random_head(tmp_path, capsys):
    """``--drafter eagle3`` on a preset: the oasis rows draft with a random EAGLE-3 head of the
    target's shape (its cost), said in the report; a preset too shallow for one is a message."""
    out = tmp_path / "f.json"
    args = [
        "--fig11", "--preset", "tiny-deep", "--contexts", "256", "--max-tokens", "4", "--device", "cpu",
        "--concurrency", "2", "--modes", "oasis", "--drafter", "eagle3", *KV,
        "--json", str(out), "--md", "", "--png", "",
    ]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["kv"]["drafter"].startswith("eagle3 (a random head")
    assert rep["kv"]["drafter_head_bytes"] > 0
    # The head's own KV per request, counted in the fit: K and V of 256 + 4 positions (unpaged on
    # the CPU), so a multiple of 2 x 260 values.
    head_kv = rep["contexts"]["256"]["drafter_bytes"]["oasis"]
    assert head_kv > 0 and head_kv % (2 * 260) == 0
    (row,) = rep["rows"]
    assert row["status"] == "ok" and row["output_tokens"] == 2 * 4
    assert bench.main([*TINY, *KV, "--drafter", "eagle3", "--json", "", "--md", "", "--png", ""]) == 2
    assert "--drafter eagle3" in capsys.readouterr().err


def test_fig11_fidelity_selection_with_the_eagle3_drafter_runs_every_mode(tmp_path):
    """``--selection fidelity --drafter eagle3`` (the default selection with the paper's drafter)
    runs the dense, oasis and oracle rows: the confidence fallback is on where the drafter reports
    its probability (the oasis rows, said in the report), off in the dense rows, which have no
    drafter (they used to be refused: "needs a drafter with a lookahead row ... got None")."""
    out = tmp_path / "f.json"
    args = [
        "--fig11", "--preset", "tiny-deep", "--contexts", "256", "--max-tokens", "4", "--device", "cpu",
        "--concurrency", "2", "--modes", "dense,oasis,oracle", "--drafter", "eagle3", *KV,
        "--selection", "fidelity", "--json", str(out), "--md", "", "--png", "",
    ]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["kv"]["selection"] == "codes1.25+sticky+succ1+conf0.5"
    rows = {r["mode"]: r for r in rep["rows"]}
    assert set(rows) == {"dense", "oasis", "oracle"}
    assert all(r["status"] == "ok" and r["output_tokens"] == 2 * 4 for r in rows.values())


def test_fig11_selection_flags_reach_the_engine(tmp_path):
    """``--block-score codes --score-candidates 2 --sticky-candidates --successor-blocks 2`` select
    differently from the Quest-only ``--selection fast`` (the report says which selection ran), and
    the oracle matches oasis under that selection too."""
    runs = {}
    for name, sel in (
        ("quest", ["--selection", "fast"]),
        (
            "codes",
            [
                "--block-score",
                "codes",
                "--score-candidates",
                "2",
                "--sticky-candidates",
                "--successor-blocks",
                "2",
            ],
        ),
    ):
        paths, out = _files(tmp_path, name)
        args = [
            *TINY,
            *KV,
            "--concurrency",
            "2",
            "--modes",
            "oasis,oracle",
            "--prompts",
            "distinct",
            *sel,
            *out,
        ]
        assert bench.main(args) == 0
        runs[name] = json.loads(paths["json"].read_text())
        assert f"- selection: {runs[name]['kv']['selection']}" in paths["md"].read_text()
    assert runs["quest"]["kv"]["selection"] == "quest"
    assert runs["codes"]["kv"]["selection"] == "codes2+sticky+succ2"
    rows = {n: {r["mode"]: r for r in rep["rows"]} for n, rep in runs.items()}
    assert rows["codes"]["oracle"]["tokens_digest"] == rows["codes"]["oasis"]["tokens_digest"]
    # The working sets differ, so the fetched blocks do.
    assert (
        rows["codes"]["oasis"]["fetched_bytes_per_step"] != rows["quest"]["oasis"]["fetched_bytes_per_step"]
    )


def _report(ceilings: dict | None, row: dict, **header) -> dict:
    """A one-row report dict as :meth:`Fig11.run` writes it (only what the markdown reads)."""
    kv = {"top_k_blocks": 128, "block_size": 16, "fetch_cap_blocks": 103, "drafter": "ngram"}
    base = {
        "context": 16384,
        "mode": "oasis",
        "concurrency": 44,
        "status": "ok",
        "host_pool_place": "cpu pinned",
    }
    cells = dict.fromkeys(
        (
            "decode_tokens_per_s",
            "tpot_p50_s",
            "tpot_p99_s",
            "ttft_p50_s",
            "peak_gpu_bytes",
            "host_pool_bytes",
        ),
        1.0,
    )
    cells.update(fetched_bytes_per_step=1.0, kernels_per_layer_step=1.0, roofline_tpot_s=0.012)
    return {
        "model": "qwen3-8b (random weights)",
        "device": "NVIDIA H100 80GB HBM3",
        "dtype": "bfloat16",
        "max_tokens": 64,
        "prompts": "shared",
        "cuda_graph": True,
        "kv": kv,
        "weights_bytes": 16 * 2**30,
        "gpu_kv_budget": "auto",
        "gpu_kv_budget_bytes": 62 * 2**30,
        "activation_reserve_bytes": 2**30,
        "host_limit_bytes": 100 * 2**30,
        "ceilings": ceilings,
        "contexts": {},
        "rows": [{**base, **cells, **row}],
        **header,
    }


def test_fig11_markdown_shows_the_bound_its_fractions_and_the_budget():
    from oasiskv.bench.fig11.report import markdown

    ceilings = {"hbm_read_Bps": 3.0e12, "d2d_copy_Bps": 2.95e12, "h2d_pinned_Bps": 5.3e10}
    row = {"roofline_fraction": 0.8, "roofline_binds": "pcie", "hbm_fraction": 0.61, "pcie_fraction": 0.8}
    md = markdown(_report(ceilings, {**row, "roofline_fraction_d2d": 0.6}, gpu_kv_budget_kind="real"))
    assert "HBM read 3000 GB/s, device-to-device copy 2950 GB/s (read + write)" in md
    assert "GPU KV budget 62.0 GiB (real: the card's free memory" in md
    assert "| 12.00 | 80% | pcie | 61% | 80% | - | 60% |" in md
    # A report from before issue 35 (no read ceiling, no budget kind, the d2d fraction only).
    old = markdown(_report({"d2d_copy_Bps": 2.95e12, "h2d_pinned_Bps": 5.3e10}, {"roofline_fraction": 0.6}))
    assert (
        "HBM read" not in old
        and "(emulated: an 80 GiB H100" in old
        and "| 12.00 | 60% | - | - | - | - |" in old
    )


def test_fig11_a_prefill_out_of_device_memory_skips_its_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A row whose pools fit but whose second request's prefill runs the device out of memory
    (the pools beside it leave too little for its activations: 86 x 16K and 10 x 128K on the H100
    in s22) is skipped with the reason, as a row that does not fit; the others run."""
    from oasiskv.engine.core import Engine

    real = Engine.prefill_chunk
    prefilled: dict[int, set] = {}

    def prefill_chunk(self, r, start, end):
        mine = prefilled.setdefault(id(self), set())
        mine.add(r.id)
        if self.max_num_seqs == 2 and len(mine) == 2:  # the C = 2 row's second request
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (test)")
        return real(self, r, start, end)

    monkeypatch.setattr(Engine, "prefill_chunk", prefill_chunk)
    paths, out = _files(tmp_path, "oom")
    args = [*TINY, *KV, "--concurrency", "1,2,1", "--modes", "oasis", "--md", "", "--png", "", "--json"]
    assert bench.main([*args, str(paths["json"])]) == 0
    rows = json.loads(paths["json"].read_text())["rows"]
    assert [(r["concurrency"], r["status"]) for r in rows] == [(1, "ok"), (2, "skipped"), (1, "ok")]
    assert "prefill ran out of device memory beside 1 running requests" in rows[1]["reason"]
    assert "Tried to allocate 1.00 GiB" in rows[1]["reason"]


def test_fig11_a_measured_admission_lowers_only_its_mode_s_budget(tmp_path, monkeypatch):
    """On CUDA each mode's warm admission is measured (its peak beyond what stays allocated); here
    the measure is set: an OasisKV admission needing 10 GiB, past the 6 GiB reserve, takes the
    excess off OasisKV's budget alone (fewer OasisKV requests fit, as many dense ones), and the
    context reports both measures. With ``--activation-reserve`` nothing measured is used."""
    from oasiskv.bench.fig11.budget import ACTIVATION_RESERVE_BYTES, ADMISSION_MARGIN
    from oasiskv.bench.fig11.sweep import Fig11

    real = Fig11.warm_up
    big = 10 * 2**30
    measured = {"on": True}

    def warm_up(self, mode, ctx, cache):
        t, _ = real(self, mode, ctx, cache)
        return t, (big if mode == "oasis" else 1) if measured["on"] else None

    monkeypatch.setattr(Fig11, "warm_up", warm_up)
    budget = str(5 * 2**30 + 20_000_000)  # 20 MB past the excess (5 GiB): some 100 tiny requests
    args = [*TINY, *KV, "--concurrency", "1", "--modes", "dense,oasis", "--gpu-kv-budget", budget]
    args += ["--md", "", "--png", ""]

    def context(name, *extra):
        path = tmp_path / f"{name}.json"
        assert bench.main([*args, *extra, "--json", str(path)]) == 0
        rep = json.loads(path.read_text())
        assert all(r["status"] == "ok" for r in rep["rows"])
        return rep["contexts"]["256"]

    info = context("measured")
    assert info["admission_bytes"] == {"dense": 1, "oasis": big}
    excess = int(big * ADMISSION_MARGIN) - ACTIVATION_RESERVE_BYTES
    assert info["admission_excess_bytes"] == {"dense": 0, "oasis": excess}
    measured["on"] = False
    plain = context("plain")
    assert plain["admission_bytes"] == {"dense": None, "oasis": None}
    assert info["max_concurrency"]["dense"] == plain["max_concurrency"]["dense"]
    most, most_plain = info["max_concurrency"]["oasis"], plain["max_concurrency"]["oasis"]
    assert 0 < most and (most_plain is None or most < most_plain)  # None: past the search's limit
    # An explicit reserve: the measure is not used.
    measured["on"] = True
    explicit = context("explicit", "--activation-reserve", "1MiB")
    assert explicit["admission_bytes"] == {"dense": None, "oasis": None}


def test_fig11_a_prompt_admitted_sparse_needs_no_dense_pages(tmp_path, monkeypatch):
    """OasisKV prefills the context's prompt in one piece straight into the host pool
    (``Engine.prefills_sparse``), so its fit reserves every request's working set and no dense
    prompt: under a GPU budget of 20 working sets, more OasisKV requests fit than through dense
    pages (``DIRECT_SPARSE_PREFILL`` off), the context says which, and the rows run."""
    from oasiskv.engine import pools

    budget = None

    def context(name, direct):
        nonlocal budget
        monkeypatch.setattr(pools, "DIRECT_SPARSE_PREFILL", direct)
        path = tmp_path / f"{name}.json"
        args = [*TINY, *KV, "--concurrency", "2", "--modes", "dense,oasis", "--md", "", "--png", ""]
        if budget is not None:
            args += ["--gpu-kv-budget", str(budget), "--activation-reserve", "0"]
        assert bench.main([*args, "--json", str(path)]) == 0
        rep = json.loads(path.read_text())
        assert all(r["status"] == "ok" for r in rep["rows"])
        return rep["contexts"]["256"]

    probe = context("probe", True)
    block = probe["request_kv_bytes"] // 16  # a block's K/V, every layer: 256 tokens, blocks of 16
    # Room for about 20 requests' working sets (K + 1 = 5 pages) and as many blocks again for their
    # metadata: a dense prompt's 16 pages are worth several requests there.
    budget = 20 * (4 + 1) * block + 20 * 16 * block
    direct, pages = context("direct", True), context("pages", False)
    assert direct["prefills_sparse"] == {"dense": False, "oasis": True}
    assert pages["prefills_sparse"] == {"dense": False, "oasis": False}
    assert direct["max_concurrency"]["oasis"] > pages["max_concurrency"]["oasis"] > 0
