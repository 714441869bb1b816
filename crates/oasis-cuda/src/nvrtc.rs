//! NVRTC: find the library, compile the embedded kernel sources, cache the images.
//!
//! # Finding libnvrtc without panicking
//!
//! cudarc opens libnvrtc lazily by *name* (`libnvrtc.so`, `libnvrtc.so.13`, ...) and panics when
//! none of its names resolves. So before the first cudarc call this module looks for the library
//! itself, in this order:
//!
//! 1. `$OASIS_NVRTC_LIB`: a file, or a directory holding one (when set, nothing else is tried);
//! 2. the dynamic loader's own search (`LD_LIBRARY_PATH`, the ld cache, a copy already loaded);
//! 3. the `nvidia/cu13/lib` (or CUDA 12 `nvidia/cuda_nvrtc/lib`) folder of the Python
//!    site-packages named by `$OASIS_PYTHON_SITE` (`:`-separated), `$VIRTUAL_ENV`,
//!    `$CONDA_PREFIX`, or mapped into this process already (PyTorch's own libraries);
//! 4. `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT` (`lib64/`, `lib/`).
//!
//! A library found by path is opened and kept open for the life of the process; the loader
//! then resolves cudarc's later open of `libnvrtc.so.13` to that copy, because a loaded object
//! answers to its soname. If even then cudarc cannot open it, the error says so.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

use crate::cache::KernelCache;
use crate::error::{guard, CudaError, Result};
use crate::kernels::{self, HEADERS, SOURCES};

/// Environment variable naming libnvrtc (a file or its directory).
pub const NVRTC_LIB_ENV: &str = "OASIS_NVRTC_LIB";

/// Library names the dynamic loader is asked for, newest first.
const SONAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Where the NVIDIA wheels put libnvrtc, relative to a site-packages directory.
const WHEEL_LIBS: &[&str] = &[
    "nvidia/cu13/lib/libnvrtc.so.13",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "nvidia/cu12/lib/libnvrtc.so.12",
];

/// Bumped whenever the way an image is built changes in a way the key does not see.
const CACHE_FORMAT: &str = "oasis-cuda-kernel-cache-v1";

/// Where libnvrtc was found and which version it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// The path that was opened, or the name the dynamic loader resolved.
    pub library: String,
    /// `(major, minor)` as reported by `nvrtcVersion`.
    pub version: (i32, i32),
}

static NVRTC: Mutex<Option<NvrtcInfo>> = Mutex::new(None);

/// Find and load libnvrtc (once per process; a failure is retried on the next call, so setting
/// `OASIS_NVRTC_LIB` afterwards helps).
///
/// # Errors
/// [`CudaError::NvrtcMissing`] listing every place searched.
pub fn nvrtc_info() -> Result<NvrtcInfo> {
    guard("nvrtc_info", || {
        let mut state = NVRTC.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(info) = state.as_ref() {
            return Ok(info.clone());
        }
        let info = load_nvrtc()?;
        *state = Some(info.clone());
        Ok(info)
    })
}

fn load_nvrtc() -> Result<NvrtcInfo> {
    let mut searched = Vec::new();
    let library = locate(&mut searched).ok_or_else(|| CudaError::NvrtcMissing {
        searched: searched.clone(),
    })?;
    // SAFETY: probing dlopen()s cudarc's candidate names and closes them again; the library we
    // keep open is NVRTC, whose initialisers are safe to run.
    if !unsafe { sys::is_culib_present() } {
        searched.push(format!(
            "{library} was opened but cudarc could not open it by name (its soname is not libnvrtc.so.12/13)"
        ));
        return Err(CudaError::NvrtcMissing { searched });
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both out-pointers are valid for writes; the library is loaded (checked above).
    check(
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    Ok(NvrtcInfo {
        library,
        version: (major, minor),
    })
}

/// Open libnvrtc from the first place that has it; record every miss in `searched`.
fn locate(searched: &mut Vec<String>) -> Option<String> {
    if let Some(v) = std::env::var_os(NVRTC_LIB_ENV).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        let files: Vec<PathBuf> = if p.is_dir() {
            SONAMES.iter().map(|n| p.join(n)).collect()
        } else {
            vec![p]
        };
        for f in files {
            if let Some(found) = open_path(&f, searched) {
                return Some(found);
            }
        }
        searched.push(format!(
            "(${NVRTC_LIB_ENV} is set, so nothing else was tried)"
        ));
        return None;
    }
    for name in SONAMES {
        // SAFETY: opening NVRTC runs its initialisers only, which are safe.
        match unsafe { libloading::Library::new(*name) } {
            // Dropping the handle is fine: cudarc opens the same name next.
            Ok(_) => return Some((*name).to_string()),
            Err(e) => searched.push(format!("{name} via the dynamic loader ({e})")),
        }
    }
    for dir in python_site_dirs() {
        for rel in WHEEL_LIBS {
            if let Some(found) = open_path(&dir.join(rel), searched) {
                return Some(found);
            }
        }
    }
    // A wheel layout not listed above (a later CUDA major): any `nvidia/*/lib/libnvrtc.so.N`,
    // highest N first, as scripts/find_nvrtc.py picks it for the Makefile.
    for dir in python_site_dirs() {
        for f in wheel_nvrtc_candidates(&dir.join("nvidia")) {
            if let Some(found) = open_path(&f, searched) {
                return Some(found);
            }
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        let Some(root) = std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
        else {
            searched.push(format!("${var} (unset)"));
            continue;
        };
        for sub in ["lib64", "lib"] {
            for name in SONAMES {
                if let Some(found) = open_path(&root.join(sub).join(name), searched) {
                    return Some(found);
                }
            }
        }
    }
    None
}

/// Every `ROOT/*/lib/libnvrtc.so.N` (or `.so.N.M`), highest major first; the
/// `libnvrtc-builtins` companion is never one.
fn wheel_nvrtc_candidates(root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = Vec::new();
    let Ok(pkgs) = std::fs::read_dir(root) else {
        return found.into_iter().map(|(_, p)| p).collect();
    };
    for pkg in pkgs.flatten() {
        let Ok(files) = std::fs::read_dir(pkg.path().join("lib")) else {
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("libnvrtc.so.")) else {
                continue;
            };
            let mut parts = rest.split('.');
            let major = parts.next().and_then(|m| m.parse::<u32>().ok());
            if let (Some(major), true) = (major, parts.all(|p| p.parse::<u32>().is_ok())) {
                found.push((major, f.path()));
            }
        }
    }
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    found.into_iter().map(|(_, p)| p).collect()
}

/// Open `path` and keep it open for the life of the process.
fn open_path(path: &Path, searched: &mut Vec<String>) -> Option<String> {
    if !path.is_file() {
        searched.push(format!("{} (absent)", path.display()));
        return None;
    }
    // SAFETY: opening NVRTC runs its initialisers only, which are safe.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            // Kept loaded on purpose: cudarc's later open by soname must find this copy.
            std::mem::forget(lib);
            Some(path.display().to_string())
        }
        Err(e) => {
            searched.push(format!("{} ({e})", path.display()));
            None
        }
    }
}

/// Python site-packages directories worth looking into, most specific first.
fn python_site_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("OASIS_PYTHON_SITE") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            dirs.extend(prefix_site_dirs(Path::new(&prefix)));
        }
    }
    // Libraries already mapped into this process (PyTorch's, numpy's, ours) name the
    // site-packages they came from.
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        for line in maps.lines() {
            let Some(path) = line.split_whitespace().nth(5) else {
                continue;
            };
            if let Some(i) = path.find("/site-packages/") {
                dirs.push(PathBuf::from(&path[..i + "/site-packages".len()]));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// `prefix/lib/python3.*/site-packages`.
fn prefix_site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

fn check(res: sys::nvrtcResult, what: &str) -> Result<()> {
    if res == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string (or null).
    let msg = unsafe {
        let p = sys::nvrtcGetErrorString(res);
        if p.is_null() {
            format!("{res:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(CudaError::Nvrtc(format!("{what}: {msg}")))
}

/// Parse `sm_90`, `sm_90a`, `compute_90` into (is_real, major*10+minor).
fn parse_arch(arch: &str) -> Result<(bool, u32)> {
    let (real, rest) = if let Some(r) = arch.strip_prefix("sm_") {
        (true, r)
    } else if let Some(r) = arch.strip_prefix("compute_") {
        (false, r)
    } else {
        return Err(CudaError::Unsupported(format!(
            "arch {arch:?}: expected sm_XY or compute_XY (e.g. sm_90)"
        )));
    };
    let digits = rest.trim_end_matches(['a', 'f']);
    match digits.parse::<u32>() {
        Ok(n) if digits.len() >= 2 => {
            if n < 80 {
                return Err(CudaError::UnsupportedArch {
                    major: (n / 10) as i32,
                    minor: (n % 10) as i32,
                });
            }
            Ok((real, n))
        }
        _ => Err(CudaError::Unsupported(format!(
            "arch {arch:?}: expected sm_XY or compute_XY (e.g. sm_90)"
        ))),
    }
}

/// The NVRTC options every kernel is compiled with, for `arch` (`"sm_90"`): the kernel-side
/// limits of [`oasis_core::limits`] arrive as `-D` defines
/// ([`KERNEL_DEFINES`](oasis_core::limits::KERNEL_DEFINES)), so the sources do not repeat them
/// (and are part of the cache key through the options).
pub fn compile_options(arch: &str) -> Vec<String> {
    let mut options = vec![
        "-std=c++17".to_string(),
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
        "-lineinfo".to_string(),
    ];
    options.extend(
        oasis_core::limits::KERNEL_DEFINES
            .iter()
            .map(|(name, value)| format!("-D{name}={value}")),
    );
    options
}

/// Compile `source` (with [`HEADERS`] available to `#include`) for `arch`, without the cache.
/// `name` is the program name shown in the log. Returns a cubin for `sm_XY`, NUL-terminated PTX
/// for `compute_XY`: both are what `cuModuleLoadData` takes.
///
/// # Errors
/// [`CudaError::NvrtcMissing`] when libnvrtc cannot be found, [`CudaError::Compile`] with the
/// compiler log when the source does not compile, [`CudaError::UnsupportedArch`] below sm_80.
pub fn compile_source(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    guard("compile_source", || {
        let (real, _) = parse_arch(arch)?;
        nvrtc_info()?;
        compile_loaded(name, source, &compile_options(arch), real)
    })
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| CudaError::Nvrtc(format!("{what} contains a NUL byte")))
}

/// Destroys the program on every exit path.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful nvrtcCreateProgram and is destroyed once.
        unsafe {
            let _ = sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn compile_loaded(name: &str, source: &str, options: &[String], real: bool) -> Result<Vec<u8>> {
    let src = cstring("kernel source", source)?;
    let prog_name = cstring("program name", name)?;
    let header_srcs = HEADERS
        .iter()
        .map(|(_, s)| cstring("header", s))
        .collect::<Result<Vec<_>>>()?;
    let header_names = HEADERS
        .iter()
        .map(|(n, _)| cstring("header name", n))
        .collect::<Result<Vec<_>>>()?;
    let header_src_ptrs: Vec<*const c_char> = header_srcs.iter().map(|s| s.as_ptr()).collect();
    let header_name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let opts = options
        .iter()
        .map(|o| cstring("option", o))
        .collect::<Result<Vec<_>>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut raw = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string (the CStrings above outlive the
    // call); the two header arrays have HEADERS.len() entries; `raw` is valid for writes.
    check(
        unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                src.as_ptr(),
                prog_name.as_ptr(),
                HEADERS.len() as c_int,
                header_src_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let prog = Program(raw);
    // SAFETY: prog.0 is a live program; opt_ptrs holds opts.len() live C strings.
    let res =
        unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    if res == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
        return Err(CudaError::Compile {
            kernel: name.to_string(),
            log: program_log(&prog)?,
        });
    }
    check(res, "nvrtcCompileProgram")?;

    let mut size = 0usize;
    let mut image;
    if real {
        // SAFETY: prog.0 compiled successfully; `size` is valid for writes, and `image` has
        // exactly `size` bytes of room for nvrtcGetCUBIN.
        unsafe {
            check(
                sys::nvrtcGetCUBINSize(prog.0, &mut size),
                "nvrtcGetCUBINSize",
            )?;
            image = vec![0u8; size];
            check(
                sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast()),
                "nvrtcGetCUBIN",
            )?;
        }
    } else {
        // SAFETY: as above, for the PTX (its size includes the terminating NUL).
        unsafe {
            check(sys::nvrtcGetPTXSize(prog.0, &mut size), "nvrtcGetPTXSize")?;
            image = vec![0u8; size];
            check(
                sys::nvrtcGetPTX(prog.0, image.as_mut_ptr().cast()),
                "nvrtcGetPTX",
            )?;
        }
    }
    if image.is_empty() {
        return Err(CudaError::Nvrtc(format!(
            "nvrtc produced an empty image for {name}"
        )));
    }
    Ok(image)
}

fn program_log(prog: &Program) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: prog.0 is a live program; `log` has `size` bytes of room.
    unsafe {
        check(
            sys::nvrtcGetProgramLogSize(prog.0, &mut size),
            "nvrtcGetProgramLogSize",
        )?;
        let mut log = vec![0u8; size.max(1)];
        check(
            sys::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast()),
            "nvrtcGetProgramLog",
        )?;
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        Ok(String::from_utf8_lossy(&log[..end]).trim_end().to_string())
    }
}

/// The cache key: SHA-256 over every input of the image, each length-prefixed.
fn cache_key(
    name: &str,
    source: &str,
    options: &[String],
    version: (i32, i32),
    arch: &str,
) -> String {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(CACHE_FORMAT.as_bytes());
    field(name.as_bytes());
    field(source.as_bytes());
    for (n, s) in HEADERS {
        field(n.as_bytes());
        field(s.as_bytes());
    }
    for o in options {
        field(o.as_bytes());
    }
    field(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    field(arch.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Compile the registered source `source_name` (`"decode_attn"`) for `arch` (`"sm_90"`),
/// through the default cache ([`KernelCache::from_env`]).
///
/// # Errors
/// As [`compile_source`], plus [`CudaError::UnknownKernel`] for a name not in the registry.
pub fn compile(source_name: &str, arch: &str) -> Result<Vec<u8>> {
    compile_with_cache(source_name, arch, &KernelCache::from_env())
}

/// [`compile`] with an explicit cache.
///
/// # Errors
/// As [`compile`].
pub fn compile_with_cache(source_name: &str, arch: &str, cache: &KernelCache) -> Result<Vec<u8>> {
    guard("compile", || {
        let src = kernels::source(source_name)
            .ok_or_else(|| CudaError::UnknownKernel(source_name.to_string()))?;
        let (real, _) = parse_arch(arch)?;
        let info = nvrtc_info()?;
        let options = compile_options(arch);
        let key = cache_key(src.file, src.source, &options, info.version, arch);
        let file = format!(
            "{}-{arch}-{}.{}",
            src.name,
            &key[..32],
            if real { "cubin" } else { "ptx" }
        );
        if let Some(image) = cache.load(&file) {
            return Ok(image);
        }
        let image = compile_loaded(src.file, src.source, &options, real)?;
        cache.store(&file, &image);
        Ok(image)
    })
}

/// Compile every registered source for `arch` (through the default cache) and return each
/// source's name with its image size in bytes. What `oasiskv._core.compile_kernels("sm_90")`
/// exposes, and what CI runs on machines without a GPU.
///
/// # Errors
/// The first failure, as [`compile`].
pub fn compile_all(arch: &str) -> Result<Vec<(String, usize)>> {
    compile_all_with_cache(arch, &KernelCache::from_env())
}

/// [`compile_all`] with an explicit cache.
///
/// # Errors
/// As [`compile_all`].
pub fn compile_all_with_cache(arch: &str, cache: &KernelCache) -> Result<Vec<(String, usize)>> {
    SOURCES
        .iter()
        .map(|s| compile_with_cache(s.name, arch, cache).map(|img| (s.name.to_string(), img.len())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_layouts_of_any_major_highest_first() {
        let root = std::env::temp_dir().join(format!("oasis-nvrtc-scan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (pkg, file) in [
            ("cu12", "libnvrtc.so.12"),
            ("cu14", "libnvrtc.so.14.1"),
            ("cu14", "libnvrtc-builtins.so.14.1"),
            ("cu13", "libnvrtc.so.13"),
            ("cu13", "libnvrtc.so.x"),
        ] {
            let lib = root.join(pkg).join("lib");
            std::fs::create_dir_all(&lib).unwrap();
            std::fs::write(lib.join(file), b"").unwrap();
        }
        let names: Vec<String> = wheel_nvrtc_candidates(&root)
            .iter()
            .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "cu14/lib/libnvrtc.so.14.1",
                "cu13/lib/libnvrtc.so.13",
                "cu12/lib/libnvrtc.so.12"
            ]
        );
        assert!(wheel_nvrtc_candidates(&root.join("absent")).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn arch_parsing() {
        assert_eq!(parse_arch("sm_90").unwrap(), (true, 90));
        assert_eq!(parse_arch("sm_90a").unwrap(), (true, 90));
        assert_eq!(parse_arch("compute_80").unwrap(), (false, 80));
        assert_eq!(parse_arch("sm_120").unwrap(), (true, 120));
        assert!(matches!(
            parse_arch("sm_75"),
            Err(CudaError::UnsupportedArch { major: 7, minor: 5 })
        ));
        assert!(matches!(
            parse_arch("hopper"),
            Err(CudaError::Unsupported(_))
        ));
        assert!(matches!(parse_arch("sm_9"), Err(CudaError::Unsupported(_))));
    }

    #[test]
    fn cache_key_sees_every_input() {
        let o = compile_options("sm_90");
        let k = cache_key("a.cu", "src", &o, (13, 0), "sm_90");
        assert_eq!(k.len(), 64);
        assert_eq!(k, cache_key("a.cu", "src", &o, (13, 0), "sm_90"));
        assert_ne!(k, cache_key("b.cu", "src", &o, (13, 0), "sm_90"));
        assert_ne!(k, cache_key("a.cu", "src2", &o, (13, 0), "sm_90"));
        assert_ne!(
            k,
            cache_key("a.cu", "src", &compile_options("sm_80"), (13, 0), "sm_90")
        );
        assert_ne!(k, cache_key("a.cu", "src", &o, (13, 1), "sm_90"));
        assert_ne!(k, cache_key("a.cu", "src", &o, (13, 0), "sm_80"));
    }

    #[test]
    fn site_dirs_of_a_prefix() {
        let root = std::env::temp_dir().join(format!("oasis-cuda-site-{}", std::process::id()));
        let site = root.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        std::fs::create_dir_all(root.join("lib/other")).unwrap();
        assert_eq!(prefix_site_dirs(&root), vec![site]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
