//! The on-disk cache of compiled kernels. An image is stored under a name that carries the
//! SHA-256 of everything that determines it (source, headers, options, NVRTC version, arch), so
//! a stale entry is never read: a changed input is a different file. The cache is best effort:
//! a directory that cannot be read or written only means compiling again.

use std::path::{Path, PathBuf};

/// Where compiled kernels are kept (or nowhere).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// `$OASIS_CACHE_DIR` (an empty value disables the cache), else
    /// `$XDG_CACHE_HOME/oasiskv/kernels`, else `$HOME/.cache/oasiskv/kernels`, else disabled.
    pub fn from_env() -> Self {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = match std::env::var_os("OASIS_CACHE_DIR") {
            Some(v) if v.is_empty() => None,
            Some(v) => Some(PathBuf::from(v)),
            None => var("XDG_CACHE_HOME")
                .or_else(|| var("HOME").map(|h| h.join(".cache")))
                .map(|c| c.join("oasiskv").join("kernels")),
        };
        Self { dir }
    }

    /// A cache in `dir` (created on first store).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: Some(dir.into()),
        }
    }

    /// No cache: every compile runs NVRTC.
    pub fn disabled() -> Self {
        Self { dir: None }
    }

    /// The cache directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub(crate) fn load(&self, file_name: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.dir.as_ref()?.join(file_name)).ok()?;
        (!bytes.is_empty()).then_some(bytes)
    }

    /// Write through a temporary file and a rename, so that a concurrent reader (another process
    /// compiling the same kernel) sees either nothing or the whole image.
    pub(crate) fn store(&self, file_name: &str, bytes: &[u8]) {
        let Some(dir) = &self.dir else { return };
        if std::fs::create_dir_all(dir).is_err() {
            return;
        }
        let tmp = dir.join(format!("{file_name}.tmp{}", std::process::id()));
        if std::fs::write(&tmp, bytes).is_err()
            || std::fs::rename(&tmp, dir.join(file_name)).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}
