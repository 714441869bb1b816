//! An async client of the daemon (the tests use it; so will the decode engine and the prefill
//! worker).
//!
//! One request in flight per client; every call has a deadline ([`ClientConfig::request_timeout`],
//! covering the send and the whole reply). A call that fails in a way that leaves the
//! connection unusable (timeout with a reply possibly in flight, peer closed, malformed reply,
//! a `bad_frame`/`unauthorized` answer) drops the connection, and later calls return
//! [`Error::Closed`] at once; errors about the request itself (`busy`, `unknown_request`,
//! `missing_block`, ...) leave it usable.
//!
//! # Cancel safety
//! Dropping a call's future mid-way leaves the stream out of step: drop the client too.

use std::time::Duration;

use bytes::Bytes;

use crate::error::{Error, ErrorCode, Result};
use crate::protocol::{
    decode_body, encode_frame, Admission, BlockKey, BlocksRma, FetchAdmission, Frame, Geometry,
    Hello, LayerBlock, Message, ReadBlocks, ReadBlocksRma, Section, StageAdmission, StageBlocks,
    StageSummaries, Staged, StagedBlock, StatsSnapshot, SummaryRun, DEFAULT_MAX_FRAME_BYTES,
    HARD_MAX_FRAME_BYTES, LEN_PREFIX_BYTES, PROTOCOL_VERSION,
};
use crate::transport::{
    Connection, RmaConnection, TcpConfig, TcpConnection, TcpTransport, Transport,
};

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub token: Option<Vec<u8>>,
    pub connect_timeout: Duration,
    /// Deadline of one call: request sent and reply received.
    pub request_timeout: Duration,
    /// Largest reply accepted (and, with the daemon's, largest request sent).
    pub max_frame: u32,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            token: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            max_frame: DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

/// A connection to the daemon, after a successful handshake.
pub struct Client<C: Connection = TcpConnection> {
    conn: Option<C>,
    seq: u32,
    timeout: Duration,
    /// Largest frame we send: the smaller of ours and the daemon's.
    send_max: u32,
    recv_max: u32,
    /// Bytes of every frame sent and received (length prefixes included) and of every RMA
    /// read: what crossed the wire.
    bytes_sent: u64,
    bytes_received: u64,
    /// The daemon serves `ReadBlocksRma` on this connection.
    daemon_rma: bool,
    /// The next RMA lease number.
    lease: u32,
}

impl Client<TcpConnection> {
    /// Connect over TCP and authenticate.
    ///
    /// # Errors
    /// [`Error::Unreachable`] or [`Error::Timeout`] when the daemon is not there;
    /// [`Error::Remote`] with `unauthorized` (wrong token) or `bad_version`.
    pub async fn connect(addr: &str, config: ClientConfig) -> Result<Self> {
        let transport = TcpTransport {
            config: TcpConfig {
                connect_timeout: config.connect_timeout,
                io_timeout: config.request_timeout,
            },
        };
        let conn = transport.connect(addr).await?;
        Self::handshake(conn, &config).await
    }
}

impl<C: Connection> Client<C> {
    /// Connect through `transport` (its deadlines bound the connect) and authenticate.
    ///
    /// # Errors
    /// As [`Client::connect`].
    pub async fn connect_with<T: Transport<Conn = C>>(
        transport: &T,
        addr: &str,
        config: ClientConfig,
    ) -> Result<Self> {
        let conn = transport.connect(addr).await?;
        Self::handshake(conn, &config).await
    }

    /// Authenticate on an established connection (any transport).
    ///
    /// # Errors
    /// As [`Client::connect`] after the connection.
    pub async fn handshake(conn: C, config: &ClientConfig) -> Result<Self> {
        let mut client = Client {
            conn: Some(conn),
            seq: 0,
            timeout: config.request_timeout,
            send_max: config.max_frame.min(HARD_MAX_FRAME_BYTES),
            recv_max: config.max_frame.min(HARD_MAX_FRAME_BYTES),
            bytes_sent: 0,
            bytes_received: 0,
            daemon_rma: false,
            lease: 0,
        };
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION.into(),
            token: Bytes::from(config.token.clone().unwrap_or_default()),
        });
        match client.call(&hello).await? {
            Message::HelloOk(ok) => {
                client.send_max = client.send_max.min(ok.max_frame);
                client.daemon_rma = ok.rma;
                Ok(client)
            }
            other => Err(client.unexpected("hello_ok", &other)),
        }
    }

    /// Whether the connection is still usable.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// The largest frame this client sends: the smaller of its own limit and the daemon's.
    /// A caller that batches (stagings, reads) sizes its batches under it.
    pub fn max_frame(&self) -> u32 {
        self.send_max
    }

    /// `(sent, received)`: bytes of every frame so far, length prefixes included (the
    /// handshake too). What crossed the wire, as the protocol counts it.
    pub fn wire_bytes(&self) -> (u64, u64) {
        (self.bytes_sent, self.bytes_received)
    }

    fn unexpected(&mut self, expected: &'static str, got: &Message) -> Error {
        self.conn = None;
        Error::UnexpectedReply {
            expected,
            got: got.name().to_string(),
        }
    }

    async fn call(&mut self, message: &Message) -> Result<Message> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        // Encoding errors are the caller's: the connection is untouched.
        let frame = encode_frame(seq, message, self.send_max)?;
        let conn = self.conn.as_mut().ok_or(Error::Closed)?;
        let (timeout, recv_max) = (self.timeout, self.recv_max);
        let (sent, received) = (&mut self.bytes_sent, &mut self.bytes_received);
        let exchange = async {
            conn.send_frame(&frame).await?;
            *sent += frame.len() as u64;
            let body = conn.recv_frame(recv_max, Some(timeout)).await?;
            *received += (LEN_PREFIX_BYTES + body.len()) as u64;
            decode_body(body, recv_max)
        };
        let result = match tokio::time::timeout(timeout, exchange).await {
            Err(_) => Err(Error::Timeout {
                op: "request",
                after: timeout,
            }),
            Ok(r) => r,
        };
        let result = match result {
            Ok(Frame { seq: got, message }) if got == seq => match message {
                Message::Error(e) => Err(Error::Remote {
                    code: e.code,
                    message: e.message,
                }),
                m => Ok(m),
            },
            // The daemon answers a refused handshake or a bad frame with seq 0 and closes.
            Ok(Frame {
                message: Message::Error(e),
                ..
            }) => Err(Error::Remote {
                code: e.code,
                message: e.message,
            }),
            Ok(Frame { seq: got, message }) => Err(Error::UnexpectedReply {
                expected: "the reply to the request sent",
                got: format!("{} with seq {got}", message.name()),
            }),
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            if e.breaks_connection() {
                self.conn = None;
            }
        }
        result
    }

    async fn stage(&mut self, message: &Message) -> Result<Staged> {
        match self.call(message).await? {
            Message::Staged(s) => Ok(s),
            other => Err(self.unexpected("staged", &other)),
        }
    }

    /// Stage blocks of a request (created on first staging).
    ///
    /// # Errors
    /// Local validation (lengths against `geometry`, frame size); `busy` / `out_of_memory`
    /// past the daemon's budget; `geometry_mismatch`; transport errors.
    pub async fn stage_blocks(
        &mut self,
        request: u64,
        geometry: Geometry,
        blocks: Vec<StagedBlock>,
    ) -> Result<Staged> {
        self.stage(&Message::StageBlocks(StageBlocks {
            request,
            geometry,
            blocks,
        }))
        .await
    }

    /// Stage summary rows of a request.
    ///
    /// # Errors
    /// As [`Client::stage_blocks`].
    pub async fn stage_summaries(
        &mut self,
        request: u64,
        geometry: Geometry,
        runs: Vec<SummaryRun>,
    ) -> Result<Staged> {
        self.stage(&Message::StageSummaries(StageSummaries {
            request,
            geometry,
            runs,
        }))
        .await
    }

    /// Set a staged request's admission set: the blocks of the first decode step and sections.
    ///
    /// # Errors
    /// `unknown_request` if nothing of it was staged; as [`Client::stage_blocks`].
    pub async fn stage_admission(
        &mut self,
        request: u64,
        selected: Vec<LayerBlock>,
        sections: Vec<Section>,
    ) -> Result<Staged> {
        self.stage(&Message::StageAdmission(StageAdmission {
            request,
            selected,
            sections,
        }))
        .await
    }

    /// Fetch the admission set of layers `first_layer..first_layer + num_layers`.
    ///
    /// # Errors
    /// `unknown_request`, `missing_block`, `too_large` (ask for fewer layers), transport errors.
    pub async fn fetch_admission(
        &mut self,
        request: u64,
        first_layer: u16,
        num_layers: u16,
        include_sections: bool,
    ) -> Result<Admission> {
        let m = Message::FetchAdmission(FetchAdmission {
            request,
            first_layer,
            num_layers,
            include_sections,
        });
        match self.call(&m).await? {
            Message::Admission(a) => Ok(a),
            other => Err(self.unexpected("admission", &other)),
        }
    }

    /// Read a batch of blocks (or block-heads), possibly across requests: one result per key.
    ///
    /// # Errors
    /// `too_large` for the whole batch; transport errors. Per-entry failures are in the result.
    pub async fn read_blocks(
        &mut self,
        keys: Vec<BlockKey>,
    ) -> Result<Vec<std::result::Result<Bytes, ErrorCode>>> {
        let n = keys.len();
        match self.call(&Message::ReadBlocks(ReadBlocks { keys })).await? {
            Message::Blocks(b) if b.entries.len() == n => Ok(b.entries),
            other => Err(self.unexpected("blocks, one per key", &other)),
        }
    }

    /// Release a request; returns the bytes the daemon freed (0 if it held nothing).
    ///
    /// # Errors
    /// Transport errors.
    pub async fn release(&mut self, request: u64) -> Result<u64> {
        match self.call(&Message::Release { request }).await? {
            Message::Released(r) => Ok(r.freed_bytes),
            other => Err(self.unexpected("released", &other)),
        }
    }

    /// The daemon's counters.
    ///
    /// # Errors
    /// Transport errors.
    pub async fn stats(&mut self) -> Result<StatsSnapshot> {
        match self.call(&Message::Stats).await? {
            Message::StatsReply(s) => Ok(s),
            other => Err(self.unexpected("stats_reply", &other)),
        }
    }
}

impl<C: RmaConnection> Client<C> {
    /// Whether [`Client::read_blocks_rma`] works here: the daemon's pool is registered with the
    /// transport, and the connection can read it (UCX).
    pub fn rma(&self) -> bool {
        self.daemon_rma && self.conn.as_ref().is_some_and(C::can_rma)
    }

    /// As [`Client::read_blocks`], with the block bytes read by RMA from the daemon's
    /// registered memory instead of inside the reply frame: the reply names ranges (checked
    /// against the regions it advertises when decoded), this client reads them, then
    /// acknowledges the lease so that the daemon lets them go. Within the request timeout.
    ///
    /// # Errors
    /// [`Error::Unavailable`] unless [`Client::rma`]; [`Error::FrameTooLarge`] when the entries
    /// pass this client's frame limit (the lease is acknowledged, the connection kept);
    /// transport errors (the connection is dropped).
    pub async fn read_blocks_rma(
        &mut self,
        keys: Vec<BlockKey>,
    ) -> Result<Vec<std::result::Result<Bytes, ErrorCode>>> {
        if !self.rma() {
            return Err(Error::Unavailable(
                "rma reads need a ucx connection to a daemon that offers them (hello_ok.rma)"
                    .into(),
            ));
        }
        let n = keys.len();
        self.lease = self.lease.wrapping_add(1);
        let lease = self.lease;
        let reply = match self
            .call(&Message::ReadBlocksRma(ReadBlocksRma { lease, keys }))
            .await?
        {
            Message::BlocksRma(b) if b.lease == lease && b.entries.len() == n => b,
            other => return Err(self.unexpected("blocks_rma of the lease, one per key", &other)),
        };
        let total: u64 = reply
            .entries
            .iter()
            .flat_map(|e| e.iter().flatten())
            .map(|r| u64::from(r.len))
            .sum();
        let read = if total > u64::from(self.recv_max) {
            Err(Error::FrameTooLarge {
                len: total,
                max: self.recv_max.into(),
            })
        } else {
            let timeout = self.timeout;
            match tokio::time::timeout(timeout, self.get_all(&reply)).await {
                Err(_) => Err(Error::Timeout {
                    op: "rma read",
                    after: timeout,
                }),
                Ok(r) => r,
            }
        };
        if let Err(e) = &read {
            if !matches!(e, Error::FrameTooLarge { .. }) {
                // A failed or late get: the connection's state is unknown.
                self.conn = None;
                return read;
            }
        }
        match self.call(&Message::Ack { lease }).await? {
            Message::Acked { lease: got } if got == lease => {}
            other => return Err(self.unexpected("acked of the lease", &other)),
        }
        read
    }

    async fn get_all(
        &mut self,
        reply: &BlocksRma,
    ) -> Result<Vec<std::result::Result<Bytes, ErrorCode>>> {
        let conn = self.conn.as_mut().ok_or(Error::Closed)?;
        // The decoder checked every range against its region; the connection checks them
        // again before the transport sees them. All in flight together.
        let ranges: Vec<_> = reply
            .entries
            .iter()
            .flat_map(|e| e.iter().flatten())
            .map(|r| {
                (
                    reply.regions[r.region as usize].clone(),
                    r.offset,
                    u64::from(r.len),
                )
            })
            .collect();
        let mut got = conn.get_many(ranges).await?.into_iter();
        let mut out = Vec::with_capacity(reply.entries.len());
        for e in &reply.entries {
            match e {
                Err(code) => out.push(Err(*code)),
                Ok(ranges) => {
                    let parts: Vec<Bytes> = got.by_ref().take(ranges.len()).collect();
                    self.bytes_received += parts.iter().map(|p| p.len() as u64).sum::<u64>();
                    out.push(Ok(match parts.len() {
                        1 => parts.into_iter().next().unwrap_or_default(),
                        // A head's K rows then its V rows, as ReadBlocks returns them.
                        _ => Bytes::from(parts.concat()),
                    }));
                }
            }
        }
        Ok(out)
    }
}
