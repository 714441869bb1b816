"""The fragment bookkeeping of the two tensor-core kernels that take E4M3 codes as MMA operands,
emulated lane by lane in numpy from PTX's documented layouts, against a direct computation:

* ``TcKv8RegPages`` (cuda/oasis_attn_tc.cuh, ``set_kv8_attention_kernel("registers")``): Q's
  fragments in the permuted order, K by ``ldmatrix`` of the code rows, V by ``ldmatrix.trans``
  then ``prmt 0x3120``, the output's columns stored back in place;
* ``score_bound8_tc`` (cuda/score_blocks.cu, ``set_bound8_score_kernel("mma")``): 16 bytes per
  lane per 64-byte chunk, the coefficients' (value, remainder) rows.

It checks index math only (which byte lands in which operand slot), not the hardware: the GPU tests
(test_gpu_kv8.py, test_gpu_bound8.py) check the kernels. Run it after changing either kernel's
fragment code:

    python3 experiments/exp_tc_fragments.py
"""

from __future__ import annotations

import numpy as np

LANES = 32


def lane_gc(lane: int) -> tuple[int, int]:
    return lane >> 2, lane & 3


# ---- PTX layouts (m16n8k16, f16 inputs, f32 accumulators; ldmatrix m8n8 b16) ----------------
def mma(a_regs, b_regs, c_regs):
    """``c += a . b`` over a warp: a_regs[lane] = 4 pairs, b_regs[lane] = 2 pairs, c_regs[lane] =
    4 floats (PTX's fragment layouts), by rebuilding the matrices."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(LANES):
        g, c = lane_gc(lane)
        a = a_regs[lane]
        A[g, 2 * c : 2 * c + 2] = a[0]
        A[g + 8, 2 * c : 2 * c + 2] = a[1]
        A[g, 2 * c + 8 : 2 * c + 10] = a[2]
        A[g + 8, 2 * c + 8 : 2 * c + 10] = a[3]
        b = b_regs[lane]
        B[2 * c : 2 * c + 2, g] = b[0]
        B[2 * c + 8 : 2 * c + 10, g] = b[1]
    C = A @ B
    for lane in range(LANES):
        g, c = lane_gc(lane)
        c_regs[lane] += [C[g, 2 * c], C[g, 2 * c + 1], C[g + 8, 2 * c], C[g + 8, 2 * c + 1]]


def ldmatrix_x4(rows_of_lane, trans=False):
    """rows_of_lane[lane] = the 16 bytes at that lane's row address (matrix lane // 8, row lane %
    8). Returns regs[lane][i] = 4 bytes of matrix i: non-trans (row g, b16 columns 2c, 2c+1), trans
    (b16 column g of rows 2c, 2c+1), the first element in the low half."""
    mats = [[rows_of_lane[8 * i + j] for j in range(8)] for i in range(4)]
    out = []
    for lane in range(LANES):
        g, c = lane_gc(lane)
        regs = []
        for i in range(4):
            m = mats[i]
            if not trans:
                regs.append(m[g][4 * c : 4 * c + 4])
            else:
                regs.append(np.concatenate([m[2 * c][2 * g : 2 * g + 2], m[2 * c + 1][2 * g : 2 * g + 2]]))
        out.append(regs)
    return out


def cvt_e4m3x4(word, decode):
    """e4m3x4_to_f16x2: (codes 0, 1) and (codes 2, 3) of a 4-byte word as value pairs."""
    v = [decode[int(b)] for b in word]
    return (v[0], v[1]), (v[2], v[3])


def prmt_3120(word):
    return np.array([word[0], word[2], word[1], word[3]], dtype=np.uint8)


def e4m3_table() -> np.ndarray:
    out = np.zeros(256)
    for x in range(256):
        s, e, m = x >> 7, (x >> 3) & 15, x & 7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out[x] = -v if s else v
    out[0x7F] = out[0xFF] = 0.0  # NaN codes are not drawn below
    return out


# ---- the registers kernel: one 16-token chunk ------------------------------------------------
def attention_chunk(D: int, rng) -> None:
    dec = e4m3_table()
    codes_k = rng.integers(0, 0x7E, (16, D), dtype=np.uint8) ^ rng.choice([0, 0x80], (16, D)).astype(np.uint8)
    codes_v = rng.integers(0, 0x7E, (16, D), dtype=np.uint8) ^ rng.choice([0, 0x80], (16, D)).astype(np.uint8)
    q = rng.standard_normal((16, D))  # 16 padded query rows
    code_upr = D // 16

    def swz(row, col):
        return col ^ (row & 7) if code_upr >= 8 else col ^ ((row >> 1) & 3)

    # The ring as the kernel writes it: unit col of row `row` at row * CODE_UPR + swz(row, col).
    ring_k = {}
    ring_v = {}
    for row in range(16):
        for col in range(code_upr):
            ring_k[row * code_upr + swz(row, col)] = codes_k[row, 16 * col : 16 * col + 16]
            ring_v[row * code_upr + swz(row, col)] = codes_v[row, 16 * col : 16 * col + 16]
    assert len(ring_k) == 16 * code_upr  # the swizzle is a bijection per row

    # Q fragments, permuted: qf[ks][r] = row (r & 1 ? g + 8 : g), dims 16 ks + 4c + 2 (r >> 1) + {0, 1}.
    qf = [[None] * 4 for _ in range(D // 16)]
    per_lane_q = []
    for lane in range(LANES):
        g, c = lane_gc(lane)
        regs = []
        for ks in range(D // 16):
            rr = []
            for r in range(4):
                row = g + 8 * (r & 1)
                x = ks * 16 + 4 * c + 2 * (r >> 1)
                rr.append((q[row, x], q[row, x + 1]))
            regs.append(rr)
        per_lane_q.append(regs)
    del qf

    # S = Q K^T: ldmatrix x4 of tokens 0-7 / 8-15 at units ks, ks + 1.
    sc = [np.zeros((LANES, 4)) for _ in range(2)]
    for ks in range(0, D // 16, 2):
        rows = []
        for lane in range(LANES):
            tok = (((lane >> 3) & 1) << 3) + (lane & 7)
            unit = ks + (lane >> 4)
            rows.append(ring_k[tok * code_upr + swz(tok, unit)])
        b = ldmatrix_x4(rows)
        for m in range(4):
            b_regs = [cvt_e4m3x4(b[lane][m], dec) for lane in range(LANES)]
            a_regs = [per_lane_q[lane][ks + (m >> 1)] for lane in range(LANES)]
            mma(a_regs, b_regs, sc[m & 1])
    # The accumulator's layout: sc[nt][lane] = S[g][8nt + 2c], S[g][8nt + 2c + 1], rows g + 8.
    S = q @ dec[codes_k].T
    for lane in range(LANES):
        g, c = lane_gc(lane)
        for nt in range(2):
            t = 8 * nt + 2 * c
            want = [S[g, t], S[g, t + 1], S[g + 8, t], S[g + 8, t + 1]]
            assert np.allclose(sc[nt][lane], want), ("S", D, lane, nt)

    # P (any values) as A: pa = (sc[0][0..1]), (sc[0][2..3]), (sc[1][0..1]), (sc[1][2..3]).
    P = rng.random((16, 16))
    pa = []
    for lane in range(LANES):
        g, c = lane_gc(lane)
        pa.append(
            [
                (P[g, 2 * c], P[g, 2 * c + 1]),
                (P[g + 8, 2 * c], P[g + 8, 2 * c + 1]),
                (P[g, 8 + 2 * c], P[g, 8 + 2 * c + 1]),
                (P[g + 8, 8 + 2 * c], P[g + 8, 8 + 2 * c + 1]),
            ]
        )
    o = [np.zeros((LANES, 4)) for _ in range(D // 8)]
    for dn in range(0, D // 16, 2):
        rows = []
        for lane in range(LANES):
            tok = (((lane >> 3) & 1) << 3) + (lane & 7)
            unit = dn + (lane >> 4)
            rows.append(ring_v[tok * code_upr + swz(tok, unit)])
        b = ldmatrix_x4(rows, trans=True)
        for hf in range(2):
            ev, od = [], []
            for lane in range(LANES):
                ev0, od0 = cvt_e4m3x4(prmt_3120(b[lane][2 * hf]), dec)
                ev1, od1 = cvt_e4m3x4(prmt_3120(b[lane][2 * hf + 1]), dec)
                ev.append((ev0, ev1))
                od.append((od0, od1))
            mma(pa, ev, o[2 * (dn + hf)])
            mma(pa, od, o[2 * (dn + hf) + 1])
    # Stored back: dim 16u + 4c + jj from o[2u + (jj & 1)][jj >> 1] (row g), [.. + 2] (row g + 8).
    O = P @ dec[codes_v]
    got = np.zeros((16, D))
    for lane in range(LANES):
        g, c = lane_gc(lane)
        for u in range(D // 16):
            for jj in range(4):
                x = u * 16 + 4 * c + jj
                got[g, x] = o[2 * u + (jj & 1)][lane][jj >> 1]
                got[g + 8, x] = o[2 * u + (jj & 1)][lane][(jj >> 1) + 2]
    assert np.allclose(got, O), ("O", D, np.abs(got - O).max())


# ---- the 8-bit bound on the tensor cores: one 8-entry n-tile ---------------------------------
def bound8_tile(D: int, rng) -> None:
    dec = e4m3_table()
    signs = rng.choice([0, 0x80], (8, 2 * D)).astype(np.uint8)
    bounds = rng.integers(0, 0x7E, (8, 2 * D), dtype=np.uint8) ^ signs
    coef = rng.standard_normal(2 * D) * 3  # [N | P]
    hi = coef.astype(np.float16).astype(np.float64)
    lo = (coef - hi).astype(np.float16).astype(np.float64)
    ksteps = D // 8
    # The warp's shared coefficients: coef_smem[ks * 8 + cc] (row 0), [ks * 8 + 4 + cc] (row 1).
    smem = {}
    for i in range(ksteps * 4):
        ks, cc = i >> 2, i & 3
        p = 64 * (ks >> 2) + 16 * cc + 4 * (ks & 3)
        smem[ks * 8 + cc] = ((hi[p], hi[p + 1]), (hi[p + 2], hi[p + 3]))
        smem[ks * 8 + 4 + cc] = ((lo[p], lo[p + 1]), (lo[p + 2], lo[p + 3]))
    raw = []  # raw[lane][kk] = 16 bytes of column g's bound at 64 kk + 16 c
    for lane in range(LANES):
        g, c = lane_gc(lane)
        raw.append([bounds[g, 64 * kk + 16 * c : 64 * kk + 16 * c + 16] for kk in range(D // 32)])
    acc = np.zeros((LANES, 4))
    for ks in range(ksteps):
        a_regs, b_regs = [], []
        for lane in range(LANES):
            w = raw[lane][ks >> 2][4 * (ks & 3) : 4 * (ks & 3) + 4]
            b_regs.append(cvt_e4m3x4(w, dec))
            a = smem[ks * 8 + lane] if lane < 8 else ((0, 0), (0, 0))
            a_regs.append([a[0], (0, 0), a[1], (0, 0)])
        mma(a_regs, b_regs, acc)
    want = dec[bounds] @ coef
    for c in range(4):  # lane c (g = 0) + lane c + 4 (g = 1): columns 2c, 2c + 1
        for e in range(2):
            got = acc[c][e] + acc[c + 4][e]
            tol = 1e-6 * np.abs(dec[bounds[2 * c + e]]).sum()
            assert np.isclose(got, want[2 * c + e], rtol=1e-6, atol=tol), ("bound8", D, c, e)


def main() -> None:
    rng = np.random.default_rng(0)
    for D in (64, 128, 256):
        attention_chunk(D, rng)
        bound8_tile(D, rng)
    print("fragment mappings agree with the direct computation for head_dim 64, 128, 256")


if __name__ == "__main__":
    main()
