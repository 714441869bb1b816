//! The wire protocol: versioned, length-prefixed binary frames.
//!
//! A frame is a little-endian `u32` length prefix, then that many bytes: an 8-byte header and
//! the message's payload.
//!
//! | offset | bytes | field | rule |
//! | --- | --- | --- | --- |
//! | 0 | 4 | `len` | bytes after this field; `8 <= len <= max_frame` (checked before the body is read) |
//! | 4 | 1 | `version` | [`PROTOCOL_VERSION`] |
//! | 5 | 1 | `kind` | message kind ([`Message::kind`]) |
//! | 6 | 2 | `reserved` | zero |
//! | 8 | 4 | `seq` | chosen by the client, echoed in the reply |
//! | 12 | `len - 8` | payload | per kind, below; must be consumed exactly |
//!
//! Payload fields are fixed-width little-endian integers; byte strings whose length follows from
//! the request's [`Geometry`] (blocks, summary rows) carry no length of their own, the others a
//! `u32` (or `u8` for names) length. Every count is checked against its bound *and* against
//! the bytes left in the frame before anything is allocated for it, so decoding allocates at most
//! a small multiple of the frame it was given and never panics. Decoded byte strings are
//! zero-copy slices of the frame ([`Bytes`]).
//!
//! Request and reply payloads:
//!
//! | kind | message | payload |
//! | --- | --- | --- |
//! | `0x01` | `Hello` | `version u16, token_len u16, token` |
//! | `0x02` | `StageBlocks` | `request u64, geometry, n u32, n x (layer u16, block u32, block bytes)` |
//! | `0x03` | `StageSummaries` | `request u64, geometry, n u32, n x (layer u16, first_block u32, num_blocks u32, rows)` |
//! | `0x04` | `StageAdmission` | `request u64, n u32, n x (layer u16, block u32), sections` |
//! | `0x05` | `FetchAdmission` | `request u64, first_layer u16, num_layers u16, include_sections u8` |
//! | `0x06` | `ReadBlocks` | `n u32, n x (request u64, layer u16, block u32, head u16)` |
//! | `0x07` | `Release` | `request u64` |
//! | `0x08` | `Stats` | empty |
//! | `0x09` | `ReadBlocksRma` | `lease u32, n u32, n x (request u64, layer u16, block u32, head u16)` |
//! | `0x0a` | `Ack` | `lease u32` |
//! | `0x81` | `HelloOk` | `version u16, max_frame u32, rma u8` |
//! | `0x82` | `Staged` | `stored_bytes u64, used_bytes u64` |
//! | `0x85` | `Admission` | `geometry, summary runs (as 0x03), blocks (as 0x02), sections` |
//! | `0x86` | `Blocks` | `n u32, n x (code u16, if 0: len u32, bytes)` |
//! | `0x87` | `Released` | `freed_bytes u64` |
//! | `0x88` | `StatsReply` | `n u8 (>= 14), n x u64` |
//! | `0x89` | `BlocksRma` | `lease u32, m u32, m x region, n u32, n x (code u16, if 0: r u8 (1 or 2), r x (region u32, offset u64, len u32))` |
//! | `0x8a` | `Acked` | `lease u32` |
//! | `0xff` | `Error` | `code u16, len u16, message (UTF-8)` |
//!
//! A `FetchAdmission` with `num_layers = 0` asks for the sections alone.
//! `geometry` is `num_layers u16, num_kv_heads u16, block_size u16, head_dim u16, dtype_bytes u8,
//! num_blocks u32, kv_format u8` (14 bytes); `sections` is `n u8, n x (name_len u8, name, len u32,
//! bytes)`. A block is `[2 (K, V)][num_kv_heads]` head segments (the host pool's layout, the K
//! page then the V page), each segment that head's `[block_size][head_dim]` rows: with
//! `kv_format = 0` (plain) elements of `dtype_bytes`; with `kv_format = 1` (fp8_e4m3) 1-byte
//! E4M3 codes followed by the head's `f32` little-endian scale (4 bytes), as
//! [`Geometry::head_bytes`] computes. `dtype_bytes` is the model dtype in
//! either format: a summary row is one block's `[num_kv_heads][2 (min, max)][head_dim]` of it.
//! A `ReadBlocks` key with `head = 0xffff` ([`ALL_HEADS`]) reads the whole block, otherwise head
//! `h`'s K segment then its V segment.
//!
//! **Block reads by RMA** (version 2; `HelloOk.rma = 1` on a connection whose transport can
//! read the daemon's registered memory, UCX). `ReadBlocksRma` names the same keys as
//! `ReadBlocks`; `BlocksRma` answers with the registered regions the entries lie in (`region`
//! is `base u64, len u64, rkey_len u16, rkey`: a [`RemoteRegion`]) and per key either a code or
//! one range (a whole block) or two (a head's K rows, then its V rows) of those regions. The
//! decoder checks every range against its region ([`RemoteRegion::check`]): a reply that names
//! bytes outside what it advertises is malformed. The daemon keeps the ranges alive and
//! registered until the client's `Ack` of the same `lease` (or the connection's end), even if
//! the request is released or evicted meanwhile.
//!
//! **Versions.** 3 added the geometry's `kv_format` (fp8 blocks); 2 the RMA reads. Peers of
//! another version are refused (`bad_version`): a version 2 peer's geometry has no `kv_format`.

use bytes::Bytes;

use crate::error::{Error, ErrorCode, Result};

mod geometry;
pub use geometry::{
    Geometry, KvFormat, FP8_SCALE_BYTES, MAX_BLOCKS_PER_REQUEST, MAX_BLOCK_SIZE, MAX_HEAD_DIM,
    MAX_KV_HEADS, MAX_LAYERS,
};

/// The protocol version this build speaks (header byte and `Hello`).
pub const PROTOCOL_VERSION: u8 = 3;
/// Bytes of the length prefix.
pub const LEN_PREFIX_BYTES: usize = 4;
/// Bytes of the header after the length prefix (version, kind, reserved, seq).
pub const HEADER_BYTES: usize = 8;
/// Default frame limit, both ways (arbitrary: a layer's batch of 64 KiB blocks for ~500 entries).
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 64 << 20;
/// No configuration may raise the frame limit past this.
pub const HARD_MAX_FRAME_BYTES: u32 = 1 << 30;
/// Frame limit before the handshake succeeds (a Hello is tiny).
pub const PREAUTH_MAX_FRAME_BYTES: u32 = 4096;
/// Longest token.
pub const MAX_TOKEN_BYTES: usize = 256;
/// Longest section name.
pub const MAX_NAME_BYTES: usize = 64;
/// Longest error message.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Most entries (blocks, rows runs, keys, selected blocks) in one message.
pub const MAX_ENTRIES: usize = 1 << 16;
/// Most named sections in one message.
pub const MAX_SECTIONS: usize = 64;
/// `head` value of a [`BlockKey`] that reads every head of the block.
pub const ALL_HEADS: u16 = u16::MAX;
/// Most regions one `BlocksRma` names (arbitrary: a layer's batch across requests names one per
/// staged frame it touches).
pub const MAX_REGIONS: usize = 1024;
/// Longest packed rkey accepted from a peer (arbitrary: UCX 1.13 packs tens to a few hundred
/// bytes per memory domain).
pub const MAX_RKEY_BYTES: usize = 4096;
/// Longest single range of a registered region read at once (the hard frame limit: a read is
/// never larger than the frame that would have carried it).
pub const MAX_GET_BYTES: u64 = HARD_MAX_FRAME_BYTES as u64;

/// What a peer needs to read a registered region by RMA: its address in the owner's process,
/// its length, and the transport's packed remote key. Received from a peer it is untrusted:
/// [`RemoteRegion::check`] bounds every range before a transport sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    pub base: u64,
    pub len: u64,
    pub rkey: Bytes,
}

impl RemoteRegion {
    /// Check the region itself: a nonempty rkey of at most [`MAX_RKEY_BYTES`], a base other than
    /// 0, and no wrap of the address space.
    ///
    /// # Errors
    /// [`Error::Invalid`], [`Error::OutOfRange`].
    pub fn validate(&self) -> Result<()> {
        if self.rkey.is_empty() {
            return Err(Error::Invalid {
                field: "rkey",
                reason: "is empty",
            });
        }
        if self.rkey.len() > MAX_RKEY_BYTES {
            return Err(Error::OutOfRange {
                field: "rkey length",
                value: self.rkey.len() as u64,
                limit: MAX_RKEY_BYTES as u64,
            });
        }
        if self.base == 0 || self.base.checked_add(self.len).is_none() {
            return Err(Error::Invalid {
                field: "region",
                reason: "starts at 0 or wraps the address space",
            });
        }
        Ok(())
    }

    /// The remote address of `len` bytes at `offset`, or why the range is refused: the region
    /// is malformed ([`RemoteRegion::validate`]), `len` passes [`MAX_GET_BYTES`], or
    /// `offset + len` passes the region's end (or overflows).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a malformed region, [`Error::OutOfRange`] for a range outside it.
    pub fn check(&self, offset: u64, len: u64) -> Result<u64> {
        self.validate()?;
        if len > MAX_GET_BYTES {
            return Err(Error::OutOfRange {
                field: "get length",
                value: len,
                limit: MAX_GET_BYTES,
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.base + offset),
            end => Err(Error::OutOfRange {
                field: "get end",
                value: end.unwrap_or(u64::MAX),
                limit: self.len,
            }),
        }
    }
}

/// One staged block: `data` is `geometry.block_bytes()` long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedBlock {
    pub layer: u16,
    pub block: u32,
    pub data: Bytes,
}

/// Summary rows of consecutive blocks `first_block..first_block + n` of one layer; `data` is
/// `n * geometry.summary_row_bytes()` long (`n >= 1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SummaryRun {
    pub layer: u16,
    pub first_block: u32,
    pub data: Bytes,
}

/// A block of a layer (the admission set's selected blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerBlock {
    pub layer: u16,
    pub block: u32,
}

/// A named byte section (the draft token's KV, the selection indices, anything the prefill side
/// hands the decode side at admission). Names: 1..=64 bytes of `[a-z0-9_.:/-]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub data: Bytes,
}

/// One entry of a [`ReadBlocks`] batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub request: u64,
    pub layer: u16,
    pub block: u32,
    /// A KV head, or [`ALL_HEADS`].
    pub head: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub token: Bytes,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloOk {
    pub version: u16,
    /// The daemon's frame limit; a client sends no larger frame.
    pub max_frame: u32,
    /// The daemon serves `ReadBlocksRma` on this connection (its pool is registered with the
    /// connection's transport).
    pub rma: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageBlocks {
    pub request: u64,
    pub geometry: Geometry,
    pub blocks: Vec<StagedBlock>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSummaries {
    pub request: u64,
    pub geometry: Geometry,
    pub runs: Vec<SummaryRun>,
}

/// What the decode side receives at admission besides the summaries: the blocks its first step
/// needs (the union of per-head top-K per layer) and named sections (the draft token's KV).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageAdmission {
    pub request: u64,
    pub selected: Vec<LayerBlock>,
    pub sections: Vec<Section>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchAdmission {
    pub request: u64,
    pub first_layer: u16,
    pub num_layers: u16,
    pub include_sections: bool,
}

/// The admission set of layers `first_layer..first_layer + num_layers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub geometry: Geometry,
    pub summaries: Vec<SummaryRun>,
    pub blocks: Vec<StagedBlock>,
    pub sections: Vec<Section>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadBlocks {
    pub keys: Vec<BlockKey>,
}

/// One result per key, in order: the bytes, or why that entry failed (the others still count).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks {
    pub entries: Vec<std::result::Result<Bytes, ErrorCode>>,
}

/// `ReadBlocks` answered by RMA: the client reads the ranges itself, then acknowledges `lease`
/// (a number of its choosing, echoed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadBlocksRma {
    pub lease: u32,
    pub keys: Vec<BlockKey>,
}

/// One range of a [`BlocksRma`] region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmaRange {
    /// Index into [`BlocksRma::regions`].
    pub region: u32,
    pub offset: u64,
    pub len: u32,
}

/// The reply to [`ReadBlocksRma`]: per key its ranges (one: a whole block; two: a head's K rows
/// then its V rows), or why it failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlocksRma {
    pub lease: u32,
    pub regions: Vec<RemoteRegion>,
    pub entries: Vec<std::result::Result<Vec<RmaRange>, ErrorCode>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// Bytes this message added to the pool (0 when it replaced identical keys).
    pub stored_bytes: u64,
    pub used_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    pub freed_bytes: u64,
}

/// The daemon's counters and gauges (`oasis-rt stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub live_requests: u64,
    pub expired_requests: u64,
    pub staged_blocks: u64,
    pub summary_rows: u64,
    pub evicted_requests: u64,
    pub evicted_bytes: u64,
    pub refused_stages: u64,
    pub bytes_staged: u64,
    pub bytes_served: u64,
    pub connections_active: u64,
    pub requests_total: u64,
    pub errors_total: u64,
}

impl StatsSnapshot {
    const FIELDS: usize = 14;

    /// `(name, value)` pairs in wire order.
    pub fn fields(&self) -> [(&'static str, u64); Self::FIELDS] {
        [
            ("budget_bytes", self.budget_bytes),
            ("used_bytes", self.used_bytes),
            ("live_requests", self.live_requests),
            ("expired_requests", self.expired_requests),
            ("staged_blocks", self.staged_blocks),
            ("summary_rows", self.summary_rows),
            ("evicted_requests", self.evicted_requests),
            ("evicted_bytes", self.evicted_bytes),
            ("refused_stages", self.refused_stages),
            ("bytes_staged", self.bytes_staged),
            ("bytes_served", self.bytes_served),
            ("connections_active", self.connections_active),
            ("requests_total", self.requests_total),
            ("errors_total", self.errors_total),
        ]
    }

    fn from_values(v: &[u64; Self::FIELDS]) -> Self {
        StatsSnapshot {
            budget_bytes: v[0],
            used_bytes: v[1],
            live_requests: v[2],
            expired_requests: v[3],
            staged_blocks: v[4],
            summary_rows: v[5],
            evicted_requests: v[6],
            evicted_bytes: v[7],
            refused_stages: v[8],
            bytes_staged: v[9],
            bytes_served: v[10],
            connections_active: v[11],
            requests_total: v[12],
            errors_total: v[13],
        }
    }
}

/// Every message, requests and replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    StageBlocks(StageBlocks),
    StageSummaries(StageSummaries),
    StageAdmission(StageAdmission),
    FetchAdmission(FetchAdmission),
    ReadBlocks(ReadBlocks),
    Release { request: u64 },
    Stats,
    ReadBlocksRma(ReadBlocksRma),
    Ack { lease: u32 },
    HelloOk(HelloOk),
    Staged(Staged),
    Admission(Admission),
    Blocks(Blocks),
    Released(Released),
    StatsReply(StatsSnapshot),
    BlocksRma(BlocksRma),
    Acked { lease: u32 },
    Error(ErrorReply),
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub seq: u32,
    pub message: Message,
}

mod kind {
    pub const HELLO: u8 = 0x01;
    pub const STAGE_BLOCKS: u8 = 0x02;
    pub const STAGE_SUMMARIES: u8 = 0x03;
    pub const STAGE_ADMISSION: u8 = 0x04;
    pub const FETCH_ADMISSION: u8 = 0x05;
    pub const READ_BLOCKS: u8 = 0x06;
    pub const RELEASE: u8 = 0x07;
    pub const STATS: u8 = 0x08;
    pub const READ_BLOCKS_RMA: u8 = 0x09;
    pub const ACK: u8 = 0x0a;
    pub const HELLO_OK: u8 = 0x81;
    pub const STAGED: u8 = 0x82;
    pub const ADMISSION: u8 = 0x85;
    pub const BLOCKS: u8 = 0x86;
    pub const RELEASED: u8 = 0x87;
    pub const STATS_REPLY: u8 = 0x88;
    pub const BLOCKS_RMA: u8 = 0x89;
    pub const ACKED: u8 = 0x8a;
    pub const ERROR: u8 = 0xff;
}

impl Message {
    /// The kind byte of the header.
    pub fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => kind::HELLO,
            Message::StageBlocks(_) => kind::STAGE_BLOCKS,
            Message::StageSummaries(_) => kind::STAGE_SUMMARIES,
            Message::StageAdmission(_) => kind::STAGE_ADMISSION,
            Message::FetchAdmission(_) => kind::FETCH_ADMISSION,
            Message::ReadBlocks(_) => kind::READ_BLOCKS,
            Message::Release { .. } => kind::RELEASE,
            Message::Stats => kind::STATS,
            Message::ReadBlocksRma(_) => kind::READ_BLOCKS_RMA,
            Message::Ack { .. } => kind::ACK,
            Message::HelloOk(_) => kind::HELLO_OK,
            Message::Staged(_) => kind::STAGED,
            Message::Admission(_) => kind::ADMISSION,
            Message::Blocks(_) => kind::BLOCKS,
            Message::Released(_) => kind::RELEASED,
            Message::StatsReply(_) => kind::STATS_REPLY,
            Message::BlocksRma(_) => kind::BLOCKS_RMA,
            Message::Acked { .. } => kind::ACKED,
            Message::Error(_) => kind::ERROR,
        }
    }

    /// Lowercase name (logs, metric labels, errors).
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::StageBlocks(_) => "stage_blocks",
            Message::StageSummaries(_) => "stage_summaries",
            Message::StageAdmission(_) => "stage_admission",
            Message::FetchAdmission(_) => "fetch_admission",
            Message::ReadBlocks(_) => "read_blocks",
            Message::Release { .. } => "release",
            Message::Stats => "stats",
            Message::ReadBlocksRma(_) => "read_blocks_rma",
            Message::Ack { .. } => "ack",
            Message::HelloOk(_) => "hello_ok",
            Message::Staged(_) => "staged",
            Message::Admission(_) => "admission",
            Message::Blocks(_) => "blocks",
            Message::Released(_) => "released",
            Message::StatsReply(_) => "stats_reply",
            Message::BlocksRma(_) => "blocks_rma",
            Message::Acked { .. } => "acked",
            Message::Error(_) => "error",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding

/// Encode `message` as one frame, length prefix included.
///
/// The message is validated the way the decoder validates it (lengths against the geometry,
/// counts, names), so a frame this returns always decodes.
///
/// # Errors
/// [`Error::FrameTooLarge`] past `max_frame` (or [`HARD_MAX_FRAME_BYTES`]); the validation
/// errors of the decoder.
pub fn encode_frame(seq: u32, message: &Message, max_frame: u32) -> Result<Vec<u8>> {
    let max_frame = max_frame.min(HARD_MAX_FRAME_BYTES);
    let body = encoded_payload_len(message)?;
    let len = HEADER_BYTES as u64 + body;
    if len > u64::from(max_frame) {
        return Err(Error::FrameTooLarge {
            len,
            max: max_frame.into(),
        });
    }
    let mut w = Writer(Vec::with_capacity(LEN_PREFIX_BYTES + len as usize));
    w.u32(len as u32);
    w.u8(PROTOCOL_VERSION);
    w.u8(message.kind());
    w.u16(0);
    w.u32(seq);
    write_payload(&mut w, message);
    debug_assert_eq!(w.0.len() as u64, LEN_PREFIX_BYTES as u64 + len);
    Ok(w.0)
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn geometry(&mut self, g: &Geometry) {
        self.u16(g.num_layers);
        self.u16(g.num_kv_heads);
        self.u16(g.block_size);
        self.u16(g.head_dim);
        self.u8(g.dtype_bytes);
        self.u32(g.num_blocks);
        self.u8(g.kv_format.as_u8());
    }
    fn blocks(&mut self, blocks: &[StagedBlock]) {
        self.u32(blocks.len() as u32);
        for b in blocks {
            self.u16(b.layer);
            self.u32(b.block);
            self.raw(&b.data);
        }
    }
    fn runs(&mut self, g: &Geometry, runs: &[SummaryRun]) {
        self.u32(runs.len() as u32);
        for r in runs {
            self.u16(r.layer);
            self.u32(r.first_block);
            self.u32((r.data.len() as u64 / g.summary_row_bytes()) as u32);
            self.raw(&r.data);
        }
    }
    fn keys(&mut self, keys: &[BlockKey]) {
        self.u32(keys.len() as u32);
        for k in keys {
            self.u64(k.request);
            self.u16(k.layer);
            self.u32(k.block);
            self.u16(k.head);
        }
    }
    fn sections(&mut self, sections: &[Section]) {
        self.u8(sections.len() as u8);
        for s in sections {
            self.u8(s.name.len() as u8);
            self.raw(s.name.as_bytes());
            self.u32(s.data.len() as u32);
            self.raw(&s.data);
        }
    }
}

/// Wire bytes of a key list (count, then 16 bytes a key), within [`MAX_ENTRIES`].
fn check_keys(keys: &[BlockKey]) -> Result<u64> {
    check_count("key count", keys.len(), MAX_ENTRIES)?;
    Ok(4 + 16 * keys.len() as u64)
}

fn check_count(field: &'static str, n: usize, max: usize) -> Result<()> {
    if n > max {
        return Err(Error::OutOfRange {
            field,
            value: n as u64,
            limit: max as u64,
        });
    }
    Ok(())
}

fn check_len(field: &'static str, got: u64, expected: u64) -> Result<()> {
    if got != expected {
        return Err(Error::OutOfRange {
            field,
            value: got,
            limit: expected,
        });
    }
    Ok(())
}

fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(Error::Invalid {
            field: "section name",
            reason: "must be 1..=64 bytes",
        });
    }
    let ok = name.iter().all(|c| {
        c.is_ascii_lowercase()
            || c.is_ascii_digit()
            || matches!(c, b'_' | b'.' | b':' | b'/' | b'-')
    });
    if !ok {
        return Err(Error::Invalid {
            field: "section name",
            reason: "allowed characters are [a-z0-9_.:/-]",
        });
    }
    Ok(())
}

fn check_blocks(g: &Geometry, blocks: &[StagedBlock]) -> Result<u64> {
    check_count("block count", blocks.len(), MAX_ENTRIES)?;
    for b in blocks {
        g.check_layer(b.layer)?;
        g.check_block(b.block)?;
        check_len("block bytes", b.data.len() as u64, g.block_bytes())?;
    }
    Ok(4 + blocks.len() as u64 * (6 + g.block_bytes()))
}

fn check_runs(g: &Geometry, runs: &[SummaryRun]) -> Result<u64> {
    check_count("summary run count", runs.len(), MAX_ENTRIES)?;
    let row = g.summary_row_bytes();
    let mut n = 4u64;
    for r in runs {
        g.check_layer(r.layer)?;
        let len = r.data.len() as u64;
        if len == 0 || !len.is_multiple_of(row) {
            return Err(Error::Invalid {
                field: "summary run",
                reason: "length must be a nonzero multiple of the row size",
            });
        }
        let rows = len / row;
        let end = u64::from(r.first_block) + rows;
        if end > u64::from(g.num_blocks) {
            return Err(Error::OutOfRange {
                field: "summary run end",
                value: end,
                limit: g.num_blocks.into(),
            });
        }
        n += 10 + len;
    }
    Ok(n)
}

fn check_sections(sections: &[Section]) -> Result<u64> {
    check_count("section count", sections.len(), MAX_SECTIONS)?;
    let mut n = 1u64;
    for s in sections {
        check_name(s.name.as_bytes())?;
        if s.data.len() as u64 > u64::from(HARD_MAX_FRAME_BYTES) {
            return Err(Error::FrameTooLarge {
                len: s.data.len() as u64,
                max: HARD_MAX_FRAME_BYTES.into(),
            });
        }
        n += 1 + s.name.len() as u64 + 4 + s.data.len() as u64;
    }
    Ok(n)
}

/// Validate a `BlocksRma` as the decoder would and return its payload length.
fn check_blocks_rma(m: &BlocksRma) -> Result<u64> {
    check_count("region count", m.regions.len(), MAX_REGIONS)?;
    check_count("entry count", m.entries.len(), MAX_ENTRIES)?;
    let mut n = 4 + 4 + 4u64;
    for r in &m.regions {
        r.validate()?;
        n += 8 + 8 + 2 + r.rkey.len() as u64;
    }
    for e in &m.entries {
        n += 2;
        match e {
            Ok(ranges) => {
                check_ranges(&m.regions, ranges)?;
                n += 1 + 16 * ranges.len() as u64;
            }
            Err(ErrorCode::Unknown(0)) => {
                return Err(Error::Invalid {
                    field: "entry code",
                    reason: "code 0 means success",
                })
            }
            Err(_) => {}
        }
    }
    Ok(n)
}

/// One entry's ranges: one or two, each inside the region it names.
fn check_ranges(regions: &[RemoteRegion], ranges: &[RmaRange]) -> Result<()> {
    if !(1..=2).contains(&ranges.len()) {
        return Err(Error::OutOfRange {
            field: "ranges per entry",
            value: ranges.len() as u64,
            limit: 2,
        });
    }
    for r in ranges {
        let region = regions.get(r.region as usize).ok_or(Error::OutOfRange {
            field: "region index",
            value: r.region.into(),
            limit: regions.len() as u64,
        })?;
        region.check(r.offset, r.len.into())?;
    }
    Ok(())
}

/// Validate `message` and return its payload length.
fn encoded_payload_len(message: &Message) -> Result<u64> {
    Ok(match message {
        Message::Hello(h) => {
            if h.token.len() > MAX_TOKEN_BYTES {
                return Err(Error::OutOfRange {
                    field: "token length",
                    value: h.token.len() as u64,
                    limit: MAX_TOKEN_BYTES as u64,
                });
            }
            4 + h.token.len() as u64
        }
        Message::StageBlocks(m) => {
            m.geometry.validate()?;
            8 + Geometry::WIRE_BYTES as u64 + check_blocks(&m.geometry, &m.blocks)?
        }
        Message::StageSummaries(m) => {
            m.geometry.validate()?;
            8 + Geometry::WIRE_BYTES as u64 + check_runs(&m.geometry, &m.runs)?
        }
        Message::StageAdmission(m) => {
            check_count("selected count", m.selected.len(), MAX_ENTRIES)?;
            8 + 4 + 6 * m.selected.len() as u64 + check_sections(&m.sections)?
        }
        Message::FetchAdmission(_) => 8 + 2 + 2 + 1,
        Message::ReadBlocks(m) => check_keys(&m.keys)?,
        Message::Release { .. } => 8,
        Message::Stats => 0,
        Message::ReadBlocksRma(m) => 4 + check_keys(&m.keys)?,
        Message::Ack { .. } | Message::Acked { .. } => 4,
        Message::BlocksRma(m) => check_blocks_rma(m)?,
        Message::HelloOk(_) => 7,
        Message::Staged(_) => 16,
        Message::Admission(m) => {
            m.geometry.validate()?;
            Geometry::WIRE_BYTES as u64
                + check_runs(&m.geometry, &m.summaries)?
                + check_blocks(&m.geometry, &m.blocks)?
                + check_sections(&m.sections)?
        }
        Message::Blocks(m) => {
            check_count("entry count", m.entries.len(), MAX_ENTRIES)?;
            let mut n = 4u64;
            for e in &m.entries {
                n += 2;
                match e {
                    Ok(b) => n += 4 + b.len() as u64,
                    Err(ErrorCode::Unknown(0)) => {
                        return Err(Error::Invalid {
                            field: "entry code",
                            reason: "code 0 means success",
                        })
                    }
                    Err(_) => {}
                }
            }
            n
        }
        Message::Released(_) => 8,
        Message::StatsReply(_) => 1 + 8 * StatsSnapshot::FIELDS as u64,
        Message::Error(e) => 2 + 2 + truncated_message(&e.message).len() as u64,
    })
}

/// Error messages longer than the limit are cut at a character boundary.
fn truncated_message(m: &str) -> &str {
    if m.len() <= MAX_MESSAGE_BYTES {
        return m;
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    &m[..end]
}

fn write_payload(w: &mut Writer, message: &Message) {
    match message {
        Message::Hello(h) => {
            w.u16(h.version);
            w.u16(h.token.len() as u16);
            w.raw(&h.token);
        }
        Message::StageBlocks(m) => {
            w.u64(m.request);
            w.geometry(&m.geometry);
            w.blocks(&m.blocks);
        }
        Message::StageSummaries(m) => {
            w.u64(m.request);
            w.geometry(&m.geometry);
            w.runs(&m.geometry, &m.runs);
        }
        Message::StageAdmission(m) => {
            w.u64(m.request);
            w.u32(m.selected.len() as u32);
            for s in &m.selected {
                w.u16(s.layer);
                w.u32(s.block);
            }
            w.sections(&m.sections);
        }
        Message::FetchAdmission(m) => {
            w.u64(m.request);
            w.u16(m.first_layer);
            w.u16(m.num_layers);
            w.u8(m.include_sections.into());
        }
        Message::ReadBlocks(m) => w.keys(&m.keys),
        Message::Release { request } => w.u64(*request),
        Message::Stats => {}
        Message::ReadBlocksRma(m) => {
            w.u32(m.lease);
            w.keys(&m.keys);
        }
        Message::Ack { lease } | Message::Acked { lease } => w.u32(*lease),
        Message::BlocksRma(m) => {
            w.u32(m.lease);
            w.u32(m.regions.len() as u32);
            for r in &m.regions {
                w.u64(r.base);
                w.u64(r.len);
                w.u16(r.rkey.len() as u16);
                w.raw(&r.rkey);
            }
            w.u32(m.entries.len() as u32);
            for e in &m.entries {
                match e {
                    Ok(ranges) => {
                        w.u16(0);
                        w.u8(ranges.len() as u8);
                        for r in ranges {
                            w.u32(r.region);
                            w.u64(r.offset);
                            w.u32(r.len);
                        }
                    }
                    Err(code) => w.u16(code.as_u16()),
                }
            }
        }
        Message::HelloOk(m) => {
            w.u16(m.version);
            w.u32(m.max_frame);
            w.u8(m.rma.into());
        }
        Message::Staged(m) => {
            w.u64(m.stored_bytes);
            w.u64(m.used_bytes);
        }
        Message::Admission(m) => {
            w.geometry(&m.geometry);
            w.runs(&m.geometry, &m.summaries);
            w.blocks(&m.blocks);
            w.sections(&m.sections);
        }
        Message::Blocks(m) => {
            w.u32(m.entries.len() as u32);
            for e in &m.entries {
                match e {
                    Ok(b) => {
                        w.u16(0);
                        w.u32(b.len() as u32);
                        w.raw(b);
                    }
                    Err(code) => w.u16(code.as_u16()),
                }
            }
        }
        Message::Released(m) => w.u64(m.freed_bytes),
        Message::StatsReply(s) => {
            w.u8(StatsSnapshot::FIELDS as u8);
            for (_, v) in s.fields() {
                w.u64(v);
            }
        }
        Message::Error(e) => {
            let m = truncated_message(&e.message);
            w.u16(e.code.as_u16());
            w.u16(m.len() as u16);
            w.raw(m.as_bytes());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// Check a length prefix before reading the body.
///
/// # Errors
/// [`Error::FrameTooLarge`] past `max_frame`; [`Error::Truncated`] below the header size.
pub fn check_frame_len(len: u32, max_frame: u32) -> Result<()> {
    let max = max_frame.min(HARD_MAX_FRAME_BYTES);
    if len > max {
        return Err(Error::FrameTooLarge {
            len: len.into(),
            max: max.into(),
        });
    }
    if (len as usize) < HEADER_BYTES {
        return Err(Error::Truncated {
            field: "header",
            needed: HEADER_BYTES as u64,
            available: len.into(),
        });
    }
    Ok(())
}

/// Decode a whole frame, length prefix included (`buf` must be exactly one frame).
///
/// # Errors
/// As [`decode_body`], plus a prefix that disagrees with `buf.len()`.
pub fn decode_frame(buf: Bytes, max_frame: u32) -> Result<Frame> {
    let mut r = Reader::new(buf);
    let len = r.u32("length prefix")?;
    check_frame_len(len, max_frame)?;
    if u64::from(len) != r.remaining() {
        return Err(Error::Truncated {
            field: "body",
            needed: len.into(),
            available: r.remaining(),
        });
    }
    decode_body(r.rest(), max_frame)
}

/// Decode a frame's body: the bytes after the length prefix (header and payload).
///
/// Never panics; allocates at most a small multiple of `body.len()` (entry vectors are sized
/// only after their count was checked against the bytes left).
///
/// # Errors
/// [`Error::Truncated`], [`Error::BadVersion`], [`Error::UnknownKind`], [`Error::OutOfRange`],
/// [`Error::Invalid`], [`Error::TrailingBytes`], [`Error::FrameTooLarge`].
pub fn decode_body(body: Bytes, max_frame: u32) -> Result<Frame> {
    let len = u32::try_from(body.len()).map_err(|_| Error::FrameTooLarge {
        len: body.len() as u64,
        max: max_frame.into(),
    })?;
    check_frame_len(len, max_frame)?;
    let mut r = Reader::new(body);
    let version = r.u8("version")?;
    if version != PROTOCOL_VERSION {
        return Err(Error::BadVersion {
            got: version.into(),
            expected: PROTOCOL_VERSION.into(),
        });
    }
    let kind = r.u8("kind")?;
    if r.u16("reserved")? != 0 {
        return Err(Error::Invalid {
            field: "reserved",
            reason: "must be zero",
        });
    }
    let seq = r.u32("seq")?;
    let message = decode_payload(kind, &mut r)?;
    r.finish()?;
    Ok(Frame { seq, message })
}

struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    fn new(buf: Bytes) -> Self {
        Reader { buf, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, field: &'static str, n: u64) -> Result<Bytes> {
        if n > self.remaining() {
            return Err(Error::Truncated {
                field,
                needed: n,
                available: self.remaining(),
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(self.buf.slice(start..self.pos))
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N]> {
        if (N as u64) > self.remaining() {
            return Err(Error::Truncated {
                field,
                needed: N as u64,
                available: self.remaining(),
            });
        }
        let mut a = [0u8; N];
        a.copy_from_slice(&self.buf[self.pos..self.pos + N]);
        self.pos += N;
        Ok(a)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A `u32` count: at most `max`, and `count * min_wire` must fit in the bytes left.
    fn count(&mut self, field: &'static str, max: usize, min_wire: u64) -> Result<usize> {
        let n = self.u32(field)?;
        self.bound_count(field, n.into(), max, min_wire)
    }

    fn bound_count(&self, field: &'static str, n: u64, max: usize, min_wire: u64) -> Result<usize> {
        if n > max as u64 {
            return Err(Error::OutOfRange {
                field,
                value: n,
                limit: max as u64,
            });
        }
        let needed = n.saturating_mul(min_wire);
        if needed > self.remaining() {
            return Err(Error::Truncated {
                field,
                needed,
                available: self.remaining(),
            });
        }
        Ok(n as usize)
    }

    fn geometry(&mut self) -> Result<Geometry> {
        let g = Geometry {
            num_layers: self.u16("num_layers")?,
            num_kv_heads: self.u16("num_kv_heads")?,
            block_size: self.u16("block_size")?,
            head_dim: self.u16("head_dim")?,
            dtype_bytes: self.u8("dtype_bytes")?,
            num_blocks: self.u32("num_blocks")?,
            kv_format: KvFormat::from_u8(self.u8("kv_format")?)?,
        };
        g.validate()?;
        Ok(g)
    }

    fn blocks(&mut self, g: &Geometry) -> Result<Vec<StagedBlock>> {
        let bb = g.block_bytes();
        let n = self.count("block count", MAX_ENTRIES, 6 + bb)?;
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let layer = self.u16("layer")?;
            g.check_layer(layer)?;
            let block = self.u32("block")?;
            g.check_block(block)?;
            let data = self.take("block bytes", bb)?;
            blocks.push(StagedBlock { layer, block, data });
        }
        Ok(blocks)
    }

    fn runs(&mut self, g: &Geometry) -> Result<Vec<SummaryRun>> {
        let row = g.summary_row_bytes();
        let n = self.count("summary run count", MAX_ENTRIES, 10 + row)?;
        let mut runs = Vec::with_capacity(n);
        for _ in 0..n {
            let layer = self.u16("layer")?;
            g.check_layer(layer)?;
            let first_block = self.u32("first_block")?;
            let num_blocks = self.u32("num_blocks")?;
            if num_blocks == 0 {
                return Err(Error::Invalid {
                    field: "num_blocks",
                    reason: "must be nonzero",
                });
            }
            let end = u64::from(first_block) + u64::from(num_blocks);
            if end > u64::from(g.num_blocks) {
                return Err(Error::OutOfRange {
                    field: "summary run end",
                    value: end,
                    limit: g.num_blocks.into(),
                });
            }
            let data = self.take("summary rows", u64::from(num_blocks) * row)?;
            runs.push(SummaryRun {
                layer,
                first_block,
                data,
            });
        }
        Ok(runs)
    }

    fn keys(&mut self) -> Result<Vec<BlockKey>> {
        let n = self.count("key count", MAX_ENTRIES, 16)?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(BlockKey {
                request: self.u64("request")?,
                layer: self.u16("layer")?,
                block: self.u32("block")?,
                head: self.u16("head")?,
            });
        }
        Ok(keys)
    }

    fn sections(&mut self) -> Result<Vec<Section>> {
        let n = self.u8("section count")?;
        let n = self.bound_count("section count", n.into(), MAX_SECTIONS, 6)?;
        let mut sections = Vec::with_capacity(n);
        for _ in 0..n {
            let name_len = self.u8("section name length")?;
            let name = self.take("section name", name_len.into())?;
            check_name(&name)?;
            // check_name admits ASCII only, so this cannot fail; stay total anyway.
            let name = String::from_utf8(name.to_vec()).map_err(|_| Error::Invalid {
                field: "section name",
                reason: "not utf-8",
            })?;
            let len = self.u32("section length")?;
            let data = self.take("section bytes", len.into())?;
            sections.push(Section { name, data });
        }
        Ok(sections)
    }

    fn rest(mut self) -> Bytes {
        let start = self.pos;
        self.pos = self.buf.len();
        self.buf.slice(start..)
    }

    fn finish(self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(Error::TrailingBytes(n)),
        }
    }
}

fn decode_payload(kind: u8, r: &mut Reader) -> Result<Message> {
    Ok(match kind {
        kind::HELLO => {
            let version = r.u16("hello version")?;
            let n = r.u16("token length")?;
            if usize::from(n) > MAX_TOKEN_BYTES {
                return Err(Error::OutOfRange {
                    field: "token length",
                    value: n.into(),
                    limit: MAX_TOKEN_BYTES as u64,
                });
            }
            let token = r.take("token", n.into())?;
            Message::Hello(Hello { version, token })
        }
        kind::STAGE_BLOCKS => {
            let request = r.u64("request")?;
            let geometry = r.geometry()?;
            let blocks = r.blocks(&geometry)?;
            Message::StageBlocks(StageBlocks {
                request,
                geometry,
                blocks,
            })
        }
        kind::STAGE_SUMMARIES => {
            let request = r.u64("request")?;
            let geometry = r.geometry()?;
            let runs = r.runs(&geometry)?;
            Message::StageSummaries(StageSummaries {
                request,
                geometry,
                runs,
            })
        }
        kind::STAGE_ADMISSION => {
            let request = r.u64("request")?;
            let n = r.count("selected count", MAX_ENTRIES, 6)?;
            let mut selected = Vec::with_capacity(n);
            for _ in 0..n {
                selected.push(LayerBlock {
                    layer: r.u16("layer")?,
                    block: r.u32("block")?,
                });
            }
            let sections = r.sections()?;
            Message::StageAdmission(StageAdmission {
                request,
                selected,
                sections,
            })
        }
        kind::FETCH_ADMISSION => {
            let request = r.u64("request")?;
            let first_layer = r.u16("first_layer")?;
            let num_layers = r.u16("num_layers")?;
            let include_sections = match r.u8("include_sections")? {
                0 => false,
                1 => true,
                _ => {
                    return Err(Error::Invalid {
                        field: "include_sections",
                        reason: "must be 0 or 1",
                    })
                }
            };
            Message::FetchAdmission(FetchAdmission {
                request,
                first_layer,
                num_layers,
                include_sections,
            })
        }
        kind::READ_BLOCKS => Message::ReadBlocks(ReadBlocks { keys: r.keys()? }),
        kind::RELEASE => Message::Release {
            request: r.u64("request")?,
        },
        kind::STATS => Message::Stats,
        kind::READ_BLOCKS_RMA => {
            let lease = r.u32("lease")?;
            Message::ReadBlocksRma(ReadBlocksRma {
                lease,
                keys: r.keys()?,
            })
        }
        kind::ACK => Message::Ack {
            lease: r.u32("lease")?,
        },
        kind::ACKED => Message::Acked {
            lease: r.u32("lease")?,
        },
        kind::BLOCKS_RMA => {
            let lease = r.u32("lease")?;
            let m = r.count("region count", MAX_REGIONS, 19)?;
            let mut regions = Vec::with_capacity(m);
            for _ in 0..m {
                let base = r.u64("region base")?;
                let len = r.u64("region length")?;
                let k = r.u16("rkey length")?;
                if usize::from(k) > MAX_RKEY_BYTES {
                    return Err(Error::OutOfRange {
                        field: "rkey length",
                        value: k.into(),
                        limit: MAX_RKEY_BYTES as u64,
                    });
                }
                let region = RemoteRegion {
                    base,
                    len,
                    rkey: r.take("rkey", k.into())?,
                };
                region.validate()?;
                regions.push(region);
            }
            let n = r.count("entry count", MAX_ENTRIES, 2)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let code = r.u16("entry code")?;
                if code != 0 {
                    entries.push(Err(ErrorCode::from_u16(code)));
                    continue;
                }
                let k = r.u8("ranges per entry")?;
                let k = r.bound_count("ranges per entry", k.into(), 2, 16)?;
                let mut ranges = Vec::with_capacity(k);
                for _ in 0..k {
                    ranges.push(RmaRange {
                        region: r.u32("range region")?,
                        offset: r.u64("range offset")?,
                        len: r.u32("range length")?,
                    });
                }
                check_ranges(&regions, &ranges)?;
                entries.push(Ok(ranges));
            }
            Message::BlocksRma(BlocksRma {
                lease,
                regions,
                entries,
            })
        }
        kind::HELLO_OK => Message::HelloOk(HelloOk {
            version: r.u16("version")?,
            max_frame: r.u32("max_frame")?,
            rma: match r.u8("rma")? {
                0 => false,
                1 => true,
                _ => {
                    return Err(Error::Invalid {
                        field: "rma",
                        reason: "must be 0 or 1",
                    })
                }
            },
        }),
        kind::STAGED => Message::Staged(Staged {
            stored_bytes: r.u64("stored_bytes")?,
            used_bytes: r.u64("used_bytes")?,
        }),
        kind::ADMISSION => {
            let geometry = r.geometry()?;
            let summaries = r.runs(&geometry)?;
            let blocks = r.blocks(&geometry)?;
            let sections = r.sections()?;
            Message::Admission(Admission {
                geometry,
                summaries,
                blocks,
                sections,
            })
        }
        kind::BLOCKS => {
            let n = r.count("entry count", MAX_ENTRIES, 2)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let code = r.u16("entry code")?;
                if code == 0 {
                    let len = r.u32("entry length")?;
                    entries.push(Ok(r.take("entry bytes", len.into())?));
                } else {
                    entries.push(Err(ErrorCode::from_u16(code)));
                }
            }
            Message::Blocks(Blocks { entries })
        }
        kind::RELEASED => Message::Released(Released {
            freed_bytes: r.u64("freed_bytes")?,
        }),
        kind::STATS_REPLY => {
            let n = r.u8("stats count")?;
            let n = usize::from(n);
            if n < StatsSnapshot::FIELDS {
                return Err(Error::OutOfRange {
                    field: "stats count",
                    value: n as u64,
                    limit: StatsSnapshot::FIELDS as u64,
                });
            }
            let mut v = [0u64; StatsSnapshot::FIELDS];
            for x in v.iter_mut() {
                *x = r.u64("stat")?;
            }
            // A newer daemon may send more counters: skip them.
            r.take("extra stats", 8 * (n - StatsSnapshot::FIELDS) as u64)?;
            Message::StatsReply(StatsSnapshot::from_values(&v))
        }
        kind::ERROR => {
            let code = ErrorCode::from_u16(r.u16("error code")?);
            let n = r.u16("message length")?;
            if usize::from(n) > MAX_MESSAGE_BYTES {
                return Err(Error::OutOfRange {
                    field: "message length",
                    value: n.into(),
                    limit: MAX_MESSAGE_BYTES as u64,
                });
            }
            let raw = r.take("message", n.into())?;
            let message = String::from_utf8_lossy(&raw).into_owned();
            Message::Error(ErrorReply { code, message })
        }
        other => return Err(Error::UnknownKind(other)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry {
            num_layers: 3,
            num_kv_heads: 2,
            block_size: 4,
            head_dim: 8,
            dtype_bytes: 2,
            num_blocks: 10,
            kv_format: KvFormat::Plain,
        }
    }

    fn roundtrip(m: Message) {
        let buf = encode_frame(7, &m, DEFAULT_MAX_FRAME_BYTES).expect("encode");
        let f = decode_frame(Bytes::from(buf), DEFAULT_MAX_FRAME_BYTES).expect("decode");
        assert_eq!(f.seq, 7);
        assert_eq!(f.message, m);
    }

    #[test]
    fn region_ranges() {
        let r = RemoteRegion {
            base: 0x1000,
            len: 100,
            rkey: Bytes::from_static(b"k"),
        };
        assert_eq!(r.check(0, 100).unwrap(), 0x1000);
        assert_eq!(r.check(99, 1).unwrap(), 0x1000 + 99);
        assert_eq!(r.check(100, 0).unwrap(), 0x1000 + 100);
        for (off, len) in [(0, 101), (100, 1), (u64::MAX, 2), (1, u64::MAX)] {
            assert!(
                matches!(r.check(off, len), Err(Error::OutOfRange { .. })),
                "{off} {len}"
            );
        }
        let bad = |base, len, rkey: &'static [u8]| RemoteRegion {
            base,
            len,
            rkey: Bytes::from_static(rkey),
        };
        assert!(bad(0x1000, 10, b"").check(0, 1).is_err());
        assert!(bad(0, 10, b"k").check(0, 1).is_err());
        assert!(bad(u64::MAX - 5, 10, b"k").check(0, 1).is_err());
        let long = RemoteRegion {
            rkey: Bytes::from(vec![0; MAX_RKEY_BYTES + 1]),
            ..r.clone()
        };
        assert!(long.check(0, 1).is_err());
        let huge = RemoteRegion {
            len: u64::MAX / 2,
            ..r
        };
        assert!(huge.check(0, MAX_GET_BYTES + 1).is_err());
        assert!(huge.check(0, MAX_GET_BYTES).is_ok());
    }

    proptest::proptest! {
        /// Whatever a peer advertises and whatever range is asked, a range passes only if it
        /// lies inside the advertised region, and the address is inside it too.
        #[test]
        fn region_checks_are_total(
            base in proptest::prelude::any::<u64>(),
            len in proptest::prelude::any::<u64>(),
            rkey_len in 0usize..(MAX_RKEY_BYTES + 8),
            offset in proptest::prelude::any::<u64>(),
            get in proptest::prelude::any::<u64>(),
            small in proptest::prelude::any::<bool>(),
        ) {
            // Half the cases near the edges of small regions.
            let (len, offset, get) = if small { (len % 4096, offset % 4200, get % 4200) } else { (len, offset, get) };
            let r = RemoteRegion { base, len, rkey: Bytes::from(vec![7; rkey_len]) };
            match r.check(offset, get) {
                Ok(addr) => {
                    proptest::prop_assert!(rkey_len > 0 && rkey_len <= MAX_RKEY_BYTES && base != 0);
                    proptest::prop_assert!(get <= MAX_GET_BYTES);
                    proptest::prop_assert!(offset as u128 + get as u128 <= len as u128);
                    proptest::prop_assert_eq!(addr as u128, base as u128 + offset as u128);
                    proptest::prop_assert!(addr as u128 + get as u128 <= base as u128 + len as u128);
                }
                Err(_) => {
                    let inside = offset as u128 + get as u128 <= len as u128;
                    let well_formed = rkey_len > 0 && rkey_len <= MAX_RKEY_BYTES && base != 0
                        && (base as u128 + len as u128) <= u64::MAX as u128;
                    proptest::prop_assert!(!(inside && well_formed && get <= MAX_GET_BYTES));
                }
            }
        }
    }

    #[test]
    fn every_message_round_trips() {
        let g = geometry();
        let block = |layer, block| StagedBlock {
            layer,
            block,
            data: Bytes::from(vec![layer as u8 ^ block as u8; g.block_bytes() as usize]),
        };
        let run = SummaryRun {
            layer: 2,
            first_block: 8,
            data: Bytes::from(vec![3u8; 2 * g.summary_row_bytes() as usize]),
        };
        let sections = vec![Section {
            name: "draft_kv/layer.0".into(),
            data: Bytes::from_static(b"abc"),
        }];
        for m in [
            Message::Hello(Hello {
                version: 1,
                token: Bytes::from_static(b"secret"),
            }),
            Message::StageBlocks(StageBlocks {
                request: 5,
                geometry: g,
                blocks: vec![block(0, 0), block(2, 9)],
            }),
            Message::StageSummaries(StageSummaries {
                request: 5,
                geometry: g,
                runs: vec![run.clone()],
            }),
            Message::StageAdmission(StageAdmission {
                request: 5,
                selected: vec![LayerBlock { layer: 1, block: 3 }],
                sections: sections.clone(),
            }),
            Message::FetchAdmission(FetchAdmission {
                request: 5,
                first_layer: 0,
                num_layers: 3,
                include_sections: true,
            }),
            Message::ReadBlocks(ReadBlocks {
                keys: vec![BlockKey {
                    request: u64::MAX,
                    layer: 1,
                    block: 2,
                    head: ALL_HEADS,
                }],
            }),
            Message::Release { request: 9 },
            Message::Stats,
            Message::HelloOk(HelloOk {
                version: 2,
                max_frame: 100,
                rma: true,
            }),
            Message::ReadBlocksRma(ReadBlocksRma {
                lease: 7,
                keys: vec![BlockKey {
                    request: 3,
                    layer: 1,
                    block: 2,
                    head: 0,
                }],
            }),
            Message::Ack { lease: 7 },
            Message::Acked { lease: 7 },
            rma_reply(),
            Message::Staged(Staged {
                stored_bytes: 1,
                used_bytes: 2,
            }),
            Message::Admission(Admission {
                geometry: g,
                summaries: vec![run],
                blocks: vec![block(1, 1)],
                sections,
            }),
            Message::Blocks(Blocks {
                entries: vec![Ok(Bytes::from_static(b"xy")), Err(ErrorCode::MissingBlock)],
            }),
            Message::Released(Released { freed_bytes: 3 }),
            Message::StatsReply(StatsSnapshot {
                used_bytes: 4,
                ..Default::default()
            }),
            Message::Error(ErrorReply {
                code: ErrorCode::Busy,
                message: "busy".into(),
            }),
        ] {
            roundtrip(m);
        }
    }

    fn rma_reply() -> Message {
        Message::BlocksRma(BlocksRma {
            lease: 7,
            regions: vec![
                RemoteRegion {
                    base: 0x7f00_0000_0000,
                    len: 4096,
                    rkey: Bytes::from_static(b"rkey-0"),
                },
                RemoteRegion {
                    base: 0x10,
                    len: 64,
                    rkey: Bytes::from_static(b"k"),
                },
            ],
            entries: vec![
                Ok(vec![RmaRange {
                    region: 0,
                    offset: 0,
                    len: 4096,
                }]),
                Err(ErrorCode::UnknownRequest),
                Ok(vec![
                    RmaRange {
                        region: 1,
                        offset: 0,
                        len: 32,
                    },
                    RmaRange {
                        region: 1,
                        offset: 32,
                        len: 32,
                    },
                ]),
            ],
        })
    }

    /// A `BlocksRma` naming bytes outside what it advertises, or malformed regions, is refused
    /// by the encoder and, written by hand, by the decoder.
    #[test]
    fn rma_replies_are_checked_against_their_regions() {
        let Message::BlocksRma(good) = rma_reply() else {
            unreachable!()
        };
        let mut frame = encode_frame(1, &Message::BlocksRma(good.clone()), 1 << 20).unwrap();
        // The first entry's range length (after lease, region count, the two regions, the
        // entry count, code and range count, region index and offset): one past its region.
        let at = 4 + 8 + 4 + 4 + (8 + 8 + 2 + 6) + (8 + 8 + 2 + 1) + 4 + 2 + 1 + 4 + 8;
        assert_eq!(
            u32::from_le_bytes(frame[at..at + 4].try_into().unwrap()),
            4096
        );
        frame[at..at + 4].copy_from_slice(&4097u32.to_le_bytes());
        assert!(matches!(
            decode_frame(Bytes::from(frame), 1 << 20),
            Err(Error::OutOfRange {
                field: "get end",
                ..
            })
        ));
        type Edit = Box<dyn Fn(&mut BlocksRma)>;
        let cases: Vec<Edit> = vec![
            Box::new(|b| b.entries[0] = Ok(vec![])),
            Box::new(|b| {
                b.entries[0] = Ok(vec![
                    RmaRange {
                        region: 1,
                        offset: 0,
                        len: 1
                    };
                    3
                ])
            }),
            Box::new(|b| {
                b.entries[0] = Ok(vec![RmaRange {
                    region: 2,
                    offset: 0,
                    len: 1,
                }])
            }),
            Box::new(|b| {
                b.entries[0] = Ok(vec![RmaRange {
                    region: 1,
                    offset: u64::MAX,
                    len: 2,
                }])
            }),
            Box::new(|b| b.regions[0].rkey = Bytes::new()),
            Box::new(|b| b.regions[0].rkey = Bytes::from(vec![1; MAX_RKEY_BYTES + 1])),
            Box::new(|b| b.regions[1].base = 0),
            Box::new(|b| b.regions[0].len = u64::MAX),
            Box::new(|b| b.entries[1] = Err(ErrorCode::Unknown(0))),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut b = good.clone();
            f(&mut b);
            assert!(
                encode_frame(1, &Message::BlocksRma(b), 1 << 20).is_err(),
                "case {i}"
            );
        }
        // HelloOk's rma flag is 0 or 1.
        let mut f = encode_frame(
            1,
            &Message::HelloOk(HelloOk {
                version: 2,
                max_frame: 9,
                rma: true,
            }),
            64,
        )
        .unwrap();
        *f.last_mut().unwrap() = 2;
        assert!(decode_frame(Bytes::from(f), 64).is_err());
    }

    #[test]
    fn encoder_refuses_what_the_decoder_would() {
        let g = geometry();
        let bad_len = Message::StageBlocks(StageBlocks {
            request: 1,
            geometry: g,
            blocks: vec![StagedBlock {
                layer: 0,
                block: 0,
                data: Bytes::from_static(b"short"),
            }],
        });
        assert!(encode_frame(0, &bad_len, DEFAULT_MAX_FRAME_BYTES).is_err());
        let bad_layer = Message::StageBlocks(StageBlocks {
            request: 1,
            geometry: g,
            blocks: vec![StagedBlock {
                layer: 3,
                block: 0,
                data: Bytes::from(vec![0; g.block_bytes() as usize]),
            }],
        });
        assert!(matches!(
            encode_frame(0, &bad_layer, DEFAULT_MAX_FRAME_BYTES),
            Err(Error::OutOfRange { field: "layer", .. })
        ));
        let big = Message::Hello(Hello {
            version: 1,
            token: Bytes::from(vec![0; 200]),
        });
        assert!(matches!(
            encode_frame(0, &big, 64),
            Err(Error::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn header_checks() {
        let mut buf = encode_frame(1, &Message::Stats, 1024).expect("encode");
        buf[4] = 9;
        assert!(matches!(
            decode_frame(Bytes::from(buf.clone()), 1024),
            Err(Error::BadVersion { got: 9, .. })
        ));
        buf[4] = PROTOCOL_VERSION;
        buf[5] = 0x42;
        assert!(matches!(
            decode_frame(Bytes::from(buf.clone()), 1024),
            Err(Error::UnknownKind(0x42))
        ));
        buf[5] = kind::STATS;
        buf[6] = 1;
        assert!(matches!(
            decode_frame(Bytes::from(buf.clone()), 1024),
            Err(Error::Invalid {
                field: "reserved",
                ..
            })
        ));
        assert!(matches!(
            check_frame_len(2000, 1024),
            Err(Error::FrameTooLarge { .. })
        ));
        assert!(matches!(
            check_frame_len(3, 1024),
            Err(Error::Truncated { .. })
        ));
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        // A ReadBlocks claiming 65536 keys with no bytes behind them.
        let mut buf = encode_frame(1, &Message::ReadBlocks(ReadBlocks { keys: vec![] }), 1024)
            .expect("encode");
        let n = buf.len();
        buf[n - 4..].copy_from_slice(&(MAX_ENTRIES as u32).to_le_bytes());
        assert!(matches!(
            decode_frame(Bytes::from(buf.clone()), 1024),
            Err(Error::Truncated {
                field: "key count",
                ..
            })
        ));
        buf[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_frame(Bytes::from(buf), 1024),
            Err(Error::OutOfRange {
                field: "key count",
                ..
            })
        ));
    }
}
