"""The Rust runtime (``oasiskv._core.Runtime``) against a plain Python model of the tables.

Randomized request mixes (hypothesis): admissions of random sizes, decode steps over random
subsets, dense->sparse transitions and releases. After every operation the runtime's tables,
its step plan and its admission decisions are compared with what the Python model computes from
first principles: the old engine's CSR construction, the reservation formula, page ownership.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv import _core, errors

# Private names read here: ``oasiskv._core.Runtime`` is what this file checks (the module docstring
# says so).


def make_runtime(b, k, threshold, rows, gpu, host, seqs=8, recall=True, seq=True, sparse=True):
    return _core.Runtime(
        block_size=b,
        top_k_blocks=k,
        sparse_threshold=threshold,
        sparse=sparse,
        rows=rows,
        measure_recall=recall,
        plan_blk_seq=seq,
        max_num_seqs=seqs,
        gpu_pages=gpu,
        host_blocks=host,
        gpu_cap=gpu,
        host_cap=host,
    )


def ref_reservation(b, k, threshold, sparse, prompt, new):
    """The peak need, derived from the engine's lifecycle: stored tokens grow to prompt + new - 1;
    a request turns sparse once kv_len > threshold at a non-final token."""
    stored = prompt + new - 1
    turns = sparse and any(kv_len > threshold for kv_len in range(prompt, prompt + new - 1))
    if not turns:
        return math.ceil(stored / b), 0
    dense_pages = max(
        math.ceil(kv / b) for kv in range(prompt, prompt + new) if kv <= max(prompt, threshold + 1)
    )
    return max(dense_pages, k + 1), math.ceil(stored / b)


def ref_plan(tables, order, b, k, rows, recall, seq, input_ids):
    """The plan of one step as the pre-runtime engine built it, from the tables before the step."""
    ts = [tables[i] for i in order]
    out = {"input_ids": list(input_ids), "positions": [t["kv_len"] + r for t in ts for r in range(rows)]}
    page_ids, host_ids, host_rows, kv_lists = [], [], [], []
    for t in ts:
        blk = t["kv_len"] // b
        if t["sparse"]:
            page_ids.append(t["local_page"])
            host_ids.append(t["host_blocks"][blk])
            host_rows.append(t["host_rows"][blk])
            kv_lists.append(t["slot_pages"] + [t["local_page"]])
        else:
            page_ids.append(t["pages"][blk])
            host_ids.append(-1)
            host_rows.append(-1)
            kv_lists.append(list(t["pages"]))
    out["page_ids"], out["host_ids"], out["host_rows"] = page_ids, host_ids, host_rows
    out["offsets"] = [t["kv_len"] % b for t in ts]
    out["last_len"] = [t["kv_len"] % b + 1 for t in ts]

    def csr(lists):
        indptr, flat = [0], []
        for xs in lists:
            flat += xs
            indptr.append(len(flat))
        return indptr, flat

    out["kv_indptr"], out["kv_indices"] = csr(kv_lists)
    sp = [(i, t) for i, t in enumerate(ts) if t["sparse"]]
    out["sp_rows"] = [i for i, _ in sp]
    out["sp_slots"] = [t["slot"] for _, t in sp]
    out["slot_pages"] = [p for _, t in sp for p in t["slot_pages"]]
    cand = [t["host_blocks"][: (t["kv_len"] + 1) // b] for _, t in sp]
    out["blk_indptr"], out["blk_indices"] = csr(cand)
    out["blk_seq"] = [j for j, c in enumerate(cand) for _ in c] if seq and rows == 2 else []
    # The gather reads host rows (the K/V); selection scores block ids (the summaries).
    out["host_indptr"], out["host_indices"] = csr([t["host_rows"] for _, t in sp])
    if recall:
        out["rec_indptr"], out["rec_indices"] = csr([t["host_blocks"][: t["kv_len"] // b] for _, t in sp])
    else:
        out["rec_indptr"], out["rec_indices"] = [], []
    # The blocks x_t completes: it lands at the last offset of its block.
    out["done_blocks"] = [t["host_blocks"][t["kv_len"] // b] for _, t in sp if t["kv_len"] % b == b - 1]
    out["done_rows"] = [t["host_rows"][t["kv_len"] // b] for _, t in sp if t["kv_len"] % b == b - 1]
    return out, max((len(x) for x in kv_lists), default=0)


def read_plan(rt, ids, input_ids):
    n, layout, n_sparse, max_pages = rt.plan(ids, input_ids)
    buf = torch.full((n + 8,), -7, dtype=torch.int32)
    rt.write_plan(buf)
    fields = {name: buf[s : s + ln].tolist() for name, (s, ln) in layout.items()}
    for s, _ln in layout.values():
        assert s % 4 == 0, "fields start on 16-byte boundaries"
    return fields, n_sparse, max_pages


def check_make_sparse(rt, i, b, k):
    t0 = rt.table(i)
    tr = rt.make_sparse(i)
    n_blocks = math.ceil(t0["kv_len"] / b)
    assert tr["src_pages"] == t0["pages"][:n_blocks]
    assert len(tr["host_blocks"]) == n_blocks and tr["n_complete"] == t0["kv_len"] // b
    assert sum(tr["lens"]) == t0["kv_len"]
    t1 = rt.table(i)
    assert t1["sparse"] and not t1["pages"] and len(t1["slot_pages"]) == k
    assert t1["host_blocks"] == tr["host_blocks"] and t1["host_rows"] == tr["host_rows"]
    assert len(set(tr["host_rows"])) == n_blocks and t1["cache_blocks"] is None
    held = set(t1["slot_pages"]) | {t1["local_page"]}
    assert len(held) == k + 1
    # The local page is the page of the block the next token lands in when the request held it.
    if t0["kv_len"] % b:
        assert t1["local_page"] == t0["pages"][t0["kv_len"] // b]
    mp, mv = rt.take_map_updates()
    upd = dict(zip(mp, mv, strict=True))
    assert upd[t1["local_page"]] == t0["kv_len"] // b
    assert all(upd[p] == -1 for p in t1["slot_pages"])


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.sampled_from([1, 3, 4, 16]),
    k=st.integers(1, 6),
    threshold=st.integers(1, 40),
    rows=st.sampled_from([1, 2]),
    recall=st.booleans(),
    sparse=st.booleans(),
)
def test_runtime_matches_the_python_model(seed, b, k, threshold, rows, recall, sparse):
    rnd = random.Random(seed)
    gpu, host = rnd.randint(k + 1, 60), rnd.randint(0, 60)
    rt = make_runtime(b, k, threshold, rows, gpu, host, seqs=5, recall=recall, sparse=sparse)
    live: dict[int, dict] = {}  # id -> the model's state: prompt, new, steps so far
    next_id = 0
    for _ in range(rnd.randint(1, 40)):
        op = rnd.random()
        if op < 0.35:
            prompt, new = rnd.randint(1, 50), rnd.randint(1, 12)
            res = ref_reservation(b, k, threshold, sparse, prompt, new)
            assert rt.reservation(prompt, new)[:2] == res
            g_res, _, h_res = rt.reserved
            fits = len(live) < 5 and g_res + res[0] <= gpu and h_res + res[1] <= host
            assert rt.can_admit(prompt, new) == fits
            if fits:
                slot, pages = rt.admit(next_id, prompt, new)
                assert len(pages) == math.ceil(prompt / b)
                assert slot not in {s["slot"] for s in live.values()}
                live[next_id] = {"prompt": prompt, "new": new, "made": 1, "slot": slot}
                # The prefill's pages map to their logical blocks.
                mp, mv = rt.take_map_updates()
                assert dict(zip(mp, mv, strict=True)) == {p: i for i, p in enumerate(pages)}
                # The engine's protocol: past the threshold, a request with tokens left turns
                # sparse before it decodes (the runtime refuses to plan it otherwise).
                if rt.wants_sparse(next_id) and new > 1:
                    with pytest.raises(errors.InvalidArgumentError, match="make_sparse"):
                        rt.plan([next_id], [0] * rows)
                    check_make_sparse(rt, next_id, b, k)
            else:
                with pytest.raises(errors.OutOfBlocksError if len(live) < 5 else errors.OasisError):
                    rt.admit(next_id, prompt, new)
            next_id += 1
        elif op < 0.75 and live:
            # A decode step over the requests that still have a token to make.
            order = [i for i, s in live.items() if s["made"] < s["new"] and rnd.random() < 0.8]
            rnd.shuffle(order)
            if not order:
                continue
            before = {i: rt.table(i) for i in order}
            # The blocks this step enters, as the old engine allocated them before planning.
            ids = [rnd.randint(0, 99) for _ in range(len(order) * rows)]
            fields, n_sparse, max_pages = read_plan(rt, order, ids)
            after = {i: rt.table(i) for i in order}
            for i in order:
                t0, t1 = before[i], after[i]
                blk = t0["kv_len"] // b
                assert t1["kv_len"] == t0["kv_len"] + 1
                if t0["sparse"]:
                    assert t1["host_blocks"][: len(t0["host_blocks"])] == t0["host_blocks"]
                    assert len(t1["host_blocks"]) == max(len(t0["host_blocks"]), blk + 1)
                else:
                    assert t1["pages"][: len(t0["pages"])] == t0["pages"]
                    assert len(t1["pages"]) == max(len(t0["pages"]), blk + 1)
            # The plan is a function of the tables the step runs with (allocated, not advanced).
            during = {i: dict(after[i], kv_len=before[i]["kv_len"]) for i in order}
            want, want_max = ref_plan(during, order, b, k, rows, recall, True, ids)
            want["map_pages"], want["map_values"] = fields["map_pages"], fields["map_values"]
            assert {kk: fields[kk] for kk in want} == want
            assert n_sparse == len(want["sp_rows"]) and max_pages == want_max
            # Mapping updates: a dense request's new page -> its block; a sparse request entering a
            # block -> its local page -> that block.
            upd = dict(zip(fields["map_pages"], fields["map_values"], strict=True))
            for i in order:
                t0, t1 = before[i], after[i]
                blk, off = divmod(t0["kv_len"], b)
                if t0["sparse"] and off == 0:
                    assert upd[t0["local_page"]] == blk
                elif not t0["sparse"] and len(t1["pages"]) > len(t0["pages"]):
                    assert upd[t1["pages"][blk]] == blk
            for i in order:
                live[i]["made"] += 1
                if rt.wants_sparse(i) and live[i]["made"] < live[i]["new"]:
                    check_make_sparse(rt, i, b, k)
        elif live:
            i = rnd.choice(list(live))
            rt.release(i)
            del live[i]
        rt.check_invariants()
        # Nobody holds more than admission reserved for it.
        for i, s in live.items():
            t = rt.table(i)
            g_res, h_res = ref_reservation(b, k, threshold, sparse, s["prompt"], s["new"])
            if t["sparse"]:
                g_res = k + 1
            assert len(t["pages"]) + len(t["slot_pages"]) + (t["local_page"] >= 0) <= g_res
            assert len(t["host_blocks"]) <= h_res and len(t["host_rows"]) == len(t["host_blocks"])
    for i in list(live):
        rt.release(i)
    rt.check_invariants()
    assert rt.num_free == (gpu, host, host) and rt.reserved == (0, 0, 0)


def test_runtime_errors_are_typed():
    rt = make_runtime(4, 2, 8, 2, 16, 16)
    with pytest.raises(errors.InvalidArgumentError, match="unknown request"):
        rt.release(3)
    rt.admit(1, 5, 5)
    with pytest.raises(errors.InvalidArgumentError, match="already admitted"):
        rt.admit(1, 5, 5)
    with pytest.raises(errors.InvalidArgumentError, match="input ids"):
        rt.plan([1], [0])
    with pytest.raises(errors.InvalidArgumentError, match="twice"):
        rt.plan([1, 1], [0, 0, 0, 0])
    n, *_ = rt.plan([1], [0, 0])
    with pytest.raises(errors.ShapeError, match="grow it"):
        rt.write_plan(torch.zeros(n - 1, dtype=torch.int32))
    with pytest.raises(errors.DTypeError):
        rt.write_plan(torch.zeros(n, dtype=torch.int64))
    with pytest.raises(errors.ConfigError, match="block_size"):
        make_runtime(0, 2, 8, 2, 16, 16)
    with pytest.raises(errors.ConfigError):
        make_runtime(4, 2, 8, 2, 2**40, 16)
    with pytest.raises(errors.ConfigError, match="caps"):
        rt.grow(17, 0, 0)
    with pytest.raises(errors.ConfigError, match="caps"):
        rt.grow(0, 0, 17)


def test_admit_sparse_reserves_and_takes_only_the_working_set():
    b, k = 4, 3
    rt = make_runtime(b, k, 12, 2, k + 1, 64)  # room for the working set, not a 40-token prompt
    assert rt.reservation(40, 5, sparse=True) == (k + 1, math.ceil(44 / b), True)
    assert not rt.can_admit(40, 5) and rt.can_admit(40, 5, sparse=True)
    assert rt.fits_ever(40, 5, sparse=True) and not rt.fits_ever(40, 5)
    assert rt.pool_sizes_needed(40, 5, sparse=True) == (k + 1, 11, 11)
    with pytest.raises(errors.OutOfBlocksError):
        rt.admit(1, 40, 5)
    tr = rt.admit_sparse(1, 42, 3)
    assert tr["slot"] == 0 and tr["src_pages"] == []
    assert len(tr["slot_pages"]) == k and tr["n_complete"] == 10
    assert tr["lens"] == [b] * 10 + [2]
    t = rt.table(1)
    assert t["sparse"] and t["pages"] == [] and t["kv_len"] == 42
    assert (t["slot_pages"], t["local_page"], t["host_blocks"]) == (
        tr["slot_pages"],
        tr["local_page"],
        tr["host_blocks"],
    )
    assert rt.take_map_updates() == (tr["slot_pages"] + [tr["local_page"]], [-1] * k + [10])
    rt.check_invariants()
    assert rt.num_free == (0, 64 - 11, 64 - 11)
    with pytest.raises(errors.InvalidArgumentError, match="already admitted"):
        rt.admit_sparse(1, 4, 1)
    with pytest.raises(errors.OutOfBlocksError):
        rt.admit_sparse(2, 4, 1)  # the GPU pool is the first request's working set
    rt.check_invariants()
    for _ in range(2):
        read_plan(rt, [1], [0, 0])
        rt.check_invariants()
    rt.release(1)
    rt.check_invariants()
    assert rt.num_free == (k + 1, 64, 64) and rt.reserved == (0, 0, 0)
    dense = make_runtime(b, k, 12, 2, 16, 16, sparse=False)
    with pytest.raises(errors.InvalidArgumentError, match="sparse backend"):
        dense.admit_sparse(1, 20, 2)


def test_bounded_cache_rows_through_the_binding():
    """``admit_sparse(..., cache_blocks=C)``: ids for every block, rows for the written blocks
    plus ``C``; ``cache_blocks`` hands rows out (LRU, pinned kept) and the next plan's
    ``host_indices`` read them."""
    b, k = 4, 3
    rt = make_runtime(b, k, 12, 2, 8, 6)  # 6 host rows: a 40-token prompt needs 11 unbounded
    assert not rt.fits_ever(40, 5, sparse=True)
    assert rt.reservation(40, 5, sparse=True, cache_blocks=2) == (k + 1, 2 + 11 - 10, True)
    assert rt.fits_ever(40, 5, sparse=True, cache_blocks=2)
    assert rt.can_admit(40, 5, sparse=True, cache_blocks=2)
    need = rt.pool_sizes_needed(40, 5, sparse=True, cache_blocks=2)
    assert need == (k + 1, 11, 3)
    rt.grow(*need)
    assert rt.pool_sizes == (8, 11, 6) and rt.caps[2] == 6
    tr = rt.admit_sparse(1, 40, 5, cache_blocks=2)
    assert len(tr["host_blocks"]) == 10 and len(set(tr["host_rows"])) == 1  # all fillers
    t = rt.table(1)
    assert t["cache_blocks"] == 2 and t["host_rows"] == tr["host_rows"]
    rows, given, evicted = rt.cache_blocks(1, [3, 7], [3, 7])
    assert given == [3, 7] and evicted == [] and len(set(rows)) == 2
    rows2, given, evicted = rt.cache_blocks(1, [5], [7, 5])
    assert evicted == [(3, rows[0])] and given == [5] and rows2 == [rows[0]]
    with pytest.raises(errors.OutOfBlocksError):
        rt.cache_blocks(1, [1], [5, 7])
    rt.check_invariants()
    fields, _, _ = read_plan(rt, [1], [0, 0])
    t = rt.table(1)
    assert fields["host_indices"][7] == rows[1] and fields["host_indices"][5] == rows[0]
    assert fields["host_indices"] == t["host_rows"][:10] + t["host_rows"][10:]
    assert fields["host_rows"] == [t["host_rows"][10]]
    assert fields["host_ids"] == [t["host_blocks"][10]]
    rt.release(1)
    rt.check_invariants()
    assert rt.num_free == (8, 11, 6) and rt.reserved == (0, 0, 0)


def test_padded_plan_keeps_its_layout_and_pads_as_documented():
    """``plan(..., pad)``: the plain plan's values first in every field, then the documented
    padding, at offsets that do not move from step to step; mapping updates stay pending."""
    b, k = 4, 2
    rt = make_runtime(b, k, 8, 2, 64, 64)
    rt.admit(1, 5, 30)  # dense for a while
    rt.admit(2, 10, 30)  # past the threshold: sparse at once
    rt.make_sparse(2)
    rt.take_map_updates()
    rows, pages, blocks, dummy = 4, 16, 16, 8
    layouts = []
    for step in range(6):
        if rt.wants_sparse(1):
            rt.make_sparse(1)
            rt.take_map_updates()
        ids = [1, 2]
        before = {i: rt.table(i) for i in ids}
        need_pages, need_blocks = rt.step_needs(ids)
        assert need_pages <= pages and need_blocks <= blocks
        n, layout, n_sparse, _ = rt.plan(ids, [step] * 4, (rows, pages, blocks, dummy))
        # The plan is a function of the tables the step runs with (allocated, not advanced).
        tables = {i: dict(rt.table(i), kv_len=before[i]["kv_len"]) for i in ids}
        want, _ = ref_plan(tables, ids, b, k, 2, True, True, [step] * 4)
        assert need_pages == max(len(t["pages"]) or k + 1 for t in tables.values())
        assert need_blocks == max(len(t["host_blocks"]) for t in tables.values())
        layouts.append(layout)
        buf = torch.full((n,), -7, dtype=torch.int32)
        rt.write_plan(buf)
        got = {name: buf[s : s + ln].tolist() for name, (s, ln) in layout.items()}
        assert got["map_pages"] == [] and got["map_values"] == []
        rt.take_map_updates()
        caps = {
            "input_ids": (rows * 2, 0),
            "positions": (rows * 2, 0),
            "page_ids": (rows, -1),
            "offsets": (rows, 0),
            "host_ids": (rows, -1),
            "host_rows": (rows, -1),
            "last_len": (rows, 1),
            "kv_indices": (rows * pages, -1),
            "sp_rows": (rows, 0),
            "sp_slots": (rows, dummy),
            "slot_pages": (rows * k, -1),
            "blk_indices": (rows * blocks, -1),
            "blk_seq": (rows * blocks, 0),
            "host_indices": (rows * blocks, -1),
            "rec_indices": (rows * blocks, -1),
            "done_blocks": (rows, -1),
            "done_rows": (rows, -1),
        }
        for ptr in ("kv_indptr", "blk_indptr", "host_indptr", "rec_indptr"):
            caps[ptr] = (rows + 1, want[ptr][-1])
        for name, (cap, fill) in caps.items():
            w, g = want[name], got[name]
            assert len(g) == cap, (step, name)
            assert g[: len(w)] == w, (step, name)
            assert all(x == fill for x in g[len(w) :]), (step, name)
        assert n_sparse == sum(t["sparse"] for t in tables.values())
    assert all(lay == layouts[0] for lay in layouts)
    with pytest.raises(errors.InvalidArgumentError, match="step_needs"):
        rt.plan([1, 2], [0] * 4, (rows, 1, blocks, dummy))


def test_capacity_buckets_of_captured_steps():
    # The graph room's private bucket functions are what this test checks.
    from oasiskv.engine.graphs import _bucket, _round_cap

    assert [_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 26, 33, 64, 65)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        20,
        28,
        40,
        64,
        80,
    ]
    # every bucket holds its n, with at most 25 % padding above 16
    for n in range(1, 300):
        assert n <= _bucket(n) and (n <= 16 or _bucket(n) <= 1.25 * n)
    assert _round_cap(0) == 0
    for x in (1, 15, 16, 17, 100, 129, 1025, 4097, 70000):
        c = _round_cap(x)
        assert x <= c <= max(16, x) * 1.25 and c >= 16, (x, c)
