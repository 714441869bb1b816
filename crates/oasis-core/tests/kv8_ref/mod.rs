//! An independent float64 reference of the kv8 (FP8 E4M3) KV cache, built from the format's
//! definition only: it calls nothing from `oasis_core`. The E4M3 grid comes from the bit layout
//! (OCP e4m3fn), quantization is a nearest-value search on that grid with ties to the even code,
//! and attention runs in f64 (softmax included) over the dequantized values.

// Each test binary uses a part of this module.
#![allow(dead_code)]

/// Largest E4M3 magnitude.
pub const MAX: f64 = 448.0;
/// Scale exponent bounds of the format.
pub const MIN_EXP: i32 = -120;
pub const MAX_EXP: i32 = 120;
/// The NaN code non-finite values quantize to.
pub const NAN_CODE: u8 = 0x7f;

/// The value of E4M3 bits `c`: sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent
/// field 0 is subnormal (`m 2^-9`); `0x7f`/`0xff` are NaN (`None`).
pub fn value(c: u8) -> Option<f64> {
    let (sign, ex, m) = (c >> 7, i32::from((c >> 3) & 15), f64::from(c & 7));
    if ex == 15 && m == 7.0 {
        return None;
    }
    let mag = if ex == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(ex - 7)
    };
    Some(if sign == 1 { -mag } else { mag })
}

/// The non-negative grid: (magnitude, code) for codes `0x00..=0x7e`, ascending.
fn grid() -> &'static [(f64, u8)] {
    use std::sync::OnceLock;
    static GRID: OnceLock<Vec<(f64, u8)>> = OnceLock::new();
    GRID.get_or_init(|| {
        let g: Vec<(f64, u8)> = (0u8..=0x7e).map(|c| (value(c).unwrap(), c)).collect();
        assert!(
            g.windows(2).all(|w| w[0].0 < w[1].0),
            "codes ordered by value"
        );
        g
    })
}

/// The code of the grid value nearest to `y` (ties: the even code), sign of `y` kept; beyond the
/// grid the nearest is ±448; NaN and ±inf give the NaN code.
pub fn rne(y: f64) -> u8 {
    if !y.is_finite() {
        return NAN_CODE;
    }
    let a = y.abs();
    let g = grid();
    // The two neighbours of `a` on the grid, then the nearer one.
    let i = g.partition_point(|&(v, _)| v < a);
    let mut best: Option<(f64, u8)> = None;
    for &(v, c) in g[i.saturating_sub(1)..(i + 1).min(g.len())].iter() {
        let err = (v - a).abs();
        best = match best {
            Some((e, b)) if e < err || (e == err && b % 2 == 0) => Some((e, b)),
            _ => Some((err, c)),
        };
    }
    let c = best.unwrap().1;
    if y.is_sign_negative() {
        c | 0x80
    } else {
        c
    }
}

/// The smallest `e` with `absmax <= 448 2^e` over the finite values, clamped to the bounds.
pub fn exponent(xs: impl IntoIterator<Item = f64>) -> i32 {
    let a = xs
        .into_iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let mut e = MIN_EXP;
    while e < MAX_EXP && a > MAX * 2f64.powi(e) {
        e += 1;
    }
    e
}

/// One value quantized at exponent `e`.
pub fn quantize(x: f64, e: i32) -> u8 {
    rne(x * 2f64.powi(-e))
}

/// One (page, head) entry under the incremental append: `codes` `[block_size, head_dim]` and the
/// exponent of its scale.
#[derive(Debug, Clone)]
pub struct Entry {
    pub codes: Vec<u8>,
    pub e: i32,
}

impl Entry {
    pub fn new(block_size: usize, head_dim: usize) -> Self {
        Entry {
            codes: vec![0; block_size * head_dim],
            e: MIN_EXP,
        }
    }

    /// Append `row` at offset `off`: offset 0 takes the row's exponent; a larger one first
    /// requantizes rows `0..off` (`rne(value * 2^(e_old - e_new))`); the exponent never shrinks.
    pub fn append(&mut self, off: usize, row: &[f64]) {
        let d = row.len();
        let e_row = exponent(row.iter().copied());
        if off == 0 {
            self.e = e_row;
        } else if e_row > self.e {
            let f = 2f64.powi(self.e - e_row);
            for c in &mut self.codes[..off * d] {
                *c = value(*c).map_or(NAN_CODE, |v| rne(v * f));
            }
            self.e = e_row;
        }
        for (i, &x) in row.iter().enumerate() {
            self.codes[off * d + i] = quantize(x, self.e);
        }
    }
}

/// Whole-block quantization of one entry: its first `valid` rows (`rows.len() = valid * d`) at
/// their exponent, the rest code 0. Returns (codes `[block_size * d]`, exponent).
pub fn quantize_block(rows: &[f64], block_elems: usize) -> (Vec<u8>, i32) {
    let e = exponent(rows.iter().copied());
    let mut codes = vec![0u8; block_elems];
    for (c, &x) in codes.iter_mut().zip(rows) {
        *c = quantize(x, e);
    }
    (codes, e)
}

/// A batch's table for [`attention`].
pub struct Table<'a> {
    pub indptr: &'a [i32],
    pub indices: &'a [i32],
    pub last: &'a [i32],
    pub page_map: Option<&'a [i32]>,
}

/// Heads and sizes for [`attention`]: (num_qo_heads, num_kv_heads, block_size, head_dim).
pub type Dims = (usize, usize, usize, usize);

/// f64 decode attention: for every (seq, row, query head) the (k, v) rows of its KV head's
/// valid entries (`row_kv(page, head, token)`), the extra K,V for rows >= 1, a textbook softmax.
/// `out[s, r, qh, :]`; zeros where nothing is attended.
pub fn attention(
    dims: Dims,
    q: &[f64], // [num_seqs, num_rows, num_qo_heads, head_dim]
    num_rows: usize,
    t: &Table,
    row_kv: impl Fn(usize, usize, usize) -> (Vec<f64>, Vec<f64>),
    extra: Option<(&[f64], &[f64])>, // [num_seqs, num_kv_heads, head_dim] each
    sm_scale: f64,
) -> Vec<f64> {
    let (hq, h_kv, bs, d) = dims;
    let num_seqs = t.indptr.len() - 1;
    let mut out = vec![0.0f64; num_seqs * num_rows * hq * d];
    for s in 0..num_seqs {
        let pages: Vec<usize> = (t.indptr[s] as usize..t.indptr[s + 1] as usize)
            .map(|j| t.indices[j] as usize)
            .collect();
        for qh in 0..hq {
            let h = qh / (hq / h_kv);
            let mut rows = Vec::new();
            for (pos, &p) in pages.iter().enumerate() {
                let ntok = if pos + 1 == pages.len() {
                    t.last[s] as usize
                } else {
                    bs
                };
                if t.page_map.is_none_or(|pm| pm[p * h_kv + h] >= 0) {
                    rows.extend((0..ntok).map(|tok| row_kv(p, h, tok)));
                }
            }
            for r in 0..num_rows {
                let mut rows = rows.clone();
                if let (Some((ek, ev)), true) = (extra, r >= 1) {
                    let at = (s * h_kv + h) * d;
                    rows.push((ek[at..at + d].to_vec(), ev[at..at + d].to_vec()));
                }
                let qa = ((s * num_rows + r) * hq + qh) * d;
                let qv = &q[qa..qa + d];
                let logits: Vec<f64> = rows
                    .iter()
                    .map(|(k, _)| k.iter().zip(qv).map(|(a, b)| a * b).sum::<f64>() * sm_scale)
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for x in 0..d {
                    let num: f64 = rows.iter().zip(&w).map(|((_, v), w)| w * v[x]).sum();
                    out[qa + x] = if z > 0.0 { num / z } else { 0.0 };
                }
            }
        }
    }
    out
}
