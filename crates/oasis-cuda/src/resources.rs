//! What ptxas gave each kernel of a compiled cubin: registers per thread and the per-thread
//! stack (local memory: spills, or arrays indexed at run time), read from the cubin itself, so a
//! kernel change can be checked for register pressure and spills on a machine without a GPU or a
//! CUDA toolkit (NVRTC from PyPI compiles sm_90 cubins; `cuobjdump` is not needed).
//!
//! A cubin is an ELF64 file. Its `.nv.info` section is a list of attributes, each `(format u8,
//! attribute u8, ...)`; the ones read here have the "sized value" format (4) and a payload of
//! `(symbol index u32, value u32)`: `EIATTR_REGCOUNT` (0x2f) and `EIATTR_FRAME_SIZE` (0x11), keyed
//! by the kernel's symbol in `.symtab`. Anything malformed is an error, never a panic.

use crate::error::{CudaError, Result};

/// The registers and stack ptxas gave one kernel entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// The entry point's name (`extern "C"`).
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack per thread (0: no local memory, so no spills).
    pub stack_bytes: u32,
}

const EIFMT_SVAL: u8 = 4;
const EIATTR_REGCOUNT: u8 = 0x2f;
const EIATTR_FRAME_SIZE: u8 = 0x11;

fn bad(why: &str) -> CudaError {
    CudaError::Unsupported(format!("not a readable cubin: {why}"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or_else(|| bad("truncated"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| bad("truncated"))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64> {
    let lo = u32_at(b, at)? as u64;
    let hi = u32_at(b, at + 4)? as u64;
    Ok(lo | hi << 32)
}

/// A NUL-terminated string at `at` of `b`.
fn c_str(b: &[u8], at: usize) -> Result<&str> {
    let tail = b.get(at..).ok_or_else(|| bad("name out of range"))?;
    let end = tail
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| bad("unterminated name"))?;
    std::str::from_utf8(&tail[..end]).map_err(|_| bad("name not utf-8"))
}

struct Section {
    name: usize,
    offset: usize,
    size: usize,
    link: usize,
}

impl Section {
    fn bytes<'a>(&self, b: &'a [u8]) -> Result<&'a [u8]> {
        b.get(self.offset..self.offset.saturating_add(self.size))
            .ok_or_else(|| bad("section out of range"))
    }
}

fn sections(b: &[u8]) -> Result<Vec<Section>> {
    if b.get(..5) != Some(&[0x7f, b'E', b'L', b'F', 2][..]) {
        return Err(bad("no ELF64 header"));
    }
    let shoff = u64_at(b, 0x28)? as usize;
    let shentsize = u16_at(b, 0x3a)? as usize;
    let shnum = u16_at(b, 0x3c)? as usize;
    if shentsize < 64 {
        return Err(bad("section header size"));
    }
    (0..shnum)
        .map(|i| {
            let at = shoff.saturating_add(i * shentsize);
            Ok(Section {
                name: u32_at(b, at)? as usize,
                offset: u64_at(b, at + 0x18)? as usize,
                size: u64_at(b, at + 0x20)? as usize,
                link: u32_at(b, at + 0x28)? as usize,
            })
        })
        .collect()
}

/// The registers and stack of every kernel in `cubin` (an sm_XY compile of
/// [`compile`](crate::compile)), in the order ptxas listed them.
///
/// # Errors
/// [`CudaError::Unsupported`] when `cubin` is not an ELF64 file with `.shstrtab`, `.symtab` and
/// `.nv.info` sections as ptxas writes them (a PTX compile, a truncated file).
pub fn cubin_resources(cubin: &[u8]) -> Result<Vec<KernelResources>> {
    let secs = sections(cubin)?;
    let shstrndx = u16_at(cubin, 0x3e)? as usize;
    let names = secs.get(shstrndx).ok_or_else(|| bad("no section names"))?;
    let find = |want: &str| -> Result<&Section> {
        for s in &secs {
            if c_str(cubin, names.offset.saturating_add(s.name))? == want {
                return Ok(s);
            }
        }
        Err(bad(&format!("no {want} section")))
    };
    let symtab = find(".symtab")?;
    let strtab = secs
        .get(symtab.link)
        .ok_or_else(|| bad("no symbol names"))?;
    let syms = symtab.bytes(cubin)?;
    let symbol = |idx: usize| -> Result<&str> {
        let name = u32_at(
            syms,
            idx.checked_mul(24).ok_or_else(|| bad("symbol index"))?,
        )? as usize;
        c_str(cubin, strtab.offset.saturating_add(name))
    };
    let info = find(".nv.info")?.bytes(cubin)?;
    let mut out: Vec<KernelResources> = Vec::new();
    let mut at = 0;
    while at + 4 <= info.len() {
        let (format, attr) = (info[at], info[at + 1]);
        if format != EIFMT_SVAL {
            at += 4; // the other formats hold their value in these four bytes
            continue;
        }
        let size = u16_at(info, at + 2)? as usize;
        if size >= 8 && (attr == EIATTR_REGCOUNT || attr == EIATTR_FRAME_SIZE) {
            let name = symbol(u32_at(info, at + 4)? as usize)?;
            let value = u32_at(info, at + 8)?;
            let k = match out.iter().position(|k| k.name == name) {
                Some(i) => i,
                None => {
                    out.push(KernelResources {
                        name: name.to_string(),
                        registers: 0,
                        stack_bytes: 0,
                    });
                    out.len() - 1
                }
            };
            if attr == EIATTR_REGCOUNT {
                out[k].registers = value;
            } else {
                out[k].stack_bytes = value;
            }
        }
        at += 4 + size;
    }
    if out.is_empty() {
        return Err(bad("no register counts in .nv.info"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_cubin() {
        for b in [
            &b""[..],
            b"\x7fELF\x01",
            b"// PTX\n.version 8.0\n",
            &[0x7f, b'E', b'L', b'F', 2, 0, 0],
        ] {
            let e = cubin_resources(b).unwrap_err().to_string();
            assert!(e.contains("not a readable cubin"), "{e}");
        }
    }

    #[test]
    fn refuses_a_header_pointing_past_the_end() {
        let mut b = vec![0u8; 64];
        b[..5].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2]);
        b[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes()); // section headers far away
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        assert!(cubin_resources(&b).is_err());
    }
}
