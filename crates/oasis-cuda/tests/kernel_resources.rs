//! What ptxas gives the decode attention kernels (registers, stack), read from an sm_90 cubin on
//! a machine without a GPU ([`oasis_cuda::cubin_resources`]). A kernel change that makes a
//! tensor-core kernel spill at head_dim 64 or 128 fails here, before any GPU run. Needs libnvrtc
//! (`make test` sets OASIS_NVRTC_LIB), like tests/nvrtc_compile.rs.

use oasis_cuda::{compile_with_cache, cubin_resources, kernels, KernelCache};

#[test]
fn decode_attention_kernels_fit_their_registers_without_spills() {
    let cubin = compile_with_cache("decode_attn", "sm_90", &KernelCache::disabled())
        .expect("decode_attn compiles for sm_90 (libnvrtc: OASIS_NVRTC_LIB)");
    let res = cubin_resources(&cubin).expect("an sm_90 compile is a cubin");
    for k in &res {
        eprintln!(
            "{:40} {:3} registers, {:4} B stack",
            k.name, k.registers, k.stack_bytes
        );
    }
    let entries = kernels::source("decode_attn").unwrap().entry_points;
    for entry in entries {
        let k = res
            .iter()
            .find(|k| k.name == *entry)
            .unwrap_or_else(|| panic!("{entry}: no register count in the cubin"));
        assert!(k.registers > 0 && k.registers <= 255, "{k:?}");
        // Every tensor-core kernel (bf16 / f16 pages, kv8 tile, registers, registers-deep) keeps
        // its state in registers at head_dim 64 and 128: two blocks of 128 threads per SM, no
        // local memory. (At head_dim 256 the kv8 ones have a stack; measured on an H100 in s28.)
        let tensor_core = entry.contains("_tc");
        if tensor_core && (entry.ends_with("_d64") || entry.ends_with("_d128")) {
            assert_eq!(k.stack_bytes, 0, "{k:?} spills");
            assert!(k.registers * 128 * 2 <= 65536, "{k:?}: two blocks per SM");
        }
    }
    let tcr = res
        .iter()
        .find(|k| k.name == "decode_attn_kv8_tcr_bf16_d128")
        .unwrap();
    assert!(
        tcr.registers > 128,
        "{tcr:?}: the accumulators alone take 64 registers a thread"
    );
}
