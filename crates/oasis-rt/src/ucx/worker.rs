//! The UCX progress thread: it owns the UCX context, the worker, every endpoint and listener, and
//! is the only thread that calls into them (`UCS_THREAD_MODE_SINGLE`).
//!
//! ```text
//!  tokio tasks                          progress thread (one per UcxTransport)
//!  ───────────                          ──────────────────────────────────────
//!  Cmd ──std mpsc──▶ + ucp_worker_signal ─▶ drain commands: connect, listen, send, pull, close
//!                                           ucp_worker_progress until idle
//!                                           UCX callbacks only push Events into the Inbox;
//!                                           events are handled after progress returns
//!  oneshot ◀── completion of a send/pull/connect
//!  unbounded mpsc ◀── Incoming per connection (frames, rendezvous descriptors, close)
//!  unbounded mpsc ◀── accepted connections per listener
//!                                           idle: ucp_worker_arm + poll(efd, 100 ms)
//! ```
//!
//! Nothing on the tokio side blocks: commands are queued and the thread is woken with
//! `ucp_worker_signal` (documented safe from any thread), answers come back on tokio channels.
//!
//! **Frames are active messages** (id [`AM_ID`], no header, the protocol's frame with its length
//! prefix as data). A small frame arrives eagerly and is copied out in the callback; a large one
//! ([`RNDV_FRAME_BYTES`] and up are sent rendezvous) arrives as a descriptor with only its length:
//! the connection's reader checks that length against its frame limit and only then asks this
//! thread to pull the bytes (`ucp_am_recv_data_nbx`, an RMA read of the sender's registered
//! buffer), or to drop them. At most [`MAX_QUEUED_FRAMES`] frames wait per connection: the
//! protocol has one call in flight, so a peer past that is misbehaving and is disconnected.
//!
//! **Registered regions and RMA get.** `Cmd::MemMap` registers a buffer (`ucp_mem_map`, remote
//! *read* only) and packs its rkey; the region keeps the buffer alive until `Cmd::MemUnmap`.
//! `Cmd::Get` reads a range of a peer's region (`ucp_get_nbx`) into a new buffer; the
//! connection caches the unpacked rkeys (at most [`MAX_RKEYS_PER_CONN`]) and destroys them
//! before its endpoint closes. The ranges are checked on the tokio side
//! (`ucx::RemoteRegion::check`) before a command is queued.
//!
//! **Rooms.** This file holds the commands and parts the tokio side sees, the [`Worker`] handle,
//! and the thread's state and events; the thread's life (init, the loop, command and event
//! dispatch, shutdown) is in `progress.rs`, connections in `conns.rs`, the data path (frames,
//! regions, gets) in `data.rs`, the UCX callbacks and their request contexts in `callbacks.rs`,
//! poll and socket addresses in `sockets.rs`.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::sys::{self, Api};
use crate::error::{Error, Result};

mod callbacks;
mod conns;
mod data;
mod progress;
mod sockets;

use callbacks::{
    on_am, on_closed, on_conn_request, on_ep_error, on_flushed, on_got, on_pulled, on_sent,
    FlushCtx, GetCtx, PullCtx, SendCtx,
};
use sockets::{parse_sockaddr, RawSockaddr};

/// The active-message id of protocol frames (arbitrary; both sides use it).
pub const AM_ID: u32 = 0x0a5;
/// Frames from this size up are sent rendezvous, so the receiver sees their length before their
/// bytes move (arbitrary; UCX may choose rendezvous for smaller ones itself).
pub const RNDV_FRAME_BYTES: usize = 64 << 10;
/// Frames that may wait unread on one connection before the peer is cut off (arbitrary; a
/// well-behaved peer has one).
pub const MAX_QUEUED_FRAMES: usize = 16;
/// Unpacked rkeys cached per connection; past it the cache starts over (arbitrary: a daemon
/// advertises one region per pool or per request).
pub const MAX_RKEYS_PER_CONN: usize = 1024;
/// How long the idle thread sleeps on the worker's event fd before progressing anyway (UCX's
/// own timers, e.g. keepalive, need progress; arbitrary).
const IDLE_POLL: Duration = Duration::from_millis(100);
/// How long shutdown waits for endpoints to close (arbitrary).
const SHUTDOWN_WAIT: Duration = Duration::from_millis(500);

pub type ConnId = u64;

/// What a connection's reader gets, in order.
#[derive(Debug)]
pub enum Incoming {
    /// A whole frame (length prefix included) that arrived eagerly.
    Eager(Bytes),
    /// A rendezvous frame of `len` bytes whose data still waits at the sender: `Cmd::Pull` it or
    /// `Cmd::Discard` it.
    Rndv { desc: u64, len: usize },
    /// An eager frame past the transport's frame limit was dropped unread.
    Oversized(usize),
    /// The connection failed or was closed (with the reason when it was not a plain close).
    Closed(Option<String>),
}

/// A new connection, handed to the tokio side.
#[derive(Debug)]
pub struct ConnParts {
    pub id: ConnId,
    pub peer: String,
    pub incoming: mpsc::UnboundedReceiver<Incoming>,
    /// Frames pushed and not yet taken (the reader decrements it).
    pub queued: Arc<AtomicUsize>,
}

/// A registered region, handed to the tokio side.
#[derive(Debug)]
pub struct RegionParts {
    pub id: u64,
    /// The buffer's address in this process (what a peer's get names).
    pub base: u64,
    /// The packed rkey (`ucp_rkey_pack`).
    pub rkey: Vec<u8>,
}

/// A bound listener, handed to the tokio side.
#[derive(Debug)]
pub struct ListenParts {
    pub id: u64,
    pub addr: SocketAddr,
    pub accepted: mpsc::UnboundedReceiver<ConnParts>,
}

pub enum Cmd {
    Connect {
        addr: SocketAddr,
        reply: oneshot::Sender<Result<ConnParts>>,
    },
    Listen {
        addr: SocketAddr,
        reply: oneshot::Sender<Result<ListenParts>>,
    },
    CloseListener(u64),
    Send {
        conn: ConnId,
        frame: Vec<u8>,
        reply: oneshot::Sender<Result<()>>,
    },
    Pull {
        conn: ConnId,
        desc: u64,
        reply: oneshot::Sender<Result<Bytes>>,
    },
    Discard {
        conn: ConnId,
        desc: u64,
    },
    Close(ConnId),
    /// Register `data` for remote reads.
    MemMap {
        data: Bytes,
        reply: oneshot::Sender<Result<RegionParts>>,
    },
    /// Deregister a region (and let its buffer go).
    MemUnmap(u64),
    /// Read `len` bytes at `addr` of the peer's region named by the packed `rkey`.
    Get {
        conn: ConnId,
        rkey: Bytes,
        addr: u64,
        len: usize,
        reply: oneshot::Sender<Result<Bytes>>,
    },
    /// Many gets of one connection in one command (one wake-up of the thread, not one per get:
    /// a step's reads are thousands of block-heads, each a K and a V range).
    Gets {
        conn: ConnId,
        items: Vec<GetItem>,
    },
    Shutdown,
}

/// One get of [`Cmd::Gets`]: a range of a peer's region, as [`Cmd::Get`].
#[derive(Debug)]
pub struct GetItem {
    pub rkey: Bytes,
    pub addr: u64,
    pub len: usize,
    pub reply: oneshot::Sender<Result<Bytes>>,
}

/// The submitting side, shared with the thread (which empties it before the worker goes away,
/// so `ucp_worker_signal` is never called on a destroyed worker).
struct Submit {
    tx: Mutex<Option<(std_mpsc::Sender<Cmd>, usize)>>,
}

/// A running progress thread. Dropping the last handle shuts it down.
pub struct Worker {
    submit: Arc<Submit>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// `(major, minor, release)` of the loaded libucp.
    pub version: (u32, u32, u32),
    /// False when the worker could not get an event fd and polls (with short sleeps).
    pub wakeup: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("version", &self.version)
            .field("wakeup", &self.wakeup)
            .finish()
    }
}

impl Worker {
    /// Load libucp, start the thread, create the context and the worker on it.
    ///
    /// NOTE: blocks the caller for UCX's initialisation (tens of milliseconds).
    ///
    /// # Errors
    /// [`Error::Unavailable`] without libucp; [`Error::Io`] when UCX refuses to initialise.
    pub fn start(max_frame: u32) -> Result<Worker> {
        let api = sys::api().map_err(|e| Error::Unavailable(format!("ucx transport: {e}")))?;
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<(usize, bool)>>();
        let (tx, rx) = std_mpsc::channel::<Cmd>();
        let submit = Arc::new(Submit {
            tx: Mutex::new(None),
        });
        let thread_submit = submit.clone();
        let max_eager = max_frame as usize + crate::protocol::LEN_PREFIX_BYTES;
        let thread = std::thread::Builder::new()
            .name("oasis-ucx".into())
            .spawn(move || {
                // SAFETY: this thread creates the context and the worker and is the only one
                // that uses them until `run` destroys them.
                let state = match unsafe { State::init(api, max_eager) } {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((state.worker as usize, state.efd.is_some())));
                state.run(rx, &thread_submit);
            })
            .map_err(Error::Io)?;
        let (worker, wakeup) = ready_rx
            .recv()
            .map_err(|_| Error::Io(std::io::Error::other("ucx progress thread died")))??;
        *submit.tx.lock().unwrap_or_else(PoisonError::into_inner) = Some((tx, worker));
        Ok(Worker {
            submit,
            thread: Mutex::new(Some(thread)),
            version: api.version,
            wakeup,
        })
    }

    /// Queue a command and wake the thread.
    ///
    /// # Errors
    /// [`Error::Closed`] once the thread is gone.
    pub fn submit(&self, cmd: Cmd) -> Result<()> {
        let guard = self
            .submit
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some((tx, worker)) = guard.as_ref() else {
            return Err(Error::Closed);
        };
        tx.send(cmd).map_err(|_| Error::Closed)?;
        if let Ok(api) = sys::api() {
            // SAFETY: the worker is alive while `tx` is set (the thread clears it, under this
            // lock, before destroying the worker); ucp_worker_signal is thread safe.
            unsafe { (api.ucp_worker_signal)(*worker as sys::ucp_worker_h) };
        }
        Ok(())
    }
}

impl Worker {
    /// Close every endpoint and listener, destroy the worker and wait for the thread to end
    /// (at most about [`SHUTDOWN_WAIT`] plus what UCX takes). Later commands fail with
    /// [`Error::Closed`].
    ///
    /// NOTE: blocks: call it outside the runtime (or in `spawn_blocking`), e.g. before the
    /// process exits, so that UCX is not torn down by the exit under a running thread.
    pub fn shutdown_blocking(&self) {
        let _ = self.submit(Cmd::Shutdown);
        let handle = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.submit(Cmd::Shutdown);
    }
}

// ---- the thread ----

enum AmData {
    Eager(Bytes),
    Rndv { desc: usize, len: usize },
    Oversized(usize),
}

enum Event {
    ConnRequest {
        listener: u64,
        request: usize,
    },
    EpError {
        ep: usize,
        status: sys::ucs_status_t,
    },
    Am {
        ep: usize,
        data: AmData,
    },
    Flushed {
        conn: ConnId,
        status: sys::ucs_status_t,
    },
    /// A send or rendezvous receive of `conn` completed (its request is freed).
    Done {
        conn: ConnId,
        request: usize,
    },
}

/// Written by UCX callbacks (on this thread, inside `ucp_worker_progress`), read after it.
struct Inbox {
    api: &'static Api,
    events: Vec<Event>,
    max_eager: usize,
    /// Endpoint close requests not yet completed.
    closing: usize,
}

struct ListenerArg {
    inbox: *mut Inbox,
    id: u64,
}

struct ListenerState {
    handle: sys::ucp_listener_h,
    arg: *mut ListenerArg,
    accepted: mpsc::UnboundedSender<ConnParts>,
}

struct ConnState {
    ep: sys::ucp_ep_h,
    incoming: mpsc::UnboundedSender<Incoming>,
    queued: Arc<AtomicUsize>,
    /// Rendezvous frames waiting for the reader: id -> (UCX descriptor, length).
    rndv: HashMap<u64, (usize, usize)>,
    /// No more frames either way (peer failed, flooded, or closed).
    broken: bool,
    /// UCX reported the endpoint failed: it is closed with `UCP_EP_CLOSE_FLAG_FORCE` (a healthy
    /// one is closed gracefully, which flushes it and tells the peer).
    failed: bool,
    /// Sends and rendezvous receives UCX has not completed yet (request pointers): the
    /// endpoint is closed only once they are done (closing it under them trips UCX).
    reqs: HashSet<usize>,
    /// The owner dropped the connection: close the endpoint once `reqs` is empty.
    closing: bool,
    /// A connect waiting for its flush (client side).
    connecting: Option<(oneshot::Sender<Result<ConnParts>>, ConnParts, SocketAddr)>,
    /// Unpacked rkeys of the peer's regions, by their packed bytes (destroyed before the
    /// endpoint closes).
    rkeys: HashMap<Bytes, usize>,
}

struct State {
    api: &'static Api,
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    efd: Option<c_int>,
    inbox: *mut Inbox,
    conns: HashMap<ConnId, ConnState>,
    by_ep: HashMap<usize, ConnId>,
    listeners: HashMap<u64, ListenerState>,
    /// Registered regions: id -> (memory handle, the buffer it keeps alive).
    regions: HashMap<u64, (usize, Bytes)>,
    next_id: u64,
}

fn status_error(api: &Api, what: &str, s: sys::ucs_status_t) -> Error {
    Error::Io(std::io::Error::other(format!(
        "ucx {what}: {}",
        api.status_string(s)
    )))
}

impl State {
    fn inbox(&mut self) -> &mut Inbox {
        // SAFETY: the inbox lives as long as the state; UCX callbacks touch it only inside
        // ucp_worker_progress (and ucp_ep_close_nbx/ucp_listener_destroy), never while this
        // borrow is live.
        unsafe { &mut *self.inbox }
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn add_conn(&mut self, ep: sys::ucp_ep_h, peer: String) -> ConnParts {
        let id = self.new_id();
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        self.conns.insert(
            id,
            ConnState {
                ep,
                incoming: tx,
                queued: queued.clone(),
                rndv: HashMap::new(),
                broken: false,
                failed: false,
                reqs: HashSet::new(),
                closing: false,
                connecting: None,
                rkeys: HashMap::new(),
            },
        );
        self.by_ep.insert(ep as usize, id);
        ConnParts {
            id,
            peer,
            incoming: rx,
            queued,
        }
    }

    fn ep_params(&self) -> sys::ucp_ep_params_t {
        sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: std::ptr::null(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: self.inbox.cast(),
            },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: sys::ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: sys::ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        }
    }
}

fn unreachable(addr: SocketAddr, why: &str) -> Error {
    Error::Unreachable {
        addr: addr.to_string(),
        source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, format!("ucx: {why}")),
    }
}

/// A failed send: the peer is gone, or the endpoint closed or was canceled.
fn send_error(api: &Api, s: sys::ucs_status_t) -> Error {
    debug!(error = %api.status_string(s), "ucx send failed");
    Error::Closed
}

#[cfg(test)]
mod tests;
