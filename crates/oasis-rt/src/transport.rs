//! Transports: how frames travel. The daemon and the client speak to a [`Connection`] and never
//! to a socket, so the same protocol code runs over plain TCP ([`TcpTransport`], here) and UCX
//! (`crate::ucx::UcxTransport`, feature `ucx`: active messages for frames). A daemon's URL
//! ([`Endpoint`]: `oasis-rt://HOST:PORT` or `oasis-rt+ucx://HOST:PORT`) names the transport;
//! [`AnyConnection`] carries frames over either.
//!
//! A connection moves whole frames: `send_frame` takes an encoded frame (length prefix
//! included, see [`crate::protocol`]), `recv_frame` returns one frame's body after checking
//! the length prefix against the caller's limit *before* reading the body. Every call has a
//! deadline: `recv_frame` waits up to `idle` for a frame to start and up to the transport's
//! I/O timeout for the rest of it; `send_frame` up to the I/O timeout.
//!
//! # Cancel safety
//! Neither call is cancel safe: dropping one mid-frame leaves the stream out of step, so the
//! connection must then be dropped (the daemon and the client both do).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::{Error, Result};
use crate::pool::Registered;
use crate::protocol::{check_frame_len, RemoteRegion, LEN_PREFIX_BYTES};

/// Default deadline of one frame's I/O once it started (arbitrary).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Default deadline of a TCP connect (arbitrary).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The body buffer starts at most this large and grows as bytes arrive, so a peer that declares
/// a large frame and sends little of it costs little memory. It holds the clients' bulk frames
/// (4 MiB of blocks) whole: growing a buffer copies what it holds.
const INITIAL_BODY_CAPACITY: usize = 8 << 20;

/// One established, authenticated-or-not connection carrying frames.
pub trait Connection: Send + 'static {
    /// Send one encoded frame (length prefix included) within the I/O timeout.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Closed`], [`Error::Io`].
    fn send_frame(&mut self, frame: &[u8]) -> impl Future<Output = Result<()>> + Send;

    /// Receive one frame's body (the bytes after the length prefix). Waits up to `idle` for
    /// the frame to begin (`None`: no limit), then up to the I/O timeout for the rest.
    ///
    /// # Errors
    /// [`Error::Closed`] when the peer closed between frames; [`Error::Truncated`] when it
    /// closed inside one; [`Error::FrameTooLarge`] when the prefix passes `max_frame` (nothing
    /// of the body is read); [`Error::Timeout`]; [`Error::Io`].
    fn recv_frame(
        &mut self,
        max_frame: u32,
        idle: Option<Duration>,
    ) -> impl Future<Output = Result<Bytes>> + Send;

    /// The peer's address, for logs.
    fn peer(&self) -> String;
}

/// A connection that may read a peer's registered memory (RMA), for `ReadBlocksRma`.
pub trait RmaConnection: Connection {
    /// Whether [`RmaConnection::get`] can work on this connection (false over TCP).
    fn can_rma(&self) -> bool;

    /// Read each `(region, offset, len)` of the peer's memory, all in flight together, after
    /// checking every range against its region ([`RemoteRegion::check`]); one buffer each.
    ///
    /// # Errors
    /// [`Error::Unavailable`] where the transport cannot; the range checks; transport errors.
    fn get_many(
        &mut self,
        ranges: Vec<(RemoteRegion, u64, u64)>,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send;
}

/// A registration's eventual answer.
pub type Registering = Pin<Box<dyn Future<Output = Result<Arc<dyn Registered>>> + Send>>;

/// Registers memory for remote reads by the transport's peers (the daemon's staged blocks).
pub trait Registrar: Send + Sync + 'static {
    /// Register `data`; it stays registered and alive while the returned value lives.
    fn register(&self, data: Bytes) -> Registering;
}

/// Accepts connections.
pub trait Listener: Send + 'static {
    type Conn: Connection;

    /// The next connection.
    ///
    /// # Errors
    /// [`Error::Io`] (the daemon logs it and goes on).
    fn accept(&mut self) -> impl Future<Output = Result<Self::Conn>> + Send;

    /// The bound address (with the real port when bound to port 0).
    fn local_addr(&self) -> String;
}

/// A way to connect and to listen.
pub trait Transport: Send + Sync + 'static {
    type Conn: Connection;
    type Listener: Listener<Conn = Self::Conn>;

    /// Connect to a daemon.
    ///
    /// # Errors
    /// [`Error::Unreachable`], [`Error::Timeout`].
    fn connect(&self, addr: &str) -> impl Future<Output = Result<Self::Conn>> + Send;

    /// Listen on `addr`.
    ///
    /// # Errors
    /// [`Error::Io`] (address in use, permission).
    fn bind(&self, addr: &str) -> impl Future<Output = Result<Self::Listener>> + Send;

    /// What registers memory for its peers' RMA reads, if this transport has RMA.
    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        None
    }
}

/// Deadlines of the TCP transport.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }
}

/// Plain TCP on tokio: frames are the protocol's length-prefixed bytes on the stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpTransport {
    pub config: TcpConfig,
}

/// A TCP connection (`TCP_NODELAY` set).
#[derive(Debug)]
pub struct TcpConnection {
    stream: TcpStream,
    peer: String,
    io_timeout: Duration,
}

impl TcpConnection {
    fn new(stream: TcpStream, io_timeout: Duration) -> Self {
        // NOTE: without NODELAY a small request after a large reply waits for Nagle + delayed ACK.
        let _ = stream.set_nodelay(true);
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string());
        TcpConnection {
            stream,
            peer,
            io_timeout,
        }
    }
}

impl Connection for TcpConnection {
    async fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        write_frame(&mut self.stream, frame, self.io_timeout).await
    }

    async fn recv_frame(&mut self, max_frame: u32, idle: Option<Duration>) -> Result<Bytes> {
        read_frame(&mut self.stream, max_frame, idle, self.io_timeout).await
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }
}

/// A bound TCP listener.
#[derive(Debug)]
pub struct TcpFrameListener {
    listener: TcpListener,
    io_timeout: Duration,
}

impl Listener for TcpFrameListener {
    type Conn = TcpConnection;

    async fn accept(&mut self) -> Result<TcpConnection> {
        let (stream, _) = self.listener.accept().await?;
        Ok(TcpConnection::new(stream, self.io_timeout))
    }

    fn local_addr(&self) -> String {
        self.listener
            .local_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string())
    }
}

impl Transport for TcpTransport {
    type Conn = TcpConnection;
    type Listener = TcpFrameListener;

    async fn connect(&self, addr: &str) -> Result<TcpConnection> {
        let after = self.config.connect_timeout;
        match tokio::time::timeout(after, TcpStream::connect(addr)).await {
            Err(_) => Err(Error::Timeout {
                op: "connect",
                after,
            }),
            Ok(Err(source)) => Err(Error::Unreachable {
                addr: addr.to_string(),
                source,
            }),
            Ok(Ok(stream)) => Ok(TcpConnection::new(stream, self.config.io_timeout)),
        }
    }

    async fn bind(&self, addr: &str) -> Result<TcpFrameListener> {
        Ok(TcpFrameListener {
            listener: TcpListener::bind(addr).await?,
            io_timeout: self.config.io_timeout,
        })
    }
}

/// The URL scheme of a daemon reached over TCP (`oasis-rt://HOST:PORT`; a bare `HOST:PORT`
/// means the same).
pub const TCP_SCHEME: &str = "oasis-rt://";
/// The URL scheme of a daemon reached over UCX (`oasis-rt+ucx://HOST:PORT`, feature `ucx`).
pub const UCX_SCHEME: &str = "oasis-rt+ucx://";

/// Which transport a daemon's URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    Tcp,
    Ucx,
}

impl TransportKind {
    /// `"tcp"` or `"ucx"`, as `--transport` spells them.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
        }
    }

    /// The URL scheme of this transport.
    pub fn scheme(self) -> &'static str {
        match self {
            TransportKind::Tcp => TCP_SCHEME,
            TransportKind::Ucx => UCX_SCHEME,
        }
    }
}

/// A daemon's address with its transport: `oasis-rt://HOST:PORT`, `oasis-rt+ucx://HOST:PORT`,
/// or a bare `HOST:PORT` (TCP). `HOST` is a name, an IPv4 address or a bracketed IPv6 one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub kind: TransportKind,
    /// `HOST:PORT`.
    pub addr: String,
}

impl Endpoint {
    /// Parse a daemon URL (the checks are syntactic: the name is resolved on connect).
    ///
    /// # Errors
    /// [`Error::Config`] naming the expected forms.
    pub fn parse(url: &str) -> Result<Endpoint> {
        let bad = || {
            Error::Config(format!(
                "'{url}' is not {TCP_SCHEME}HOST:PORT, {UCX_SCHEME}HOST:PORT or HOST:PORT"
            ))
        };
        let (kind, addr) = if let Some(a) = url.strip_prefix(UCX_SCHEME) {
            (TransportKind::Ucx, a)
        } else if let Some(a) = url.strip_prefix(TCP_SCHEME) {
            (TransportKind::Tcp, a)
        } else if url.contains("://") {
            return Err(bad());
        } else {
            (TransportKind::Tcp, url)
        };
        let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
        let port_ok = !port.is_empty()
            && port.len() <= 5
            && port.bytes().all(|b| b.is_ascii_digit())
            && (1..=65535).contains(&port.parse::<u32>().unwrap_or(0));
        let host_ok = !host.is_empty()
            && !host.contains('/')
            && !host.bytes().any(|b| b.is_ascii_whitespace())
            && (host.starts_with('[') == host.ends_with(']'));
        if !port_ok || !host_ok {
            return Err(bad());
        }
        Ok(Endpoint {
            kind,
            addr: addr.to_string(),
        })
    }

    /// The canonical URL (`scheme` + `HOST:PORT`).
    pub fn url(&self) -> String {
        format!("{}{}", self.kind.scheme(), self.addr)
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url())
    }
}

/// A connection over either transport, so one [`crate::Client`] type serves both (the Python
/// client holds a `Client<AnyConnection>`).
#[derive(Debug)]
pub enum AnyConnection {
    Tcp(TcpConnection),
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxConnection),
}

impl AnyConnection {
    /// Which transport carries it.
    pub fn kind(&self) -> TransportKind {
        match self {
            AnyConnection::Tcp(_) => TransportKind::Tcp,
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(_) => TransportKind::Ucx,
        }
    }
}

impl RmaConnection for TcpConnection {
    fn can_rma(&self) -> bool {
        false
    }

    async fn get_many(&mut self, _: Vec<(RemoteRegion, u64, u64)>) -> Result<Vec<Bytes>> {
        Err(Error::Unavailable(
            "rma reads need the ucx transport".into(),
        ))
    }
}

impl RmaConnection for AnyConnection {
    fn can_rma(&self) -> bool {
        match self {
            AnyConnection::Tcp(c) => c.can_rma(),
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(c) => c.can_rma(),
        }
    }

    async fn get_many(&mut self, ranges: Vec<(RemoteRegion, u64, u64)>) -> Result<Vec<Bytes>> {
        match self {
            AnyConnection::Tcp(c) => c.get_many(ranges).await,
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(c) => RmaConnection::get_many(c, ranges).await,
        }
    }
}

impl Connection for AnyConnection {
    async fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        match self {
            AnyConnection::Tcp(c) => c.send_frame(frame).await,
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(c) => c.send_frame(frame).await,
        }
    }

    async fn recv_frame(&mut self, max_frame: u32, idle: Option<Duration>) -> Result<Bytes> {
        match self {
            AnyConnection::Tcp(c) => c.recv_frame(max_frame, idle).await,
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(c) => c.recv_frame(max_frame, idle).await,
        }
    }

    fn peer(&self) -> String {
        match self {
            AnyConnection::Tcp(c) => c.peer(),
            #[cfg(feature = "ucx")]
            AnyConnection::Ucx(c) => c.peer(),
        }
    }
}

async fn deadline<T>(
    op: &'static str,
    after: Duration,
    f: impl Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(after, f).await {
        Err(_) => Err(Error::Timeout { op, after }),
        Ok(r) => r.map_err(io_error),
    }
}

fn io_error(e: std::io::Error) -> Error {
    use std::io::ErrorKind::*;
    match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof => Error::Closed,
        _ => Error::Io(e),
    }
}

/// Write one encoded frame and flush, within `io_timeout`.
///
/// # Errors
/// [`Error::Timeout`], [`Error::Closed`], [`Error::Io`].
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    frame: &[u8],
    io_timeout: Duration,
) -> Result<()> {
    deadline("send frame", io_timeout, async {
        w.write_all(frame).await?;
        w.flush().await
    })
    .await
}

/// Read one frame from a byte stream: the length prefix (its first byte within `idle`, the
/// rest within `io_timeout`), the limit check, then the body (within `io_timeout`).
///
/// # Errors
/// As [`Connection::recv_frame`].
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: u32,
    idle: Option<Duration>,
    io_timeout: Duration,
) -> Result<Bytes> {
    let mut prefix = [0u8; LEN_PREFIX_BYTES];
    let first = r.read(&mut prefix[..1]);
    let n = match idle {
        Some(after) => deadline("wait for a frame", after, first).await?,
        None => first.await.map_err(io_error)?,
    };
    if n == 0 {
        return Err(Error::Closed);
    }
    let truncated = |e: Error, needed: u64, available: u64| match e {
        Error::Closed => Error::Truncated {
            field: "frame",
            needed,
            available,
        },
        e => e,
    };
    deadline("read frame", io_timeout, r.read_exact(&mut prefix[1..]))
        .await
        .map_err(|e| truncated(e, LEN_PREFIX_BYTES as u64, 1))?;
    let len = u32::from_le_bytes(prefix);
    check_frame_len(len, max_frame)?;
    let len = len as usize;
    let mut body = Vec::with_capacity(len.min(INITIAL_BODY_CAPACITY));
    let got = deadline(
        "read frame",
        io_timeout,
        (&mut *r).take(len as u64).read_to_end(&mut body),
    )
    .await?;
    if got < len {
        return Err(Error::Truncated {
            field: "frame body",
            needed: len as u64,
            available: got as u64,
        });
    }
    Ok(Bytes::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{encode_frame, Message};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    }

    #[test]
    fn endpoints() {
        let e = Endpoint::parse("oasis-rt+ucx://127.0.0.1:7470").unwrap();
        assert_eq!(
            (e.kind, e.addr.as_str()),
            (TransportKind::Ucx, "127.0.0.1:7470")
        );
        assert_eq!(e.url(), "oasis-rt+ucx://127.0.0.1:7470");
        let e = Endpoint::parse("oasis-rt://[::1]:1").unwrap();
        assert_eq!((e.kind, e.addr.as_str()), (TransportKind::Tcp, "[::1]:1"));
        assert_eq!(
            Endpoint::parse("host:65535").unwrap().kind,
            TransportKind::Tcp
        );
        for bad in [
            "",
            "http://h:1",
            "oasis-rt://h",
            "oasis-rt://h:0",
            "oasis-rt://h:65536",
            "oasis-rt://:7",
            "oasis-rt+ucx://h:7/x",
            "oasis-rt+ucx://h/x:7",
            "h:+7",
            "[::1:7",
            "h: 7",
            "oasis-rt+tcp://h:7",
        ] {
            assert!(
                matches!(Endpoint::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn stream_framing() {
        rt().block_on(async {
            let t = Duration::from_secs(1);
            let f = encode_frame(3, &Message::Stats, 1024).unwrap();
            let mut two = f.clone();
            two.extend_from_slice(&f);
            let mut r = &two[..];
            for _ in 0..2 {
                let body = read_frame(&mut r, 1024, Some(t), t).await.unwrap();
                assert_eq!(&body[..], &f[4..]);
            }
            assert!(matches!(
                read_frame(&mut r, 1024, None, t).await,
                Err(Error::Closed)
            ));
            let mut short = &f[..f.len() - 1];
            assert!(matches!(
                read_frame(&mut short, 1024, None, t).await,
                Err(Error::Truncated { .. })
            ));
            let mut half_prefix = &f[..2];
            assert!(matches!(
                read_frame(&mut half_prefix, 1024, None, t).await,
                Err(Error::Truncated { .. })
            ));
            let mut big = &u32::MAX.to_le_bytes()[..];
            assert!(matches!(
                read_frame(&mut big, 1024, None, t).await,
                Err(Error::FrameTooLarge { .. })
            ));
        });
    }
}
