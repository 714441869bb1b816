//! `oasiskv._core.RtClient`: a blocking client of the `oasis-rt` staging daemon, for the prefill
//! worker and the decode engine (`oasiskv.disagg`).
//!
//! ```text
//! Python thread ── RtClient.method(...) ──▶ GIL released ──▶ Mutex<Client> ──▶ tokio
//!                                                                (current-thread runtime owned
//!                                                                 by this object; block_on)
//! ```
//!
//! Each object owns one connection (`oasis_rt::Client`, one call in flight) and a
//! current-thread tokio runtime that only drives that connection, so the object needs no
//! background tokio thread and no global runtime; calls from several Python threads take turns
//! on the mutex.
//!
//! **Transports.** The address names one: `HOST:PORT` or `oasis-rt://HOST:PORT` is TCP,
//! `oasis-rt+ucx://HOST:PORT` is UCX (the daemon runs `oasis-rt serve --transport ucx`). Every
//! UCX client of the process shares one [`UcxTransport`] (one UCX context, worker and progress
//! thread), started by the first and shut down by an `atexit` hook: UCX must not be torn down by
//! the process exit under its running thread. libucp is loaded then, not at import, so the
//! module imports where UCX is absent; there a UCX address raises `ConfigError` (`.code`
//! `"ucx_unavailable"`) saying what to install. [`ucx_version`] asks without connecting. UCX
//! is not fork-safe: a child forked after the first UCX client gets the same error for UCX
//! addresses (TCP clients work there). Every call releases the GIL, is bounded by the client's `timeout_s` (send and whole
//! reply), and runs under `catch_unwind`: no panic crosses into Python. Errors become the
//! `oasiskv.errors.Remote*` classes (each carries `.code`, the protocol's error name).
//!
//! **RMA.** Over UCX, `read_blocks` reads the block bytes straight from the daemon's registered
//! memory (`ReadBlocksRma`: the reply names ranges, this client `get`s them and acknowledges)
//! unless the client was made with `rma=False`; the result is the same.
//!
//! **Bytes.** Staging takes a contiguous CPU torch tensor (read in place through its data
//! pointer) or any C-contiguous buffer (`bytes`, `bytearray`, `memoryview`, numpy): one copy
//! into a frame-sized buffer per call, sliced per block without further copies, then the
//! protocol's encoder writes the frame (a second copy). Replies come back as one `bytearray`
//! per call (`blocks`, `summaries`, read data): one copy out of the received frame, made with
//! the GIL released; `torch.frombuffer(data, dtype=...)` views it without copying.
//! `read_blocks_into` skips that buffer: each entry is copied from the received frame straight
//! into its row of the caller's host pools (the decode loop's reads of missing blocks).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use oasis_rt::protocol::{
    BlockKey, Geometry, KvFormat, LayerBlock, Section, StagedBlock, SummaryRun, ALL_HEADS,
    DEFAULT_MAX_FRAME_BYTES, HARD_MAX_FRAME_BYTES, MAX_ENTRIES,
};
use oasis_rt::transport::{
    AnyConnection, Endpoint, TcpConfig, TcpTransport, Transport, TransportKind, UCX_SCHEME,
};
use oasis_rt::{ClientConfig, Error as RtError, ErrorCode, UcxConfig, UcxTransport};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use crate::errors::py_err;
use crate::tensor::TensorArg;

pub(crate) mod buffers;
pub(crate) mod errors;
pub(crate) mod ucx;

use buffers::*;
use errors::*;
use ucx::*;

/// A client over either transport.
type Client = oasis_rt::Client<AnyConnection>;

/// Frame bytes a staging spends besides its blocks (header, request, geometry, count), rounded
/// up. Arbitrary margin.
const STAGE_OVERHEAD: u64 = 64;
/// Bulk staging frames stay this small even when the frame limit is larger: buffers of a few
/// MiB come from (and go back to) the allocator's heap, while 64 MiB ones are fresh mappings
/// whose page faults cost more than the copy itself (measured: 1,023 blocks of 64 KiB per frame
/// staged at 0.2-0.3 GB/s over loopback TCP, 16-64 per frame at 1.1-1.3 GB/s).
const BULK_FRAME_BYTES: u64 = 4 << 20;

/// `read_blocks`' answer: the entries' bytes, their lengths, their error codes.
type ReadReply<'py> = (
    Bound<'py, PyByteArray>,
    Vec<usize>,
    Vec<Option<&'static str>>,
);

/// `(num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks, kv_format)`.
type GeometryTuple = (u16, u16, u16, u16, u8, u32, u8);

fn geometry(py: Python<'_>, g: GeometryTuple) -> PyResult<Geometry> {
    let kv_format = KvFormat::from_u8(g.6).map_err(|_| {
        bad_arg(
            py,
            format!(
                "geometry's kv_format is {}; pass 0 (plain blocks of dtype_bytes) or 1 (fp8_e4m3 \
                 codes with a float32 scale per head)",
                g.6
            ),
        )
    })?;
    Ok(Geometry {
        num_layers: g.0,
        num_kv_heads: g.1,
        block_size: g.2,
        head_dim: g.3,
        dtype_bytes: g.4,
        num_blocks: g.5,
        kv_format,
    })
}

fn geometry_tuple(g: &Geometry) -> GeometryTuple {
    (
        g.num_layers,
        g.num_kv_heads,
        g.block_size,
        g.head_dim,
        g.dtype_bytes,
        g.num_blocks,
        g.kv_format.as_u8(),
    )
}

struct Conn {
    client: Option<Client>,
    /// Wire bytes of clients this object held before (none today: kept for `close`).
    sent: u64,
    received: u64,
}

/// A blocking client of one `oasis-rt` daemon (see the module docs).
///
/// `max_frame` bounds the frames it sends and the replies it accepts: a reply past it (a read
/// of too many keys) is refused as `too_large` and costs the connection, since the daemon does
/// not know the client's limit. Batch reads under [`PyRtClient::max_frame`].
#[pyclass(name = "RtClient", module = "oasiskv._core")]
pub struct PyRtClient {
    rt: tokio::runtime::Runtime,
    conn: Mutex<Conn>,
    /// `HOST:PORT`.
    addr: String,
    /// The daemon in error messages: `HOST:PORT` over TCP, the URL over UCX.
    label: String,
    endpoint: Endpoint,
    timeout: Duration,
    /// Read blocks by RMA when the connection offers it.
    use_rma: bool,
}

impl PyRtClient {
    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `f` on the connection with the GIL released and no panic escaping.
    fn call<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&tokio::runtime::Runtime, &mut Client) -> Result<R, RtError> + Send,
    ) -> PyResult<R> {
        let res = py.detach(|| {
            catch_unwind(AssertUnwindSafe(|| {
                let mut conn = self.lock();
                let client = conn.client.as_mut().ok_or((RtError::Closed, true))?;
                f(&self.rt, client).map_err(|e| (e, !client.is_connected()))
            }))
        });
        match res {
            Ok(Ok(v)) => Ok(v),
            Ok(Err((e, dropped))) => Err(rt_err(py, e, &self.label, dropped)),
            Err(_) => Err(internal(py, what)),
        }
    }

    /// The daemon's answer to `keys` (`(request, layer, block, head)`, head -1 = every head),
    /// by RMA where the connection offers it.
    fn read_entries(
        &self,
        py: Python<'_>,
        keys: Vec<(u64, u16, u32, i32)>,
    ) -> PyResult<Vec<Result<Bytes, ErrorCode>>> {
        let mut ks = Vec::with_capacity(keys.len());
        for (request, layer, block, head) in keys {
            let head = match head {
                -1 => ALL_HEADS,
                h if (0..i32::from(ALL_HEADS)).contains(&h) => h as u16,
                h => {
                    return Err(bad_arg(
                        py,
                        format!("head {h} is neither -1 (every head) nor a KV head index"),
                    ))
                }
            };
            ks.push(BlockKey {
                request,
                layer,
                block,
                head,
            });
        }
        let use_rma = self.use_rma;
        self.call(py, "read_blocks", move |rt, c| {
            if use_rma && c.rma() {
                rt.block_on(c.read_blocks_rma(ks))
            } else {
                rt.block_on(c.read_blocks(ks))
            }
        })
    }

    fn max_frame_now(&self) -> u64 {
        self.lock()
            .client
            .as_ref()
            .map_or(DEFAULT_MAX_FRAME_BYTES, Client::max_frame)
            .into()
    }
}

/// A daemon token passed as `str` or `bytes` (None: none), surrounding ASCII whitespace removed
/// as the daemon removes it from its `--token-file`.
pub(crate) fn token_bytes(
    py: Python<'_>,
    token: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<u8>>> {
    let Some(t) = token else {
        return Ok(None);
    };
    let raw: Vec<u8> = if let Ok(s) = t.extract::<String>() {
        s.into_bytes()
    } else if let Ok(b) = t.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else {
        return Err(py_err(
            py,
            "ConfigError",
            "token must be str or bytes".into(),
        ));
    };
    Ok(Some(raw.trim_ascii().to_vec()))
}

pub(crate) fn check_timeout(py: Python<'_>, name: &str, s: f64) -> PyResult<Duration> {
    if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
        return Err(py_err(
            py,
            "ConfigError",
            format!("{name} must be a number of seconds in (0, 86400], got {s}"),
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

#[pymethods]
impl PyRtClient {
    /// Connect to the daemon at `addr` and authenticate with `token` (str or bytes; the
    /// contents of the daemon's `--token-file`, surrounding whitespace ignored as the daemon
    /// does). `addr` names the transport: `HOST:PORT` or `oasis-rt://HOST:PORT` (TCP),
    /// `oasis-rt+ucx://HOST:PORT` (UCX; the daemon runs `--transport ucx`). Every later call
    /// must finish within `timeout_s`.
    ///
    /// Raises `RemoteUnavailableError` (nothing listens there), `RemoteTimeoutError`,
    /// `RemoteAuthError` (missing or wrong token), `ConfigError` (bad timeouts or address; a
    /// UCX address where libucp cannot be loaded, `.code == "ucx_unavailable"`).
    #[new]
    #[pyo3(signature = (addr, token = None, timeout_s = 30.0, connect_timeout_s = 5.0, max_frame = None, rma = true))]
    fn new(
        py: Python<'_>,
        addr: String,
        token: Option<&Bound<'_, PyAny>>,
        timeout_s: f64,
        connect_timeout_s: f64,
        max_frame: Option<u32>,
        rma: bool,
    ) -> PyResult<Self> {
        let timeout = check_timeout(py, "timeout_s", timeout_s)?;
        let connect_timeout = check_timeout(py, "connect_timeout_s", connect_timeout_s)?;
        let token = token_bytes(py, token)?;
        let max_frame = max_frame.unwrap_or(DEFAULT_MAX_FRAME_BYTES);
        if !(4096..=HARD_MAX_FRAME_BYTES).contains(&max_frame) {
            return Err(py_err(
                py,
                "ConfigError",
                format!("max_frame must be in 4096..={HARD_MAX_FRAME_BYTES}, got {max_frame}"),
            ));
        }
        let endpoint = Endpoint::parse(&addr).map_err(|e| rt_err(py, e, "address", false))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| py_err(py, "OasisError", format!("cannot start tokio: {e}")))?;
        let config = ClientConfig {
            token,
            connect_timeout,
            request_timeout: timeout,
            max_frame,
        };
        let res = py.detach(|| catch_unwind(AssertUnwindSafe(|| connect(&rt, &endpoint, &config))));
        if endpoint.kind == TransportKind::Ucx && !UCX_ATEXIT.load(Ordering::Acquire) {
            // Whether or not this connect succeeded, the shared transport may be running now.
            if UCX.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                ucx_atexit(py)?;
            }
        }
        let addr = endpoint.addr.clone();
        let label = match endpoint.kind {
            TransportKind::Tcp => addr.clone(),
            TransportKind::Ucx => endpoint.url(),
        };
        let client = match res {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                // Nothing was connected when the transport itself is missing.
                let dropped = !matches!(e, RtError::Unavailable(_));
                return Err(rt_err(py, e, &label, dropped));
            }
            Err(_) => return Err(internal(py, "__init__")),
        };
        Ok(Self {
            rt,
            conn: Mutex::new(Conn {
                client: Some(client),
                sent: 0,
                received: 0,
            }),
            addr,
            label,
            endpoint,
            timeout,
            use_rma: rma,
        })
    }

    /// Stage whole blocks of `request`: `keys[i] = (layer, block)` takes the i-th
    /// `geometry.block_bytes` of `data` (`[2 (K, V)][num_kv_heads][block_size][head_dim]` each).
    /// `geometry = (num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks,
    /// kv_format)`: `kv_format` 0 (elements of `dtype_bytes`) or 1 (fp8_e4m3: each head's
    /// `block_size * head_dim` one-byte codes, then its float32 scale).
    /// Split into as many frames as the frame limit needs. Returns `(stored_bytes, used_bytes)`.
    ///
    /// Raises `RemoteBusyError` past the daemon's budget, `InvalidArgumentError` for keys or
    /// lengths that do not fit the geometry.
    fn stage_blocks(
        &self,
        py: Python<'_>,
        request: u64,
        geometry: GeometryTuple,
        keys: Vec<(u16, u32)>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, u64)> {
        let g = self::geometry(py, geometry)?;
        g.validate()
            .map_err(|e| rt_err(py, e, &self.label, false))?;
        let data = payload_view(py, "data", data)?;
        let bb = g.block_bytes();
        if data.len as u64 != keys.len() as u64 * bb {
            return Err(bad_arg(
                py,
                format!(
                    "data holds {} bytes but {} blocks of {bb} bytes need {}; pass one block per key",
                    data.len,
                    keys.len(),
                    keys.len() as u64 * bb
                ),
            ));
        }
        let frame = self.max_frame_now().min(BULK_FRAME_BYTES);
        let per_frame = ((frame.saturating_sub(STAGE_OVERHEAD)) / (6 + bb))
            .clamp(1, MAX_ENTRIES as u64) as usize;
        let bb = bb as usize;
        let view = &data;
        let res = self.call(py, "stage_blocks", move |rt, c| {
            let (mut stored, mut used) = (0, 0);
            for (n, chunk) in keys.chunks(per_frame).enumerate() {
                let first = n * per_frame;
                // One copy per frame: the frame's blocks, sliced from it.
                let bytes = view.copy(first * bb..(first + chunk.len()) * bb);
                let blocks = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, &(layer, block))| StagedBlock {
                        layer,
                        block,
                        data: bytes.slice(i * bb..(i + 1) * bb),
                    })
                    .collect();
                let s = rt.block_on(c.stage_blocks(request, g, blocks))?;
                stored += s.stored_bytes;
                used = s.used_bytes;
            }
            Ok((stored, used))
        });
        data.release(py);
        res
    }

    /// Stage summary rows: `runs[i] = (layer, first_block, num_blocks)` takes the next
    /// `num_blocks * geometry.summary_row_bytes` of `data` (`[num_kv_heads][2 (min, max)]
    /// [head_dim]` per block). One frame per run group under the frame limit. Returns
    /// `(stored_bytes, used_bytes)`.
    fn stage_summaries(
        &self,
        py: Python<'_>,
        request: u64,
        geometry: GeometryTuple,
        runs: Vec<(u16, u32, u32)>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, u64)> {
        let g = self::geometry(py, geometry)?;
        g.validate()
            .map_err(|e| rt_err(py, e, &self.label, false))?;
        let data = payload(py, "data", data)?;
        let row = g.summary_row_bytes();
        let rows: u64 = runs.iter().map(|r| u64::from(r.2)).sum();
        if data.len() as u64 != rows * row {
            return Err(bad_arg(
                py,
                format!(
                    "data holds {} bytes but {rows} summary rows of {row} bytes need {}",
                    data.len(),
                    rows * row
                ),
            ));
        }
        let limit = self.max_frame_now().saturating_sub(STAGE_OVERHEAD);
        self.call(py, "stage_summaries", move |rt, c| {
            let (mut stored, mut used) = (0, 0);
            let mut at = 0usize;
            let mut batch: Vec<SummaryRun> = Vec::new();
            let mut batch_bytes = 0u64;
            let mut flush = |batch: &mut Vec<SummaryRun>, c: &mut Client| -> Result<(), RtError> {
                if !batch.is_empty() {
                    let s = rt.block_on(c.stage_summaries(request, g, std::mem::take(batch)))?;
                    stored += s.stored_bytes;
                    used = s.used_bytes;
                }
                Ok(())
            };
            for (layer, first_block, num_blocks) in runs {
                // Long runs are cut so that each piece fits a frame.
                let max_rows = (limit.saturating_sub(10) / row).max(1);
                let mut done = 0u64;
                while done < u64::from(num_blocks) {
                    let n = (u64::from(num_blocks) - done).min(max_rows);
                    let len = (n * row) as usize;
                    if batch_bytes + 10 + n * row > limit {
                        flush(&mut batch, c)?;
                        batch_bytes = 0;
                    }
                    batch.push(SummaryRun {
                        layer,
                        first_block: first_block + done as u32,
                        data: data.slice(at..at + len),
                    });
                    batch_bytes += 10 + n * row;
                    at += len;
                    done += n;
                }
            }
            flush(&mut batch, c)?;
            Ok((stored, used))
        })
    }

    /// Set the admission set of a staged request: `selected` `(layer, block)` pairs (the blocks
    /// its first decode step needs) and named `sections` (name -> tensor or bytes-like; names of
    /// 1-64 characters from `[a-z0-9_.:/-]`). Returns `(stored_bytes, used_bytes)`.
    ///
    /// Raises `RemoteNotFoundError` when nothing of the request was staged.
    #[pyo3(signature = (request, selected, sections = None))]
    fn stage_admission(
        &self,
        py: Python<'_>,
        request: u64,
        selected: Vec<(u16, u32)>,
        sections: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(u64, u64)> {
        let mut secs = Vec::new();
        if let Some(d) = sections {
            for (k, v) in d.iter() {
                let name: String = k
                    .extract()
                    .map_err(|_| bad_arg(py, "section names must be str".into()))?;
                let data = payload(py, &format!("section {name:?}"), &v)?;
                secs.push(Section { name, data });
            }
        }
        let selected = selected
            .into_iter()
            .map(|(layer, block)| LayerBlock { layer, block })
            .collect();
        self.call(py, "stage_admission", move |rt, c| {
            let s = rt.block_on(c.stage_admission(request, selected, secs))?;
            Ok((s.stored_bytes, s.used_bytes))
        })
    }

    /// The admission set of layers `first_layer .. first_layer + num_layers` as a dict:
    /// `geometry` (the staged 7-tuple), `summary_runs` (`(layer, first_block, num_blocks)`) with
    /// their rows back to back in `summaries` (a bytearray), `block_keys` (`(layer, block)`) with
    /// the blocks back to back in `blocks` (a bytearray), `sections` (name -> bytes, when
    /// `include_sections`) and `wire_bytes` (the reply frame's bytes).
    ///
    /// Raises `RemoteNotFoundError` (unknown request, or a selected block not staged);
    /// `InvalidArgumentError` when the reply would pass the frame limit (ask for fewer layers).
    #[pyo3(signature = (request, first_layer, num_layers, include_sections = true))]
    fn fetch_admission<'py>(
        &self,
        py: Python<'py>,
        request: u64,
        first_layer: u16,
        num_layers: u16,
        include_sections: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (a, wire) = self.call(py, "fetch_admission", move |rt, c| {
            let before = c.wire_bytes().1;
            let a =
                rt.block_on(c.fetch_admission(request, first_layer, num_layers, include_sections))?;
            Ok((a, c.wire_bytes().1 - before))
        })?;
        let d = PyDict::new(py);
        d.set_item("geometry", geometry_tuple(&a.geometry))?;
        let row = a.geometry.summary_row_bytes().max(1);
        let runs: Vec<(u16, u32, u64)> = a
            .summaries
            .iter()
            .map(|r| (r.layer, r.first_block, r.data.len() as u64 / row))
            .collect();
        d.set_item("summary_runs", runs)?;
        let rows: Vec<Bytes> = a.summaries.iter().map(|r| r.data.clone()).collect();
        d.set_item("summaries", bytearray_of(py, &rows)?)?;
        let keys: Vec<(u16, u32)> = a.blocks.iter().map(|b| (b.layer, b.block)).collect();
        d.set_item("block_keys", keys)?;
        let blocks: Vec<Bytes> = a.blocks.iter().map(|b| b.data.clone()).collect();
        d.set_item("blocks", bytearray_of(py, &blocks)?)?;
        let sections = PyDict::new(py);
        for s in &a.sections {
            sections.set_item(&s.name, PyBytes::new(py, &s.data))?;
        }
        d.set_item("sections", sections)?;
        d.set_item("wire_bytes", wire)?;
        Ok(d)
    }

    /// Read a batch of blocks, possibly across requests: `keys[i] = (request, layer, block,
    /// head)`, `head = -1` for the whole block, else that KV head's K rows then its V rows.
    /// Returns `(data, lens, errors)`: the entries' bytes back to back in one bytearray, each
    /// entry's length (0 when it failed), and per entry `None` or the error's code name
    /// (`"unknown_request"`, `"missing_block"`, ...): entries fail one by one.
    ///
    /// Over UCX the bytes are read by RMA (see [`PyRtClient::rma`]); the answer is the same.
    ///
    /// Raises `InvalidArgumentError` when the reply would pass the frame limit (fewer keys).
    fn read_blocks<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<(u64, u16, u32, i32)>,
    ) -> PyResult<ReadReply<'py>> {
        let entries = self.read_entries(py, keys)?;
        let mut parts = Vec::with_capacity(entries.len());
        let mut lens = Vec::with_capacity(entries.len());
        let mut errors = Vec::with_capacity(entries.len());
        for e in entries {
            match e {
                Ok(b) => {
                    lens.push(b.len());
                    errors.push(None);
                    parts.push(b);
                }
                Err(code) => {
                    lens.push(0);
                    errors.push(Some(code.name()));
                }
            }
        }
        Ok((bytearray_of(py, &parts)?, lens, errors))
    }

    /// `read_blocks`, written straight into host pools instead of returned: entry `i` goes to
    /// row `rows[i]` of `host_k[layer]` / `host_v[layer]` (`layer` the key's): with `head = -1`
    /// the whole row (every head), else that head's `[block_size, head_dim]`. Each pool is a
    /// contiguous CPU tensor `[rows, num_kv_heads, block_size, head_dim]`, all of one shape and
    /// dtype. An fp8_e4m3 pool (uint8 codes; a request staged with `kv_format = 1`) passes its
    /// scales too, `host_k_scales` / `host_v_scales`: one float32 `[rows, num_kv_heads]` tensor
    /// per layer; each head's codes go to the pool and the scale after them to its place there.
    /// Returns `(lens, errors)` as `read_blocks`; an entry whose length is not the
    /// destination's (a plain entry into an fp8 pool, say) fails with `"size_mismatch"` and
    /// writes nothing.
    ///
    /// One copy per entry, from the received frame into the pool, with the GIL released: no
    /// bytearray and no tensor ops in between (the decode loop's reads of missing blocks).
    ///
    /// Raises `InvalidArgumentError` for a key or row outside the pools, `ShapeError` /
    /// `DTypeError` / `DeviceError` for pools that are not as above.
    #[pyo3(signature = (keys, rows, host_k, host_v, host_k_scales = None, host_v_scales = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: pools and their scales per side
    fn read_blocks_into(
        &self,
        py: Python<'_>,
        keys: Vec<(u64, u16, u32, i32)>,
        rows: Vec<i64>,
        host_k: Vec<TensorArg>,
        host_v: Vec<TensorArg>,
        host_k_scales: Option<Vec<TensorArg>>,
        host_v_scales: Option<Vec<TensorArg>>,
    ) -> PyResult<(Vec<usize>, Vec<Option<&'static str>>)> {
        let scales = match (&host_k_scales, &host_v_scales) {
            (None, None) => None,
            (Some(k), Some(v)) => Some((k.as_slice(), v.as_slice())),
            _ => {
                return Err(bad_arg(
                    py,
                    "pass host_k_scales and host_v_scales together (an fp8 pool) or neither".into(),
                ))
            }
        };
        let dests = pool_dests(py, &keys, &rows, &host_k, &host_v, scales)?;
        let entries = self.read_entries(py, keys)?;
        py.detach(|| {
            let mut lens = Vec::with_capacity(entries.len());
            let mut errors = Vec::with_capacity(entries.len());
            for (e, d) in entries.iter().zip(&dests) {
                match e {
                    Ok(b) if b.len() == d.entry_bytes() => {
                        // SAFETY: (1) the guard; (2) pool_dests checked that the row's heads
                        // (and their scales) lie inside host_k[layer] / host_v[layer] (and the
                        // scale tensors), live CPU tensors the caller holds for the whole call;
                        // the frame's bytes are a separate buffer.
                        unsafe { d.write(b) }
                        lens.push(b.len());
                        errors.push(None);
                    }
                    Ok(_) => {
                        lens.push(0);
                        errors.push(Some("size_mismatch"));
                    }
                    Err(code) => {
                        lens.push(0);
                        errors.push(Some(code.name()));
                    }
                }
            }
            Ok((lens, errors))
        })
    }

    /// Release a request in the daemon; returns the bytes it freed (0 when it held nothing).
    fn release(&self, py: Python<'_>, request: u64) -> PyResult<u64> {
        self.call(py, "release", move |rt, c| rt.block_on(c.release(request)))
    }

    /// The daemon's counters and gauges, name -> int.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, "stats", |rt, c| rt.block_on(c.stats()))?;
        let d = PyDict::new(py);
        for (name, v) in s.fields() {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Drop the connection (later calls raise `RemoteUnavailableError`). Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let mut conn = self.lock();
            if let Some(c) = conn.client.take() {
                let (s, r) = c.wire_bytes();
                conn.sent += s;
                conn.received += r;
            }
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    /// Whether the connection is usable (a timeout, a closed socket or a malformed reply drop
    /// it for good).
    #[getter]
    fn connected(&self) -> bool {
        self.lock()
            .client
            .as_ref()
            .is_some_and(Client::is_connected)
    }

    /// `(sent, received)`: bytes of every frame this object exchanged, length prefixes
    /// included (the protocol's count of what crossed the wire).
    #[getter]
    fn wire_bytes(&self) -> (u64, u64) {
        let conn = self.lock();
        let (s, r) = conn.client.as_ref().map_or((0, 0), Client::wire_bytes);
        (conn.sent + s, conn.received + r)
    }

    /// The largest frame this client sends (its own limit and the daemon's, the smaller).
    #[getter]
    fn max_frame(&self) -> u64 {
        self.max_frame_now()
    }

    /// `HOST:PORT` of the daemon.
    #[getter]
    fn addr(&self) -> String {
        self.addr.clone()
    }

    /// The daemon's URL, `oasis-rt://HOST:PORT` or `oasis-rt+ucx://HOST:PORT`.
    #[getter]
    fn url(&self) -> String {
        self.endpoint.url()
    }

    /// `"tcp"` or `"ucx"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.endpoint.kind.name()
    }

    /// Whether `read_blocks` reads by RMA (a UCX connection to a daemon that offers it, and
    /// `rma=True`).
    #[getter]
    fn rma(&self) -> bool {
        self.use_rma && self.lock().client.as_ref().is_some_and(Client::rma)
    }

    #[getter]
    fn timeout_s(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    fn __repr__(&self) -> String {
        format!(
            "RtClient(url={:?}, timeout_s={}, connected={})",
            self.endpoint.url(),
            self.timeout.as_secs_f64(),
            self.connected()
        )
    }
}

/// Add the client class and `ucx_version` to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRtClient>()?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
    Ok(())
}
