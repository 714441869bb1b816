//! The kv8 format: `e4m3_rne` and `quantize_kv8` against the independent f64 reference
//! (`kv8_ref`), and `quantize_kv8`'s errors.

use half::bf16;
use oasis_core::kernels::{
    e4m3_decode, e4m3_rne, kv8_exponent, quantize_kv8, KV8_MAX_EXP, KV8_MIN_EXP,
};
use oasis_core::{KvElem, KvGeometry, OasisError};

mod common;
mod kv8_ref;
use common::Rng;

#[test]
fn reference_constants_match_the_crate() {
    assert_eq!(
        (KV8_MIN_EXP, KV8_MAX_EXP),
        (kv8_ref::MIN_EXP, kv8_ref::MAX_EXP)
    );
}

#[test]
fn every_code_round_trips() {
    for c in 0u8..=255 {
        let v = e4m3_decode(c);
        match kv8_ref::value(c) {
            Some(r) => {
                assert_eq!(f64::from(v), r, "decode({c:#04x})");
                assert_eq!(e4m3_rne(v), c, "rne(decode({c:#04x}))");
            }
            None => {
                assert!(v.is_nan());
                assert_eq!(e4m3_rne(v), kv8_ref::NAN_CODE);
            }
        }
    }
}

#[test]
fn midpoints_go_to_the_even_code() {
    for c in 0u8..0x7e {
        let (lo, hi) = (e4m3_decode(c), e4m3_decode(c + 1));
        let mid = (lo + hi) / 2.0; // 5 significant bits: exact in f32
        assert_eq!(f64::from(mid), (f64::from(lo) + f64::from(hi)) / 2.0);
        let even = if c % 2 == 0 { c } else { c + 1 };
        assert_eq!(
            e4m3_rne(mid),
            even,
            "midpoint of {c:#04x} and {:#04x}",
            c + 1
        );
        assert_eq!(e4m3_rne(-mid), 0x80 | even);
        // One ulp either side leaves the tie.
        let below = f32::from_bits(mid.to_bits() - 1);
        let above = f32::from_bits(mid.to_bits() + 1);
        if mid > 0.0 && below > lo {
            assert_eq!(e4m3_rne(below), c);
        }
        assert_eq!(e4m3_rne(above), c + 1);
    }
}

#[test]
fn saturation_and_non_finite() {
    for y in [448.0f32, 448.5, 464.0, 480.0, 1e6, f32::MAX] {
        assert_eq!(e4m3_rne(y), 0x7e, "{y}");
        assert_eq!(e4m3_rne(-y), 0xfe, "{y}");
        assert_eq!(kv8_ref::rne(f64::from(y)), 0x7e);
    }
    for y in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(e4m3_rne(y), kv8_ref::NAN_CODE, "{y}");
        assert!(e4m3_decode(e4m3_rne(y)).is_nan());
    }
    assert_eq!(e4m3_rne(0.0), 0x00);
    assert_eq!(e4m3_rne(-0.0), 0x80);
    // Below half the smallest subnormal (2^-10): zero; at it, the tie goes to even (zero).
    assert_eq!(e4m3_rne(2f32.powi(-10)), 0x00);
    assert_eq!(e4m3_rne(2f32.powi(-10) * 1.001), 0x01);
    assert_eq!(e4m3_rne(-1e-30), 0x80);
}

#[test]
fn dense_sweep_matches_the_reference_grid() {
    // Every 1021st f32 between 2^-13 and 2^10, both signs, plus random values across the range.
    let (lo, hi) = (2f32.powi(-13).to_bits(), 2f32.powi(10).to_bits());
    let mut n = 0;
    for bits in (lo..hi).step_by(1021) {
        let y = f32::from_bits(bits);
        for y in [y, -y] {
            assert_eq!(e4m3_rne(y), kv8_ref::rne(f64::from(y)), "rne({y:e})");
            n += 1;
        }
    }
    let mut rng = Rng(5);
    for _ in 0..50_000 {
        let y = rng.f32() * 2f32.powi(rng.below(24) as i32 - 12);
        assert_eq!(e4m3_rne(y), kv8_ref::rne(f64::from(y)), "rne({y:e})");
    }
    assert!(n > 300_000);
}

#[test]
fn exponent_is_the_definition() {
    let mut rng = Rng(9);
    let mut xs: Vec<f32> = vec![0.0, 448.0, 448.0001, 224.0, 1e-38, 1e-45, 3e38, f32::MAX];
    for _ in 0..5000 {
        xs.push(rng.f32().abs() * 2f32.powi(rng.below(240) as i32 - 120));
    }
    for x in xs {
        assert_eq!(kv8_exponent(x), kv8_ref::exponent([f64::from(x)]), "{x:e}");
    }
}

/// Blocks of `T` whose (block, head) entries span magnitudes from subnormal f32 to 2^100, with
/// some exact zeros, NaN and inf.
fn blocks<T: KvElem>(g: &KvGeometry, n: usize, rng: &mut Rng) -> Vec<T> {
    let e = g.entry_elems();
    let mut out = Vec::with_capacity(n * g.page_elems());
    for i in 0..n * g.num_kv_heads {
        let mag = match i % 7 {
            0 => 0.0,
            1 => 2f32.powi(-130),
            2 => 2f32.powi(100),
            _ => 2f32.powi(rng.below(40) as i32 - 20),
        };
        for j in 0..e {
            let x = match rng.below(200) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => 0.0,
                _ => rng.f32() * mag,
            };
            let x = if j == 0 && i % 7 == 3 { 448.0 * mag } else { x }; // a boundary absmax
            out.push(T::from_f32(x));
        }
    }
    out
}

fn quantize_matches<T: KvElem>() {
    let mut rng = Rng(3);
    for (h_kv, d, bs) in [(1, 1, 1), (2, 7, 5), (3, 64, 8), (1, 128, 16)] {
        let g = KvGeometry::new(h_kv, h_kv, d, bs).unwrap();
        let n = 9;
        let src = blocks::<T>(&g, n, &mut rng);
        let valid: Vec<i32> = (0..n).map(|i| 1 + ((i * 5) % bs) as i32).collect();
        let mut codes = vec![0xaau8; src.len()];
        let mut scales = vec![-1.0f32; n * h_kv];
        quantize_kv8(&g, &src, &valid, &mut codes, &mut scales).unwrap();
        let e = g.entry_elems();
        for b in 0..n {
            for h in 0..h_kv {
                let at = (b * h_kv + h) * e;
                let rows: Vec<f64> = src[at..at + valid[b] as usize * d]
                    .iter()
                    .map(|x| f64::from(x.to_f32()))
                    .collect();
                let (want, ex) = kv8_ref::quantize_block(&rows, e);
                assert_eq!(
                    f64::from(scales[b * h_kv + h]),
                    2f64.powi(ex),
                    "scale {b} {h}"
                );
                assert_eq!(
                    &codes[at..at + e],
                    &want[..],
                    "codes {b} {h} {:?}",
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn quantize_kv8_matches_the_reference() {
    quantize_matches::<f32>();
    quantize_matches::<bf16>();
    quantize_matches::<half::f16>();
}

#[test]
fn quantize_kv8_errors_write_nothing() {
    let g = KvGeometry::new(2, 2, 4, 3).unwrap();
    let src = vec![1.0f32; 2 * g.page_elems()];
    let mut codes = vec![7u8; src.len()];
    let mut scales = vec![5.0f32; 4];
    let mut run = |src: &[f32], valid: &[i32], nc: usize, ns: usize| {
        let r = quantize_kv8(&g, src, valid, &mut codes[..nc], &mut scales[..ns]);
        assert!(codes.iter().all(|&c| c == 7) && scales.iter().all(|&s| s == 5.0));
        r
    };
    let shape = |r: Result<(), OasisError>, what: &str| match r {
        Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected shape error for {what}, got {other:?}"),
    };
    let n = src.len();
    shape(run(&src[1..], &[1, 1], n, 4), "src");
    shape(run(&src, &[1], n, 4), "valid");
    shape(run(&src, &[1, 1], n - 1, 4), "codes");
    shape(run(&src, &[1, 1], n, 3), "scales");
    for bad in [0, 4, -1] {
        assert!(matches!(
            run(&src, &[1, bad], n, 4),
            Err(OasisError::Invalid(_))
        ));
    }
    quantize_kv8(&g, &src, &[3, 1], &mut codes, &mut scales).unwrap();
    assert_eq!(scales, vec![2f32.powi(-8); 4]); // 1 <= 448 2^-8
}
