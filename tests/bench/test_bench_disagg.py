"""``python -m oasiskv.bench.disagg`` (the paper's Fig. 12 harness): three processes (the
cargo-built daemon, the prefill process, this decode process) on a tiny random model over TCP;
partial fetching moves fewer bytes at admission than the full transfer and decodes the same
tokens; bad flags are refused."""

from __future__ import annotations

import json

import pytest

from oasiskv.bench import disagg
from support.rtd import need_binary


def small_run(out, *flags: str, md="") -> dict:
    """``bench.disagg`` on the tiny preset over the CPU: two 300-token requests of 6 new tokens at
    once, a budget of 4 of their 19 blocks (sparse from 64 tokens); its JSON report (``md``: where
    the markdown goes, none by default)."""
    argv = [
        "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--daemon", need_binary(),
        "--prompt-tokens", "300", "--max-tokens", "6", "--requests", "2", "--rates", "100",
        "--block-size", "16", "--top-k-blocks", "4", "--sparse-threshold", "64",
        *flags, "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    assert disagg.main(argv) == 0
    return json.loads(out.read_text())


def test_fig12_sweep_on_the_cpu(tmp_path):
    binary = need_binary()
    out, md = tmp_path / "d.json", tmp_path / "d.md"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--daemon", binary,
        "--prompt-tokens", "300", "--max-tokens", "6", "--requests", "3", "--rates", "40,200",
        "--block-size", "16", "--top-k-blocks", "4", "--sparse-threshold", "64", "--kv-cache-blocks", "8",
        "--read-connections", "2", "--kv-prefetch", "16",
        "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    assert disagg.main(argv) == 0
    rep = json.loads(out.read_text())
    rows = {(r["transfer"], r["rate"]): r for r in rep["rows"]}
    assert set(rows) == {(t, r) for t in ("full", "partial") for r in (40.0, 200.0)}
    for r in rows.values():
        assert r["requests"] == 3 and r["output_tokens"] == 3 * 6 and r["failures"] == 0
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["same_tokens"] == 1.0  # partial fetching reads what the selection gathers
        assert r["peak_host_kv_bytes"] > 0
        assert r["prefill_p50_s"] > 0 and r["stage_p50_s"] > 0 and r["add_staged_p50_s"] >= 0
    for rate in (40.0, 200.0):
        full, part = rows[("full", rate)], rows[("partial", rate)]
        # The full transfer moves every block at admission (300 tokens: 19 blocks of 16), the
        # partial one the summaries and the first step's working set (4 blocks per KV head).
        assert full["admission_bytes_per_request"] >= full["kv_bytes_per_request"]
        assert part["admission_bytes_per_request"] < 0.75 * full["admission_bytes_per_request"]
        assert full["fetched_bytes_per_request"] == 0
        # Host rows reserved at most (how many requests overlap depends on timing): a full
        # transfer's request reserves a row for each of its 19 blocks; a partial one's bounded
        # cache 8 plus the blocks it writes itself (at most 2 here), for each of 3 requests.
        row = full["kv_bytes_per_request"] / 19
        assert full["host_reserved_peak_bytes"] >= 19 * row
        assert 0 < part["host_reserved_peak_bytes"] <= 3 * 10 * row
        # The decode-time reads a partial row's steps made themselves and read ahead (at most
        # --kv-prefetch a step), and the hits among those; nothing after a full transfer.
        assert part["prefetch_hits"] <= part["prefetched_entries"]
        assert full["miss_entries"] == full["prefetched_entries"] == 0
    assert rep["kv"]["kv_prefetch"] == 16
    # In-step reads are the default, but not with a bounded cache (--kv-cache-blocks).
    assert rep["kv"]["kv_in_step_reads"] is False
    assert "| partial | 200 |" in md.read_text()


@pytest.mark.parametrize("flag", ["--host-kv-dtype", "--kv-dtype"])
def test_fp8_rows_stage_and_name_fp8_blocks(tmp_path, flag):
    """``--host-kv-dtype`` / ``--kv-dtype fp8``: both nodes hold an fp8 host pool, the staged
    blocks are fp8 (each request's KV in codes plus a scale per block-head and side), the rows
    name the dtypes, and with ``--first-query prompt`` both transfers decode the single-process
    fp8 engine's tokens (the ``local`` row, first) under a budget of 4 of 19 blocks."""
    from oasiskv.models.config import PRESETS

    rep = small_run(
        tmp_path / "d.json", "--transfers", "local,full,partial", "--first-query", "prompt", flag, "fp8"
    )
    pages = "fp8_e4m3" if flag == "--kv-dtype" else "float32"
    assert (rep["kv"]["kv_dtype"], rep["kv"]["host_kv_dtype"]) == (pages, "fp8_e4m3")
    assert rep["kv"]["kv_in_step_reads"] is True  # the default, with no flag
    assert rep["kv"]["first_query"] == "prompt"
    cfg = PRESETS["tiny"]
    # 300 tokens: 19 blocks of 16 per layer; a block-head side is 16 x 16 codes and a scale.
    fp8_kv = cfg.num_hidden_layers * 19 * 2 * cfg.num_key_value_heads * (16 * cfg.head_dim + 4)
    rows = {r["transfer"]: r for r in rep["rows"]}
    assert list(rows) == ["local", "full", "partial"]
    for r in rows.values():
        assert (r["kv_dtype"], r["host_kv_dtype"]) == (pages, "fp8_e4m3")
        assert r["failures"] == 0 and r["same_tokens"] == 1.0
    for t in ("full", "partial"):
        assert rows[t]["kv_bytes_per_request"] == fp8_kv
        # Host rows counted at the host pool's row size (fp8), not the pages' (float32 under
        # --host-kv-dtype): two requests of at most 20 blocks (306 tokens) each.
        assert fp8_kv <= rows[t]["host_reserved_peak_bytes"] <= 2 * 20 * fp8_kv // 19
    assert rows["partial"]["fetched_bytes_per_request"] > 0  # the selection drifted to unsent blocks
    # The single-process row stages nothing and moves nothing over the network.
    loc = rows["local"]
    assert loc["kv_bytes_per_request"] == loc["admission_bytes_per_request"] == 0
    assert loc["prefill_p50_s"] is None and loc["peak_host_kv_bytes"] is None


def test_the_default_first_query_selects_with_the_first_token(tmp_path):
    """``--first-query first_token`` (the default, the paper's): under a budget of 4 of 19 blocks
    the staged requests' first working set is the first token's own choice, not the
    single-process engine's (the prompt's last query), so their tokens need not equal the
    ``local`` row's; full and partial transfers still agree with each other."""
    rep = small_run(tmp_path / "d.json", "--transfers", "full,partial,local")
    rows = {r["transfer"]: r for r in rep["rows"]}
    assert rep["kv"]["first_query"] == "first_token"
    assert rows["partial"]["same_tokens"] == 1.0
    # The seeded prompts, model and arrivals: the local row differs here (a regression of the
    # first query's meaning would make it equal).
    assert rows["local"]["same_tokens"] < 1.0


def test_in_step_reads_rows(tmp_path):
    """``--kv-in-step-reads``: the partial rows read their misses during each step (the CPU path
    waits inline for the step reader), decode the full transfer's tokens, and say so; the JSON
    records the flags and the layers' wait on their reads."""
    md = tmp_path / "d.md"
    rep = small_run(
        tmp_path / "d.json", "--kv-prefetch", "0", "--kv-in-step-reads", "--transfer-stream", md=md
    )
    # --transfer-stream is recorded; on the CPU the chains run inline, with no stream to move to.
    assert rep["kv"]["kv_in_step_reads"] is True and rep["kv"]["transfer_stream"] is True
    rows = {r["transfer"]: r for r in rep["rows"]}
    part = rows["partial"]
    assert part["failures"] == 0 and part["same_tokens"] == 1.0
    assert part["miss_entries"] > 0 and part["wait_ms_per_step"] > 0
    # The compute stream's own wait (the critical path): none on the CPU, where chains run inline.
    assert all(r["gpu_wait_ms_per_step"] == 0.0 for r in rep["rows"])
    assert all(r["gpu_wait_p50_ms"] == r["gpu_wait_max_ms"] == 0.0 for r in rep["rows"])
    assert all(r["step_p50_ms"] > 0 for r in rep["rows"]) and "step p50 ms" in md.read_text()
    assert "read their misses in the step" in md.read_text()
    assert "GPU wait ms/step" in md.read_text() and "GPU wait p50 / max ms" in md.read_text()


def test_admission_and_first_query_choices_are_the_workers():
    from oasiskv.disagg import ADMISSIONS, FIRST_QUERIES

    assert disagg.ADMISSIONS == ADMISSIONS and disagg.FIRST_QUERIES == FIRST_QUERIES


def test_arrivals_are_seeded_poisson():
    a = disagg.arrivals(4.0, 2000, seed=3)
    assert a == disagg.arrivals(4.0, 2000, seed=3) and a != disagg.arrivals(4.0, 2000, seed=4)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.025  # mean gap 1 / rate (sd of the mean 0.0056)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--rates", "0"], "rates must be positive"),
        (["--rates", "x"], "comma-separated numbers"),
        (["--transfers", "full,bogus"], "--transfers takes"),
        (["--transfers", "local,local"], "--transfers takes"),
        (["--first-query", "draft"], "invalid choice"),
        (["--requests", "0"], "integer >= 1"),
        (["--read-connections", "0"], "integer >= 1"),
        (["--kv-prefetch", "-1"], "integer >= 0"),
    ],
)
def test_bad_flags_are_refused(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        disagg.build_parser().parse_args(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_missing_daemon_binary_says_what_to_do(tmp_path, capsys):
    argv = ["--daemon", str(tmp_path / "nope"), "--preset", "tiny", "--device", "cpu"]
    assert disagg.main(argv) == 2
    assert "cargo build --release -p oasis-rt" in capsys.readouterr().err
