//! Bytes across the boundary: staged payloads read in place (torch tensors, buffers), the host
//! pool rows `read_blocks_into` writes, and the `bytearray` replies.

use super::*;

// Where `read_blocks_into` writes an entry: the coordinator's `Dest` (its heads' K and V rows,
// with an fp8 pool their scales), the same one write per entry from the received frame.
pub(super) use oasis_coord::pools::{Dest, SCALE_BYTES};

/// A staging argument's bytes, borrowed: a contiguous CPU tensor's storage or a C-contiguous
/// buffer. Valid while the Python object it came from is alive, which the caller's reference
/// guarantees for the whole call; `release` it (with the GIL) when done.
pub(super) struct Payload {
    pub(super) ptr: usize,
    pub(super) len: usize,
    pub(super) buf: Option<PyBuffer<u8>>,
}

impl Payload {
    /// A copy of bytes `range` (callable with the GIL released). Bulk staging copies frame-sized
    /// pieces, never the whole argument at once: a large fresh buffer costs its page faults.
    pub(super) fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "payload range"
        );
        if range.is_empty() {
            return Bytes::new();
        }
        // SAFETY: `ptr..ptr + len` is the argument's memory (a contiguous CPU tensor's storage or
        // a C-contiguous buffer, checked in `payload_view`), kept alive and unmoved by the
        // caller's reference (and `buf`) until `release`; `range` lies inside it; only read.
        let s = unsafe {
            std::slice::from_raw_parts((self.ptr + range.start) as *const u8, range.len())
        };
        Bytes::copy_from_slice(s)
    }

    pub(super) fn release(self, py: Python<'_>) {
        if let Some(b) = self.buf {
            b.release(py);
        }
    }
}

/// Borrow a staging argument: a contiguous CPU tensor or a C-contiguous buffer.
pub(super) fn payload_view(
    py: Python<'_>,
    name: &str,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Payload> {
    if obj.hasattr("data_ptr")? {
        let t: TensorArg = obj.extract()?;
        if t.device != "cpu" || !t.contiguous {
            return Err(py_err(
                py,
                "DeviceError",
                format!(
                    "{name} must be a contiguous CPU tensor, got one on {} (contiguous: {}); pass \
                     {name}.contiguous().cpu()",
                    t.device, t.contiguous
                ),
            ));
        }
        return Ok(Payload {
            ptr: t.ptr,
            len: t.numel() * t.elem_size,
            buf: None,
        });
    }
    let buf = PyBuffer::<u8>::get(obj).map_err(|_| {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        py_err(
            py,
            "DTypeError",
            format!("{name} must be a CPU tensor or a bytes-like object, got {ty}"),
        )
    })?;
    if !buf.is_c_contiguous() {
        return Err(bad_arg(
            py,
            format!("{name} is not C-contiguous; pass bytes(...) or a contiguous array"),
        ));
    }
    Ok(Payload {
        ptr: buf.buf_ptr() as usize,
        len: buf.len_bytes(),
        buf: Some(buf),
    })
}

/// Bytes of a staging argument, copied once with the GIL released.
pub(super) fn payload(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    let view = payload_view(py, name, obj)?;
    let out = py.detach(|| view.copy(0..view.len));
    view.release(py);
    Ok(out)
}

/// Check `pools` (one CPU tensor per layer, all contiguous, of `first`'s shape and dtype).
pub(crate) fn check_pools(
    py: Python<'_>,
    what: &str,
    pools: &[&TensorArg],
    shape: &[usize],
    dtype: &str,
) -> PyResult<()> {
    for t in pools {
        if t.device != "cpu" {
            return Err(py_err(
                py,
                "DeviceError",
                format!("{what} pools must be CPU tensors, got one on {}", t.device),
            ));
        }
        if !t.contiguous {
            return Err(py_err(
                py,
                "ShapeError",
                format!("{what} pools must be contiguous"),
            ));
        }
        if t.shape != shape {
            return Err(py_err(
                py,
                "ShapeError",
                format!(
                    "every {what} pool must have shape {shape:?}; got {:?}",
                    t.shape
                ),
            ));
        }
        if t.dtype != dtype {
            return Err(py_err(
                py,
                "DTypeError",
                format!("{what} pools must be {dtype}, got {}", t.dtype),
            ));
        }
    }
    Ok(())
}

/// Check per-layer host pools `host_k` / `host_v` (one contiguous CPU tensor per layer, `[rows,
/// num_kv_heads, block_size, head_dim]`, all of one shape and dtype) and, for an fp8_e4m3 pool
/// (uint8 codes), its float32 `[rows, num_kv_heads]` scales per layer. Returns `(rows,
/// num_kv_heads, bytes of one head's K or V rows of a block)`. The one check of
/// `RtClient.read_blocks_into` and `Coordinator.register_pools`.
pub(crate) fn check_host_pools(
    py: Python<'_>,
    host_k: &[TensorArg],
    host_v: &[TensorArg],
    scales: Option<(&[TensorArg], &[TensorArg])>,
) -> PyResult<(usize, usize, usize)> {
    if host_k.len() != host_v.len() || host_k.is_empty() {
        return Err(bad_arg(
            py,
            format!(
                "host_k and host_v are lists of one pool per layer, of equal length (got {} and {})",
                host_k.len(),
                host_v.len()
            ),
        ));
    }
    let first = &host_k[0];
    if first.shape.len() != 4 {
        return Err(py_err(
            py,
            "ShapeError",
            format!(
                "every host pool must be [rows, num_kv_heads, block_size, head_dim]; got {:?}",
                first.shape
            ),
        ));
    }
    let pools: Vec<&TensorArg> = host_k.iter().chain(host_v).collect();
    check_pools(py, "host_k and host_v", &pools, &first.shape, &first.dtype)?;
    let (nrows, heads) = (first.shape[0], first.shape[1]);
    if let Some((ks, vs)) = scales {
        if ks.len() != host_k.len() || vs.len() != host_k.len() {
            return Err(bad_arg(
                py,
                format!(
                    "host_k_scales and host_v_scales need one tensor per layer ({}), got {} and {}",
                    host_k.len(),
                    ks.len(),
                    vs.len()
                ),
            ));
        }
        if first.elem_size != 1 {
            return Err(py_err(
                py,
                "DTypeError",
                format!(
                    "scales go with fp8_e4m3 pools of uint8 codes, got {} pools; pass no scales",
                    first.dtype
                ),
            ));
        }
        let sc: Vec<&TensorArg> = ks.iter().chain(vs).collect();
        check_pools(py, "host scale", &sc, &[nrows, heads], "float32")?;
    }
    Ok((
        nrows,
        heads,
        first.shape[2] * first.shape[3] * first.elem_size,
    ))
}

/// Check the pools (and with an fp8 pool its scales) and every `(key, row)` against them; the
/// destinations in key order.
pub(super) fn pool_dests(
    py: Python<'_>,
    keys: &[(u64, u16, u32, i32)],
    rows: &[i64],
    host_k: &[TensorArg],
    host_v: &[TensorArg],
    scales: Option<(&[TensorArg], &[TensorArg])>,
) -> PyResult<Vec<Dest>> {
    if rows.len() != keys.len() {
        return Err(bad_arg(
            py,
            format!(
                "rows has {} entries for {} keys; pass one host row per key",
                rows.len(),
                keys.len()
            ),
        ));
    }
    let (nrows, heads, head_bytes) = check_host_pools(py, host_k, host_v, scales)?;
    let mut out = Vec::with_capacity(keys.len());
    for (&(_, layer, block, head), &row) in keys.iter().zip(rows) {
        let l = usize::from(layer);
        if l >= host_k.len() {
            return Err(bad_arg(
                py,
                format!(
                    "block {block} of layer {layer}: the pools have {} layers",
                    host_k.len()
                ),
            ));
        }
        let row = usize::try_from(row)
            .ok()
            .filter(|&r| r < nrows)
            .ok_or_else(|| {
                bad_arg(
                    py,
                    format!("host row {row} is outside the pools' {nrows} rows"),
                )
            })?;
        let (first_head, n) = match head {
            -1 => (row * heads, heads),
            h if h >= 0 && (h as usize) < heads => (row * heads + h as usize, 1),
            h => {
                return Err(bad_arg(
                    py,
                    format!(
                        "head {h} is neither -1 (every head) nor one of the pools' {heads} heads"
                    ),
                ))
            }
        };
        out.push(Dest {
            k: host_k[l].ptr + first_head * head_bytes,
            v: host_v[l].ptr + first_head * head_bytes,
            scales: scales.map(|(ks, vs)| {
                (
                    ks[l].ptr + first_head * SCALE_BYTES,
                    vs[l].ptr + first_head * SCALE_BYTES,
                )
            }),
            heads: n,
            head_bytes,
        });
    }
    Ok(out)
}

/// One `bytearray` holding `parts` back to back; the copy runs with the GIL released.
pub(super) fn bytearray_of<'py>(
    py: Python<'py>,
    parts: &[Bytes],
) -> PyResult<Bound<'py, PyByteArray>> {
    let total: usize = parts.iter().map(Bytes::len).sum();
    let out = PyByteArray::new_with(py, total, |_| Ok(()))?;
    let dst = out.data() as usize;
    py.detach(|| {
        let mut at = 0;
        for p in parts {
            // SAFETY: `out` was just created here and is referenced nowhere else, so nothing can
            // resize or free it while the GIL is released; it holds `total` bytes, the sum of
            // the parts' lengths, so every write stays inside it; the parts are Rust buffers
            // and cannot overlap it.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), (dst as *mut u8).add(at), p.len());
            }
            at += p.len();
        }
    });
    Ok(out)
}
