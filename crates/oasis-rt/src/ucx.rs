//! UCX, runtime-loaded (feature `ucx`). This session: only a probe of the system `libucp`.
//!
//! Neither published binding builds against the system UCX (see `docs/ARCHITECTURE.md`,
//! "Choosing the UCX bindings"): `ucx-sys` 0.1.3 compiles its own UCX and rdma-core with musl
//! cross tools, `ucx1-sys` 0.1.0 its own UCX with autotools and bindgen. So the UCX transport
//! will declare the few `ucp_*` entry points it needs by hand and load `libucp.so.0` at run
//! time (`libloading`), as `oasis-cuda` does with the CUDA driver: the binary then runs, and
//! says what is missing, on a machine without UCX. Its progress loop will own the UCX worker
//! on a thread of its own and feed tokio tasks through channels.

use std::os::raw::c_uint;

use crate::error::{Error, Result};

/// Library names tried in order (override with `OASIS_UCP_LIB`).
pub const LIBUCP_NAMES: [&str; 2] = ["libucp.so.0", "libucp.so"];

/// The version `ucp_get_version` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UcxVersion {
    pub major: u32,
    pub minor: u32,
    pub release: u32,
}

/// Load `libucp` and ask its version.
///
/// # Errors
/// [`Error::Unavailable`] when the library or the symbol cannot be loaded.
pub fn probe() -> Result<UcxVersion> {
    let names: Vec<String> = match std::env::var("OASIS_UCP_LIB") {
        Ok(p) => vec![p],
        Err(_) => LIBUCP_NAMES.iter().map(|s| s.to_string()).collect(),
    };
    let mut last = String::new();
    for name in &names {
        // SAFETY: (1) loading libucp runs its initialisers, which only set up UCX's own
        // global state; (2) `ucp_get_version(unsigned*, unsigned*, unsigned*)` is its C
        // signature in every UCX 1.x (ucp/api/ucp.h), and it writes the three out-pointers,
        // which point at live locals.
        unsafe {
            let lib = match libloading::Library::new(name) {
                Ok(l) => l,
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            let get: libloading::Symbol<
                unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
            > = lib
                .get(b"ucp_get_version\0")
                .map_err(|e| Error::Unavailable(format!("{name} has no ucp_get_version: {e}")))?;
            let (mut major, mut minor, mut release) = (0, 0, 0);
            get(&mut major, &mut minor, &mut release);
            return Ok(UcxVersion {
                major,
                minor,
                release,
            });
        }
    }
    Err(Error::Unavailable(format!(
        "ucx transport unavailable: cannot load libucp ({last}); install libucx0 or set OASIS_UCP_LIB"
    )))
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_is_total() {
        // Here or not, the probe answers without panicking.
        match super::probe() {
            Ok(v) => {
                eprintln!("libucp {}.{}.{}", v.major, v.minor, v.release);
                assert!(v.major >= 1, "{v:?}");
            }
            Err(e) => assert!(e.to_string().contains("libucp"), "{e}"),
        }
    }
}
