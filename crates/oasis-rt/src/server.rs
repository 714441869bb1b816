//! The staging daemon: accepts connections, authenticates them, and serves the staging pool.
//!
//! Each connection is one task: handshake (a whole `Hello` within the handshake timeout, its
//! frame at most [`PREAUTH_MAX_FRAME_BYTES`], the token compared in constant time), then
//! request -> reply until the peer closes. Requests of one connection are served in order; connections run
//! concurrently. The pool is one mutex held only for map operations: block bytes are copied
//! before it is taken and replies are encoded and written after it is released.
//!
//! # Failure semantics
//! - A request the pool refuses (budget, unknown request, missing block, out of range for the
//!   request's geometry) gets an `Error` reply; the connection stays open.
//! - A malformed frame (bad length prefix, version, kind, field; truncated; trailing bytes)
//!   gets a best-effort `Error` reply with code `bad_frame` (or `too_large`, `bad_version`),
//!   then the connection is closed: nothing of it reached the pool, which decodes only whole,
//!   valid frames.
//! - A failed handshake gets `unauthorized` and is closed; so does a connection that sent no
//!   whole `Hello` within `handshake_timeout` (seconds, so that idle sockets cannot hold the
//!   `max_connections` slots for long).
//! - A connection idle past `idle_timeout`, or stalled inside a frame past `io_timeout`, is
//!   closed. Staged data is never tied to a connection: it lives until released or, once its
//!   lease expired, evicted under memory pressure.
//! - Over a transport with RMA (UCX), each `StageBlocks` frame's blocks are copied into one
//!   allocation registered for remote reads, and `ReadBlocksRma` answers with ranges of it.
//!   The ranges stay alive and registered until the client's `Ack` of that lease, the
//!   connection's end, or the I/O timeout (checked at each request), whatever happens to the
//!   request meanwhile; at most [`MAX_LEASES`] per connection (`busy` past it). Leased bytes of
//!   a released request are no longer counted by the pool (at most [`MAX_LEASES`] frames' worth
//!   per connection).
//! - Shutdown (SIGINT/SIGTERM in the binary, or the future given to [`Server::run`]) stops
//!   accepting, lets each connection finish the request it is serving (up to
//!   [`SHUTDOWN_GRACE`]), then closes everything. Dropping the `run` future closes everything
//!   at once.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

use crate::error::{Error, ErrorCode, Result};
use crate::metrics::{run_http, token_matches, Metrics, REQUEST_KINDS};
use crate::pool::{PoolConfig, Registered, StagingPool};
use crate::protocol::{
    decode_body, encode_frame, Blocks, BlocksRma, ErrorReply, HelloOk, Message, Released, Staged,
    StatsSnapshot, DEFAULT_MAX_FRAME_BYTES, HARD_MAX_FRAME_BYTES, HEADER_BYTES,
    PREAUTH_MAX_FRAME_BYTES, PROTOCOL_VERSION,
};
use crate::transport::{
    Connection, Listener, Registrar, TcpConfig, TcpFrameListener, TcpTransport, Transport,
    DEFAULT_IO_TIMEOUT,
};

/// Where the daemon listens unless told otherwise (loopback; the port is arbitrary).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7470";
/// How long shutdown waits for connections to finish their current request.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Default idle limit of a connection between frames (arbitrary).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default time a new connection has to send its whole `Hello` (arbitrary: a client sends it
/// right after connecting, so this is a round trip plus scheduling, with a wide margin).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default lease of a staged request (arbitrary).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(600);
/// Default connection limit (arbitrary).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Unacknowledged RMA leases one connection may hold (arbitrary: a client reads one layer's
/// batch at a time and acknowledges it before the next).
pub const MAX_LEASES: usize = 16;

/// Everything the daemon is configured with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: String,
    /// Where to serve `GET /metrics` (Prometheus text); `None`: nowhere.
    pub metrics: Option<String>,
    pub budget_bytes: u64,
    /// Shared token every client must present; required on a non-loopback address.
    pub token: Option<Vec<u8>>,
    pub max_frame: u32,
    pub io_timeout: Duration,
    /// How long an authenticated connection may sit between frames (`None`: forever).
    pub idle_timeout: Option<Duration>,
    /// How long a new connection has to send its whole `Hello`.
    pub handshake_timeout: Duration,
    pub lease: Option<Duration>,
    /// Connections served at once; past it a new one gets `busy` and is closed.
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: DEFAULT_LISTEN.to_string(),
            metrics: None,
            budget_bytes: 1 << 30,
            token: None,
            max_frame: DEFAULT_MAX_FRAME_BYTES,
            io_timeout: DEFAULT_IO_TIMEOUT,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            lease: Some(DEFAULT_LEASE),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

struct Shared {
    pool: Mutex<StagingPool>,
    metrics: Metrics,
    config: ServerConfig,
    connections: Arc<Semaphore>,
    /// Registers staged blocks for RMA reads (a transport with RMA), or none.
    registrar: Option<Arc<dyn Registrar>>,
}

/// What one RMA read keeps alive until its `Ack`: the blocks and their registered regions.
struct Lease {
    _pins: Vec<Bytes>,
    _regions: Vec<Arc<dyn Registered>>,
    at: Instant,
}

/// A connection's unacknowledged RMA leases.
#[derive(Default)]
struct Leases(std::collections::HashMap<u32, Lease>);

impl Shared {
    fn pool(&self) -> std::sync::MutexGuard<'_, StagingPool> {
        // The pool's methods do not panic on any input; if one ever did, its accounting is
        // still consistent (every mutation is applied after its checks), so go on.
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stats(&self) -> StatsSnapshot {
        let mut s = self.pool().stats(Instant::now());
        let m = &self.metrics;
        s.bytes_served = m.bytes_served.get();
        s.connections_active = m.connections_active.get();
        s.requests_total = m.requests_total();
        s.errors_total = m.errors_total();
        s
    }
}

/// A view of a running daemon's state (for tests and embedding), independent of the network.
#[derive(Clone)]
pub struct ServerHandle(Arc<Shared>);

impl ServerHandle {
    /// The same numbers `oasis-rt stats` prints.
    pub fn stats(&self) -> StatsSnapshot {
        self.0.stats()
    }

    /// Recount the pool's accounting (see [`StagingPool::audit`]).
    ///
    /// # Errors
    /// A description of the first broken invariant.
    pub fn audit(&self) -> std::result::Result<(), String> {
        self.0.pool().audit()
    }

    /// The Prometheus text the metrics endpoint serves.
    pub fn render_metrics(&self) -> String {
        self.0.metrics.render(&self.0.stats())
    }
}

/// Resolve `addr` and refuse a non-loopback address unless a token is configured.
///
/// # Errors
/// [`Error::Config`] with a one-line reason.
pub async fn check_exposure(addr: &str, what: &str, has_token: bool) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::Config(format!("cannot resolve {what} address {addr}: {e}")))?
        .collect();
    let first = *addrs
        .first()
        .ok_or_else(|| Error::Config(format!("{what} address {addr} resolves to nothing")))?;
    let exposed = addrs.iter().any(|a| !a.ip().to_canonical().is_loopback());
    if exposed && !has_token {
        return Err(Error::Config(format!(
            "refusing to listen on non-loopback {what} address {addr} without a token (use --token-file)"
        )));
    }
    Ok(first)
}

/// A bound daemon, ready to [`run`](Server::run), listening through any [`Transport`]'s
/// listener (TCP unless built with [`Server::bind_with`]).
pub struct Server<L: Listener = TcpFrameListener> {
    listener: L,
    metrics: Option<tokio::net::TcpListener>,
    shared: Arc<Shared>,
}

impl Server {
    /// Validate the configuration and bind the listeners, over TCP.
    ///
    /// # Errors
    /// [`Error::Config`] (non-loopback without a token, bad limits, unresolvable address),
    /// [`Error::Io`] (address in use).
    pub async fn bind(config: ServerConfig) -> Result<Server> {
        let transport = TcpTransport {
            config: TcpConfig {
                io_timeout: config.io_timeout,
                ..TcpConfig::default()
            },
        };
        Server::bind_with(&transport, config).await
    }
}

impl<L: Listener> Server<L> {
    /// As [`Server::bind`], listening on `config.listen` through `transport` (its own deadlines
    /// apply to frame I/O; the metrics endpoint is always TCP).
    ///
    /// # Errors
    /// As [`Server::bind`].
    pub async fn bind_with<T: Transport<Listener = L>>(
        transport: &T,
        config: ServerConfig,
    ) -> Result<Server<L>> {
        if config.max_frame < PREAUTH_MAX_FRAME_BYTES || config.max_frame > HARD_MAX_FRAME_BYTES {
            return Err(Error::Config(format!(
                "max frame must be within {PREAUTH_MAX_FRAME_BYTES}..={HARD_MAX_FRAME_BYTES} bytes"
            )));
        }
        if config.budget_bytes == 0 || config.max_connections == 0 {
            return Err(Error::Config(
                "memory budget and connection limit must be nonzero".into(),
            ));
        }
        if config.handshake_timeout.is_zero() || config.idle_timeout.is_some_and(|d| d.is_zero()) {
            return Err(Error::Config(
                "handshake and idle timeouts must be nonzero".into(),
            ));
        }
        if config.token.as_ref().is_some_and(|t| t.is_empty()) {
            return Err(Error::Config("the token is empty".into()));
        }
        let has_token = config.token.is_some();
        let listen = check_exposure(&config.listen, "listen", has_token).await?;
        let metrics = match &config.metrics {
            Some(m) => {
                let addr = check_exposure(m, "metrics", has_token).await?;
                Some(tokio::net::TcpListener::bind(addr).await?)
            }
            None => None,
        };
        let listener = transport.bind(&listen.to_string()).await?;
        let counters = Metrics::new();
        counters.connection_slots.set(config.max_connections as u64);
        let shared = Arc::new(Shared {
            pool: Mutex::new(StagingPool::new(PoolConfig {
                budget_bytes: config.budget_bytes,
                lease: config.lease,
            })),
            metrics: counters,
            connections: Arc::new(Semaphore::new(config.max_connections)),
            registrar: transport.registrar(),
            config,
        });
        Ok(Server {
            listener,
            metrics,
            shared,
        })
    }

    /// The bound address (the real port when bound to port 0).
    pub fn local_addr(&self) -> String {
        self.listener.local_addr()
    }

    /// The bound metrics address, if any.
    pub fn metrics_addr(&self) -> Option<String> {
        self.metrics
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.to_string())
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle(self.shared.clone())
    }

    /// Serve until `shutdown` completes, then shut down gracefully (module docs).
    ///
    /// # Cancel safety
    /// Dropping the future closes every connection at once (their tasks are owned here);
    /// staged data stays in the pool (reachable through a [`ServerHandle`]).
    ///
    /// # Errors
    /// None today; the signature leaves room for fatal listener errors.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let Server {
            mut listener,
            metrics,
            shared,
        } = self;
        info!(
            listen = %listener.local_addr(),
            budget_bytes = shared.config.budget_bytes,
            token = shared.config.token.is_some(),
            "oasis-rt serving"
        );
        let mut aux = JoinSet::new();
        if let Some(m) = metrics {
            let s = shared.clone();
            let token = shared.config.token.clone();
            aux.spawn(run_http(m, token, move || s.metrics.render(&s.stats())));
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(done) = conns.join_next(), if !conns.is_empty() => {
                    if let Err(e) = done {
                        if e.is_panic() {
                            warn!(error = %e, "connection task panicked");
                        }
                    }
                }
                accepted = listener.accept() => match accepted {
                    Ok(conn) => {
                        let peer = conn.peer();
                        shared.metrics.connections_total.inc();
                        match shared.connections.clone().try_acquire_owned() {
                            Ok(permit) => {
                                let span = tracing::info_span!("conn", peer = %peer);
                                conns.spawn(
                                    serve_connection(conn, shared.clone(), stop_rx.clone(), permit)
                                        .instrument(span),
                                );
                            }
                            Err(_) => {
                                shared.metrics.connections_refused.inc();
                                warn!(%peer, "connection limit reached, refusing");
                                conns.spawn(refuse(conn, ErrorCode::Busy, "too many connections"));
                            }
                        }
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
            }
        }
        info!(connections = conns.len(), "shutting down");
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!(
                left = conns.len(),
                "connections still busy after the grace period, closing"
            );
        }
        conns.shutdown().await;
        aux.shutdown().await;
        info!("stopped");
        Ok(())
    }
}

/// Decrements the active-connection gauge however the task ends (even when aborted).
struct ActiveGuard(Arc<Shared>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.metrics.connections_active.dec();
    }
}

async fn refuse<C: Connection>(mut conn: C, code: ErrorCode, message: &str) {
    let reply = Message::Error(ErrorReply {
        code,
        message: message.to_string(),
    });
    if let Ok(f) = encode_frame(0, &reply, PREAUTH_MAX_FRAME_BYTES) {
        let _ = conn.send_frame(&f).await;
    }
}

/// The handshake: one Hello, right version, right token, all within the handshake timeout.
async fn handshake<C: Connection>(conn: &mut C, shared: &Shared) -> Result<u32> {
    let limit = shared.config.handshake_timeout;
    let hello = conn.recv_frame(PREAUTH_MAX_FRAME_BYTES, Some(limit));
    // The whole frame, not only its start, within the limit: a peer that sends a byte and
    // stalls does not hold a connection slot for the I/O timeout.
    let body = match tokio::time::timeout(limit, hello).await {
        Ok(body) => body?,
        Err(_) => {
            return Err(Error::Timeout {
                op: "handshake",
                after: limit,
            })
        }
    };
    let frame = decode_body(body, PREAUTH_MAX_FRAME_BYTES)?;
    let Message::Hello(hello) = frame.message else {
        return Err(Error::Unauthorized);
    };
    if hello.version != u16::from(PROTOCOL_VERSION) {
        return Err(Error::BadVersion {
            got: hello.version,
            expected: PROTOCOL_VERSION.into(),
        });
    }
    if let Some(token) = &shared.config.token {
        if !token_matches(token, &hello.token) {
            return Err(Error::Unauthorized);
        }
    }
    Ok(frame.seq)
}

async fn serve_connection<C: Connection>(
    mut conn: C,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    shared.metrics.connections_active.inc();
    let _active = ActiveGuard(shared.clone());
    let max_frame = shared.config.max_frame;
    let start = Instant::now();
    match handshake(&mut conn, &shared).await {
        Ok(seq) => {
            shared.metrics.observe(0, start.elapsed());
            let ok = Message::HelloOk(HelloOk {
                version: PROTOCOL_VERSION.into(),
                max_frame,
                rma: shared.registrar.is_some(),
            });
            match encode_frame(seq, &ok, max_frame) {
                Ok(f) if conn.send_frame(&f).await.is_ok() => debug!("connected"),
                _ => return,
            }
        }
        Err(e) => {
            shared.metrics.connections_refused.inc();
            if matches!(e, Error::Timeout { .. }) {
                shared.metrics.handshake_timeouts.inc();
            }
            let code = match e {
                Error::Closed => return,
                Error::BadVersion { .. } => ErrorCode::BadVersion,
                Error::Unauthorized => ErrorCode::Unauthorized,
                Error::FrameTooLarge { .. } | Error::Timeout { .. } => ErrorCode::Unauthorized,
                _ => ErrorCode::BadFrame,
            };
            shared.metrics.error(code);
            warn!(error = %e, "handshake refused");
            refuse(conn, code, &e.to_string()).await;
            return;
        }
    }
    let mut leases = Leases::default();
    loop {
        let received = tokio::select! {
            biased;
            _ = stop.changed() => break,
            r = conn.recv_frame(max_frame, shared.config.idle_timeout) => r,
        };
        let frame = match received.and_then(|body| decode_body(body, max_frame)) {
            Ok(frame) => frame,
            Err(Error::Closed) => {
                debug!("closed by peer");
                break;
            }
            Err(e @ Error::Timeout { .. }) => {
                debug!(error = %e, "closing idle or stalled connection");
                break;
            }
            Err(e) => {
                // Malformed: answer once, close. Nothing reached the pool.
                shared.metrics.bad_frames.inc();
                let code = match e.code() {
                    c @ (ErrorCode::TooLarge | ErrorCode::BadVersion) => c,
                    _ => ErrorCode::BadFrame,
                };
                shared.metrics.error(code);
                warn!(error = %e, "bad frame, closing connection");
                refuse(conn, code, &e.to_string()).await;
                return;
            }
        };
        let start = Instant::now();
        let seq = frame.seq;
        let mut message = frame.message;
        let region = match register_blocks(&shared, &mut message).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "registering staged blocks failed");
                let r = error_message(&e);
                match encode_frame(seq, &r, max_frame) {
                    Ok(f) if conn.send_frame(&f).await.is_ok() => continue,
                    _ => break,
                }
            }
        };
        let (kind, reply) = match dispatch(&shared, message, region, &mut leases) {
            Ok(r) => r,
            Err(e) => {
                // Not a request kind (a reply, or Hello again): a confused peer; close.
                shared.metrics.bad_frames.inc();
                shared.metrics.error(ErrorCode::BadFrame);
                warn!(error = %e, "unexpected message, closing connection");
                refuse(conn, ErrorCode::BadFrame, &e.to_string()).await;
                return;
            }
        };
        let (reply, encoded) = match encode_frame(seq, &reply, max_frame) {
            Ok(f) => (reply, f),
            Err(e) => {
                // The reply passed the frame limit (the pool bounds it first; this is the
                // backstop): say so instead.
                let r = error_message(&e);
                match encode_frame(seq, &r, max_frame) {
                    Ok(f) => (r, f),
                    Err(_) => break,
                }
            }
        };
        if let Message::Error(e) = &reply {
            shared.metrics.error(e.code);
        }
        let served = served_bytes(&reply);
        if let Err(e) = conn.send_frame(&encoded).await {
            debug!(error = %e, "reply not delivered");
            break;
        }
        shared.metrics.bytes_served.inc_by(served);
        shared.metrics.observe(kind, start.elapsed());
    }
}

fn served_bytes(reply: &Message) -> u64 {
    match reply {
        Message::Admission(a) => {
            let s: usize = a.summaries.iter().map(|r| r.data.len()).sum();
            let b: usize = a.blocks.iter().map(|b| b.data.len()).sum();
            let c: usize = a.sections.iter().map(|c| c.data.len()).sum();
            (s + b + c) as u64
        }
        Message::Blocks(b) => b
            .entries
            .iter()
            .map(|e| e.as_ref().map_or(0, |d| d.len() as u64))
            .sum(),
        // The bytes the client reads by RMA.
        Message::BlocksRma(b) => b
            .entries
            .iter()
            .flat_map(|e| e.iter().flatten())
            .map(|r| u64::from(r.len))
            .sum(),
        _ => 0,
    }
}

/// Over a transport with RMA: copy a `StageBlocks` frame's blocks into one allocation, register
/// it, and make the blocks slices of it. `None` for any other message or transport.
async fn register_blocks(
    shared: &Shared,
    message: &mut Message,
) -> Result<Option<Arc<dyn Registered>>> {
    let (Some(registrar), Message::StageBlocks(m)) = (&shared.registrar, message) else {
        return Ok(None);
    };
    if m.blocks.is_empty() {
        return Ok(None);
    }
    // NOTE: copies up to a frame's bytes on a runtime thread (as the per-block copy does).
    let total: usize = m.blocks.iter().map(|b| b.data.len()).sum();
    let mut arena = Vec::with_capacity(total);
    for b in &m.blocks {
        arena.extend_from_slice(&b.data);
    }
    let arena = Bytes::from(arena);
    let mut at = 0;
    for b in &mut m.blocks {
        let n = b.data.len();
        b.data = arena.slice(at..at + n);
        at += n;
    }
    Ok(Some(registrar.register(arena).await?))
}

fn copy(data: &Bytes) -> Bytes {
    // Own the bytes: a slice would pin the whole received frame (see pool docs).
    Bytes::copy_from_slice(data)
}

/// Serve one request. `Err` only for messages that are not requests. `region`: the
/// registered allocation a `StageBlocks`' blocks were copied into ([`register_blocks`]).
fn dispatch(
    shared: &Shared,
    message: Message,
    region: Option<Arc<dyn Registered>>,
    leases: &mut Leases,
) -> Result<(usize, Message)> {
    let kind = message.name();
    let index = REQUEST_KINDS.iter().position(|k| *k == kind);
    let now = Instant::now();
    let max_reply = u64::from(shared.config.max_frame) - HEADER_BYTES as u64;
    // Leases past the I/O timeout are the client's loss (it stalled mid-read).
    let io = shared.config.io_timeout;
    leases
        .0
        .retain(|_, l| now.saturating_duration_since(l.at) <= io);
    let result = match message {
        Message::StageBlocks(mut m) => {
            if region.is_none() {
                // NOTE: copies up to a frame's bytes on a runtime thread (~10 ms for 64 MiB).
                for b in &mut m.blocks {
                    b.data = copy(&b.data);
                }
            }
            let mut pool = shared.pool();
            let r = pool.stage_blocks(m.request, m.geometry, m.blocks, now);
            if let (Ok(_), Some(region)) = (&r, region) {
                pool.attach_region(m.request, region);
            }
            r.map(|stored| (m.request, stored))
        }
        Message::StageSummaries(mut m) => {
            for r in &mut m.runs {
                r.data = copy(&r.data);
            }
            let r = shared
                .pool()
                .stage_summaries(m.request, m.geometry, m.runs, now);
            r.map(|stored| (m.request, stored))
        }
        Message::StageAdmission(mut m) => {
            for s in &mut m.sections {
                s.data = copy(&s.data);
            }
            let r = shared
                .pool()
                .stage_admission(m.request, m.selected, m.sections, now);
            r.map(|stored| (m.request, stored))
        }
        Message::FetchAdmission(m) => {
            let r = shared.pool().fetch_admission(
                m.request,
                m.first_layer,
                m.num_layers,
                m.include_sections,
                max_reply,
                now,
            );
            return Ok((
                index.unwrap_or(0),
                match r {
                    Ok(a) => Message::Admission(a),
                    Err(e) => error_message(&e),
                },
            ));
        }
        Message::ReadBlocks(m) => {
            let r = shared.pool().read_blocks(&m.keys, max_reply, now);
            return Ok((
                index.unwrap_or(0),
                match r {
                    Ok(entries) => Message::Blocks(Blocks { entries }),
                    Err(e) => error_message(&e),
                },
            ));
        }
        Message::Release { request } => {
            let freed_bytes = shared.pool().release(request);
            debug!(request, freed_bytes, "released");
            return Ok((
                index.unwrap_or(0),
                Message::Released(Released { freed_bytes }),
            ));
        }
        Message::Stats => {
            return Ok((index.unwrap_or(0), Message::StatsReply(shared.stats())));
        }
        Message::ReadBlocksRma(m) => {
            let refuse = |code, message: String| Message::Error(ErrorReply { code, message });
            let reply = if shared.registrar.is_none() {
                refuse(
                    ErrorCode::BadRequest,
                    "no rma reads on this transport (hello_ok.rma = 0): use read_blocks".into(),
                )
            } else if leases.0.contains_key(&m.lease) {
                refuse(
                    ErrorCode::BadRequest,
                    format!("lease {} is held: acknowledge it first", m.lease),
                )
            } else if leases.0.len() >= MAX_LEASES {
                refuse(
                    ErrorCode::Busy,
                    format!("{MAX_LEASES} rma leases of this connection are unacknowledged"),
                )
            } else {
                match shared.pool().read_blocks_rma(&m.keys, max_reply, now) {
                    Ok(read) => {
                        let regions = read.regions.iter().map(|r| r.remote().clone()).collect();
                        leases.0.insert(
                            m.lease,
                            Lease {
                                _pins: read.pins,
                                _regions: read.regions,
                                at: now,
                            },
                        );
                        Message::BlocksRma(BlocksRma {
                            lease: m.lease,
                            regions,
                            entries: read.entries,
                        })
                    }
                    Err(e) => error_message(&e),
                }
            };
            return Ok((index.unwrap_or(0), reply));
        }
        Message::Ack { lease } => {
            leases.0.remove(&lease);
            return Ok((index.unwrap_or(0), Message::Acked { lease }));
        }
        other => {
            return Err(Error::UnexpectedReply {
                expected: "a request",
                got: other.name().to_string(),
            })
        }
    };
    let reply = match result {
        Ok((request, stored_bytes)) => {
            debug!(request, kind, stored_bytes, "staged");
            Message::Staged(Staged {
                stored_bytes,
                used_bytes: shared.pool().used_bytes(),
            })
        }
        Err(e) => {
            debug!(kind, error = %e, "refused");
            error_message(&e)
        }
    };
    Ok((index.unwrap_or(0), reply))
}

fn error_message(e: &Error) -> Message {
    Message::Error(ErrorReply {
        code: e.code(),
        message: e.to_string(),
    })
}
