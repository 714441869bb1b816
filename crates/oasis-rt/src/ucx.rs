//! The UCX transport (feature `ucx`): `libucp` loaded at run time, frames as active messages.
//!
//! Neither published binding builds against the system UCX (see `docs/ARCHITECTURE.md`,
//! "Choosing the UCX bindings"), so [`sys`] declares the few `ucp_*` entry points used by hand
//! and loads `libucp.so.0` with `libloading`, as `oasis-cuda` does with the CUDA driver: the
//! binary runs on a machine without UCX and says what is missing when UCX is asked for.
//!
//! ```text
//!  Client / Server (tokio)                       oasis-ucx thread ([`worker`])
//!  UcxConnection::send_frame ── Cmd::Send ──▶ ucp_am_send_nbx (rendezvous from 64 KiB:
//!                            ◀── oneshot ───    the receiver RMA-reads the sender's buffer)
//!  UcxConnection::recv_frame ◀── Incoming ───  AM callback: eager bytes, or a rendezvous
//!     check the length against max_frame       descriptor with only the length
//!     ── Cmd::Pull / Cmd::Discard ──────────▶  ucp_am_recv_data_nbx / ucp_am_data_release
//!  UcxListener::accept      ◀── ConnParts ──   listener conn request -> ucp_ep_create
//!  UcxTransport::connect    ── Cmd::Connect ▶  ucp_ep_create(sockaddr) + ucp_ep_flush_nbx
//! ```
//!
//! Addresses are `HOST:PORT` socket addresses, as for TCP: UCX's connection manager connects
//! over TCP/IP and then picks its transports (`UCX_TLS`: shared memory, TCP, RDMA verbs...).
//! The protocol, its limits and its failure semantics are the TCP transport's: same frames, same
//! length check before a frame's body is received (a rendezvous frame's bytes stay at the
//! sender until the reader accepts its length), same deadlines.
//!
//! **RMA.** [`UcxTransport::register`] registers a buffer for remote reads ([`UcxRegion`]; its
//! [`RemoteRegion`] is what a peer needs: base address, length, packed rkey), and
//! [`UcxConnection::get`] reads a range of a peer's region by `ucp_get_nbx`, after checking the
//! range against the region the peer advertised ([`RemoteRegion::check`]). The daemon registers
//! its staged blocks through [`Transport::registrar`] and answers `ReadBlocksRma` with ranges of
//! them; the client reads them with `get` (see `crate::protocol`, `crate::server`).

pub mod sys;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::pool::Registered;
use crate::protocol::{check_frame_len, DEFAULT_MAX_FRAME_BYTES, LEN_PREFIX_BYTES};
use crate::transport::{
    Connection, Listener, Registering, Registrar, RmaConnection, Transport,
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT,
};
use worker::{Cmd, ConnParts, GetItem, Incoming, RegionParts, Worker};

pub use sys::LIBUCP_NAMES;

pub use crate::protocol::{RemoteRegion, MAX_GET_BYTES, MAX_RKEY_BYTES};

/// A buffer registered with a transport's UCX context for remote reads (`ucp_mem_map`, remote
/// read only). The buffer stays registered and alive until the region is dropped.
///
/// NOTE: UCX enforces the region's bounds and protection only where the hardware does (RDMA
/// verbs); over shared memory (CMA) a peer with any rkey of this process can read other memory
/// of it too. Hand rkeys to authenticated peers only.
#[derive(Debug)]
pub struct UcxRegion {
    worker: Arc<Worker>,
    id: u64,
    remote: RemoteRegion,
}

impl UcxRegion {
    /// What a peer needs to read it.
    pub fn remote(&self) -> &RemoteRegion {
        &self.remote
    }
}

impl Registered for UcxRegion {
    fn remote(&self) -> &RemoteRegion {
        &self.remote
    }
}

impl Registrar for UcxTransport {
    fn register(&self, data: Bytes) -> Registering {
        let t = self.clone();
        Box::pin(async move {
            let r: Arc<dyn Registered> = Arc::new(t.register(data).await?);
            Ok(r)
        })
    }
}

impl Drop for UcxRegion {
    fn drop(&mut self) {
        let _ = self.worker.submit(Cmd::MemUnmap(self.id));
    }
}

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
/// [`Error::Unavailable`] when the library or one of the symbols used cannot be loaded.
pub fn probe() -> Result<UcxVersion> {
    let api =
        sys::api().map_err(|e| Error::Unavailable(format!("ucx transport unavailable: {e}")))?;
    let (major, minor, release) = api.version;
    Ok(UcxVersion {
        major,
        minor,
        release,
    })
}

/// Deadlines and limits of the UCX transport.
#[derive(Clone, Copy, Debug)]
pub struct UcxConfig {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    /// Eager frames longer than this (plus the prefix) are dropped unread by the progress
    /// thread; each reader still checks its own, smaller, limit.
    pub max_frame: u32,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
            max_frame: DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

/// UCX: one context, one worker and one progress thread per transport (and its clones); every
/// connection and listener made through it shares them, and keeps them alive.
#[derive(Clone, Debug)]
pub struct UcxTransport {
    worker: Arc<Worker>,
    pub config: UcxConfig,
}

impl UcxTransport {
    /// Load libucp and start the progress thread.
    ///
    /// NOTE: blocks for UCX's initialisation (tens of milliseconds); create one transport and
    /// clone it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when libucp cannot be loaded; [`Error::Io`] when UCX fails to
    /// initialise.
    pub fn new(config: UcxConfig) -> Result<UcxTransport> {
        Ok(UcxTransport {
            worker: Arc::new(Worker::start(config.max_frame)?),
            config,
        })
    }

    /// The loaded libucp's version.
    pub fn version(&self) -> UcxVersion {
        let (major, minor, release) = self.worker.version;
        UcxVersion {
            major,
            minor,
            release,
        }
    }

    /// Close every connection and listener of this transport, destroy its UCX worker and
    /// context, and wait for the progress thread to end. Dropping the last clone does the same
    /// without waiting; a process should call this before it exits (UCX's own teardown at exit
    /// must not race the thread).
    ///
    /// NOTE: blocks (up to about half a second): not on a runtime thread.
    pub fn shutdown_blocking(&self) {
        self.worker.shutdown_blocking();
    }

    /// Register `data` for remote reads by this transport's peers (see [`UcxRegion`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty buffer; [`Error::Io`] when UCX refuses; [`Error::Closed`]
    /// after shutdown; [`Error::Timeout`].
    pub async fn register(&self, data: Bytes) -> Result<UcxRegion> {
        let len = data.len() as u64;
        let (reply, rx) = oneshot::channel();
        self.worker.submit(Cmd::MemMap { data, reply })?;
        let RegionParts { id, base, rkey } =
            answer(rx, "register memory", self.config.io_timeout).await?;
        Ok(UcxRegion {
            worker: self.worker.clone(),
            id,
            remote: RemoteRegion {
                base,
                len,
                rkey: Bytes::from(rkey),
            },
        })
    }

    /// Whether the progress thread sleeps on UCX's event fd (false: it polls).
    pub fn has_wakeup(&self) -> bool {
        self.worker.wakeup
    }
}

async fn resolve(addr: &str) -> std::io::Result<SocketAddr> {
    tokio::net::lookup_host(addr).await?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{addr} resolves to nothing"),
        )
    })
}

async fn answer<T>(
    rx: oneshot::Receiver<Result<T>>,
    op: &'static str,
    after: Duration,
) -> Result<T> {
    match tokio::time::timeout(after, rx).await {
        Err(_) => Err(Error::Timeout { op, after }),
        // The thread dropped the request: it is shutting down.
        Ok(Err(_)) => Err(Error::Closed),
        Ok(Ok(r)) => r,
    }
}

impl Transport for UcxTransport {
    type Conn = UcxConnection;
    type Listener = UcxListener;

    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        Some(Arc::new(self.clone()))
    }

    async fn connect(&self, addr: &str) -> Result<UcxConnection> {
        let to = resolve(addr).await.map_err(|source| Error::Unreachable {
            addr: addr.to_string(),
            source,
        })?;
        let (reply, rx) = oneshot::channel();
        self.worker.submit(Cmd::Connect { addr: to, reply })?;
        let parts = answer(rx, "connect", self.config.connect_timeout).await?;
        Ok(UcxConnection::new(
            self.worker.clone(),
            parts,
            self.config.io_timeout,
        ))
    }

    async fn bind(&self, addr: &str) -> Result<UcxListener> {
        let at = resolve(addr).await?;
        let (reply, rx) = oneshot::channel();
        self.worker.submit(Cmd::Listen { addr: at, reply })?;
        let parts = answer(rx, "listen", self.config.io_timeout).await?;
        Ok(UcxListener {
            worker: self.worker.clone(),
            id: parts.id,
            addr: parts.addr,
            accepted: parts.accepted,
            io_timeout: self.config.io_timeout,
        })
    }
}

/// A bound UCX listener (a `ucp_listener` on a socket address).
#[derive(Debug)]
pub struct UcxListener {
    worker: Arc<Worker>,
    id: u64,
    addr: SocketAddr,
    accepted: mpsc::UnboundedReceiver<ConnParts>,
    io_timeout: Duration,
}

impl Listener for UcxListener {
    type Conn = UcxConnection;

    async fn accept(&mut self) -> Result<UcxConnection> {
        match self.accepted.recv().await {
            Some(parts) => Ok(UcxConnection::new(
                self.worker.clone(),
                parts,
                self.io_timeout,
            )),
            None => Err(Error::Io(std::io::Error::other(
                "ucx progress thread stopped",
            ))),
        }
    }

    fn local_addr(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for UcxListener {
    fn drop(&mut self) {
        let _ = self.worker.submit(Cmd::CloseListener(self.id));
    }
}

/// A UCX endpoint carrying frames as active messages.
#[derive(Debug)]
pub struct UcxConnection {
    worker: Arc<Worker>,
    id: worker::ConnId,
    peer: String,
    incoming: mpsc::UnboundedReceiver<Incoming>,
    queued: Arc<AtomicUsize>,
    io_timeout: Duration,
    closed: bool,
}

impl UcxConnection {
    fn new(worker: Arc<Worker>, parts: ConnParts, io_timeout: Duration) -> UcxConnection {
        UcxConnection {
            worker,
            id: parts.id,
            peer: parts.peer,
            incoming: parts.incoming,
            queued: parts.queued,
            io_timeout,
            closed: false,
        }
    }

    /// Check a whole received frame (prefix included) and return its body.
    fn body(frame: Bytes, max_frame: u32) -> Result<Bytes> {
        if frame.len() < LEN_PREFIX_BYTES {
            return Err(Error::Truncated {
                field: "frame",
                needed: LEN_PREFIX_BYTES as u64,
                available: frame.len() as u64,
            });
        }
        let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]);
        check_frame_len(len, max_frame)?;
        if len as usize != frame.len() - LEN_PREFIX_BYTES {
            return Err(Error::Invalid {
                field: "length prefix",
                reason: "differs from the message's length",
            });
        }
        Ok(frame.slice(LEN_PREFIX_BYTES..))
    }

    /// The length a message of `len` bytes declares for its body, checked against `max_frame`.
    fn check_message_len(len: usize, max_frame: u32) -> Result<()> {
        let body = len.checked_sub(LEN_PREFIX_BYTES).ok_or(Error::Truncated {
            field: "frame",
            needed: LEN_PREFIX_BYTES as u64,
            available: len as u64,
        })?;
        let body = u32::try_from(body).map_err(|_| Error::FrameTooLarge {
            len: body as u64,
            max: max_frame.into(),
        })?;
        check_frame_len(body, max_frame)
    }

    async fn receive(&mut self, max_frame: u32, idle: Option<Duration>) -> Result<Bytes> {
        if self.closed {
            return Err(Error::Closed);
        }
        let next = self.incoming.recv();
        let item = match idle {
            Some(after) => tokio::time::timeout(after, next)
                .await
                .map_err(|_| Error::Timeout {
                    op: "wait for a frame",
                    after,
                })?,
            None => next.await,
        };
        let Some(item) = item else {
            return Err(Error::Closed);
        };
        if !matches!(item, Incoming::Closed(_)) {
            // A frame left the queue (the thread counts frames, not the close).
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        match item {
            Incoming::Closed(why) => {
                self.closed = true;
                match why {
                    None => Err(Error::Closed),
                    Some(why) => Err(Error::Io(std::io::Error::other(why))),
                }
            }
            Incoming::Oversized(len) => Err(Error::FrameTooLarge {
                len: len.saturating_sub(LEN_PREFIX_BYTES) as u64,
                max: max_frame.into(),
            }),
            Incoming::Eager(frame) => Self::body(frame, max_frame),
            Incoming::Rndv { desc, len } => {
                if let Err(e) = Self::check_message_len(len, max_frame) {
                    // The bytes never leave the sender.
                    let _ = self.worker.submit(Cmd::Discard {
                        conn: self.id,
                        desc,
                    });
                    return Err(e);
                }
                let (reply, rx) = oneshot::channel();
                self.worker.submit(Cmd::Pull {
                    conn: self.id,
                    desc,
                    reply,
                })?;
                let frame = answer(rx, "read frame", self.io_timeout).await?;
                Self::body(frame, max_frame)
            }
        }
    }
}

impl UcxConnection {
    /// Read `len` bytes at `offset` of the peer's registered `region` by RMA get, into a new
    /// buffer, within the I/O timeout. The range is checked against `region` first
    /// ([`RemoteRegion::check`]); nothing reaches UCX otherwise.
    ///
    /// # Errors
    /// As [`RemoteRegion::check`]; [`Error::Invalid`] when UCX cannot unpack the rkey;
    /// [`Error::Closed`]; [`Error::Timeout`]; [`Error::Io`] when the get fails.
    pub async fn get(&mut self, region: &RemoteRegion, offset: u64, len: u64) -> Result<Bytes> {
        if self.closed {
            return Err(Error::Closed);
        }
        let addr = region.check(offset, len)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        let (reply, rx) = oneshot::channel();
        self.worker.submit(Cmd::Get {
            conn: self.id,
            rkey: region.rkey.clone(),
            addr,
            len: len as usize,
            reply,
        })?;
        answer(rx, "rma get", self.io_timeout).await
    }
}

impl RmaConnection for UcxConnection {
    fn can_rma(&self) -> bool {
        true
    }

    async fn get_many(&mut self, ranges: Vec<(RemoteRegion, u64, u64)>) -> Result<Vec<Bytes>> {
        if self.closed {
            return Err(Error::Closed);
        }
        // Check every range before the first get is queued.
        let mut addrs = Vec::with_capacity(ranges.len());
        for (region, offset, len) in &ranges {
            addrs.push(region.check(*offset, *len)?);
        }
        let mut pending = Vec::with_capacity(ranges.len());
        let mut items = Vec::with_capacity(ranges.len());
        for ((region, _, len), addr) in ranges.into_iter().zip(addrs) {
            if len == 0 {
                pending.push(None);
                continue;
            }
            let (reply, rx) = oneshot::channel();
            items.push(GetItem {
                rkey: region.rkey,
                addr,
                len: len as usize,
                reply,
            });
            pending.push(Some(rx));
        }
        // One command (one wake-up of the progress thread) for the batch.
        if !items.is_empty() {
            self.worker.submit(Cmd::Gets {
                conn: self.id,
                items,
            })?;
        }
        // One deadline for the batch (the gets overlap). A get left behind completes into its
        // own buffer, which the thread frees.
        let after = self.io_timeout;
        let deadline = tokio::time::Instant::now() + after;
        let mut out = Vec::with_capacity(pending.len());
        for rx in pending {
            let Some(rx) = rx else {
                out.push(Bytes::new());
                continue;
            };
            match tokio::time::timeout_at(deadline, rx).await {
                Err(_) => {
                    return Err(Error::Timeout {
                        op: "rma get",
                        after,
                    })
                }
                Ok(Err(_)) => return Err(Error::Closed),
                Ok(Ok(r)) => out.push(r?),
            }
        }
        Ok(out)
    }
}

impl Connection for UcxConnection {
    async fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        if self.closed {
            return Err(Error::Closed);
        }
        // NOTE: one copy per frame: the bytes must outlive this future (UCX may still read them
        // after a timeout drops it).
        let (reply, rx) = oneshot::channel();
        self.worker.submit(Cmd::Send {
            conn: self.id,
            frame: frame.to_vec(),
            reply,
        })?;
        answer(rx, "send frame", self.io_timeout).await
    }

    async fn recv_frame(&mut self, max_frame: u32, idle: Option<Duration>) -> Result<Bytes> {
        self.receive(max_frame, idle).await
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }
}

impl Drop for UcxConnection {
    fn drop(&mut self) {
        let _ = self.worker.submit(Cmd::Close(self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_is_total() {
        // Here or not, the probe answers without panicking.
        match probe() {
            Ok(v) => {
                eprintln!("libucp {}.{}.{}", v.major, v.minor, v.release);
                assert!(v.major >= 1, "{v:?}");
            }
            Err(e) => assert!(e.to_string().contains("libucp"), "{e}"),
        }
    }

    #[test]
    fn frame_checks() {
        let f = crate::protocol::encode_frame(3, &crate::protocol::Message::Stats, 1024).unwrap();
        let body = UcxConnection::body(Bytes::from(f.clone()), 1024).unwrap();
        assert_eq!(&body[..], &f[4..]);
        // A prefix that disagrees with the message length.
        let mut longer = f.clone();
        longer.push(0);
        assert!(matches!(
            UcxConnection::body(Bytes::from(longer), 1024),
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            UcxConnection::body(Bytes::from(f.clone()), 8 - 1),
            Err(Error::FrameTooLarge { .. })
        ));
        assert!(matches!(
            UcxConnection::body(Bytes::from_static(&[1, 0]), 1024),
            Err(Error::Truncated { .. })
        ));
        assert!(UcxConnection::check_message_len(4 + 4096, 4096).is_ok());
        assert!(matches!(
            UcxConnection::check_message_len(4 + 4097, 4096),
            Err(Error::FrameTooLarge { .. })
        ));
        assert!(matches!(
            UcxConnection::check_message_len(usize::MAX, u32::MAX),
            Err(Error::FrameTooLarge { .. })
        ));
        assert!(UcxConnection::check_message_len(2, 4096).is_err());
    }
}
