//! The launch wrappers' CPU-side checks, no GPU needed: the tile, split and shared-memory sizing
//! and the size checks of `ops/mod.rs`, the entry names, and the kernel sources against the
//! wrappers (launch constants and limits as their `#define`s, tensor-core variants registered,
//! CSR rows checked in every kernel that reads one).

use super::*;

#[test]
fn codes_tile_shrinks_for_small_batches_only() {
    // The H200 (132 SMs), 8 KV heads, 160 candidates per sequence.
    let tile = |seqs: usize| score_codes_tile(seqs * 160, 8, 132);
    assert_eq!(tile(64), 32); // 2560 warps of 32 entries: enough
    assert_eq!(tile(32), 16);
    assert_eq!(tile(16), 8);
    assert_eq!(tile(1), 8); // never below 8
    for (n, h, sms) in [
        (0, 0, 0),
        (usize::MAX, usize::MAX, usize::MAX),
        (1, 1, 1),
        (7, 3, 0),
    ] {
        let t = score_codes_tile(n, h, sms);
        assert!([8, 16, 32].contains(&t), "{n} {h} {sms}: {t}");
    }
    // The tile chosen gives the warps asked for whenever some tile does.
    for n in [100, 1000, 5000, 20000, 100000] {
        let t = score_codes_tile(n, 8, 132);
        let want = SCORE_CODES_WARPS_PER_SM * 132;
        assert!(n.div_ceil(t) * 8 >= want || t == 8, "{n}: {t}");
        assert!(
            t == SCORE_CODES_TILE || n.div_ceil(t * 2) * 8 < want,
            "{n}: {t} is shorter than needed"
        );
    }
}

#[test]
fn split_planning() {
    // One long sequence, 8 KV heads, 132 SMs (264 block slots): 30 splits fill 240 of them
    // (over 90%), 4096 pages allow that.
    assert_eq!(plan_num_splits(132, 1, 8, 4096), 30);
    // Batch 16 at 16K tokens: 128 blocks fill half the slots, 2 splits fill 256 of 264
    // (3 would leave a second wave 45% full).
    assert_eq!(plan_num_splits(132, 16, 8, 1024), 2);
    // 300 blocks: a second wave 14% full unsplit; 4 splits give 1200 blocks in 5 waves.
    assert_eq!(plan_num_splits(132, 300, 1, 129), 4);
    // Short sequences never split below MIN_PAGES_PER_SPLIT pages.
    assert_eq!(plan_num_splits(132, 1, 8, 10), 1);
    assert_eq!(plan_num_splits(132, 1, 8, 16), 2);
    // A big batch fills the device alone.
    assert_eq!(plan_num_splits(132, 64, 8, 4096), 1);
    assert!(plan_num_splits(10_000, 1, 1, usize::MAX / 2) <= MAX_SPLITS);
}

/// Any arguments plan a count in 1..=MAX_SPLITS: no overflow, no division by zero (the
/// planner is reachable from Python with arbitrary integers).
#[test]
fn split_planning_is_total() {
    let big = [
        0,
        1,
        7,
        132,
        1 << 40,
        usize::MAX / 2,
        usize::MAX - 1,
        usize::MAX,
    ];
    for &sms in &big {
        for &seqs in &big {
            for &heads in &[0, 1, 8, usize::MAX] {
                for &pages in &big {
                    let n = plan_num_splits(sms, seqs, heads, pages);
                    assert!(
                        (1..=MAX_SPLITS).contains(&n),
                        "plan_num_splits({sms}, {seqs}, {heads}, {pages}) = {n}"
                    );
                }
            }
        }
    }
}

#[test]
fn workspace_len_saturates() {
    assert_eq!(
        decode_attn_workspace_len(3, 2, 4, 64, 5),
        3 * 2 * 4 * 5 * 65
    );
    assert_eq!(decode_attn_workspace_len(0, 2, 4, 64, 5), 0);
    assert_eq!(
        decode_attn_workspace_len(1 << 40, 1 << 20, 64, 128, 256),
        usize::MAX
    );
    assert_eq!(
        decode_attn_workspace_len(1, 1, 1, usize::MAX, 2),
        usize::MAX
    );
}

/// The text of a header of [`crate::kernels::HEADERS`] (named with its extension).
fn header(name: &str) -> &'static str {
    crate::kernels::HEADERS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("{name} is not in kernels::HEADERS"))
        .1
}

/// Every kernel that reads a CSR table checks its rows in the kernel (the wrappers pass the
/// indices' length as `nnz`): a malformed table reads as empty rows, never out of bounds.
#[test]
fn csr_tables_are_checked_in_the_kernels() {
    let (_, common) = crate::kernels::HEADERS[0];
    assert!(common.contains("bool csr_row("));
    for (source, uses) in [
        // The generic kernel; the tensor-core one is in oasis_attn_tc.cuh (below).
        ("decode_attn", 1),
        // topk_blocks, force_scores.
        ("score_blocks", 2),
        ("gather_blocks", 1),
    ] {
        let src = crate::kernels::source(source).unwrap().source;
        assert_eq!(src.matches("csr_row(").count(), uses, "{source}");
        assert!(src.contains("int nnz"), "{source} takes no nnz");
    }
    // topk_candidates_impl (oasis_topk.cuh) only bounds successors by its rows' lengths: its
    // launches pass i32::MAX, a malformed row reads as empty.
    let (_, topk) = crate::kernels::HEADERS[2];
    assert_eq!(topk.matches("csr_row(").count(), 1);
    assert!(topk.contains("int nnz"));
    let (name, tc) = crate::kernels::HEADERS[3];
    assert_eq!(name, "oasis_attn_tc.cuh");
    assert_eq!(tc.matches("csr_row(").count(), 1);
    assert!(tc.contains("int nnz"));
    // score_blocks checks its rows inline (it walks them rather than indexing one).
    let src = crate::kernels::source("score_blocks").unwrap().source;
    assert_eq!(src.matches("seq_end <= nnz").count(), 1);
    assert_eq!(src.matches("row_e <= nnz").count(), 1);
    // So do key_codes.cu's scores (score_blocks_codes_impl, rescore_topk_codes_impl), in
    // oasis_codes_tc.cuh.
    let codes = header("oasis_codes_tc.cuh");
    assert!(codes.contains("row_e <= nnz"), "key_codes checks its rows");
    assert!(codes.contains("int nnz"), "key_codes takes no nnz");
}

#[test]
fn tensor_core_variants() {
    // Qwen3-8B shapes: head_dim 128, 3 stages of 8 KiB per warp, two blocks per SM fit the
    // 227 KiB of an H100/H200.
    assert_eq!(decode_attn_tc_stages(128), Some(3));
    let b = decode_attn_tc_smem_bytes(128, 3);
    assert_eq!(b, 4 * 3 * 8192 + 8 * 513 + 512 + 144);
    assert!(DECODE_TC_BLOCKS_PER_SM * (b + 1024) <= 227 * 1024);
    assert!(decode_attn_tc_smem_bytes(256, 2) <= 227 * 1024);
    assert_eq!(decode_attn_tc_stages(96), None);
    assert_eq!(
        decode_attn_tc_entry::<half::bf16>(64),
        Some(("decode_attn_tc_bf16_d64", 4))
    );
    assert_eq!(decode_attn_tc_entry::<f32>(128), None);
    let src = crate::kernels::source("decode_attn").unwrap().source;
    let (_, tc) = crate::kernels::HEADERS[3];
    assert!(tc.contains(&format!("#define OASIS_TC_LIST_CAP {DECODE_TC_LIST_CAP}\n")));
    // The launch gives it DECODE_THREADS threads: 4 warps.
    assert!(tc.contains("#define OASIS_TC_WARPS 4\n"));
    assert_eq!(DECODE_THREADS, 4 * 32);
    for d in [64, 128, 256] {
        let st = decode_attn_tc_stages(d).unwrap();
        for (t, ty) in [("bf16", "bf16"), ("f16", "f16")] {
            let inst = format!("(decode_attn_tc_{t}_d{d}, oasis::{ty}, {d}, {st})");
            assert!(src.contains(&inst), "{inst} not in decode_attn.cu");
        }
    }
    for d in [64, 128, 256] {
        for name in [
            decode_attn_tc_entry::<half::bf16>(d),
            decode_attn_tc_entry::<half::f16>(d),
        ] {
            let (name, _) = name.unwrap();
            assert!(
                crate::kernels::source_of(name).is_some(),
                "{name} not registered"
            );
        }
    }
}

#[test]
fn shared_memory_sizes() {
    // Qwen3-8B shapes, 2 rows: 8 query vectors, head_dim 128, a 32-token tile.
    let b = decode_attn_smem_bytes(8, 128, 32);
    assert_eq!(
        b,
        4 * (8 * 129 + 32 * 129 + 32 * 128 + 8 * 32 + 8 * 128 + 16)
    );
    assert!(b <= DECODE_SMEM_TARGET);
    assert_eq!(
        delta_select_smem_bytes(100, 20),
        8 * 128 + 4 * 128 + 4 * 100 + 4 * 32
    );
    assert!(delta_select_smem_bytes(MAX_SELECT_BUDGET, MAX_SELECT_BUDGET) <= 227 * 1024);
}

#[test]
fn sizes_and_limits() {
    assert_eq!(rows("x", 12, &[3, 2]).unwrap(), 2);
    assert!(rows("x", 13, &[3, 2]).is_err());
    assert!(rows("x", 0, &[0]).is_err());
    assert_eq!(csr_rows("p", 3).unwrap(), 2);
    assert!(csr_rows("p", 0).is_err());
    assert!(int("n", 1 << 31).is_err());
    assert!(grid_dim("y", 65536, GRID_YZ_MAX).is_err());
    assert_eq!(row_threads(64), 64);
    assert_eq!(row_threads(54), 64);
    assert_eq!(row_threads(256), ROW_THREADS);
    assert_eq!(row_threads(1), 32);
}

#[test]
fn entry_names_follow_the_dtype() {
    assert_eq!(entry!(half::bf16, "gather_blocks"), "gather_blocks_bf16");
    assert_eq!(entry!(half::f16, "gather_blocks"), "gather_blocks_f16");
    assert_eq!(entry!(f32, "gather_blocks"), "gather_blocks_f32");
    for name in [
        "append_kv_bf16",
        "decode_attn_f16",
        "merge_attn_states_f32",
        "score_blocks_bf16",
    ] {
        assert!(
            crate::kernels::source_of(name).is_some(),
            "{name} not registered"
        );
    }
}

/// The kernel-side limits are defined once (oasis_core::limits): NVRTC passes them to every
/// source, and no source defines them itself.
#[test]
fn limits_reach_the_kernels_as_defines() {
    let options = crate::nvrtc::compile_options("sm_90");
    for (name, value, source) in [
        ("OASIS_MAX_TOPK", MAX_TOPK, "score_blocks"),
        ("OASIS_CAND_MAX", MAX_CANDIDATES, "oasis_topk.cuh"),
        ("OASIS_MAX_SELECT_BUDGET", MAX_SELECT_BUDGET, "delta_select"),
    ] {
        assert!(
            options.contains(&format!("-D{name}={value}")),
            "{name}: {options:?}"
        );
        // A source, or a header (named with its extension).
        let src = crate::kernels::source(source).map_or_else(|| header(source), |s| s.source);
        assert!(
            src.contains(&format!("#ifndef {name}\n")),
            "{source} guards {name}"
        );
        for s in crate::kernels::SOURCES {
            assert!(
                !s.source.contains(&format!("#define {name} ")),
                "{} defines {name} again",
                s.file
            );
        }
    }
}

/// The launch constants repeated from the kernels' `#define`s agree with them.
#[test]
fn constants_match_the_kernel_sources() {
    // A source, or a header (named with its extension).
    let define = |source: &str, name: &str| -> usize {
        let src = crate::kernels::source(source).map_or_else(|| header(source), |s| s.source);
        let line = src
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap();
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    assert_eq!(
        define("score_blocks", "OASIS_SCORE_THREADS"),
        SCORE_THREADS as usize
    );
    assert_eq!(
        define("score_blocks", "OASIS_TOPK_THREADS"),
        TOPK_THREADS as usize
    );
    assert_eq!(
        define("delta_select", "OASIS_SELECT_THREADS"),
        SELECT_THREADS as usize
    );
    assert_eq!(define("score_blocks", "OASIS_SCORE_TILE"), SCORE_TILE);
    assert_eq!(
        define("key_codes", "OASIS_CODES_BUILD_THREADS"),
        CODES_BUILD_THREADS as usize
    );
    assert_eq!(
        define("key_codes", "OASIS_CODES_THREADS"),
        SCORE_CODES_THREADS as usize
    );
    assert_eq!(define("key_codes", "OASIS_CODES_TILE"), SCORE_CODES_TILE);
    assert_eq!(
        define("oasis_codes_tc.cuh", "OASIS_CODES_STAGES"),
        SCORE_CODES_STAGES
    );
    assert_eq!(
        define("oasis_codes_tc.cuh", "OASIS_RESCORE_TOPK_THREADS"),
        RESCORE_TOPK_THREADS as usize
    );
    assert_eq!(
        define("delta_select", "OASIS_SELECT_WARP_THREADS"),
        SELECT_WARP_THREADS as usize
    );
    assert_eq!(
        define("delta_select", "OASIS_SELECT_WARP_MAX"),
        SELECT_WARP_MAX
    );
    assert_eq!(
        define("gather_blocks", "OASIS_COPY_THREADS"),
        COPY_THREADS as usize
    );
    assert_eq!(
        define("norm_rope", "OASIS_QK_ROPE_WARPS"),
        QK_ROPE_WARPS as usize
    );
}

/// The 8-bit bound's MMA kernel serves only the head_dims it is instantiated for, with aligned
/// bounds (every other call takes the FMA kernel); it is the default, and every name is registered.
#[test]
fn bound8_score_kernel_choice() {
    use half::{bf16, f16};
    assert_eq!(bound8_score_kernel(), Bound8ScoreKernel::Mma);
    let src = crate::kernels::source("score_blocks").unwrap().source;
    for d in [64, 128, 256] {
        assert_eq!(
            score_bound8_entry::<bf16>(Bound8ScoreKernel::Mma, d, true),
            "score_blocks_bound8_tc_bf16"
        );
        assert!(src.contains(&format!("case {d}: score_bound8_tc<T, {d}>")));
        assert_eq!(
            score_bound8_entry::<f16>(Bound8ScoreKernel::Fma, d, true),
            "score_blocks_bound8_f16"
        );
        assert_eq!(
            score_bound8_entry::<f32>(Bound8ScoreKernel::Mma, d, false),
            "score_blocks_bound8_f32"
        );
    }
    assert_eq!(
        score_bound8_entry::<f32>(Bound8ScoreKernel::Mma, 96, true),
        "score_blocks_bound8_f32"
    );
    for name in [
        score_bound8_entry::<bf16>(Bound8ScoreKernel::Mma, 128, true),
        score_bound8_entry::<f16>(Bound8ScoreKernel::Mma, 128, true),
        score_bound8_entry::<f32>(Bound8ScoreKernel::Mma, 128, true),
    ] {
        assert!(crate::kernels::source_of(name).is_some(), "{name}");
    }
}
