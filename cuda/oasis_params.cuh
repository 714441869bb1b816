// oasis_params.cuh — the launch parameters of every OasisKV kernel: one struct per kernel family,
// passed by value as the kernel's only parameter:
//
//     extern "C" __global__ void k(const __grid_constant__ FooParams<T> p)
//
// `__grid_constant__` (sm_70+) lets the kernel read the fields in place from the parameter bank
// instead of copying the struct to local memory first; the entry points only unpack the fields
// into the `*_impl` device functions, whose code did not change when the parameters became
// structs. The launch copies the struct's bytes (at most 4 KiB of kernel parameters).
//
// Each struct is mirrored field for field by a `#[repr(C)]` struct of oasis_cuda::params, which
// the launch wrappers fill. The two must have the same layout: the Rust test
// crates/oasis-cuda/tests/params_layout.rs compiles this header with NVRTC and compares sizeof,
// alignof and every field's offsetof, size and kind with std::mem::size_of / offset_of!, and
// checks that every entry point takes exactly its struct. So: add, remove or reorder a field here
// and in params.rs together, and run `make test-rust`.
//
// Rules that keep the layout the same in both languages:
// - only 8-byte pointers (`const T*` / `T*`, a u64 `DevPtr` in Rust), `int` (i32), `long long`
//   (i64) and `float` (f32) fields;
// - pointers first, then 8-byte scalars, then 4-byte ones;
// - no implicit padding: a struct whose 4-byte fields leave its size off a multiple of 8 ends
//   with an explicit `int _pad0` (Rust: `_pad0: i32`, always 0).
// A pointer field carries its shape; null is allowed only where its comment says so.
//
// Plain C++ with no include (the kernels' storage types are template parameters), so that a
// probe program can include it alone.
#pragma once

namespace oasis {

// append_kv_* (cuda/append_kv.cu): one token per sequence into its page, written through to the
// host pool and the summaries for sparse sequences.
template <typename T>
struct AppendKvParams {
    const T* k_new;            // [num_seqs, num_kv_heads, head_dim]
    const T* v_new;            // [num_seqs, num_kv_heads, head_dim]
    const int* page_ids;       // [num_seqs]
    const int* page_offsets;   // [num_seqs] 0..block_size
    const int* host_block_ids; // [num_seqs] < 0 = dense (no write-through)
    const int* host_rows;      // [num_seqs] host row of the write-through, or null (row = id)
    T* k_pages;                // [num_pages, num_kv_heads, block_size, head_dim]
    T* v_pages;                // [num_pages, num_kv_heads, block_size, head_dim]
    T* host_k;                 // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* host_v;                 // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* summaries;              // [num_host_blocks, num_kv_heads, 2, head_dim] row 0 min, row 1 max
    int num_kv_heads;
    int head_dim;
    int block_size;
    int num_pages;
    int num_host_blocks;
    int num_host_rows;
};

// build_summaries_* (cuda/append_kv.cu): min/max summaries of whole host blocks.
template <typename T>
struct BuildSummariesParams {
    const T* host_k;       // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const int* block_ids;  // [n]
    const int* block_rows; // [n] host row of each block, or null (row = id)
    const int* block_lens; // [n] 1..=block_size
    T* summaries;          // [num_host_blocks, num_kv_heads, 2, head_dim]
    int num_kv_heads;
    int head_dim;
    int block_size;
    int num_host_blocks;
    int num_host_rows;
    int _pad0;
};

// decode_attn_* and decode_attn_tc_* (cuda/decode_attn.cu; the tensor-core kernels ignore
// head_dim, a template parameter there, and tile_tokens).
template <typename T>
struct DecodeAttnParams {
    const T* q;                  // [num_seqs, num_rows, num_qo_heads, head_dim]
    const T* k_pages;            // [num_pages, num_kv_heads, block_size, head_dim]
    const T* v_pages;            // [num_pages, num_kv_heads, block_size, head_dim]
    const int* kv_indptr;        // [num_seqs + 1] CSR over kv_indices
    const int* kv_indices;       // [nnz] GPU page ids, in sequence order
    const int* kv_last_page_len; // [num_seqs] 1..=block_size valid tokens of the last page
    const int* page_map;         // [num_pages, num_kv_heads] logical block held, < 0 empty; or null
    const T* extra_k;            // [num_seqs, num_kv_heads, head_dim] or null
    const T* extra_v;            // [num_seqs, num_kv_heads, head_dim] or null
    T* out;                      // [num_seqs, num_rows, num_qo_heads, head_dim] (num_splits == 1)
    float* tmp_out;              // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] (num_splits > 1; else null)
    float* tmp_lse;              // [num_seqs, num_rows, num_qo_heads, num_splits] (num_splits > 1; else null)
    int num_rows;
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;
    int block_size;
    int num_pages;
    int nnz;                     // kv_indices' length: every kv_indptr row is checked against it
    int num_splits;
    int tile_tokens;             // 1..=32 (generic kernel); 0 for the tensor-core kernels
    float sm_scale;
};

// merge_attn_states_* (cuda/decode_attn.cu): the split-KV merge.
template <typename T>
struct MergeAttnStatesParams {
    const float* tmp_out; // [num_heads_total, num_splits, head_dim]
    const float* tmp_lse; // [num_heads_total, num_splits]
    T* out;               // [num_heads_total, head_dim]
    int num_splits;
    int head_dim;
};

// score_blocks_* (cuda/score_blocks.cu): Quest scores of every listed block summary.
template <typename T>
struct ScoreBlocksParams {
    const T* q;             // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const T* summaries;     // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* blk_indptr;  // [num_seqs + 1]
    const int* blk_indices; // [nnz] host block of each logical block, logical order
    float* scores;          // [nnz, num_kv_heads]
    int num_seqs;
    int nnz;
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;
    int num_host_blocks;
};

// score_blocks_bound8_* (cuda/score_blocks.cu): Quest scores over the 8-bit (E4M3, outward
// rounded) bounds, times each row's scale (oasis_core::kernels::bound8).
template <typename T>
struct ScoreBlocksBound8Params {
    const T* q;                   // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3 bits
    const float* scales;          // [num_host_blocks, num_kv_heads] (a power of two, or NaN)
    const int* blk_indptr;        // [num_seqs + 1]
    const int* blk_indices;       // [nnz] host block of each logical block, logical order
    float* scores;                // [nnz, num_kv_heads]
    int num_seqs;
    int nnz;
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;
    int num_host_blocks;
};

// build_bounds8_* (cuda/key_codes.cu): the 8-bit bounds of whole host blocks from their summaries.
template <typename T>
struct BuildBounds8Params {
    const T* summaries;     // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* block_ids;   // [n] host blocks (complete blocks)
    unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim]
    float* scales;          // [num_host_blocks, num_kv_heads]
    int n;
    int num_kv_heads;
    int head_dim;
    int num_host_blocks;
};

// build_key_codes_* (cuda/key_codes.cu): 2-bit codes of every key of whole host blocks, inside
// each block's decoded 8-bit bound (e4m3_decode(bounds8) * scales, built first by build_bounds8).
template <typename T>
struct BuildKeyCodesParams {
    const T* host_k;              // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3 bits, row 0 min, row 1 max
    const float* scales;          // [num_host_blocks, num_kv_heads] (a power of two, or NaN)
    const int* block_ids;         // [n] host blocks to encode (complete blocks)
    const int* block_rows;        // [n] host row of each block, or null (row = id)
    unsigned char* codes;         // [num_host_blocks, num_kv_heads, block_size, head_dim / 4] channel 4i+j in bits 2j..2j+2 of byte i
    int n;
    int num_kv_heads;
    int head_dim;                 // a multiple of 4
    int block_size;
    int num_host_blocks;
    int num_host_rows;
};

// encode_blocks_* (cuda/key_codes.cu): build_bounds8 then build_key_codes of the same blocks in one
// launch (the codes inside the bound the launch writes).
template <typename T>
struct EncodeBlocksParams {
    const T* host_k;        // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const T* summaries;     // [num_host_blocks, num_kv_heads, 2, head_dim] row 0 min, row 1 max
    const int* block_ids;   // [n] host blocks to encode (complete blocks)
    const int* block_rows;  // [n] host row of each block, or null (row = id)
    unsigned char* codes;   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim]
    float* scales;          // [num_host_blocks, num_kv_heads]
    int n;
    int num_kv_heads;
    int head_dim;           // a multiple of 4
    int block_size;
    int num_host_blocks;
    int num_host_rows;
};

// score_blocks_codes_* (cuda/key_codes.cu): the largest approximate logit of each listed block,
// from its 2-bit key codes, summed over the GQA group.
template <typename T>
struct ScoreBlocksCodesParams {
    const T* q;                   // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3 bits
    const float* scales;          // [num_host_blocks, num_kv_heads] (a power of two, or NaN)
    const unsigned char* codes;   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    const int* blk_indptr;        // [num_seqs + 1]
    const int* blk_indices;       // [nnz] host block of each logical block, logical order
    float* scores;                // [nnz, num_kv_heads]; with cand: [num_seqs * cand_m, num_kv_heads]
    const int* cand;              // [num_seqs, num_kv_heads, cand_m] logical blocks (< 0: none), or null
    int num_seqs;
    int nnz;                      // blk_indices' length: every blk_indptr row is checked against it
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;                 // a multiple of 4
    int block_size;
    int num_host_blocks;
    int cand_m;                   // candidates per (sequence, KV head) with cand; 0 without
    int tile;                     // entries per warp, 1..OASIS_CODES_TILE (clamped): the launch's
                                  // choice, smaller for a small batch so that more warps run
    int _pad0;
};

// topk_blocks_f32 (cuda/score_blocks.cu).
struct TopkBlocksParams {
    float* scores;         // [nnz, num_kv_heads]; written only with `forced`
    const int* blk_indptr; // [num_seqs + 1]; a malformed row has no blocks
    int* out;              // [num_seqs, num_kv_heads, k]
    const int* index_map;  // [num_seqs, num_kv_heads, map_m]: out holds index_map[s, h, i]; or null
    const int* forced;     // [num_seqs, num_kv_heads, n_forced]: set to +inf in scores first; or null
    int num_kv_heads;
    int nnz;
    int k;
    int map_m;             // index_map's last dimension; a position at or past it gives -1
    int n_forced;
    int _pad0;
};

// force_scores_f32 (cuda/score_blocks.cu).
struct ForceScoresParams {
    float* scores;         // [nnz, num_kv_heads], the forced entries set to +inf in place
    const int* blk_indptr; // [num_seqs + 1]
    const int* forced;     // [num_seqs, num_kv_heads, n_forced]
    int num_seqs;
    int num_kv_heads;
    int nnz;
    int n_forced;
};

// topk_candidates_f32 (cuda/score_blocks.cu).
struct TopkCandidatesParams {
    const float* scores;   // [num_seqs * m, num_kv_heads]
    const int* cand;       // [num_seqs, num_kv_heads, m]
    const int* blk_indptr; // [num_seqs + 1]: the requests' rows
    const int* forced;     // [num_seqs, num_kv_heads, n_forced], or null
    int* out;              // [num_seqs, num_kv_heads, k]
    int num_kv_heads;
    int nnz;               // blk_indptr's last entry bound
    int m;
    int k;
    int successors;
    int n_forced;
};

// rescore_topk_codes_* (cuda/key_codes.cu): score_blocks_codes_*'s scores of the candidates and
// topk_candidates_f32's selection over them, in one launch (the last of each row's blocks selects).
template <typename T>
struct RescoreTopkCodesParams {
    const T* q;                   // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const unsigned char* bounds8; // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3 bits
    const float* scales;          // [num_host_blocks, num_kv_heads] (a power of two, or NaN)
    const unsigned char* codes;   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    const int* blk_indptr;        // [num_seqs + 1]
    const int* blk_indices;       // [nnz] host block of each logical block, logical order
    const int* cand;              // [num_seqs, num_kv_heads, m] logical blocks (< 0: none)
    const int* forced;            // [num_seqs, num_kv_heads, n_forced], or null
    int* out;                     // [num_seqs, num_kv_heads, k]
    float* scratch;               // [num_seqs, num_kv_heads, m] the candidates' scores
    int* counters;                // [num_seqs, num_kv_heads] zero before the launch (and after it)
    int nnz;                      // blk_indices' length: the candidates' rows are checked against it
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;                 // a multiple of 4
    int block_size;
    int num_host_blocks;
    int m;                        // candidates per (sequence, KV head)
    int k;
    int successors;
    int n_forced;
    int tile;                     // candidates per warp (1..OASIS_CODES_TILE); gridDim.z blocks per row
    int _pad0;
};

// delta_select_i32 and delta_select_warp_i32 (cuda/delta_select.cu; only the warp kernel reads
// num_seqs, the other has one thread block per (sequence, KV head)).
struct DeltaSelectParams {
    const int* predicted;    // [num_seqs, num_kv_heads, num_pred] logical blocks, best first, < 0 = none
    const int* slot_pages;   // [num_seqs, budget] GPU page of each slot
    int* page_map;           // [num_pages, num_kv_heads] logical block held, < 0 = empty
    int* page_last_selected; // [num_pages, num_kv_heads] step last selected
    int* plan_slots;         // [num_seqs, num_kv_heads, fetch_cap] victim slot or -1
    int* plan_blocks;        // [num_seqs, num_kv_heads, fetch_cap] missing block or -1
    int* stats;              // [num_seqs, num_kv_heads, 3] (pairs, kept, missing) or null
    const int* step_now;     // [1] the step, read on the device (a captured CUDA graph), or null: `step`
    int num_kv_heads;
    int num_pred;
    int budget;
    int num_pages;
    int step;
    int fetch_cap;
    int num_seqs;
    int _pad0;
};

// gather_blocks_* (cuda/gather_blocks.cu): a selection plan, host pool -> GPU slots.
template <typename T>
struct GatherBlocksParams {
    const int* plan_slots;   // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
    const int* plan_blocks;  // [num_seqs, num_kv_heads, fetch_cap] logical block
    const int* slot_pages;   // [num_seqs, budget]
    const int* host_indptr;  // [num_seqs + 1] CSR over host_indices, checked per row
    const int* host_indices; // [nnz] host block of each logical block of each sequence
    const T* host_k;         // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host, UVA
    const T* host_v;         // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* k_pages;              // [num_pages, num_kv_heads, block_size, head_dim]
    T* v_pages;              // [num_pages, num_kv_heads, block_size, head_dim]
    int num_kv_heads;
    int fetch_cap;
    int budget;
    int block_size;
    int head_dim;
    int num_pages;
    int num_host_blocks;
    int nnz;
    int num_seqs;
    int entries_per_warp;  // plan entries one warp checks per pass, 1-32
    int stage_entries;     // entries a warp stages in shared memory at once; 0: through registers
    int _pad0;
};

// copy_pages_* (cuda/gather_blocks.cu): whole pages between two pools of one page geometry.
template <typename T>
struct CopyPagesParams {
    const T* src_k;       // [num_src_pages, num_kv_heads, block_size, head_dim]
    const T* src_v;       // [num_src_pages, num_kv_heads, block_size, head_dim]
    const int* src_ids;   // [n]
    T* dst_k;             // [num_dst_pages, num_kv_heads, block_size, head_dim] (may be pinned host, UVA)
    T* dst_v;             // [num_dst_pages, num_kv_heads, block_size, head_dim]
    const int* dst_ids;   // [n]
    long long page_elems; // num_kv_heads * block_size * head_dim
    int num_src_pages;
    int num_dst_pages;
};

// ---- kv8 pages (FP8 E4M3 codes + f32 power-of-two scales per (page, KV head), K and V apart;
// oasis_core::kernels::kv8). A tier buffer whose type depends on the kernel (T pages or codes) is
// untyped here; its scales are null for a T tier.

// append_kv_<gpu>_<host>_* (cuda/append_kv.cu): append_kv with each tier T pages or kv8 pages.
template <typename T>
struct AppendKvTiersParams {
    const T* k_new;            // [num_seqs, num_kv_heads, head_dim]
    const T* v_new;            // [num_seqs, num_kv_heads, head_dim]
    const int* page_ids;       // [num_seqs]
    const int* page_offsets;   // [num_seqs] 0..block_size
    const int* host_block_ids; // [num_seqs] < 0 = dense (no write-through)
    const int* host_rows;      // [num_seqs] host row of the write-through, or null (row = id)
    void* k_pages;             // [num_pages, num_kv_heads, block_size, head_dim] T or codes
    void* v_pages;             // [num_pages, num_kv_heads, block_size, head_dim] T or codes
    float* k_scales;           // [num_pages, num_kv_heads] kv8 GPU tier; null for T
    float* v_scales;           // [num_pages, num_kv_heads] kv8 GPU tier; null for T
    void* host_k;              // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    void* host_v;              // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    float* host_k_scales;      // [num_host_rows, num_kv_heads] kv8 host tier; null for T
    float* host_v_scales;      // [num_host_rows, num_kv_heads] kv8 host tier; null for T
    T* summaries;              // [num_host_blocks, num_kv_heads, 2, head_dim] row 0 min, row 1 max
    int num_kv_heads;
    int head_dim;
    int block_size;
    int num_pages;
    int num_host_blocks;
    int num_host_rows;
};

// gather_blocks_kv8, gather_blocks_<host>_<gpu>_* (cuda/gather_blocks.cu): gather_blocks with
// either tier kv8.
struct GatherBlocksTiersParams {
    const int* plan_slots;      // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
    const int* plan_blocks;     // [num_seqs, num_kv_heads, fetch_cap] logical block
    const int* slot_pages;      // [num_seqs, budget]
    const int* host_indptr;     // [num_seqs + 1] CSR over host_indices, checked per row
    const int* host_indices;    // [nnz] host block of each logical block of each sequence
    const void* host_k;         // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host, UVA
    const void* host_v;         // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host, UVA
    const float* host_k_scales; // [num_host_blocks, num_kv_heads] kv8 host tier; null for T
    const float* host_v_scales; // [num_host_blocks, num_kv_heads] kv8 host tier; null for T
    void* k_pages;              // [num_pages, num_kv_heads, block_size, head_dim]
    void* v_pages;              // [num_pages, num_kv_heads, block_size, head_dim]
    float* k_scales;            // [num_pages, num_kv_heads] kv8 GPU tier; null for T
    float* v_scales;            // [num_pages, num_kv_heads] kv8 GPU tier; null for T
    int num_kv_heads;
    int fetch_cap;
    int budget;
    int block_size;
    int head_dim;
    int num_pages;
    int num_host_blocks;
    int nnz;
    int num_seqs;
    int entries_per_warp;  // plan entries one warp checks per pass, 1-32
    int stage_entries;     // gather_blocks_kv8: entries a warp stages in shared memory; 0: registers
    int _pad0;
};

// copy_pages_kv8, copy_pages_<src>_<dst>_* (cuda/gather_blocks.cu): copy_pages with either pool kv8.
struct CopyPagesTiersParams {
    const void* src_k;         // [num_src_pages, num_kv_heads, block_size, head_dim]
    const void* src_v;         // [num_src_pages, num_kv_heads, block_size, head_dim]
    const float* src_k_scales; // [num_src_pages, num_kv_heads] kv8 source; null for T
    const float* src_v_scales; // [num_src_pages, num_kv_heads] kv8 source; null for T
    const int* src_ids;        // [n]
    void* dst_k;               // [num_dst_pages, num_kv_heads, block_size, head_dim] (may be pinned host, UVA)
    void* dst_v;               // [num_dst_pages, num_kv_heads, block_size, head_dim]
    float* dst_k_scales;       // [num_dst_pages, num_kv_heads] kv8 destination; null for T
    float* dst_v_scales;       // [num_dst_pages, num_kv_heads] kv8 destination; null for T
    const int* dst_ids;        // [n]
    const int* valid;          // [n] 1..=block_size rows of src page i (T -> kv8 only), or null (all)
    int num_kv_heads;
    int block_size;
    int head_dim;
    int num_src_pages;
    int num_dst_pages;
    int _pad0;
};

// quantize_kv8_* (cuda/gather_blocks.cu): whole-block quantization of one array (K or V).
template <typename T>
struct QuantizeKv8Params {
    const T* src;         // [n, num_kv_heads, block_size, head_dim]
    const int* valid;     // [n] 1..=block_size
    unsigned char* codes; // [n, num_kv_heads, block_size, head_dim]
    float* scales;        // [n, num_kv_heads]
    int num_kv_heads;
    int block_size;
    int head_dim;
    int _pad0;
};

// decode_attn_kv8_* and decode_attn_kv8_tc_* (cuda/decode_attn.cu): DecodeAttnParams over kv8 pages.
template <typename T>
struct DecodeAttnKv8Params {
    const T* q;                     // [num_seqs, num_rows, num_qo_heads, head_dim]
    const unsigned char* k_codes;   // [num_pages, num_kv_heads, block_size, head_dim] E4M3
    const unsigned char* v_codes;   // [num_pages, num_kv_heads, block_size, head_dim] E4M3
    const float* k_scales;          // [num_pages, num_kv_heads]
    const float* v_scales;          // [num_pages, num_kv_heads]
    const int* kv_indptr;           // [num_seqs + 1] CSR over kv_indices
    const int* kv_indices;          // [nnz] GPU page ids, in sequence order
    const int* kv_last_page_len;    // [num_seqs] 1..=block_size
    const int* page_map;            // [num_pages, num_kv_heads] or null (every entry valid)
    const T* extra_k;               // [num_seqs, num_kv_heads, head_dim] or null
    const T* extra_v;               // [num_seqs, num_kv_heads, head_dim] or null
    T* out;                         // [num_seqs, num_rows, num_qo_heads, head_dim]
    float* tmp_out;                 // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] or null
    float* tmp_lse;                 // [num_seqs, num_rows, num_qo_heads, num_splits] or null
    int num_rows;
    int num_qo_heads;
    int num_kv_heads;
    int head_dim;
    int block_size;
    int num_pages;
    int nnz;
    int num_splits;
    int tile_tokens;  // 1..=32 (generic kernel); 0 for the tensor-core kernels
    float sm_scale;
};

// rms_norm_* (cuda/norm_rope.cu): HF RMSNorm of rows, with an optional fused residual add.
template <typename T>
struct RmsNormParams {
    const T* x;            // [n, x_stride] rows of hidden elements (x_stride >= hidden)
    const T* weight;       // [hidden]
    const T* residual;     // [n, hidden] or null (no residual add)
    T* residual_out;       // [n, hidden], null exactly when residual is; may be residual itself
    T* out;                // [n, hidden]
    long long x_stride;    // elements between rows of x
    int hidden;
    float eps;
};

// silu_mul_* (cuda/norm_rope.cu): the MLP's silu(gate) * up over the fused gate/up projection.
template <typename T>
struct SiluMulParams {
    const T* gu;   // [n, 2 * inter]: gate columns, then up
    T* out;        // [n, inter]
    long long n;
    int inter;
    int _pad0;
};

// qk_norm_rope_* (cuda/norm_rope.cu): q, k, v from the fused QKV projection, with the optional
// per-head q/k RMSNorm and rotate-half RoPE.
template <typename T>
struct QkNormRopeParams {
    const T* qkv;                  // [n, qkv_stride] rows of (num_heads + 2 * num_kv_heads) * head_dim
    const long long* positions_i64; // [n] or null (then positions_i32)
    const int* positions_i32;      // [n] or null (then positions_i64)
    const float* inv_freq;         // [head_dim / 2]
    const T* q_norm;               // [head_dim] or null (no q/k norm)
    const T* k_norm;               // [head_dim], null exactly when q_norm is
    T* q_out;                      // [n, num_heads, head_dim]
    T* k_out;                      // [n, num_kv_heads, head_dim]
    T* v_out;                      // [n, num_kv_heads, head_dim]
    long long qkv_stride;          // elements between rows of qkv
    int num_heads;
    int num_kv_heads;
    int head_dim;                  // even
    float eps;                     // of the q/k norm
    int kv_groups;                 // >= 1: k_out, v_out rows grouped by row within groups of this many
    int num_rows;                  // n, a multiple of kv_groups
    float rope_scale;              // cos and sin times this (YaRN's attention factor; 1 otherwise)
    int _pad0;
};

// wait_stamp (cuda/wait_stamp.cu): the compute stream's waits on background work, timed.
struct WaitStampParams {
    unsigned long long* stamps;  // [3]: start of the current wait (ns), total waited (ns), waits
    int mode;                    // 0: a wait starts; else it ended
    int _pad0;
};

// wait_epoch (cuda/wait_stamp.cu): hold a stream until a layer's landed epoch reaches the step's.
struct WaitEpochParams {
    const unsigned long long* landed;  // host-mapped: the layer's landed epoch
    const long long* epoch;            // [1]: the step's epoch
    unsigned long long* stats;         // [4]: waits that gave up, the last one's epoch, ns held, waits
    long long timeout_ns;
};

}  // namespace oasis
