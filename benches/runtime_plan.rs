//! Criterion bench of the per-step plan (`oasis-runtime`): 256 requests, the tables of every layer
//! laid out once. Two mixes at Qwen3-8B-like serving sizes (block 16, K = 128):
//!
//! * `sparse_16k`: 256 sparse requests at 16K context (129 attention pages, 1024 candidates each);
//! * `dense_4k`: 256 dense requests at 4K context (256 pages each).
//!
//! `cargo bench -p oasis-runtime --bench plan`. Each measured call plans one step (allocating the
//! blocks it enters) on a fresh copy of the runtime, so contexts do not grow across iterations.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use oasis_runtime::{Runtime, RuntimeConfig};

const SEQS: usize = 256;
const BLOCK: usize = 16;
const K: usize = 128;

fn runtime(context: usize, sparse: bool) -> Runtime {
    let cfg = RuntimeConfig {
        block_size: BLOCK,
        top_k_blocks: K,
        sparse_threshold: if sparse { K * BLOCK } else { usize::MAX / 2 },
        sparse,
        rows: 2,
        measure_recall: true,
        plan_blk_seq: false,
        max_num_seqs: SEQS,
    };
    let per = context.div_ceil(BLOCK) + 8;
    let (gpu, host) = (SEQS * per, if sparse { SEQS * per } else { 0 });
    let mut rt = Runtime::new(cfg, gpu, host, gpu, host).expect("config");
    for id in 0..SEQS as u64 {
        // Stagger the lengths so requests enter new blocks at different steps.
        let len = context - (id as usize % BLOCK);
        rt.admit(id, len, 64).expect("fits");
        if rt.wants_sparse(id).expect("admitted") {
            rt.make_sparse(id).expect("reserved");
        }
    }
    // One step first, so the arena has its steady-state capacity (the engine reuses it).
    let ids: Vec<u64> = (0..SEQS as u64).collect();
    rt.plan(&ids, &vec![1; SEQS * 2]).expect("plan");
    rt
}

fn bench_plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_256_requests");
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_secs(1));
    g.sample_size(20);
    let ids: Vec<u64> = (0..SEQS as u64).collect();
    let input_ids = vec![1i32; SEQS * 2];
    for (name, context, sparse) in [("sparse_16k", 16384, true), ("dense_4k", 4096, false)] {
        let rt = runtime(context, sparse);
        g.throughput(Throughput::Elements(SEQS as u64));
        g.bench_function(BenchmarkId::new(name, SEQS), |b| {
            b.iter_batched_ref(
                || rt.clone(),
                |rt| black_box(rt.plan(&ids, &input_ids).expect("plan").arena().len()),
                BatchSize::NumIterations(8),
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
