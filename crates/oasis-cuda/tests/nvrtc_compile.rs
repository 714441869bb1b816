//! Every embedded kernel source compiles with NVRTC for sm_90, and compile errors come back as
//! errors with the compiler's log. Needs libnvrtc only, no GPU: `make test` points
//! OASIS_NVRTC_LIB at the copy from the pip package nvidia-cuda-nvrtc. Without libnvrtc these
//! tests fail (they do not skip): CI must prove the kernels compile.

use std::path::PathBuf;

use oasis_cuda::{
    compile_source, compile_with_cache, kernels, nvrtc_info, CudaError, KernelCache, NvrtcInfo,
};

const ARCH: &str = "sm_90";

fn require_nvrtc() -> NvrtcInfo {
    match nvrtc_info() {
        Ok(info) => info,
        Err(e) => panic!(
            "this test needs libnvrtc: set OASIS_NVRTC_LIB to libnvrtc.so.13 (pip install \
             nvidia-cuda-nvrtc, then <site-packages>/nvidia/cu13/lib/libnvrtc.so.13); `make test` \
             sets it to the virtualenv's copy.\n{e}"
        ),
    }
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("oasis-cuda-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    let info = require_nvrtc();
    println!(
        "nvrtc {}.{} from {}",
        info.version.0, info.version.1, info.library
    );
    let mut failures = Vec::new();
    for src in kernels::SOURCES {
        // No cache: this test is about the compiler accepting today's sources.
        match compile_with_cache(src.name, ARCH, &KernelCache::disabled()) {
            Ok(image) => {
                assert_eq!(&image[..4], b"\x7fELF", "{}: not a cubin", src.file);
                for entry in src.entry_points {
                    assert!(
                        contains(&image, entry.as_bytes()),
                        "{}: the registry lists {entry} but the cubin does not define it",
                        src.file
                    );
                }
                println!(
                    "{}: {} bytes, {} kernels",
                    src.file,
                    image.len(),
                    src.entry_points.len()
                );
            }
            Err(CudaError::Compile { kernel, log }) => failures.push(format!("{kernel}:\n{log}")),
            Err(e) => panic!("{}: {e}", src.file),
        }
    }
    assert!(
        failures.is_empty(),
        "NVRTC rejected {} source(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn a_broken_source_returns_the_compile_log() {
    require_nvrtc();
    let src = "#include \"oasis_common.cuh\"\n\
               extern \"C\" __global__ void broken_kernel(float* x) { x[0] = undeclared_thing; }\n";
    match compile_source("broken.cu", src, ARCH) {
        Err(CudaError::Compile { kernel, log }) => {
            assert_eq!(kernel, "broken.cu");
            assert!(
                log.contains("undeclared_thing"),
                "the log does not name the error:\n{log}"
            );
            assert!(log.contains("error"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn a_source_may_include_only_the_shared_header() {
    require_nvrtc();
    let src = "#include \"not_a_header.cuh\"\n";
    assert!(matches!(
        compile_source("include.cu", src, ARCH),
        Err(CudaError::Compile { .. })
    ));
}

#[test]
fn compiled_images_are_cached_by_content() {
    require_nvrtc();
    let dir = TempDir::new("cache");
    let cache = KernelCache::at(&dir.0);
    let first = compile_with_cache("delta_select", ARCH, &cache).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].to_string_lossy().into_owned();
    assert!(
        name.starts_with("delta_select-sm_90-") && name.ends_with(".cubin"),
        "{name}"
    );
    // A second compile is served from the file: prove it by planting different bytes there.
    std::fs::write(dir.0.join(&name), b"planted").unwrap();
    assert_eq!(
        compile_with_cache("delta_select", ARCH, &cache).unwrap(),
        b"planted"
    );
    // Another arch is another entry.
    let other = compile_with_cache("delta_select", "sm_80", &cache).unwrap();
    assert_ne!(other, first);
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 2);
}

#[test]
fn compile_all_names_every_source() {
    require_nvrtc();
    let dir = TempDir::new("all");
    let all = oasis_cuda::compile_all_with_cache(ARCH, &KernelCache::at(&dir.0)).unwrap();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    let expected: Vec<&str> = kernels::SOURCES.iter().map(|s| s.name).collect();
    assert_eq!(names, expected);
    assert!(all.iter().all(|(_, size)| *size > 0));
}

#[test]
fn compute_arch_gives_ptx() {
    require_nvrtc();
    let ptx = compile_with_cache("gather_blocks", "compute_90", &KernelCache::disabled()).unwrap();
    assert_eq!(
        ptx.last(),
        Some(&0),
        "PTX for cuModuleLoadData must be NUL-terminated"
    );
    let text = String::from_utf8_lossy(&ptx);
    assert!(
        text.contains(".target sm_90") && text.contains("gather_blocks_bf16"),
        "{text:.200}"
    );
}

#[test]
fn bad_names_and_old_archs_are_errors() {
    require_nvrtc();
    assert!(matches!(
        compile_with_cache("no_such_kernel", ARCH, &KernelCache::disabled()),
        Err(CudaError::UnknownKernel(_))
    ));
    assert!(matches!(
        compile_with_cache("gather_blocks", "sm_70", &KernelCache::disabled()),
        Err(CudaError::UnsupportedArch { major: 7, minor: 0 })
    ));
}

/// Every file of cuda/ is embedded, and every entry point the registry lists is defined in its
/// source (by name, in an `extern "C"` definition or a macro instantiation).
#[test]
fn the_registry_covers_cuda_dir() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../cuda");
    for e in std::fs::read_dir(&dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".cu") {
            let src = kernels::SOURCES.iter().find(|s| s.file == name);
            let src = src.unwrap_or_else(|| panic!("cuda/{name} is not in kernels::SOURCES"));
            assert_eq!(
                src.source,
                std::fs::read_to_string(dir.join(&name)).unwrap()
            );
        } else if name.ends_with(".cuh") {
            assert!(
                kernels::HEADERS.iter().any(|(n, _)| *n == name),
                "cuda/{name} is not in kernels::HEADERS"
            );
        }
    }
    for src in kernels::SOURCES {
        for entry in src.entry_points {
            assert!(
                src.source.contains(&format!("({entry},"))
                    || src.source.contains(&format!(" {entry}(")),
                "{entry} is not defined in {}",
                src.file
            );
        }
    }
}
