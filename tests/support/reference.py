"""Independent float64 references that walk the tables token by token (vLLM's ``ref_*`` habit).

They share no code with the Rust kernels: plain Python loops over the CSR tables, float64 math.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch

# One tolerance table (vLLM's), used by every kernel test: dtype -> (atol, rtol).
TOL = {
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-3, 1.6e-2),
    torch.float32: (1e-5, 1.3e-6),
}
# NOTE: attention outputs are rounded to the storage dtype once and accumulate f32 rounding over
# hundreds of tokens, so outputs are compared with a looser absolute tolerance scaled to that.
ATTN_TOL = {
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (2e-5, 1e-4),
}


def ref_decode_attention(
    q,
    k_pages,
    v_pages,
    kv_indptr,
    kv_indices,
    last_len,
    page_map=None,
    extra_k=None,
    extra_v=None,
    scale=None,
):
    """q [S, R, Hq, D]; pages [P, Hkv, B, D]; returns float64 [S, R, Hq, D]."""
    s_n, r_n, hq, d = q.shape
    hk, b = k_pages.shape[1], k_pages.shape[2]
    group = hq // hk
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qd, kd, vd = q.double(), k_pages.double(), v_pages.double()
    out = torch.zeros(s_n, r_n, hq, d, dtype=torch.float64)
    for s in range(s_n):
        pages = kv_indices[int(kv_indptr[s]) : int(kv_indptr[s + 1])].tolist()
        for h in range(hq):
            kh = h // group
            keys, vals = [], []
            for i, page in enumerate(pages):
                if page_map is not None and int(page_map[page, kh]) < 0:
                    continue
                n_tok = int(last_len[s]) if i == len(pages) - 1 else b
                for t in range(n_tok):
                    keys.append(kd[page, kh, t])
                    vals.append(vd[page, kh, t])
            for r in range(r_n):
                ks, vs = list(keys), list(vals)
                if r >= 1 and extra_k is not None:
                    ks.append(extra_k[s, kh].double())
                    vs.append(extra_v[s, kh].double())
                if not ks:
                    continue
                kmat, vmat = torch.stack(ks), torch.stack(vs)
                logits = kmat @ qd[s, r, h] * scale
                w = torch.softmax(logits, dim=0)
                out[s, r, h] = w @ vmat
    return out


def ref_score_blocks(q, summaries, blk_indptr, blk_indices):
    """q [S, Hq, D]; summaries [N, Hkv, 2, D]; returns float64 [nnz, Hkv]."""
    s_n, hq, d = q.shape
    hk = summaries.shape[1]
    group = hq // hk
    out = torch.zeros(blk_indices.shape[0], hk, dtype=torch.float64)
    for s in range(s_n):
        for j in range(int(blk_indptr[s]), int(blk_indptr[s + 1])):
            blk = int(blk_indices[j])
            for kh in range(hk):
                lo, hi = summaries[blk, kh, 0].double(), summaries[blk, kh, 1].double()
                total = 0.0
                for g in range(kh * group, (kh + 1) * group):
                    qq = q[s, g].double()
                    total += torch.maximum(qq * lo, qq * hi).sum().item()
                out[j, kh] = total
    return out


# Malformed CSR tables (issue 9): each case corrupts a well-formed indptr of at least 3 rows. The
# CPU twins reject every one with a typed error; the GPU kernels read each row on its own and
# treat a malformed one as empty (docs/CORE_CONTRACT.md, last section).
MALFORMED_INDPTR = ["past_nnz", "huge", "decreasing", "negative_start", "negative_end", "int_min"]


def malformed_indptr(indptr: torch.Tensor, case: str) -> torch.Tensor:
    p = indptr.clone()
    if case == "past_nnz":  # the last row ends past the indices
        p[-1] += 1000
    elif case == "huge":
        p[-1] = 2**31 - 1
    elif case == "decreasing":  # row 1 ends before it starts; row 0 overlaps row 2
        p[1] = p[2] + 5
    elif case == "negative_start":
        p[0] = -1000
    elif case == "negative_end":  # row 0 ends before it starts, row 1 starts below 0
        p[1] = -5
    elif case == "int_min":
        p[1] = -(2**31)
    else:
        raise ValueError(case)
    return p


def csr_rows(indptr: torch.Tensor, nnz: int) -> list[tuple[int, int] | None]:
    """Each row's ``(begin, end)`` where ``0 <= begin <= end <= nnz`` (how the GPU kernels read a row),
    else None (read as an empty row)."""
    p = indptr.tolist()
    return [(b, e) if 0 <= b <= e <= nnz else None for b, e in zip(p[:-1], p[1:], strict=True)]


# ---- helpers of the GPU tests (test_gpu_kernels.py, test_gpu_key_codes.py) ----------------------
DEV = torch.device("cuda", 0)


def gpu_test(fn):
    """Running out of GPU memory skips the test: never a pass, never a failure."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            pytest.skip(f"out of GPU memory: {e}")

    return run


def seeded(*key) -> torch.Generator:
    """A CPU generator seeded from the test parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def dev(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy on the GPU."""
    return None if t is None else t.to(DEV, copy=True)


def back(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU after everything queued has run (pinned host pools are written by the
    GPU through unified addressing, so reading them needs the synchronisation too)."""
    torch.cuda.synchronize()
    return t.cpu()


def csr(lens: list[int]) -> torch.Tensor:
    """The indptr of rows of these lengths."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return i32(out)
