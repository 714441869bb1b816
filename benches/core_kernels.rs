//! Criterion benches of the CPU twins that run every decode step: delta selection (+ top-K) at a
//! serving-sized batch, and decode attention at Qwen3-8B head shapes.
//!
//! `cargo bench -p oasis-core --bench kernels`. Measurement times are short on purpose (these
//! run on small CI machines); pass `--measurement-time` to Criterion for steadier numbers.

use std::hint::black_box;
use std::time::Duration;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use half::bf16;
use oasis_core::kernels::{decode_attention, delta_select, topk_blocks, ExtraKv, PagedKv};
use oasis_core::{KvElem, KvGeometry};

// The tests' SplitMix64 `Rng`, so the benches need no RNG crate (and no test-support feature).
#[path = "../crates/oasis-core/tests/common/mod.rs"]
mod common;
use common::Rng;

// Selection preset: a batch of 64 sparse requests, 8 KV heads, 128 budget slots, 8K context.
const SEL_SEQS: usize = 64;
const SEL_HEADS: usize = 8;
const SEL_BUDGET: usize = 128;
const SEL_BLOCKS: usize = 512; // 8K tokens at block size 16
const SEL_FETCH_CAP: usize = 16; // arbitrary: a few PCIe-bound entries per head per step
const SEL_PATTERNS: usize = 8; // predictions cycled through, so the working set keeps changing

fn bench_selection(c: &mut Criterion) {
    let mut rng = Rng(1);
    let num_pages = SEL_SEQS * SEL_BUDGET;
    let slot_pages: Vec<i32> = (0..num_pages as i32).collect();
    // Each pattern: per (seq, head) a top-K of random scores (distinct blocks, best first), made
    // by topk_blocks itself from random scores.
    let blk_indptr: Vec<i32> = (0..=SEL_SEQS).map(|s| (s * SEL_BLOCKS) as i32).collect();
    let scores: Vec<Vec<f32>> = (0..SEL_PATTERNS)
        .map(|_| {
            (0..SEL_SEQS * SEL_BLOCKS * SEL_HEADS)
                .map(|_| rng.f32())
                .collect()
        })
        .collect();
    let predicted: Vec<Vec<i32>> = scores
        .iter()
        .map(|sc| {
            let mut out = vec![0; SEL_SEQS * SEL_HEADS * SEL_BUDGET];
            topk_blocks(SEL_HEADS, sc, &blk_indptr, SEL_BUDGET, &mut out).unwrap();
            out
        })
        .collect();

    let mut g = c.benchmark_group("selection");
    g.throughput(Throughput::Elements((SEL_SEQS * SEL_HEADS) as u64));
    g.bench_function(BenchmarkId::new("topk_blocks", "64x8x512_k128"), |b| {
        let mut out = vec![0; SEL_SEQS * SEL_HEADS * SEL_BUDGET];
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % SEL_PATTERNS;
            topk_blocks(
                SEL_HEADS,
                black_box(&scores[i]),
                &blk_indptr,
                SEL_BUDGET,
                &mut out,
            )
            .unwrap();
            black_box(&out);
        })
    });
    g.bench_function(BenchmarkId::new("delta_select", "64x8x128_cap16"), |b| {
        let mut page_map = vec![-1; num_pages * SEL_HEADS];
        let mut last = vec![-1; num_pages * SEL_HEADS];
        let mut plan_slots = vec![0; SEL_SEQS * SEL_HEADS * SEL_FETCH_CAP];
        let mut plan_blocks = vec![0; SEL_SEQS * SEL_HEADS * SEL_FETCH_CAP];
        // Start from a full working set of random blocks.
        for (e, m) in page_map.iter_mut().enumerate() {
            *m = ((e / SEL_HEADS % SEL_BUDGET) * 4 + rng.below(4)) as i32;
        }
        let mut step = 0i32;
        b.iter(|| {
            step += 1;
            let pred = &predicted[step as usize % SEL_PATTERNS];
            let stats = delta_select(
                SEL_HEADS,
                black_box(pred),
                SEL_BUDGET,
                &slot_pages,
                SEL_BUDGET,
                &mut page_map,
                &mut last,
                step,
                SEL_FETCH_CAP,
                &mut plan_slots,
                &mut plan_blocks,
            )
            .unwrap();
            black_box(stats)
        })
    });
    g.finish();
}

// Attention preset: Qwen3-8B heads (32 query / 8 KV, head_dim 128), block 16, 129 pages per seq
// (a 128-block working set + the local block), current + lookahead rows.
const ATT_SEQS: usize = 4;
const ATT_PAGES_PER_SEQ: usize = 129;
const ATT_LAST_LEN: i32 = 9;

fn bench_attention_dtype<T: KvElem>(c: &mut Criterion, name: &str) {
    let geo = KvGeometry::new(32, 8, 128, 16).unwrap();
    let mut rng = Rng(2);
    let num_pages = ATT_SEQS * ATT_PAGES_PER_SEQ;
    let k: Vec<T> = (0..num_pages * geo.page_elems())
        .map(|_| T::from_f32(rng.f32()))
        .collect();
    let v: Vec<T> = (0..num_pages * geo.page_elems())
        .map(|_| T::from_f32(rng.f32()))
        .collect();
    let num_rows = 2;
    let q: Vec<T> = (0..ATT_SEQS * num_rows * geo.num_qo_heads * geo.head_dim)
        .map(|_| T::from_f32(rng.f32()))
        .collect();
    let ek: Vec<T> = (0..ATT_SEQS * geo.num_kv_heads * geo.head_dim)
        .map(|_| T::from_f32(rng.f32()))
        .collect();
    let indptr: Vec<i32> = (0..=ATT_SEQS)
        .map(|s| (s * ATT_PAGES_PER_SEQ) as i32)
        .collect();
    // Pages of each sequence scattered over the pool.
    let indices: Vec<i32> = (0..num_pages)
        .map(|i| ((i * 97) % num_pages) as i32)
        .collect();
    let last = vec![ATT_LAST_LEN; ATT_SEQS];
    // Working set: each head holds its own blocks, in a per-head order.
    let page_map: Vec<i32> = (0..num_pages * geo.num_kv_heads)
        .map(|e| (((e / geo.num_kv_heads) * 31 + e % geo.num_kv_heads * 7) % 4096) as i32)
        .collect();
    let tokens = ATT_SEQS * ((ATT_PAGES_PER_SEQ - 1) * geo.block_size + ATT_LAST_LEN as usize);
    let bytes = tokens * geo.num_kv_heads * geo.head_dim * 2 * std::mem::size_of::<T>();
    let scale = 1.0 / (geo.head_dim as f32).sqrt();
    let extra = ExtraKv { k: &ek, v: &ek };

    let mut g = c.benchmark_group("decode_attention");
    g.throughput(Throughput::Bytes(bytes as u64));
    // Tens of ms per call: flat sampling keeps the run to about sample_size calls.
    g.sampling_mode(SamplingMode::Flat);
    for (label, page_map) in [("dense", None), ("working_set", Some(page_map.as_slice()))] {
        let kv = PagedKv {
            k_pages: &k,
            v_pages: &v,
            kv_indptr: &indptr,
            kv_indices: &indices,
            kv_last_page_len: &last,
            page_map,
        };
        let mut out = vec![T::from_f32(0.0); q.len()];
        g.bench_function(
            BenchmarkId::new(format!("{name}_{label}"), "qwen3-8b_4x129p_2rows"),
            |b| {
                b.iter(|| {
                    decode_attention(
                        &geo,
                        black_box(&q),
                        num_rows,
                        &kv,
                        Some(&extra),
                        scale,
                        &mut out,
                    )
                    .unwrap();
                    black_box(&out);
                })
            },
        );
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    bench_attention_dtype::<bf16>(c, "bf16");
    bench_attention_dtype::<f32>(c, "f32");
}

criterion_group! {
    name = benches;
    // Short on purpose: 2 cores, shared with other builds.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = bench_selection, bench_attention
}
criterion_main!(benches);
