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

mod checks;
mod decode;
mod encode;
mod geometry;
#[cfg(test)]
mod tests;

pub use decode::{check_frame_len, decode_body, decode_frame};
pub use encode::encode_frame;
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
