"""The E4M3 (OCP e4m3fn) grid from the format's definition, in float64, for the references of the
8-bit kernels' tests (the Quest bound, the fp8_e4m3 KV cache): decode, round to nearest with
ties to the even code, and the power-of-two scale rule. Written from the definition (bias 7,
subnormals m 2^-9, no infinities, exponent 15 with mantissa 7 is NaN), not from the code under
test."""

from __future__ import annotations

import numpy as np

#: Magnitudes of the codes 0..126 (0x7f is NaN), ascending: code c has magnitude MAGS[c].
MAGS = np.array(
    [m * 2.0**-9 for m in range(8)]
    + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:119],
    dtype=np.float64,
)
assert MAGS.shape == (127,) and MAGS[-1] == 448.0 and np.all(np.diff(MAGS) > 0)

NAN_CODE = 0x7F

#: Every finite E4M3 value, ascending (one zero).
GRID = np.unique(np.concatenate([-MAGS, MAGS]))


def decode(b: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> float64 (NaN for 0x7f/0xff)."""
    b = np.asarray(b).astype(np.int64)
    mag = np.where((b & 0x7F) == NAN_CODE, np.nan, MAGS[np.minimum(b & 0x7F, 126)])
    return np.where(b & 0x80, -mag, mag)


def rne(y: np.ndarray) -> np.ndarray:
    """float64 -> E4M3 bytes: the nearest code (ties to the even code), the sign kept (so -0.0 is
    0x80), magnitudes past 448 saturating to 448, NaN and +-inf to the NaN code."""
    y = np.asarray(y, dtype=np.float64)
    a = np.abs(y)
    hi = np.clip(np.searchsorted(MAGS, a, side="left"), 0, 126)  # smallest magnitude >= a
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - MAGS[lo], MAGS[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= 448.0, 126, pick)
    code = pick | np.where(np.signbit(y), 0x80, 0)
    return np.where(np.isfinite(y), code, NAN_CODE).astype(np.uint8)


def exponent(absmax: float, lo: int = -120, hi: int | None = None) -> int:
    """The smallest e >= lo with absmax <= 448 2^e (clamped to hi when given)."""
    e = lo
    while absmax > 448.0 * 2.0**e and (hi is None or e < hi):
        e += 1
    return e
