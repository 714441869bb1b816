//! The decoder MLP's SwiGLU activation over the fused gate/up projection: `silu(gate) * up`, one
//! pass instead of torch's two elementwise kernels (`F.silu(g) * u`). The CPU twin of
//! `silu_mul_*` (cuda/norm_rope.cu), bit for bit, with torch's rounding: the SiLU in f32, rounded
//! to `T`, then the product in f32, rounded to `T`. The exponential is taken in f64 and rounded to
//! f32 (the correctly rounded value, which the kernel computes too), where torch's f32 `exp` may
//! differ by its last bit.

use crate::dtype::KvElem;
use crate::error::{check_len, OasisError, Result};

/// `x * sigmoid(x)` as torch computes it for a float tensor, `x / (1 + exp(-x))` in f32, with
/// `exp(-x)` correctly rounded to f32 (taken in f64).
#[inline]
pub fn silu_f32(x: f32) -> f32 {
    let e = (-f64::from(x)).exp() as f32;
    x / (1.0 + e)
}

/// The rows `n` of a `silu_mul` call with `gu_len` and `out_len` elements: `out [n, inter]`,
/// `gu [n, 2 * inter]`. The one check of the twin and of the CUDA launch.
///
/// # Errors
/// [`OasisError::Config`] for `inter == 0`; [`OasisError::Shape`] when `out` is not whole rows of
/// `inter` or `gu` is not `[n, 2 * inter]`.
pub fn silu_mul_rows(gu_len: usize, inter: usize, out_len: usize) -> Result<usize> {
    if inter == 0 {
        return Err(OasisError::Config(
            "silu_mul needs inter > 0 columns".into(),
        ));
    }
    if !out_len.is_multiple_of(inter) {
        return Err(OasisError::Shape {
            what: "out",
            expected: format!("[n, {inter}] (a multiple of {inter} elements)"),
            got: format!("{out_len} elements"),
        });
    }
    let n = out_len / inter;
    check_len("gu", gu_len, &[n, 2, inter])?;
    Ok(n)
}

/// `out[r, c] = T(f32(T(silu(gu[r, c]))) * f32(gu[r, inter + c]))` for the `n = out.len() /
/// inter` rows of `gu [n, 2 * inter]` (gate columns first, then up, as the fused projection's
/// weight stacks them) into `out [n, inter]`.
///
/// # Errors
/// As [`silu_mul_rows`]. Nothing is written then.
pub fn silu_mul<T: KvElem>(gu: &[T], inter: usize, out: &mut [T]) -> Result<()> {
    silu_mul_rows(gu.len(), inter, out.len())?;
    // 2 * inter does not overflow: gu holds n rows of it (checked).
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            let s = T::from_f32(silu_f32(g.to_f32()));
            *o = T::from_f32(s.to_f32() * u.to_f32());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Against a float64 SiLU and product, each rounded as the twin rounds: exact in f32 up to
    /// exp's last bit, so within one ulp of T.
    #[test]
    fn matches_a_float64_reference() {
        let inter = 5;
        let vals: Vec<f32> = (0..3 * 2 * inter)
            .map(|i| (i as f32 - 14.5) * 0.73)
            .collect();
        let gu: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = vec![bf16::ZERO; 3 * inter];
        silu_mul(&gu, inter, &mut out).unwrap();
        for r in 0..3 {
            for c in 0..inter {
                let g = gu[r * 2 * inter + c].to_f64();
                let u = gu[r * 2 * inter + inter + c].to_f64();
                let s = bf16::from_f64(g / (1.0 + (-g).exp())).to_f64();
                let want = s * u;
                let got = out[r * inter + c].to_f64();
                assert!(
                    (got - want).abs() <= want.abs() * 2f64.powi(-7) + 1e-30,
                    "{r},{c}: {got} vs {want}"
                );
            }
        }
        // f32: the SiLU unrounded.
        let x = [3.0f32, -2.0, 0.5, 7.0];
        let mut o = [0.0f32; 2];
        silu_mul(&x, 2, &mut o).unwrap();
        let want = [
            3.0 / (1.0 + (-3.0f64).exp()) * 0.5,
            -2.0 / (1.0 + 2.0f64.exp()) * 7.0,
        ];
        for (g, w) in o.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() <= w.abs() * 1e-6);
        }
    }

    #[test]
    fn bad_shapes_write_nothing() {
        let gu = [1.0f32; 8];
        let mut out = [9.0f32; 3];
        assert!(silu_mul(&gu, 0, &mut out).is_err());
        assert!(silu_mul(&gu, 2, &mut out).is_err()); // 3 is not whole rows of 2
        let mut out = [9.0f32; 6];
        assert!(silu_mul(&gu, 3, &mut out).is_err()); // two rows need gu [2, 6], not 8 elements
        assert_eq!(out, [9.0; 6]);
        let mut out = [9.0f32; 4];
        silu_mul(&gu, 4, &mut out).unwrap(); // gu [1, 8]
        assert!(out
            .iter()
            .all(|&v| (v - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-7));
    }
}
