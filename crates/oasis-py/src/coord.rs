//! `oasiskv._core.Coordinator`: the decode side's remote reads (`oasis_coord::Coordinator`)
//! for `oasiskv.disagg.RemoteKvSource` (decode-time misses and a full transfer's admission).
//!
//! ```text
//! Python (engine thread)                       oasis-coord (its own tokio threads)
//! register_pools(host_k, host_v[, scales]) ──▶ raw addresses of the pinned pools
//! submit(layers, rows, heads)  (GIL released) ▶ frames in layer order over N connections
//! wait_layer(layer)            (GIL released) ◀ that layer's bytes written, entries present
//! wait_request(request, layer) (GIL released) ◀ one request's (an admission streaming it in)
//! take_failed() ◀─ requests whose reads failed, with why
//! ```
//!
//! Connections go over the address's transport: `HOST:PORT` / `oasis-rt://` is TCP,
//! `oasis-rt+ucx://` UCX through the process's shared UCX transport (as `RtClient`; bytes by
//! RMA unless `rma=False`). Connections open on first use and again after a transport failure,
//! `retries` times per frame; every call of a connection finishes within `timeout_s`.
//!
//! Every method runs under `catch_unwind` (no panic crosses into Python); the ones that block
//! or copy release the GIL. Caller mistakes raise `InvalidArgumentError` / `ShapeError` /
//! `DTypeError` / `DeviceError` saying what to pass.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use oasis_coord::{
    Connector, CoordConfig, CoordError, Coordinator, Entry, LayerPool, PoolLayout, ALL_HEADS,
};
use oasis_rt::transport::{
    AnyConnection, Endpoint, TcpConfig, TcpTransport, Transport, TransportKind,
};
use oasis_rt::{Client, ClientConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{core_err, py_err};
use crate::rt::buffers::check_host_pools;
use crate::rt::errors::{bad_arg, rt_err};
use crate::rt::ucx::{shared_ucx, ucx_atexit, UCX, UCX_ATEXIT};
use crate::rt::{check_timeout, token_bytes};
use crate::tensor::TensorArg;

/// Connections over the endpoint's transport (the UCX one shared with `RtClient`).
struct AnyConnector {
    endpoint: Endpoint,
    config: ClientConfig,
}

impl Connector for AnyConnector {
    type Conn = AnyConnection;

    async fn connect(&self, _index: usize) -> oasis_rt::Result<Client<AnyConnection>> {
        let (connect_timeout, io_timeout) =
            (self.config.connect_timeout, self.config.request_timeout);
        let conn = match self.endpoint.kind {
            TransportKind::Tcp => {
                let t = TcpTransport {
                    config: TcpConfig {
                        connect_timeout,
                        io_timeout,
                    },
                };
                AnyConnection::Tcp(t.connect(&self.endpoint.addr).await?)
            }
            TransportKind::Ucx => {
                let mut t = shared_ucx()?;
                t.config.connect_timeout = connect_timeout;
                t.config.io_timeout = io_timeout;
                AnyConnection::Ucx(t.connect(&self.endpoint.addr).await?)
            }
        };
        Client::handshake(conn, &self.config).await
    }
}

pub(crate) fn coord_err(py: Python<'_>, e: CoordError) -> PyErr {
    match e {
        CoordError::Invalid(m) => bad_arg(py, m),
        CoordError::Presence(e) => core_err(py, e),
        CoordError::NoPools => bad_arg(
            py,
            "no host pools registered: call register_pools(host_k, host_v[, scales]) first".into(),
        ),
        CoordError::Closed => py_err(
            py,
            "RemoteUnavailableError",
            "the coordinator is closed; make a new Coordinator".into(),
        ),
        e @ CoordError::Runtime(_) => py_err(py, "OasisError", e.to_string()),
    }
}

pub(crate) fn internal(py: Python<'_>, what: &str) -> PyErr {
    py_err(
        py,
        "OasisError",
        format!("internal error in Coordinator.{what}; please report it"),
    )
}

fn row_u32(py: Python<'_>, row: i64) -> PyResult<u32> {
    u32::try_from(row).map_err(|_| bad_arg(py, format!("host row {row} must be in 0..2**32")))
}

fn entries(py: Python<'_>, layers: &[i64], rows: &[i64], heads: &[i64]) -> PyResult<Vec<Entry>> {
    if layers.len() != rows.len() || rows.len() != heads.len() {
        return Err(bad_arg(
            py,
            format!(
                "layers, rows and heads are one entry each: pass lists of equal length (got {}, \
                 {} and {})",
                layers.len(),
                rows.len(),
                heads.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(rows.len());
    for ((&l, &r), &h) in layers.iter().zip(rows).zip(heads) {
        let layer =
            u16::try_from(l).map_err(|_| bad_arg(py, format!("layer {l} must be in 0..65535")))?;
        let head = match h {
            -1 => ALL_HEADS,
            h if (0..i64::from(ALL_HEADS)).contains(&h) => h as u16,
            h => {
                return Err(bad_arg(
                    py,
                    format!("head {h} is neither -1 (every head) nor a KV head index"),
                ))
            }
        };
        out.push(Entry {
            layer,
            row: row_u32(py, r)?,
            head,
        });
    }
    Ok(out)
}

/// The decode side's remote reads (see the module docs).
#[pyclass(name = "Coordinator", module = "oasiskv._core")]
pub struct PyCoordinator {
    /// Shared with the step readers it starts (`oasiskv._core.StepReader`).
    pub(crate) inner: std::sync::Arc<Coordinator>,
    label: String,
    /// The registered pools, kept alive while their addresses are in use (`register_pools`'
    /// safety obligation 1); replaced by the next registration, dropped at `close`.
    pools: std::sync::Mutex<Vec<TensorArg>>,
}

/// `f` with the GIL released and no panic escaping: its error as `coord_err` says, a panic as
/// an internal error of `Coordinator.{what}` (the coordinator's and its step readers' calls).
pub(crate) fn coord_call<R: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> Result<R, CoordError> + Send,
) -> PyResult<R> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(coord_err(py, e)),
        Err(_) => Err(internal(py, what)),
    }
}

impl PyCoordinator {
    /// `f` on the coordinator with the GIL released and no panic escaping.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&Coordinator) -> Result<R, CoordError> + Send,
    ) -> PyResult<R> {
        coord_call(py, what, || f(&self.inner))
    }
}

#[pymethods]
impl PyCoordinator {
    /// Read staged block-heads of the daemon at `addr` (any `kv_source` form) into the host
    /// pools of an engine of `num_layers` layers and `num_kv_heads` KV heads, over
    /// `connections` connections, on `threads` threads of its own. A frame that fails in
    /// transport reconnects and is sent again `retries` times before the requests of its
    /// entries fail; every call finishes within `timeout_s`. A layer's entries are spread
    /// over the connections past `split_min_entries` per connection; reply frames stay under
    /// `frame_bytes`.
    ///
    /// Raises `ConfigError` for a bad address, timeouts or counts (a UCX address where libucp
    /// cannot be loaded fails its reads, with the reason, as `RtClient` says at connect).
    #[new]
    #[pyo3(signature = (addr, num_layers, num_kv_heads, *, token = None, timeout_s = 30.0, connect_timeout_s = 5.0, retries = 0, connections = 1, threads = 1, rma = true, split_min_entries = oasis_coord::coordinator::DEFAULT_SPLIT_MIN_ENTRIES, frame_bytes = oasis_coord::coordinator::DEFAULT_FRAME_BYTES))]
    #[allow(clippy::too_many_arguments)] // the Python signature, keywords with defaults
    fn new(
        py: Python<'_>,
        addr: String,
        num_layers: usize,
        num_kv_heads: usize,
        token: Option<&Bound<'_, PyAny>>,
        timeout_s: f64,
        connect_timeout_s: f64,
        retries: u32,
        connections: usize,
        threads: usize,
        rma: bool,
        split_min_entries: usize,
        frame_bytes: usize,
    ) -> PyResult<Self> {
        let request_timeout = check_timeout(py, "timeout_s", timeout_s)?;
        let connect_timeout = check_timeout(py, "connect_timeout_s", connect_timeout_s)?;
        if !(1..=64).contains(&connections) || !(1..=64).contains(&threads) {
            return Err(py_err(
                py,
                "ConfigError",
                format!(
                    "connections and threads must be in 1..=64, got {connections} and {threads}"
                ),
            ));
        }
        let token = token_bytes(py, token)?;
        let endpoint = Endpoint::parse(&addr).map_err(|e| rt_err(py, e, "address", false))?;
        if endpoint.kind == TransportKind::Ucx && !UCX_ATEXIT.load(Ordering::Acquire) {
            // The first UCX connection may start the shared transport from a coordinator
            // thread: register its shutdown now, with the GIL.
            let started = py.detach(|| shared_ucx().is_ok());
            if started || UCX.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                ucx_atexit(py)?;
            }
        }
        let label = endpoint.url();
        let connector = AnyConnector {
            endpoint,
            config: ClientConfig {
                token,
                connect_timeout,
                request_timeout,
                ..ClientConfig::default()
            },
        };
        let config = CoordConfig {
            connections,
            retries,
            threads,
            use_rma: rma,
            split_min_entries,
            frame_bytes,
        };
        let res = py.detach(|| {
            catch_unwind(AssertUnwindSafe(|| {
                Coordinator::start(connector, config, num_layers, num_kv_heads)
            }))
        });
        let inner = match res {
            Ok(Ok(c)) => c,
            Ok(Err(CoordError::Presence(e))) => {
                return Err(py_err(py, "ConfigError", e.to_string()))
            }
            Ok(Err(e)) => return Err(coord_err(py, e)),
            Err(_) => return Err(internal(py, "__init__")),
        };
        Ok(Self {
            inner: std::sync::Arc::new(inner),
            label,
            pools: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Register the host pools the reads write into (again whenever they grow or are
    /// replaced), after every read in flight has landed: `host_k` / `host_v` one contiguous CPU
    /// tensor per layer, `[rows, num_kv_heads, block_size, head_dim]`, all of one shape and
    /// dtype; an fp8_e4m3 pool (uint8 codes) passes its float32 scales too, `[rows,
    /// num_kv_heads]` per layer. The coordinator keeps references to the tensors until the next
    /// registration or `close`, so their memory outlives every write. Returns, when the pools
    /// moved, per request how many prefetched block-heads are absent again (they landed since
    /// the last step's submission and may have missed the copy into the new pools).
    ///
    /// Raises `ShapeError` / `DTypeError` / `DeviceError` for pools not as above,
    /// `InvalidArgumentError` for pools of other layers or heads than the coordinator's.
    #[pyo3(signature = (host_k, host_v, host_k_scales = None, host_v_scales = None))]
    fn register_pools(
        &self,
        py: Python<'_>,
        host_k: Vec<TensorArg>,
        host_v: Vec<TensorArg>,
        host_k_scales: Option<Vec<TensorArg>>,
        host_v_scales: Option<Vec<TensorArg>>,
    ) -> PyResult<std::collections::HashMap<i64, u64>> {
        let scales = match (&host_k_scales, &host_v_scales) {
            (None, None) => None,
            (Some(ks), Some(vs)) => Some((ks.as_slice(), vs.as_slice())),
            _ => {
                return Err(bad_arg(
                    py,
                    "pass host_k_scales and host_v_scales together (an fp8 pool) or neither".into(),
                ))
            }
        };
        let (rows, heads, head_bytes) = check_host_pools(py, &host_k, &host_v, scales)?;
        let layout = PoolLayout {
            layers: (0..host_k.len())
                .map(|l| LayerPool {
                    k: host_k[l].ptr,
                    v: host_v[l].ptr,
                    scales: scales.map(|(ks, vs)| (ks[l].ptr, vs[l].ptr)),
                })
                .collect(),
            rows,
            heads,
            head_bytes,
        };
        // SAFETY: (1) the tensors were checked above to be contiguous CPU tensors of this shape
        // (so every address the layout names is inside them), and `self.pools` keeps a
        // reference to each below until the next registration (which drains first) or
        // `close` (which drains first): their storage stays allocated. Python's side of the
        // contract (oasiskv.disagg.RemoteKvSource): it never resizes these tensors in place (a
        // grown pool is a new tensor, registered again), and (2) it writes a staged row only
        // through the coordinator's reads or before the row is taken (`take_row`), and gathers
        // a layer only after `wait_layer(layer)` (or `drain`) returned.
        let dropped = self.run(py, "register_pools", |c| unsafe {
            c.register_pools(layout)
        })?;
        let mut kept = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        *kept = host_k.into_iter().chain(host_v).collect();
        if let (Some(ks), Some(vs)) = (host_k_scales, host_v_scales) {
            kept.extend(ks.into_iter().chain(vs));
        }
        Ok(dropped.into_iter().collect())
    }

    /// Host rows of the registered pools (0: none registered).
    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    /// Engine request `request` reads from the daemon's staged request `daemon_id`.
    fn stage(&self, request: i64, daemon_id: u64) {
        self.inner.stage(request, daemon_id);
    }

    /// `request` ends: wait for its reads in flight, forget it and give its host `rows` back.
    /// Returns how many of their entries held their bytes.
    fn end(&self, py: Python<'_>, request: i64, rows: Vec<i64>) -> PyResult<u64> {
        let rows = rows
            .into_iter()
            .map(|r| row_u32(py, r))
            .collect::<PyResult<Vec<_>>>()?;
        self.run(py, "end", |c| c.end(request, &rows))
    }

    /// Host row `row` now holds staged block `logical` of `request`: every entry absent.
    fn take_row(&self, py: Python<'_>, row: i64, request: i64, logical: u32) -> PyResult<()> {
        let row = row_u32(py, row)?;
        self.run(py, "take_row", |c| c.take_row(row, request, logical))
    }

    /// `row` names `request` without holding a staged block (a bounded cache's filler).
    fn set_owner(&self, py: Python<'_>, row: i64, request: i64) -> PyResult<()> {
        let row = row_u32(py, row)?;
        self.run(py, "set_owner", |c| c.set_owner(row, request))
    }

    /// The block in `row` was evicted (after its request's reads landed): nothing left to read
    /// of it. Returns how many of its entries held their bytes.
    fn forget_row(&self, py: Python<'_>, row: i64) -> PyResult<u64> {
        let row = row_u32(py, row)?;
        self.run(py, "forget_row", |c| c.forget_row(row))
    }

    /// Entries the caller wrote itself (an admission's blocks), `(layers[i], rows[i],
    /// heads[i])`, head -1 for every head of the row; per entry how many were absent.
    fn mark_present(
        &self,
        py: Python<'_>,
        layers: Vec<i64>,
        rows: Vec<i64>,
        heads: Vec<i64>,
    ) -> PyResult<Vec<u32>> {
        let keys = entries(py, &layers, &rows, &heads)?;
        self.run(py, "mark_present", |c| c.mark_present(&keys))
    }

    /// The `rows` of `layer` with some head absent.
    fn absent_blocks(&self, py: Python<'_>, layer: u16, rows: Vec<i64>) -> PyResult<Vec<u32>> {
        let rows = rows
            .into_iter()
            .map(|r| row_u32(py, r))
            .collect::<PyResult<Vec<_>>>()?;
        self.run(py, "absent_blocks", |c| c.absent_blocks(layer, &rows))
    }

    /// Whether head `head` of `row` in `layer` holds its bytes.
    fn is_present(&self, py: Python<'_>, layer: i64, row: i64, head: i64) -> PyResult<bool> {
        let e = entries(py, &[layer], &[row], &[head])?[0];
        self.run(py, "is_present", |c| c.is_present(e))
    }

    /// Per row of `rows`: `(request, logical block)`, request -1 for a row no staged request
    /// holds.
    fn owners(&self, py: Python<'_>, rows: Vec<i64>) -> PyResult<Vec<(i64, u32)>> {
        let rows = rows
            .into_iter()
            .map(|r| row_u32(py, r))
            .collect::<PyResult<Vec<_>>>()?;
        self.run(py, "owners", |c| c.owners(&rows))
    }

    /// Absent entries, all layers (0: nothing left to read).
    #[getter]
    fn missing(&self) -> u64 {
        self.inner.missing()
    }

    /// Read the absent entries among `(layers[i], rows[i], heads[i])` (head -1: every head of
    /// the row) that are not in flight and whose request has not failed, in layer order over
    /// every connection. Returns at once: per layer, how many entries its `wait_layer` waits
    /// for (0: that layer's gather reads nothing new). `background=True`: reads no step waits for (a
    /// request streamed in at admission): `wait_layer` skips them, `wait_request` of their
    /// request waits for them. A step's submission takes over the background reads it needs
    /// (their `wait_layer` covers them). `prefetch=N` (a step's only): then queue background
    /// reads of up to N block-heads the next steps likely plan (the successors of these blocks,
    /// their requests' most recent staged blocks), at most N in flight at once; no wait covers
    /// them, and a failed one fails its request like any read. Not with rows that change hands
    /// between steps (a bounded cache).
    #[pyo3(signature = (layers, rows, heads, *, background = false, prefetch = 0))]
    fn submit(
        &self,
        py: Python<'_>,
        layers: Vec<i64>,
        rows: Vec<i64>,
        heads: Vec<i64>,
        background: bool,
        prefetch: usize,
    ) -> PyResult<Vec<u32>> {
        if background && prefetch > 0 {
            return Err(bad_arg(
                py,
                "prefetch follows a step's reads: pass background=False with prefetch".into(),
            ));
        }
        let keys = entries(py, &layers, &rows, &heads)?;
        self.run(py, "submit", |c| {
            if background {
                c.submit_background(&keys)
            } else {
                c.submit_step(&keys, prefetch)
            }
        })
    }

    /// Block (GIL released) until every entry of `layer` submitted so far for a step (not in
    /// the background) has landed or failed; the seconds waited.
    fn wait_layer(&self, py: Python<'_>, layer: usize) -> PyResult<f64> {
        self.run(py, "wait_layer", |c| c.wait_layer(layer))
            .map(|d| d.as_secs_f64())
    }

    /// Block (GIL released) until every read in flight has landed or failed; the seconds
    /// waited.
    fn drain(&self, py: Python<'_>) -> PyResult<f64> {
        self.run(py, "drain", |c| Ok(c.drain()))
            .map(|d| d.as_secs_f64())
    }

    /// Step entries of `layer` in flight.
    fn pending(&self, layer: usize) -> usize {
        self.inner.pending(layer)
    }

    /// Entries of `request` in flight: of `layer` only, or (None) of every layer. 0: every
    /// read submitted for it has landed or failed (`take_failed` says which).
    #[pyo3(signature = (request, layer = None))]
    fn in_flight(&self, request: i64, layer: Option<u16>) -> usize {
        self.inner.in_flight(request, layer)
    }

    /// Block (GIL released) until every entry of `request` submitted so far (of `layer` only,
    /// when given) has landed or failed; the seconds waited. An admission streaming a request
    /// in waits this way, layer by layer, for its own reads alone.
    #[pyo3(signature = (request, layer = None))]
    fn wait_request(&self, py: Python<'_>, request: i64, layer: Option<usize>) -> PyResult<f64> {
        self.run(py, "wait_request", |c| c.wait_request(request, layer))
            .map(|d| d.as_secs_f64())
    }

    /// Release the daemon's staged request `daemon_id` from a connection's thread, after the
    /// frames queued on it (call it after `end`): returns at once, never waiting on the daemon.
    /// Best effort: `stats()["failed_releases"]` counts the ones that failed (the daemon's lease
    /// frees them). Raises `RemoteUnavailableError` once closed.
    fn release(&self, py: Python<'_>, daemon_id: u64) -> PyResult<()> {
        self.run(py, "release", |c| c.release(daemon_id))
    }

    /// Fail `request` for the caller's own reason: nothing of it is read until it ends.
    fn fail(&self, request: i64, message: String) {
        self.inner.fail(request, message);
    }

    /// Requests whose reads failed since the last call -> why.
    fn take_failed(&self) -> std::collections::HashMap<i64, String> {
        self.inner.take_failed().into_iter().collect()
    }

    /// Per request since the last call: `request -> (block-heads landed, wire bytes)`.
    fn take_landed(&self) -> std::collections::HashMap<i64, (u64, u64)> {
        self.inner
            .take_landed()
            .into_iter()
            .map(|(o, n, w)| (o, (n, w)))
            .collect()
    }

    /// Counters since it started: `read_seconds` (connection time on frames, off this
    /// thread), `wait_seconds` (time blocked in `wait_layer` / `drain`), `wire_bytes`,
    /// `sent_entries` (block-heads submitted), `entries` (block-heads landed), `failed_entries`,
    /// `frames` (done), `frames_started` (taken off a queue), `reconnects`, `releases` and
    /// `failed_releases`; `step_entries` (block-heads
    /// steps submitted: their own misses), `prefetch_entries` / `prefetched_entries`
    /// (prefetched block-heads queued / landed), `prefetch_hits` (planned block-heads a
    /// prefetch brought), `prefetch_taken` (queued prefetches a step read itself),
    /// `prefetch_cancelled` (queued prefetches of a request that ended) and `prefetch_dropped`
    /// (prefetches made absent again when the pools moved).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("read_seconds", s.read_seconds)?;
        d.set_item("wait_seconds", s.wait_seconds)?;
        d.set_item("wire_bytes", s.wire_bytes)?;
        d.set_item("sent_entries", s.sent_entries)?;
        d.set_item("entries", s.entries)?;
        d.set_item("failed_entries", s.failed_entries)?;
        d.set_item("frames", s.frames)?;
        d.set_item("frames_started", s.frames_started)?;
        d.set_item("reconnects", s.reconnects)?;
        d.set_item("releases", s.releases)?;
        d.set_item("failed_releases", s.failed_releases)?;
        d.set_item("step_entries", s.step_entries)?;
        d.set_item("prefetch_entries", s.prefetch_entries)?;
        d.set_item("prefetched_entries", s.prefetched_entries)?;
        d.set_item("prefetch_hits", s.prefetch_hits)?;
        d.set_item("prefetch_taken", s.prefetch_taken)?;
        d.set_item("prefetch_cancelled", s.prefetch_cancelled)?;
        d.set_item("prefetch_dropped", s.prefetch_dropped)?;
        Ok(d)
    }

    /// Let every read in flight land, then stop the connections and threads (and drop the
    /// pools' references). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, "close", |c| {
            c.close();
            Ok(())
        })?;
        self.pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Coordinator({}, connections={}, retries={})",
            self.label,
            self.inner.config().connections,
            self.inner.config().retries
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCoordinator>()
}
