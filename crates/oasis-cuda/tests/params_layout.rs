//! The kernel parameter structs have the same layout in Rust (`oasis_cuda::params`) and in C
//! (`cuda/oasis_params.cuh`), and every kernel takes exactly its struct. Needs libnvrtc only, no
//! GPU (as tests/nvrtc_compile.rs: `make test` sets OASIS_NVRTC_LIB; without it these fail).
//!
//! How: a probe program includes the header and defines
//! `extern "C" __device__ const unsigned long long OASIS_LAYOUT[]` holding, for every struct
//! (every instantiation `T` = bf16, f16, float of the templated ones), `sizeof`, `alignof` and
//! for every field of the Rust struct its `offsetof`, `sizeof` and kind (pointer, int, long
//! long, float). NVRTC compiles it to PTX, where the initialiser is plain text
//! (`.global .align 8 .b8 OASIS_LAYOUT[N] = {...}`); the test reads it back and compares it with
//! `ParamsLayout` (Rust's `size_of` / `align_of` / `offset_of!`).
//!
//! Why that is complete: the Rust unit tests prove that the Rust fields tile the struct with no
//! padding. If the C struct has the same size and every Rust field exists in C (else the probe
//! does not compile) at the same offset with the same size and kind, the C fields cover every
//! byte too, so C can have no other field. A renamed, added, removed, reordered or retyped field
//! on either side fails here.

use oasis_cuda::params::{self, FieldKind, ParamsLayout};
use oasis_cuda::{compile_source, kernels, nvrtc_info, CudaError};

/// PTX: the probe's data and the kernels' parameter lists are readable text.
const PTX_ARCH: &str = "compute_90";

/// Marks the end of the probe's table (catches a truncated or misparsed initialiser).
const END_MARK: u64 = 0x0A51_5E4D;

fn require_nvrtc() {
    if let Err(e) = nvrtc_info() {
        panic!(
            "this test needs libnvrtc: set OASIS_NVRTC_LIB to libnvrtc.so.13 (pip install \
             nvidia-cuda-nvrtc); `make test` sets it to the virtualenv's copy.\n{e}"
        );
    }
}

fn kind_code(k: FieldKind) -> u64 {
    match k {
        FieldKind::Ptr => 1,
        FieldKind::I32 => 2,
        FieldKind::I64 => 3,
        FieldKind::F32 => 4,
    }
}

/// The C types a layout stands for: each storage type of a templated struct, else itself.
fn c_instances(l: &ParamsLayout) -> Vec<String> {
    if l.c_type.contains("<T>") {
        ["oasis::bf16", "oasis::f16", "float"]
            .iter()
            .map(|t| l.c_type.replace("<T>", &format!("<{t}>")))
            .collect()
    } else {
        vec![l.c_type.to_string()]
    }
}

/// Helpers shared by the probes: the kind of a field's type, and type equality.
const PROBE_PRELUDE: &str = r#"#include "oasis_common.cuh"
#include "oasis_params.cuh"

// offsetof without <cstddef> (NVRTC has no standard headers): EDG's own builtin, which is what
// its stddef.h uses; the result is a constant expression.
#define OASIS_OFFSETOF(P, f) ((unsigned long long)__INTADDR__(&(((P*)0)->f)))

template <typename X> struct oasis_kind { static constexpr unsigned long long value = 0; };
template <typename X> struct oasis_kind<X*> { static constexpr unsigned long long value = 1; };
template <> struct oasis_kind<int> { static constexpr unsigned long long value = 2; };
template <> struct oasis_kind<long long> { static constexpr unsigned long long value = 3; };
template <> struct oasis_kind<float> { static constexpr unsigned long long value = 4; };

template <typename A, typename B> struct oasis_same { static constexpr bool value = false; };
template <typename A> struct oasis_same<A, A> { static constexpr bool value = true; };
"#;

/// The probe's source, and the values Rust expects in its table, entry for entry (each with a
/// label for the failure message).
fn probe() -> (String, Vec<(String, u64)>) {
    let mut src = String::from(PROBE_PRELUDE);
    let mut inits = Vec::new();
    let mut expected = Vec::new();
    for (i, l) in params::ALL.iter().enumerate() {
        for (j, c) in c_instances(l).into_iter().enumerate() {
            let alias = format!("P{i}_{j}");
            src.push_str(&format!("typedef {c} {alias};\n"));
            inits.push(format!("sizeof({alias})"));
            expected.push((format!("sizeof({c})"), l.size as u64));
            inits.push(format!("alignof({alias})"));
            expected.push((format!("alignof({c})"), l.align as u64));
            for f in l.fields {
                let n = f.name;
                inits.push(format!("OASIS_OFFSETOF({alias}, {n})"));
                expected.push((format!("offsetof({c}, {n})"), f.offset as u64));
                inits.push(format!("sizeof((({alias}*)0)->{n})"));
                expected.push((format!("sizeof({c}::{n})"), f.size as u64));
                inits.push(format!("oasis_kind<decltype({alias}::{n})>::value"));
                expected.push((
                    format!("kind of {c}::{n} (1 ptr, 2 int, 3 long long, 4 float)"),
                    kind_code(f.kind),
                ));
            }
        }
    }
    inits.push(format!("{END_MARK:#x}ull"));
    expected.push(("end mark".into(), END_MARK));
    src.push_str("\nextern \"C\" __device__ const unsigned long long OASIS_LAYOUT[] = {\n");
    for v in &inits {
        src.push_str(&format!("    {v},\n"));
    }
    src.push_str("};\n");
    (src, expected)
}

/// The values of the global array `name` in `ptx`, as u64: the initialiser of
/// `.global .align A .TYPE name[N] = {v, ...}` for a `.b8`/`.u8`, `.b32`/`.u32` or
/// `.b64`/`.u64` element type, little-endian, zero-filled up to `N` (PTX omits trailing zeros).
fn ptx_u64_array(ptx: &str, name: &str) -> Vec<u64> {
    let decl = format!(" {name}[");
    let line = ptx
        .lines()
        .find(|l| l.contains(&decl) && l.contains('='))
        .unwrap_or_else(|| panic!("no initialised {name} in the PTX:\n{ptx}"));
    let elem = if line.contains(".b8 ") || line.contains(".u8 ") {
        1
    } else if line.contains(".b32 ") || line.contains(".u32 ") {
        4
    } else if line.contains(".b64 ") || line.contains(".u64 ") {
        8
    } else {
        panic!("unexpected element type: {line}")
    };
    let after = &line[line.find(&decl).unwrap() + decl.len()..];
    let count: usize = after[..after.find(']').unwrap()].parse().unwrap();
    let body = &line[line.find('{').unwrap() + 1..line.rfind('}').unwrap()];
    let mut bytes = Vec::with_capacity(count * elem);
    for v in body.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        let x: u64 = v.parse().unwrap_or_else(|_| panic!("not a number: {v:?}"));
        bytes.extend_from_slice(&x.to_le_bytes()[..elem]);
    }
    assert!(bytes.len() <= count * elem, "{line}");
    bytes.resize(count * elem, 0);
    assert_eq!(bytes.len() % 8, 0, "{line}");
    bytes
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn compile_ptx(name: &str, src: &str) -> String {
    match compile_source(name, src, PTX_ARCH) {
        Ok(ptx) => String::from_utf8_lossy(&ptx)
            .trim_end_matches('\0')
            .to_string(),
        Err(CudaError::Compile { log, .. }) => panic!("{name} does not compile:\n{log}\n{src}"),
        Err(e) => panic!("{name}: {e}"),
    }
}

/// Every struct's size, alignment and every field's offset, size and kind agree between the
/// Rust layout and what NVRTC computes from cuda/oasis_params.cuh.
#[test]
fn rust_and_c_layouts_agree() {
    require_nvrtc();
    let (src, expected) = probe();
    let ptx = compile_ptx("params_probe.cu", &src);
    let got = ptx_u64_array(&ptx, "OASIS_LAYOUT");
    assert_eq!(
        got.len(),
        expected.len(),
        "the probe's table has {} values, Rust expects {}",
        got.len(),
        expected.len()
    );
    let mismatches: Vec<String> = expected
        .iter()
        .zip(&got)
        .filter(|((_, want), got)| want != *got)
        .map(|((what, want), got)| format!("{what}: Rust {want}, C {got}"))
        .collect();
    assert!(
        mismatches.is_empty(),
        "oasis_params.cuh and oasis_cuda::params disagree:\n{}",
        mismatches.join("\n")
    );
    println!(
        "{} values checked over {} structs",
        got.len(),
        params::ALL.len()
    );
}

/// Every entry point takes exactly one parameter, of the C type its Rust struct mirrors: a
/// static_assert on the function type, appended to the real source, and the parameter list of
/// the compiled `.entry` (one `.param .align 8 .b8 NAME_param_0[size_of::<P>()]`).
#[test]
fn every_entry_point_takes_its_params_struct() {
    require_nvrtc();
    for src in kernels::SOURCES {
        let mut text = format!(
            "{}\n{}",
            src.source,
            &PROBE_PRELUDE[PROBE_PRELUDE.find("#define").unwrap()..]
        );
        for entry in src.entry_points {
            let l = params::layout_of(entry)
                .unwrap_or_else(|| panic!("{entry} has no parameter struct in oasis_cuda::params"));
            let c = l.c_type_for(entry);
            text.push_str(&format!(
                "static_assert(oasis_same<decltype(&{entry}), void (*)({c})>::value, \
                 \"{entry} must take exactly one {c}\");\n"
            ));
        }
        let ptx = compile_ptx(src.file, &text);
        for entry in src.entry_points {
            let l = params::layout_of(entry).unwrap();
            let head = format!(".entry {entry}(");
            let at = ptx
                .find(&head)
                .unwrap_or_else(|| panic!("{}: no .entry {entry} in the PTX", src.file));
            let rest = &ptx[at + head.len()..];
            let params_text = &rest[..rest.find(')').unwrap()];
            let decls: Vec<&str> = params_text
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .collect();
            let want = format!(".param .align {} .b8 {entry}_param_0[{}]", l.align, l.size);
            assert_eq!(
                decls,
                vec![want.as_str()],
                "{entry}: parameter list in the PTX"
            );
        }
    }
}

/// The PTX reader, on the forms NVRTC emits.
#[test]
fn ptx_arrays_are_read_back() {
    let ptx =
        ".global .align 8 .b8 A[24] = {24, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 77};\n";
    assert_eq!(ptx_u64_array(ptx, "A"), vec![24, 8, 77]);
    let ptx = ".global .align 8 .u64 B[3] = {1, 2, 300};\n";
    assert_eq!(ptx_u64_array(ptx, "B"), vec![1, 2, 300]);
    let ptx = ".const .align 4 .u32 C[4] = {5, 0, 6, 0};\n";
    assert_eq!(ptx_u64_array(ptx, "C"), vec![5, 6]);
}
