//! The process's shared UCX transport (started on first use, shut down at exit), `ucx_version`,
//! and `connect` over either transport.

use super::*;

/// The process's UCX transport, shared by every UCX client (see the module docs), with the id
/// of the process that started it.
pub(crate) static UCX: Mutex<Option<(u32, UcxTransport)>> = Mutex::new(None);
/// Whether the `atexit` hook that shuts [`UCX`] down is registered.
pub(crate) static UCX_ATEXIT: AtomicBool = AtomicBool::new(false);

/// The shared UCX transport, started (libucp loaded, progress thread running) on first use.
/// Blocks for UCX's initialisation: call it with the GIL released.
pub(crate) fn shared_ucx() -> Result<UcxTransport, RtError> {
    let mut slot = UCX.lock().unwrap_or_else(PoisonError::into_inner);
    let pid = std::process::id();
    match slot.as_ref() {
        Some((owner, t)) if *owner == pid => return Ok(t.clone()),
        // UCX is not fork-safe: in a child forked after UCX started, a new context's
        // connections hang and its teardown aborts (seen with UCX 1.13).
        Some(_) => {
            return Err(RtError::Unavailable(
                "ucx transport: this process was forked after UCX started in its parent, and \
                 UCX cannot be used after a fork; start the process with multiprocessing's \
                 'spawn' method"
                    .into(),
            ))
        }
        None => {}
    }
    // Eager frames past the hard limit are dropped by the thread; each client checks its own,
    // smaller, max_frame.
    let t = UcxTransport::new(UcxConfig {
        max_frame: HARD_MAX_FRAME_BYTES,
        ..UcxConfig::default()
    })?;
    *slot = Some((pid, t.clone()));
    Ok(t)
}

/// Register [`ucx_shutdown`] with `atexit`, once.
pub(crate) fn ucx_atexit(py: Python<'_>) -> PyResult<()> {
    if UCX_ATEXIT.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    let hook = wrap_pyfunction!(ucx_shutdown, py)?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// Shut the shared UCX transport down (its connections close, its progress thread ends); a
/// later UCX client starts a new one. Registered with `atexit` by the first UCX client.
#[pyfunction]
#[pyo3(name = "_ucx_shutdown")]
pub(super) fn ucx_shutdown(py: Python<'_>) {
    let t = UCX.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some((owner, t)) = t {
        if owner != std::process::id() {
            // A forked child's copy of its parent's transport: UCX must not be touched here.
            std::mem::forget(t);
            return;
        }
        py.detach(|| {
            let _ = catch_unwind(AssertUnwindSafe(|| t.shutdown_blocking()));
        });
    }
}

/// The version of the libucp the UCX transport loads, `(major, minor, release)`, without
/// connecting anywhere.
///
/// Raises `ConfigError` (`.code == "ucx_unavailable"`) when libucp cannot be loaded, saying how
/// to install it.
#[pyfunction]
pub fn ucx_version(py: Python<'_>) -> PyResult<(u32, u32, u32)> {
    match py.detach(oasis_rt::ucx::probe) {
        Ok(v) => Ok((v.major, v.minor, v.release)),
        Err(e) => Err(rt_err(py, e, "(ucx)", false)),
    }
}

/// Connect to `endpoint` over its transport and authenticate. Runs with the GIL released.
pub(super) fn connect(
    rt: &tokio::runtime::Runtime,
    endpoint: &Endpoint,
    config: &ClientConfig,
) -> Result<Client, RtError> {
    let (connect_timeout, io_timeout) = (config.connect_timeout, config.request_timeout);
    let conn = match endpoint.kind {
        TransportKind::Tcp => {
            let t = TcpTransport {
                config: TcpConfig {
                    connect_timeout,
                    io_timeout,
                },
            };
            AnyConnection::Tcp(rt.block_on(t.connect(&endpoint.addr))?)
        }
        TransportKind::Ucx => {
            // This client's deadlines on the shared worker.
            let mut t = shared_ucx()?;
            t.config.connect_timeout = connect_timeout;
            t.config.io_timeout = io_timeout;
            AnyConnection::Ucx(rt.block_on(t.connect(&endpoint.addr))?)
        }
    };
    rt.block_on(Client::handshake(conn, config))
}
