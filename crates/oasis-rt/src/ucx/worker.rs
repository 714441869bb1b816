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

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::sys::{self, Api};
use crate::error::{Error, Result};

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
    Shutdown,
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
    /// # Safety
    /// Call on the thread that will run [`State::run`].
    unsafe fn init(api: &'static Api, max_eager: usize) -> Result<State> {
        let mut context: sys::ucp_context_h = std::ptr::null_mut();
        let mut params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME,
            features: sys::UCP_FEATURE_AM | sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: std::ptr::null_mut(),
            request_cleanup: std::ptr::null_mut(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: c"oasis-rt".as_ptr(),
        };
        let mut s = (api.ucp_init_version)(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            std::ptr::null(),
            &mut context,
        );
        if s != sys::UCS_OK {
            // Without wakeup support the thread polls instead.
            params.features &= !sys::UCP_FEATURE_WAKEUP;
            s = (api.ucp_init_version)(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                std::ptr::null(),
                &mut context,
            );
        }
        if s != sys::UCS_OK {
            return Err(status_error(api, "init", s));
        }
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
        wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let s = (api.ucp_worker_create)(context, &wp, &mut worker);
        if s != sys::UCS_OK {
            (api.ucp_cleanup)(context);
            return Err(status_error(api, "worker create", s));
        }
        let mut efd: c_int = -1;
        let efd = if params.features & sys::UCP_FEATURE_WAKEUP != 0
            && (api.ucp_worker_get_efd)(worker, &mut efd) == sys::UCS_OK
        {
            Some(efd)
        } else {
            None
        };
        let inbox = Box::into_raw(Box::new(Inbox {
            api,
            events: Vec::new(),
            max_eager,
            closing: 0,
        }));
        let handler = sys::ucp_am_handler_param_t {
            field_mask: sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_am),
            arg: inbox.cast(),
        };
        let s = (api.ucp_worker_set_am_recv_handler)(worker, &handler);
        if s != sys::UCS_OK {
            (api.ucp_worker_destroy)(worker);
            (api.ucp_cleanup)(context);
            drop(Box::from_raw(inbox));
            return Err(status_error(api, "am handler", s));
        }
        Ok(State {
            api,
            context,
            worker,
            efd,
            inbox,
            conns: HashMap::new(),
            by_ep: HashMap::new(),
            listeners: HashMap::new(),
            regions: HashMap::new(),
            next_id: 1,
        })
    }

    fn run(mut self, rx: std_mpsc::Receiver<Cmd>, submit: &Submit) {
        'outer: loop {
            let mut busy = false;
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(std_mpsc::TryRecvError::Disconnected) => break 'outer,
                    Ok(cmd) => {
                        busy = true;
                        self.command(cmd);
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                }
            }
            // SAFETY: the worker is ours; callbacks only touch the inbox.
            while unsafe { (self.api.ucp_worker_progress)(self.worker) } != 0 {
                busy = true;
            }
            busy |= self.events();
            if busy {
                continue;
            }
            self.idle();
        }
        // Stop taking commands before the worker goes.
        *submit.tx.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.shutdown();
    }

    fn idle(&mut self) {
        let Some(fd) = self.efd else {
            std::thread::sleep(Duration::from_micros(50));
            return;
        };
        // SAFETY: our worker; arm returns BUSY when events (or a ucp_worker_signal) are pending.
        let s = unsafe { (self.api.ucp_worker_arm)(self.worker) };
        if s == sys::UCS_ERR_BUSY {
            return;
        }
        if s != sys::UCS_OK {
            std::thread::sleep(Duration::from_micros(50));
            return;
        }
        let mut pfd = PollFd {
            fd,
            events: POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; poll has this signature in every libc.
        unsafe { poll(&mut pfd, 1, IDLE_POLL.as_millis() as c_int) };
    }

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

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Connect { addr, reply } => self.connect(addr, reply),
            Cmd::Listen { addr, reply } => {
                let _ = reply.send(self.listen(addr));
            }
            Cmd::CloseListener(id) => self.close_listener(id),
            Cmd::Send { conn, frame, reply } => self.send(conn, frame, reply),
            Cmd::Pull { conn, desc, reply } => self.pull(conn, desc, reply),
            Cmd::Discard { conn, desc } => {
                if let Some((d, _)) = self.conns.get_mut(&conn).and_then(|c| c.rndv.remove(&desc)) {
                    // SAFETY: a descriptor UCX gave us and nobody released yet.
                    unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
                }
            }
            Cmd::Close(id) => self.close(id),
            Cmd::MemMap { data, reply } => {
                if let Err(Ok(parts)) = reply.send(self.mem_map(data)) {
                    // The caller gave up (timeout): nobody would unmap it.
                    self.mem_unmap(parts.id);
                }
            }
            Cmd::MemUnmap(id) => self.mem_unmap(id),
            Cmd::Get {
                conn,
                rkey,
                addr,
                len,
                reply,
            } => self.get(conn, &rkey, addr, len, reply),
            Cmd::Shutdown => {}
        }
    }

    fn connect(&mut self, addr: SocketAddr, reply: oneshot::Sender<Result<ConnParts>>) {
        let raw = RawSockaddr::new(addr);
        let mut params = self.ep_params();
        params.field_mask |= sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR;
        params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        params.sockaddr = raw.as_ucs();
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: params and the sockaddr outlive the call (UCX copies the address).
        let s = unsafe { (self.api.ucp_ep_create)(self.worker, &params, &mut ep) };
        if s != sys::UCS_OK {
            let _ = reply.send(Err(unreachable(addr, &self.api.status_string(s))));
            return;
        }
        let parts = self.add_conn(ep, addr.to_string());
        let id = parts.id;
        // The flush completes once the endpoint is connected (or fails when it cannot be).
        let ctx = Box::into_raw(Box::new(FlushCtx {
            inbox: self.inbox,
            conn: id,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_flushed as *const c_void, ctx.cast(), 0);
        // SAFETY: a live endpoint; `ctx` is freed by the callback, or below when there is none.
        let r = unsafe { (self.api.ucp_ep_flush_nbx)(ep, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run: the context is still ours.
            drop(unsafe { Box::from_raw(ctx) });
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            self.finish_connect(reply, parts, addr, status);
        } else if let Some(c) = self.conns.get_mut(&id) {
            c.connecting = Some((reply, parts, addr));
        }
    }

    fn finish_connect(
        &mut self,
        reply: oneshot::Sender<Result<ConnParts>>,
        parts: ConnParts,
        addr: SocketAddr,
        status: sys::ucs_status_t,
    ) {
        let id = parts.id;
        let broken = self.conns.get(&id).is_none_or(|c| c.broken);
        if status != sys::UCS_OK || broken {
            let why = if status != sys::UCS_OK {
                self.api.status_string(status)
            } else {
                "connection failed".into()
            };
            let _ = reply.send(Err(unreachable(addr, &why)));
            self.close(id);
        } else if reply.send(Ok(parts)).is_err() {
            // The caller gave up (connect timeout).
            self.close(id);
        }
    }

    fn listen(&mut self, addr: SocketAddr) -> Result<ListenParts> {
        let id = self.new_id();
        let raw = RawSockaddr::new(addr);
        let arg = Box::into_raw(Box::new(ListenerArg {
            inbox: self.inbox,
            id,
        }));
        let params = sys::ucp_listener_params_t {
            field_mask: sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            sockaddr: raw.as_ucs(),
            accept_handler: [std::ptr::null_mut(); 2],
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(on_conn_request),
                arg: arg.cast(),
            },
        };
        let mut handle: sys::ucp_listener_h = std::ptr::null_mut();
        // SAFETY: params outlive the call; `arg` lives until the listener is destroyed.
        let s = unsafe { (self.api.ucp_listener_create)(self.worker, &params, &mut handle) };
        if s != sys::UCS_OK {
            // SAFETY: no listener holds it.
            drop(unsafe { Box::from_raw(arg) });
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!("ucx listen on {addr}: {}", self.api.status_string(s)),
            )));
        }
        // SAFETY: attr is plain data; a live listener.
        let mut attr: sys::ucp_listener_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        let bound = match unsafe { (self.api.ucp_listener_query)(handle, &mut attr) } {
            sys::UCS_OK => parse_sockaddr(&attr.sockaddr).unwrap_or(addr),
            _ => addr,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        self.listeners.insert(
            id,
            ListenerState {
                handle,
                arg,
                accepted: tx,
            },
        );
        Ok(ListenParts {
            id,
            addr: bound,
            accepted: rx,
        })
    }

    fn close_listener(&mut self, id: u64) {
        if let Some(l) = self.listeners.remove(&id) {
            // SAFETY: a live listener; its conn handler cannot run after destroy, so the
            // argument can go.
            unsafe {
                (self.api.ucp_listener_destroy)(l.handle);
                drop(Box::from_raw(l.arg));
            }
        }
    }

    fn send(&mut self, conn: ConnId, frame: Vec<u8>, reply: oneshot::Sender<Result<()>>) {
        let Some(c) = self.conns.get(&conn).filter(|c| !c.broken) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let ep = c.ep;
        let mut flags = sys::UCP_AM_SEND_FLAG_REPLY;
        if frame.len() >= RNDV_FRAME_BYTES {
            flags |= sys::UCP_AM_SEND_FLAG_RNDV;
        }
        let (ptr, len) = (frame.as_ptr(), frame.len());
        let ctx = Box::into_raw(Box::new(SendCtx {
            inbox: self.inbox,
            conn,
            _frame: frame,
            reply,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_sent as *const c_void, ctx.cast(), flags);
        // SAFETY: the frame's heap buffer lives in `ctx` until the send completes (the Vec is
        // moved, its buffer is not); a live endpoint.
        let r = unsafe {
            (self.api.ucp_am_send_nbx)(ep, AM_ID, std::ptr::null(), 0, ptr.cast(), len, &param)
        };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: completed (or failed) at once: no callback, the context is ours.
            let ctx = unsafe { Box::from_raw(ctx) };
            let result = if r.is_null() {
                Ok(())
            } else {
                Err(send_error(self.api, sys::ptr_status(r)))
            };
            let _ = ctx.reply.send(result);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    fn pull(&mut self, conn: ConnId, desc: u64, reply: oneshot::Sender<Result<Bytes>>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let Some((d, len)) = c.rndv.remove(&desc) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        if c.broken {
            // SAFETY: an unreleased descriptor.
            unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
            let _ = reply.send(Err(Error::Closed));
            return;
        }
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        let ptr = buf.as_mut_ptr();
        let ctx = Box::into_raw(Box::new(PullCtx {
            api: self.api,
            inbox: self.inbox,
            conn,
            buf,
            len,
            reply,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_pulled as *const c_void, ctx.cast(), 0);
        // SAFETY: `buf` has `len` bytes of capacity and lives in `ctx` until completion; the
        // descriptor is unreleased.
        let r = unsafe {
            (self.api.ucp_am_recv_data_nbx)(self.worker, d as *mut c_void, ptr.cast(), len, &param)
        };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run.
            let ctx = unsafe { Box::from_raw(ctx) };
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            ctx.finish(status, len);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    fn mem_map(&mut self, data: Bytes) -> Result<RegionParts> {
        if data.is_empty() {
            return Err(Error::Invalid {
                field: "region",
                reason: "is empty",
            });
        }
        // Peers may read it; nobody may write it remotely.
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            address: data.as_ptr() as *mut c_void,
            length: data.len(),
            flags: 0,
            prot: sys::UCP_MEM_MAP_PROT_LOCAL_READ
                | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
                | sys::UCP_MEM_MAP_PROT_REMOTE_READ,
            memory_type: 0,
        };
        let mut memh: *mut c_void = std::ptr::null_mut();
        // SAFETY: `data` (`length` bytes at `address`) stays alive and unmoved while mapped: the
        // region keeps it until ucp_mem_unmap.
        let s = unsafe { (self.api.ucp_mem_map)(self.context, &params, &mut memh) };
        if s != sys::UCS_OK {
            return Err(status_error(self.api, "mem map", s));
        }
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: a live memory handle of our context.
        let s = unsafe { (self.api.ucp_rkey_pack)(self.context, memh, &mut buf, &mut size) };
        if s != sys::UCS_OK || buf.is_null() {
            // SAFETY: mapped above, unmapped once.
            unsafe { (self.api.ucp_mem_unmap)(self.context, memh) };
            return Err(status_error(self.api, "rkey pack", s));
        }
        // SAFETY: UCX packed `size` bytes at `buf`, released right after the copy.
        let rkey = unsafe {
            let v = std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec();
            (self.api.ucp_rkey_buffer_release)(buf);
            v
        };
        let id = self.new_id();
        let base = data.as_ptr() as u64;
        self.regions.insert(id, (memh as usize, data));
        Ok(RegionParts { id, base, rkey })
    }

    fn mem_unmap(&mut self, id: u64) {
        if let Some((memh, data)) = self.regions.remove(&id) {
            // SAFETY: a handle mapped by `mem_map`, unmapped once; the buffer goes after it.
            unsafe { (self.api.ucp_mem_unmap)(self.context, memh as *mut c_void) };
            drop(data);
        }
    }

    fn get(
        &mut self,
        conn: ConnId,
        rkey: &Bytes,
        addr: u64,
        len: usize,
        reply: oneshot::Sender<Result<Bytes>>,
    ) {
        let api = self.api;
        let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.broken) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let handle = match c.rkeys.get(rkey) {
            Some(&h) => h,
            None => {
                if c.rkeys.len() >= MAX_RKEYS_PER_CONN {
                    if !c.reqs.is_empty() {
                        // A get in flight may use any of them: none can go now.
                        let _ = reply.send(Err(Error::OutOfRange {
                            field: "distinct rkeys of one connection",
                            value: c.rkeys.len() as u64 + 1,
                            limit: MAX_RKEYS_PER_CONN as u64,
                        }));
                        return;
                    }
                    for (_, h) in c.rkeys.drain() {
                        // SAFETY: unpacked on this endpoint, destroyed once, and nothing is
                        // outstanding on the endpoint (`reqs` is empty).
                        unsafe { (api.ucp_rkey_destroy)(h as *mut c_void) };
                    }
                }
                let mut h: *mut c_void = std::ptr::null_mut();
                // SAFETY: a live endpoint; UCX parses `rkey.len()` bytes (bounded by the tokio
                // side) that the authenticated peer packed.
                let s = unsafe { (api.ucp_ep_rkey_unpack)(c.ep, rkey.as_ptr().cast(), &mut h) };
                if s != sys::UCS_OK {
                    let _ = reply.send(Err(Error::Invalid {
                        field: "rkey",
                        reason: "ucx cannot unpack it",
                    }));
                    return;
                }
                c.rkeys.insert(rkey.clone(), h as usize);
                h as usize
            }
        };
        let ep = c.ep;
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        let ptr = buf.as_mut_ptr();
        let ctx = Box::into_raw(Box::new(GetCtx {
            api,
            inbox: self.inbox,
            conn,
            buf,
            len,
            reply,
        }));
        let param = sys::ucp_request_param_t::with_callback(on_got as *const c_void, ctx.cast(), 0);
        // SAFETY: `buf` has `len` bytes of capacity and lives in `ctx` until completion; the
        // rkey was unpacked on this endpoint and lives until the endpoint closes.
        let r =
            unsafe { (api.ucp_get_nbx)(ep, ptr.cast(), len, addr, handle as *mut c_void, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run.
            let ctx = unsafe { Box::from_raw(ctx) };
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            ctx.finish(status);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    fn close(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.closing {
            return;
        }
        c.closing = true;
        c.broken = true;
        let ep = c.ep;
        let rndv: Vec<usize> = c.rndv.drain().map(|(_, (d, _))| d).collect();
        let reqs: Vec<usize> = c.reqs.iter().copied().collect();
        if let Some((reply, _, addr)) = c.connecting.take() {
            let _ = reply.send(Err(unreachable(addr, "connection closed")));
        }
        let _ = c.incoming.send(Incoming::Closed(None));
        // No more arrivals for it.
        self.by_ep.remove(&(ep as usize));
        for d in rndv {
            // SAFETY: unreleased descriptors of this connection.
            unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
        }
        for r in reqs {
            // SAFETY: requests in `reqs` are outstanding: their callbacks have not run (a
            // completion is removed from `reqs` before any command or close runs).
            unsafe { (self.api.ucp_request_cancel)(self.worker, r as *mut c_void) };
        }
        self.reap(id);
    }

    /// Close the endpoint of a closing connection once nothing is outstanding on it.
    fn reap(&mut self, id: ConnId) {
        let ready = self
            .conns
            .get(&id)
            .is_some_and(|c| c.closing && c.reqs.is_empty());
        if !ready {
            return;
        }
        if let Some(c) = self.conns.remove(&id) {
            for (_, h) in c.rkeys {
                // SAFETY: unpacked on this endpoint, no get outstanding (`reqs` is empty);
                // destroyed before the endpoint, as UCX requires.
                unsafe { (self.api.ucp_rkey_destroy)(h as *mut c_void) };
            }
            self.close_ep(c.ep, c.failed);
        }
    }

    fn close_ep(&mut self, ep: sys::ucp_ep_h, force: bool) {
        let flags = if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        let mut param = sys::ucp_request_param_t::with_callback(
            on_closed as *const c_void,
            self.inbox.cast(),
            0,
        );
        param.flags = flags;
        self.inbox().closing += 1;
        // SAFETY: a live endpoint, closed once (it left the maps above).
        let r = unsafe { (self.api.ucp_ep_close_nbx)(ep, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            self.inbox().closing -= 1;
        }
    }

    /// Handle what the callbacks reported. True if there was anything.
    fn events(&mut self) -> bool {
        let mut events = std::mem::take(&mut self.inbox().events);
        let any = !events.is_empty();
        // Completions first: a request they name is freed and must leave `reqs` before any
        // close below could cancel it.
        let mut reaped = Vec::new();
        events.retain(|e| match e {
            Event::Done { conn, request } => {
                if let Some(c) = self.conns.get_mut(conn) {
                    c.reqs.remove(request);
                    reaped.push(*conn);
                }
                false
            }
            _ => true,
        });
        for id in reaped {
            self.reap(id);
        }
        for e in events {
            match e {
                Event::Done { .. } => {}
                Event::ConnRequest { listener, request } => self.accept(listener, request),
                Event::EpError { ep, status } => {
                    let Some(&id) = self.by_ep.get(&ep) else {
                        continue;
                    };
                    let why = self.api.status_string(status);
                    debug!(conn = id, error = %why, "ucx endpoint failed");
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.broken = true;
                        c.failed = true;
                        let _ = c.incoming.send(Incoming::Closed(None));
                    }
                }
                Event::Flushed { conn, status } => {
                    let Some(pending) = self.conns.get_mut(&conn).and_then(|c| c.connecting.take())
                    else {
                        continue;
                    };
                    let (reply, parts, addr) = pending;
                    self.finish_connect(reply, parts, addr, status);
                }
                Event::Am { ep, data } => self.arrived(ep, data),
            }
        }
        any
    }

    fn accept(&mut self, listener: u64, request: usize) {
        let request = request as sys::ucp_conn_request_h;
        let Some(l) = self.listeners.get(&listener) else {
            return;
        };
        let lh = l.handle;
        // SAFETY: attr is plain data; the request is live until an ep is created or it is
        // rejected.
        let mut attr: sys::ucp_conn_request_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
        let peer = match unsafe { (self.api.ucp_conn_request_query)(request, &mut attr) } {
            sys::UCS_OK => parse_sockaddr(&attr.client_address)
                .map_or_else(|| "?".to_string(), |a| a.to_string()),
            _ => "?".to_string(),
        };
        let mut params = self.ep_params();
        params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST;
        params.conn_request = request;
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: a pending connection request of a live listener.
        let s = unsafe { (self.api.ucp_ep_create)(self.worker, &params, &mut ep) };
        if s != sys::UCS_OK {
            warn!(%peer, error = %self.api.status_string(s), "ucx accept failed");
            // SAFETY: the request was not consumed.
            unsafe { (self.api.ucp_listener_reject)(lh, request) };
            return;
        }
        let parts = self.add_conn(ep, peer);
        let id = parts.id;
        let delivered = self
            .listeners
            .get(&listener)
            .is_some_and(|l| l.accepted.send(parts).is_ok());
        if !delivered {
            self.close(id);
        }
    }

    fn arrived(&mut self, ep: usize, data: AmData) {
        let release = |api: &Api, worker, data: &AmData| {
            if let AmData::Rndv { desc, .. } = data {
                // SAFETY: an unreleased descriptor that nobody will pull.
                unsafe { (api.ucp_am_data_release)(worker, *desc as *mut c_void) };
            }
        };
        let Some(&id) = self.by_ep.get(&ep) else {
            // No reply endpoint, or a connection closed meanwhile.
            release(self.api, self.worker, &data);
            return;
        };
        let next = self.new_id();
        let Some(c) = self.conns.get_mut(&id) else {
            release(self.api, self.worker, &data);
            return;
        };
        if c.broken {
            release(self.api, self.worker, &data);
            return;
        }
        if c.queued.load(Ordering::Acquire) >= MAX_QUEUED_FRAMES {
            release(self.api, self.worker, &data);
            warn!(
                conn = id,
                "peer sent {MAX_QUEUED_FRAMES} frames without reading replies, disconnecting"
            );
            c.broken = true;
            let _ = c.incoming.send(Incoming::Closed(Some(format!(
                "peer queued more than {MAX_QUEUED_FRAMES} frames"
            ))));
            return;
        }
        let item = match data {
            AmData::Eager(b) => Incoming::Eager(b),
            AmData::Oversized(len) => Incoming::Oversized(len),
            AmData::Rndv { desc, len } => {
                c.rndv.insert(next, (desc, len));
                Incoming::Rndv { desc: next, len }
            }
        };
        c.queued.fetch_add(1, Ordering::AcqRel);
        let _ = c.incoming.send(item);
    }

    fn shutdown(mut self) {
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id);
        }
        let lids: Vec<u64> = self.listeners.keys().copied().collect();
        for id in lids {
            self.close_listener(id);
        }
        let start = Instant::now();
        while (self.inbox().closing > 0 || !self.conns.is_empty())
            && start.elapsed() < SHUTDOWN_WAIT
        {
            // SAFETY: our worker.
            unsafe { (self.api.ucp_worker_progress)(self.worker) };
            self.events();
        }
        if !self.conns.is_empty() {
            warn!(
                left = self.conns.len(),
                "ucx requests still outstanding at shutdown"
            );
        }
        let regions: Vec<u64> = self.regions.keys().copied().collect();
        for id in regions {
            self.mem_unmap(id);
        }
        // SAFETY: every endpoint and listener is closed; nothing uses the worker after this.
        unsafe {
            (self.api.ucp_worker_destroy)(self.worker);
            (self.api.ucp_cleanup)(self.context);
            drop(Box::from_raw(self.inbox));
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

// ---- callbacks (all run on the progress thread, inside UCX calls) ----

struct SendCtx {
    inbox: *mut Inbox,
    conn: ConnId,
    _frame: Vec<u8>,
    reply: oneshot::Sender<Result<()>>,
}

struct PullCtx {
    api: &'static Api,
    inbox: *mut Inbox,
    conn: ConnId,
    buf: Vec<u8>,
    len: usize,
    reply: oneshot::Sender<Result<Bytes>>,
}

impl PullCtx {
    fn finish(mut self, status: sys::ucs_status_t, got: usize) {
        let result = if status == sys::UCS_OK && got == self.len {
            // SAFETY: UCX wrote `got` bytes into the buffer's capacity.
            unsafe { self.buf.set_len(got) };
            Ok(Bytes::from(self.buf))
        } else if status == sys::UCS_OK {
            Err(Error::Truncated {
                field: "frame",
                needed: self.len as u64,
                available: got as u64,
            })
        } else {
            debug!(error = %self.api.status_string(status), "ucx rendezvous receive failed");
            Err(Error::Closed)
        };
        let _ = self.reply.send(result);
    }
}

struct GetCtx {
    api: &'static Api,
    inbox: *mut Inbox,
    conn: ConnId,
    buf: Vec<u8>,
    len: usize,
    reply: oneshot::Sender<Result<Bytes>>,
}

impl GetCtx {
    fn finish(mut self, status: sys::ucs_status_t) {
        let result = if status == sys::UCS_OK {
            // SAFETY: a completed get wrote all `len` bytes into the buffer's capacity.
            unsafe { self.buf.set_len(self.len) };
            Ok(Bytes::from(self.buf))
        } else {
            debug!(error = %self.api.status_string(status), "ucx get failed");
            Err(Error::Io(std::io::Error::other(format!(
                "ucx get: {}",
                self.api.status_string(status)
            ))))
        };
        let _ = self.reply.send(result);
    }
}

unsafe extern "C" fn on_got(request: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    let ctx = Box::from_raw(user.cast::<GetCtx>());
    (ctx.api.ucp_request_free)(request);
    (*ctx.inbox).events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    ctx.finish(status);
}

struct FlushCtx {
    inbox: *mut Inbox,
    conn: ConnId,
}

unsafe extern "C" fn on_sent(request: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    let ctx = Box::from_raw(user.cast::<SendCtx>());
    let inbox = &mut *ctx.inbox;
    let result = if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(send_error(inbox.api, status))
    };
    (inbox.api.ucp_request_free)(request);
    inbox.events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    let _ = ctx.reply.send(result);
}

unsafe extern "C" fn on_pulled(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<PullCtx>());
    (ctx.api.ucp_request_free)(request);
    (*ctx.inbox).events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    ctx.finish(status, length);
}

unsafe extern "C" fn on_flushed(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<FlushCtx>());
    let inbox = &mut *ctx.inbox;
    (inbox.api.ucp_request_free)(request);
    inbox.events.push(Event::Flushed {
        conn: ctx.conn,
        status,
    });
}

unsafe extern "C" fn on_closed(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let inbox = &mut *user.cast::<Inbox>();
    inbox.closing = inbox.closing.saturating_sub(1);
    (inbox.api.ucp_request_free)(request);
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    let inbox = &mut *arg.cast::<Inbox>();
    inbox.events.push(Event::EpError {
        ep: ep as usize,
        status,
    });
}

unsafe extern "C" fn on_conn_request(request: sys::ucp_conn_request_h, arg: *mut c_void) {
    let arg = &*arg.cast::<ListenerArg>();
    (*arg.inbox).events.push(Event::ConnRequest {
        listener: arg.id,
        request: request as usize,
    });
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let inbox = &mut *arg.cast::<Inbox>();
    let param = &*param;
    let ep = if param.recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 {
        param.reply_ep as usize
    } else {
        0
    };
    if param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        // Keep the descriptor: the reader decides (after the size check) to pull or drop it.
        inbox.events.push(Event::Am {
            ep,
            data: AmData::Rndv {
                desc: data as usize,
                len: length,
            },
        });
        return sys::UCS_INPROGRESS;
    }
    let data = if length > inbox.max_eager {
        AmData::Oversized(length)
    } else if length == 0 || data.is_null() {
        AmData::Eager(Bytes::new())
    } else {
        AmData::Eager(Bytes::copy_from_slice(std::slice::from_raw_parts(
            data.cast::<u8>(),
            length,
        )))
    };
    inbox.events.push(Event::Am { ep, data });
    sys::UCS_OK
}

// ---- sockets and poll, declared by hand (Linux) ----

#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}

const POLLIN: i16 = 1;

extern "C" {
    fn poll(fds: *mut PollFd, nfds: u64, timeout: c_int) -> c_int;
}

/// A `struct sockaddr_in` (16 bytes) or `sockaddr_in6` (28 bytes) built from a [`SocketAddr`]:
/// family in host order, port in network order, then the address.
#[repr(C, align(4))]
struct RawSockaddr {
    bytes: [u8; 28],
    len: u32,
}

impl RawSockaddr {
    fn new(addr: SocketAddr) -> RawSockaddr {
        let mut bytes = [0u8; 28];
        bytes[2..4].copy_from_slice(&addr.port().to_be_bytes());
        let len = match addr {
            SocketAddr::V4(a) => {
                bytes[..2].copy_from_slice(&sys::AF_INET.to_ne_bytes());
                bytes[4..8].copy_from_slice(&a.ip().octets());
                16
            }
            SocketAddr::V6(a) => {
                bytes[..2].copy_from_slice(&sys::AF_INET6.to_ne_bytes());
                bytes[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
                bytes[8..24].copy_from_slice(&a.ip().octets());
                bytes[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
                28
            }
        };
        RawSockaddr { bytes, len }
    }

    fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        sys::ucs_sock_addr_t {
            addr: self.bytes.as_ptr().cast(),
            addrlen: self.len,
        }
    }
}

fn parse_sockaddr(s: &sys::sockaddr_storage) -> Option<SocketAddr> {
    let b = &s.bytes;
    let family = u16::from_ne_bytes([b[0], b[1]]);
    let port = u16::from_be_bytes([b[2], b[3]]);
    match family {
        sys::AF_INET => Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(b[4], b[5], b[6], b[7])),
            port,
        )),
        sys::AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[8..24]);
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a)), port))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddrs_round_trip() {
        for a in ["127.0.0.1:7470", "[::1]:9", "10.1.2.3:0"] {
            let addr: SocketAddr = a.parse().unwrap();
            let raw = RawSockaddr::new(addr);
            let mut s = sys::sockaddr_storage { bytes: [0; 128] };
            let n = raw.len as usize;
            s.bytes[..n].copy_from_slice(&raw.bytes[..n]);
            assert_eq!(parse_sockaddr(&s), Some(addr), "{a}");
        }
    }
}
