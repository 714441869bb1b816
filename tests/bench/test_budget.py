"""The Fig. 11 GPU KV budget's choice (``oasiskv.bench.fig11.budget``), one case each: a given
size, the emulated H100, the real card (``auto`` on an H100, or ``real``), and the errors; with
the numbers of issue 35, where the emulated budget let dense try 13 requests of 32K that the real
H100 refused."""

from __future__ import annotations

import pytest

from oasiskv.bench.fig11.budget import (
    ACTIVATION_RESERVE_BYTES,
    ADMISSION_MARGIN,
    H100_BYTES,
    MAX_FITTING,
    MAX_SEARCHED,
    REAL_ACTIVATION_RESERVE_BYTES,
    Budgets,
    GpuKvBudget,
    activation_reserve,
    admission_excess,
    budget_kind,
    choose_gpu_kv_budget,
    fit,
    max_concurrency,
    resolve_concurrency,
)
from oasiskv.bench.fig11.flags import parse_budget
from oasiskv.errors import ConfigError

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
#: Qwen3-8B's bf16 weights on the H100 of issue 35 (results/h100-2026-12-06-s17).
WEIGHTS = int(15.256 * GIB)
#: Free beside the weights and a 32K prompt's prefill cache there (``device_free_bytes``).
FREE_32K = int(58.577 * GIB)
#: One dense request of 32K + 32 tokens: 2050 pages of 16 tokens at 144 KiB a token.
DENSE_32K = {"peak_pages": 2050, "block_bytes": 16 * 147456}


@pytest.mark.parametrize(
    "flag, device, kind",
    [
        ("auto", H100, "real"),
        ("auto", "NVIDIA H100 PCIe", "real"),
        ("auto", H200, "emulated h100"),
        ("auto", "cpu", "emulated h100"),
        ("h100", H100, "emulated h100"),  # asked for: emulated even on the real card
        ("h100", H200, "emulated h100"),
        ("real", H200, "real"),
        (64 * GIB, H100, "given"),
    ],
)
def test_budget_kind(flag, device, kind):
    assert budget_kind(flag, device) == kind


def test_a_given_size_is_the_budget():
    b = choose_gpu_kv_budget(64 * GIB, H100, FREE_32K, WEIGHTS, ACTIVATION_RESERVE_BYTES)
    assert b == GpuKvBudget("given", 64 * GIB)


def test_emulated_h100_is_80_gib_less_weights_and_reserve():
    for free in (None, FREE_32K, 130 * GIB):  # the free bytes do not matter
        b = choose_gpu_kv_budget("auto", H200, free, WEIGHTS, ACTIVATION_RESERVE_BYTES)
        assert b == GpuKvBudget("emulated h100", H100_BYTES - WEIGHTS - ACTIVATION_RESERVE_BYTES)


def test_real_on_an_h100_is_the_free_bytes_less_the_reserve():
    b = choose_gpu_kv_budget("auto", H100, FREE_32K, WEIGHTS, REAL_ACTIVATION_RESERVE_BYTES)
    assert b == GpuKvBudget("real", FREE_32K - REAL_ACTIVATION_RESERVE_BYTES)
    assert choose_gpu_kv_budget("real", H200, 100 * GIB, WEIGHTS, GIB) == GpuKvBudget("real", 99 * GIB)


def test_issue_35_dense_fits_12_of_32k_on_the_real_card_not_13():
    """The emulated budget (58.74 GiB) admitted 13 dense requests of 32K (58.6 GiB); the real one
    beside the prefill cache (58.58 GiB free, less 1 GiB) admits 12, what the card ran."""
    assert 13 * DENSE_32K["peak_pages"] * DENSE_32K["block_bytes"] == pytest.approx(58.6 * GIB, rel=1e-3)
    emulated = choose_gpu_kv_budget("h100", H100, FREE_32K, WEIGHTS, ACTIVATION_RESERVE_BYTES)
    real = choose_gpu_kv_budget("auto", H100, FREE_32K, WEIGHTS, REAL_ACTIVATION_RESERVE_BYTES)
    for budget, most in ((emulated, 13), (real, 12)):
        assert max_concurrency("dense", DENSE_32K, Budgets(budget.bytes, 0, 0), None) == most


def test_real_without_free_bytes_or_room_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a CUDA device's free memory"):
        choose_gpu_kv_budget("real", "meta", None, WEIGHTS, GIB)
    with pytest.raises(ConfigError, match="lower --activation-reserve"):
        choose_gpu_kv_budget("auto", H100, GIB, WEIGHTS, 2 * GIB)
    with pytest.raises(ConfigError, match="leave no KV budget on an H100"):
        choose_gpu_kv_budget("h100", H200, None, 76 * GIB, ACTIVATION_RESERVE_BYTES)


def test_unknown_word_is_a_value_error():
    with pytest.raises(ValueError, match="auto"):
        budget_kind("h200", H200)


def test_activation_reserve_default_follows_the_budget_and_prompts():
    assert activation_reserve(3 * GIB, "auto", H100, "shared") == 3 * GIB  # given: as given
    assert activation_reserve(None, "auto", H100, "shared") == REAL_ACTIVATION_RESERVE_BYTES
    assert activation_reserve(None, "auto", H100, "distinct") == ACTIVATION_RESERVE_BYTES  # prefills per row
    assert activation_reserve(None, "auto", H200, "shared") == ACTIVATION_RESERVE_BYTES  # emulated
    assert activation_reserve(None, 64 * GIB, H100, "shared") == ACTIVATION_RESERVE_BYTES


@pytest.mark.parametrize("s, out", [("auto", "auto"), ("REAL", "real"), ("h100", "h100"), ("2GiB", 2 * GIB)])
def test_parse_budget(s, out):
    assert parse_budget(s) == out


def test_a_measured_admission_past_the_reserve_comes_off_that_mode_s_budget():
    """An OasisKV row's admission (the EAGLE-3 head's) that needs 1.5 GiB beside the pools, under
    a real budget that leaves 1 GiB: the excess (1.5 x the margin - 1 GiB) comes off the budget, so
    fewer requests fit; a mode with nothing measured (None, or a CPU sweep) keeps its budget, and
    one whose admission fits the reserve loses nothing."""
    budgets = Budgets(20 * GIB, 10**15, REAL_ACTIVATION_RESERVE_BYTES)
    oasis = {
        "peak_pages": 1025,
        "steady_pages": 129,
        "host_blocks": 1025,
        "summary_bytes": 300 * 1024,
        "block_bytes": 16 * 147456,
    }
    measured = {**oasis, "admission_bytes": int(1.5 * GIB)}
    excess = admission_excess(measured, budgets)
    assert excess == int(1.5 * GIB * ADMISSION_MARGIN) - GIB > 0
    unmeasured = admission_excess({**oasis, "admission_bytes": None}, budgets)
    assert admission_excess(oasis, budgets) == unmeasured == 0
    assert admission_excess({**oasis, "admission_bytes": GIB // 2}, budgets) == 0
    plain = max_concurrency("oasis", oasis, budgets, None)
    fewer = max_concurrency("oasis", measured, budgets, None)
    assert 0 < fewer < plain
    # The row at the old most fails with the reduced budget in its reason; dense's budget shrinks too.
    reason, _, _ = fit("oasis", plain, measured, budgets, None)
    assert reason is not None and f"{(20 * GIB - excess) / GIB:.1f} GiB" in reason
    dense = {**DENSE_32K, "admission_bytes": int(1.5 * GIB)}
    assert fit("dense", 1, dense, budgets, None)[1] == 20 * GIB - excess


@pytest.mark.parametrize(
    "level, most, out",
    [
        (4, 9, (4, None)),
        (MAX_FITTING, 9, (9, None)),
        (MAX_FITTING, 0, (None, "not even one request fits")),
        (MAX_FITTING, None, (None, f"{MAX_SEARCHED} or more requests fit")),
    ],
)
def test_resolve_concurrency(level, most, out):
    conc, why = resolve_concurrency(level, most)
    assert conc == out[0]
    assert (why is None) if out[1] is None else (out[1] in why)


def test_the_drafters_device_state_shares_the_budget():
    """A drafter's per-request device bytes (the EAGLE-3 head's KV) count against the GPU budget:
    12 dense 32K requests (4.50 GiB each) fit 54.5 GiB alone, 11 beside 64 MiB of head KV each
    (12 need 54.05 GiB of pages + 0.75 GiB), and the reason names the drafter. An oasis row
    likewise."""
    budgets = Budgets(int(54.5 * GIB), 0, 0)
    assert max_concurrency("dense", DENSE_32K, budgets, None) == 12
    with_head = {**DENSE_32K, "drafter_bytes": 64 * 2**20}
    assert max_concurrency("dense", with_head, budgets, None) == 11
    why, _, _ = fit("dense", 12, with_head, budgets, None)
    assert "dense KV + drafter" in why
    oasis = {
        "peak_pages": 129,
        "steady_pages": 129,
        "host_blocks": 1024,
        "block_bytes": 16 * 147456,
        "summary_bytes": 0,
    }
    roomy = Budgets(100 * 129 * oasis["block_bytes"], 10**15, 0)
    assert max_concurrency("oasis", oasis, roomy, None) == 100
    head = {**oasis, "drafter_bytes": oasis["block_bytes"] * 129}  # as much as a working set
    assert max_concurrency("oasis", head, roomy, None) == 50
    assert "pages + summaries + drafter" in fit("oasis", 51, head, roomy, None)[0]
