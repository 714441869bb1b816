//! Registers and stack per kernel of one source, as ptxas gives them for sm_90, without a GPU:
//! `OASIS_NVRTC_LIB=$(.venv/bin/python scripts/find_nvrtc.py) cargo run -q --release -p oasis-cuda
//! --example kernel_resources -- decode_attn` (a source name of `oasis_cuda::kernels`; every
//! source when left out).

use oasis_cuda::{compile_with_cache, cubin_resources, kernels, KernelCache};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    for src in kernels::SOURCES {
        if !wanted.is_empty() && !wanted.iter().any(|w| w == src.name) {
            continue;
        }
        let cubin = compile_with_cache(src.name, "sm_90", &KernelCache::disabled())?;
        for k in cubin_resources(&cubin)? {
            println!(
                "{:12} {:44} {:3} registers {:5} B stack",
                src.name, k.name, k.registers, k.stack_bytes
            );
        }
    }
    Ok(())
}
