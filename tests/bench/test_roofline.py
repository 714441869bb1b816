"""The Fig. 11 roofline's arithmetic (``oasiskv.bench.fig11.roofline``), hand-computed: a step's
bound is the larger of its HBM time (bytes read over the HBM read bandwidth) and its PCIe time
(bytes fetched from a pinned host pool over the pinned host-to-device bandwidth); a row that
fetches nothing has PCIe time 0; without ceilings (no GPU) every column is None."""

from __future__ import annotations

import pytest

from oasiskv.bench.fig11.roofline import (
    fraction,
    kv_read_bytes,
    pcie_bytes_per_step,
    roofline_columns,
    step_bound,
    step_roofline,
)

GB = 10**9
#: Round ceilings so the times are exact: 2 TB/s HBM read, 50 GB/s pinned H2D, 3 TB/s copy.
CEILINGS = {"hbm_read_Bps": 2000 * GB, "h2d_pinned_Bps": 50 * GB, "d2d_copy_Bps": 3000 * GB}
#: One request of a 16-token block model: 8 KiB blocks, 512 B summaries, K + 1 = 5 pages.
NEED = {"steady_pages": 5, "block_bytes": 8192, "summary_bytes": 512, "score_bytes": 512}


def test_hbm_binds_when_the_reads_take_longer():
    # 20 GB read at 2 TB/s: 10 ms; 0.25 GB fetched at 50 GB/s: 5 ms.
    b = step_bound(20 * GB, 0.25 * GB, hbm_read_Bps=2000 * GB, h2d_Bps=50 * GB)
    assert b == {
        "hbm_s": pytest.approx(0.010),
        "pcie_s": pytest.approx(0.005),
        "bound_s": pytest.approx(0.010),
        "binds": "hbm",
    }


def test_pcie_binds_when_the_fetch_takes_longer():
    # 4 GB read at 2 TB/s: 2 ms; 0.5 GB fetched at 50 GB/s: 10 ms.
    b = step_bound(4 * GB, 0.5 * GB, hbm_read_Bps=2000 * GB, h2d_Bps=50 * GB)
    assert b["hbm_s"] == pytest.approx(0.002) and b["pcie_s"] == pytest.approx(0.010)
    assert b["bound_s"] == pytest.approx(0.010) and b["binds"] == "pcie"


@pytest.mark.parametrize("read, fetched", [(1, 0), (10**9, 10**6), (10**6, 10**9), (3 * 10**10, 6 * 10**8)])
def test_the_bound_is_the_max_of_the_two_times(read, fetched):
    b = step_bound(read, fetched, hbm_read_Bps=2000 * GB, h2d_Bps=50 * GB)
    assert b["bound_s"] == max(b["hbm_s"], b["pcie_s"])
    assert b["binds"] == ("pcie" if b["pcie_s"] > b["hbm_s"] else "hbm")


def test_a_tie_binds_hbm():
    b = step_bound(40 * GB, 1 * GB, hbm_read_Bps=2000 * GB, h2d_Bps=50 * GB)  # 20 ms each
    assert b["hbm_s"] == b["pcie_s"] == pytest.approx(0.020) and b["binds"] == "hbm"


def test_no_fetch_has_pcie_time_zero_even_without_a_pcie_ceiling():
    for h2d in (50 * GB, None):
        b = step_bound(2 * GB, 0, hbm_read_Bps=2000 * GB, h2d_Bps=h2d)
        assert (
            b["pcie_s"] == 0.0 and b["bound_s"] == b["hbm_s"] == pytest.approx(0.001) and b["binds"] == "hbm"
        )


def test_no_ceilings_is_none_not_a_crash():
    assert step_bound(GB, GB, hbm_read_Bps=None, h2d_Bps=None) == dict.fromkeys(
        ("hbm_s", "pcie_s", "bound_s", "binds")
    )
    # Fetched bytes and no PCIe ceiling: the HBM time alone, no bound (it would be too low).
    b = step_bound(2 * GB, GB, hbm_read_Bps=2000 * GB, h2d_Bps=None)
    assert b["hbm_s"] == pytest.approx(0.001) and b["pcie_s"] is None and b["bound_s"] is None


def test_pcie_bytes_count_only_a_pinned_host_pool():
    assert pcie_bytes_per_step("pinned", 4, 1.5e6) == 6e6  # per request and step, times C
    assert pcie_bytes_per_step("device", 4, 1.5e6) == 0.0  # the oracle: device to device
    assert pcie_bytes_per_step("pinned", 4, None) == 0.0  # dense fetches nothing
    assert pcie_bytes_per_step("pinned", 4, 0.0) == 0.0


def test_fraction_is_bound_over_measured():
    assert fraction(0.006, 0.010) == pytest.approx(0.6)
    assert fraction(0.0, 0.010) == 0.0  # a zero time is 0, not missing
    assert fraction(None, 0.010) is None and fraction(0.006, None) is None and fraction(0.006, 0.0) is None


def test_row_columns_hand_computed():
    """20 GB read, 0.75 GB fetched, a 20 ms step: HBM 10 ms (50 %), PCIe 15 ms (75 %) binds, the
    bound 15 ms (75 %); the copy bound 20 GB / 3 TB/s = 6.67 ms (33 %)."""
    c = roofline_columns(20 * GB, 0.75 * GB, 0.020, CEILINGS)
    assert c["roofline_tpot_s"] == pytest.approx(0.015) and c["roofline_fraction"] == pytest.approx(0.75)
    assert c["roofline_binds"] == "pcie" and c["pcie_bytes_per_step"] == 0.75 * GB
    assert c["hbm_tpot_s"] == pytest.approx(0.010) and c["hbm_fraction"] == pytest.approx(0.5)
    assert c["pcie_tpot_s"] == pytest.approx(0.015) and c["pcie_fraction"] == pytest.approx(0.75)
    assert c["roofline_tpot_d2d_s"] == pytest.approx(0.02 / 3) and c[
        "roofline_fraction_d2d"
    ] == pytest.approx(1 / 3)
    assert c["roofline_fraction"] == max(c["hbm_fraction"], c["pcie_fraction"])


def test_dense_row_is_its_hbm_time():
    c = roofline_columns(20 * GB, pcie_bytes_per_step("pinned", 8, None), 0.0125, CEILINGS)
    assert c["pcie_tpot_s"] == 0.0 and c["pcie_fraction"] == 0.0 and c["roofline_binds"] == "hbm"
    assert c["roofline_tpot_s"] == c["hbm_tpot_s"] == pytest.approx(0.010)
    assert c["roofline_fraction"] == pytest.approx(0.8)


@pytest.mark.parametrize("ceilings", [None, {}, {"d2d_copy_Bps": 3000 * GB, "h2d_pinned_Bps": 50 * GB}])
def test_row_columns_without_the_read_ceiling(ceilings):
    """On the CPU (None), or from a run before ``hbm_read_Bps`` existed: no bound, no crash; the
    copy bound still where its ceiling is."""
    c = roofline_columns(20 * GB, GB, 0.020, ceilings)
    assert c["roofline_tpot_s"] is None and c["roofline_fraction"] is None and c["roofline_binds"] is None
    assert c["hbm_fraction"] is None and c["pcie_fraction"] is None
    assert (c["roofline_fraction_d2d"] is None) == (not ceilings)


def test_units_bytes_over_bytes_per_second_are_seconds():
    """Qwen3-8B-like numbers: 16.4 GB of weights and 26 dense requests of 16K at 144 KiB a token
    read 78.1 GB a step; at 3.35 TB/s that is 23.3 ms, a realistic TPOT (not ms or us)."""
    per_token = 147456
    need = {"block_bytes": per_token * 16}
    read = 16_400_000_000 + 26 * kv_read_bytes("dense", 16384, need, 16)
    c = roofline_columns(read, 0, 0.030, {"hbm_read_Bps": 3.35e12, "h2d_pinned_Bps": 5.5e10})
    assert read == 16_400_000_000 + 26 * 16384 * per_token
    assert c["hbm_tpot_s"] == pytest.approx(read / 3.35e12) and 0.020 < c["hbm_tpot_s"] < 0.025


def test_step_roofline_reads_the_middle_of_the_decode():
    """Two sparse requests at 256 + 4 / 2 = 258 tokens: 5 pages of 8 KiB and 16 summaries each,
    beside 1000 weight bytes; the read time at 1 MB/s."""
    r = step_roofline(
        "oasis", 256, 2, NEED, block_size=16, max_tokens=4, weights_read=1000, bandwidth_Bps=1e6
    )
    per = 5 * 8192 + 16 * 512
    assert r["step_read_bytes"] == 1000 + 2 * per and r["roofline_tpot_s"] == pytest.approx(
        (1000 + 2 * per) / 1e6
    )
    assert (
        step_roofline(
            "oasis", 256, 2, NEED, block_size=16, max_tokens=4, weights_read=1000, bandwidth_Bps=None
        )["roofline_tpot_s"]
        is None
    )


def test_sm_read_bound_beside_the_hardware_bound():
    """A PCIe-bound row: 1 GB fetched at 50 GB/s (copy engines) is 20 ms, at 32 GB/s (SM reads)
    31.25 ms; the hardware bound (and its fraction) stays the copy engines', the SM columns put the
    gathers' own ceiling beside it. Without ``h2d_sm_Bps`` the SM columns are None."""
    c = roofline_columns(10 * GB, GB, 0.040, {**CEILINGS, "h2d_sm_Bps": 32 * GB})
    assert c["roofline_binds"] == "pcie" and c["roofline_tpot_s"] == pytest.approx(0.020)
    assert c["pcie_sm_tpot_s"] == pytest.approx(1 / 32)
    assert c["pcie_sm_fraction"] == pytest.approx(1 / 32 / 0.040)
    assert c["roofline_sm_fraction"] == pytest.approx(1 / 32 / 0.040)
    assert c["roofline_sm_fraction"] > c["roofline_fraction"]
    # HBM-bound when nothing is fetched: both bounds are the HBM time.
    d = roofline_columns(10 * GB, 0.0, 0.010, {**CEILINGS, "h2d_sm_Bps": 32 * GB})
    assert d["roofline_sm_fraction"] == d["roofline_fraction"] == pytest.approx(0.5)
    e = roofline_columns(10 * GB, GB, 0.040, CEILINGS)
    assert e["pcie_sm_tpot_s"] is None and e["roofline_sm_fraction"] is None
