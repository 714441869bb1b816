//! `oasis-rt bench`: block-read throughput from a running daemon, against a host memcpy of the
//! same bytes measured in the same run (so a figure is a ratio to a ceiling of this machine,
//! not a number to compare across machines).
//!
//! For each block size `B` (a multiple of [`HEAD_BLOCK_BYTES`]: one KV head of a 16-token
//! block, head_dim 128, 2-byte elements; 64 KiB is a Qwen3-8B layer-block of 8 heads):
//!
//! ```text
//!  stage   total / B blocks of B deterministic bytes under a fresh request id, in frames
//!          under the client's frame limit
//!  verify  read every block once (untimed), compare with what was staged
//!  time    `repeats` passes reading every block, `batch` keys per call (head = ALL_HEADS, or
//!          with `per_head` each KV head of each block as its own entry, as the decode side
//!          reads its misses): ReadBlocksRma where the connection offers it (UCX), ReadBlocks
//!          frames otherwise
//!  memcpy  `repeats` passes copying the same bytes between two host buffers in chunks of B,
//!          and one big copy
//!  release the request (on error too, while the connection lives)
//! ```
//!
//! Every timed entry is checked to be present and `B` long; a mismatch is an error, not a number.
//! GB/s are 1e9 bytes per second of payload (the block bytes; wire bytes are counted apart).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::client::Client;
use crate::error::{Error, ErrorCode, Result};
use crate::pool::{ENTRY_OVERHEAD_BYTES, REQUEST_OVERHEAD_BYTES};
use crate::protocol::{
    BlockKey, Geometry, KvFormat, StagedBlock, ALL_HEADS, HEADER_BYTES, LEN_PREFIX_BYTES,
    MAX_BLOCKS_PER_REQUEST, MAX_ENTRIES, MAX_KV_HEADS,
};
use crate::transport::{RmaConnection, TransportKind};

/// Tokens per block of the bench geometry (vLLM's default block size).
pub const BLOCK_SIZE: u16 = 16;
/// Head dimension of the bench geometry (Qwen3, Llama 3).
pub const HEAD_DIM: u16 = 128;
/// Bytes per element of the bench geometry (bf16).
pub const DTYPE_BYTES: u8 = 2;
/// Bytes of one KV head of one block, K and V: the unit a block size must be a multiple of.
pub const HEAD_BLOCK_BYTES: u64 = 2 * BLOCK_SIZE as u64 * HEAD_DIM as u64 * DTYPE_BYTES as u64;

/// Bytes of a `StageBlocks` frame besides its blocks: prefix 4, header 8, request 8, geometry 14,
/// count 4 = 38, rounded up (arbitrary margin).
const STAGE_FRAME_OVERHEAD: u64 = 64;
/// Bytes of a staged block besides its data: layer u16, block u32.
const STAGE_BLOCK_OVERHEAD: u64 = 6;
/// Staging frames stay this small, as the Python client's do (`oasis-py`'s `BULK_FRAME_BYTES`):
/// a frame buffer of a few MiB is reused by the allocator, a 64 MiB one is a fresh mapping.
const STAGE_FRAME_BYTES: u64 = 4 << 20;
/// Bytes of a `Blocks` reply besides its entries: prefix, header, count.
const REPLY_FRAME_OVERHEAD: u64 = (LEN_PREFIX_BYTES + HEADER_BYTES + 4) as u64;
/// Bytes of a `Blocks` entry besides its data: code u16, len u32.
const REPLY_ENTRY_OVERHEAD: u64 = 6;

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Block sizes, each a positive multiple of [`HEAD_BLOCK_BYTES`].
    pub block_bytes: Vec<u64>,
    /// Bytes staged and read per pass, per block size (`total / B` blocks, at least one).
    pub total_bytes: u64,
    /// Keys per read call.
    pub batch: usize,
    /// Timed passes (reads and memcpy each).
    pub repeats: usize,
    /// How the blocks come back: by RMA where offered (`None`), or as asked (`Some(true)`: by
    /// RMA, refused where unavailable; `Some(false)`: inside reply frames even over UCX, to
    /// compare the two on one transport).
    pub rma: Option<bool>,
    /// Read each KV head of a block as its own entry (K rows then V rows, as the decode side
    /// reads its misses; the daemon copies the two halves together) instead of whole blocks.
    pub per_head: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            block_bytes: vec![8 << 10, 64 << 10],
            total_bytes: 256 << 20,
            batch: 64,
            repeats: 5,
            rma: None,
            per_head: false,
        }
    }
}

impl BenchConfig {
    /// Check everything that needs no daemon and return one geometry per block size: head_dim
    /// 128, 2-byte elements, 16-token blocks, `B / 8192` KV heads, one layer, `total / B` blocks.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag to change: a block size that is not a positive multiple
    /// of [`HEAD_BLOCK_BYTES`] or has more heads than the protocol allows, more blocks than a
    /// request may hold, a batch of zero or past [`MAX_ENTRIES`], zero repeats.
    pub fn plan(&self) -> Result<Vec<Geometry>> {
        if self.block_bytes.is_empty() {
            return Err(Error::Config(
                "--block-bytes needs at least one size".into(),
            ));
        }
        if self.total_bytes == 0 {
            return Err(Error::Config("--total must be positive".into()));
        }
        if self.batch == 0 || self.batch > MAX_ENTRIES {
            return Err(Error::Config(format!(
                "--batch must be 1..={MAX_ENTRIES}, got {}",
                self.batch
            )));
        }
        if self.repeats == 0 {
            return Err(Error::Config("--repeats must be at least 1".into()));
        }
        self.block_bytes.iter().map(|&b| self.geometry(b)).collect()
    }

    fn geometry(&self, block_bytes: u64) -> Result<Geometry> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(HEAD_BLOCK_BYTES) {
            return Err(Error::Config(format!(
                "--block-bytes {block_bytes} is not a positive multiple of {HEAD_BLOCK_BYTES} \
                 (one KV head of a {BLOCK_SIZE}-token block, head_dim {HEAD_DIM}, \
                 {DTYPE_BYTES}-byte elements)"
            )));
        }
        let heads = block_bytes / HEAD_BLOCK_BYTES;
        if heads > u64::from(MAX_KV_HEADS) {
            return Err(Error::Config(format!(
                "--block-bytes {block_bytes} is {heads} KV heads, past the protocol's \
                 {MAX_KV_HEADS}: lower --block-bytes"
            )));
        }
        let blocks = (self.total_bytes / block_bytes).max(1);
        if blocks > u64::from(MAX_BLOCKS_PER_REQUEST) {
            return Err(Error::Config(format!(
                "--total {} is {blocks} blocks of {block_bytes} bytes, past the protocol's \
                 {MAX_BLOCKS_PER_REQUEST} per request: lower --total",
                self.total_bytes
            )));
        }
        let g = Geometry {
            num_layers: 1,
            num_kv_heads: heads as u16,
            block_size: BLOCK_SIZE,
            head_dim: HEAD_DIM,
            dtype_bytes: DTYPE_BYTES,
            num_blocks: blocks as u32,
            kv_format: KvFormat::Plain,
        };
        g.validate()
            .map_err(|e| Error::Config(format!("--block-bytes {block_bytes}: {e}")))?;
        Ok(g)
    }
}

/// One block size's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub block_bytes: u64,
    pub blocks: u32,
    /// Keys per read call (the configured batch, at most `blocks`).
    pub batch: usize,
    pub repeats: usize,
    /// Reads went by RMA (`ReadBlocksRma`), not inside reply frames.
    pub rma: bool,
    /// One entry per KV head of a block (see [`BenchConfig::per_head`]), not per block.
    pub per_head: bool,
    /// GB/s of each timed read pass.
    pub read_gbps: Vec<f64>,
    /// GB/s of each staging pass (every block sent again; the daemon replaces them).
    pub stage_gbps: Vec<f64>,
    /// GB/s of each memcpy pass in chunks of `block_bytes`.
    pub memcpy_gbps: Vec<f64>,
    /// GB/s of the median one-big-copy pass.
    pub memcpy_one_copy_gbps: f64,
    /// Bytes sent and received per block read in the timed passes (frames, keys, RMA bytes).
    pub wire_bytes_per_block: f64,
}

impl BenchRow {
    pub fn read_gbps_median(&self) -> f64 {
        median(&self.read_gbps)
    }

    pub fn stage_gbps_median(&self) -> f64 {
        median(&self.stage_gbps)
    }

    pub fn memcpy_gbps_median(&self) -> f64 {
        median(&self.memcpy_gbps)
    }

    /// Read throughput as a fraction of the chunked memcpy's (medians).
    pub fn ratio(&self) -> f64 {
        self.read_gbps_median() / self.memcpy_gbps_median()
    }

    /// `"rma"` or `"frames"`.
    pub fn path(&self) -> &'static str {
        if self.rma {
            "rma"
        } else {
            "frames"
        }
    }

    /// What one read entry is: `"block"` or `"head"`.
    pub fn entry(&self) -> &'static str {
        if self.per_head {
            "head"
        } else {
            "block"
        }
    }
}

/// Every row of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchReport {
    /// The connection read by RMA.
    pub rma: bool,
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    /// A table, one line per block size, with a header line.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:>11} {:>8} {:>6} {:>5} {:>10} {:>12} {:>12} {:>13} {:>11}\n",
            "block_bytes",
            "blocks",
            "path",
            "entry",
            "read_GB/s",
            "memcpy_GB/s",
            "read/memcpy",
            "wire_B/block",
            "stage_GB/s"
        );
        for r in &self.rows {
            out.push_str(&format!(
                "{:>11} {:>8} {:>6} {:>5} {:>10.3} {:>12.3} {:>12.3} {:>13.0} {:>11.3}\n",
                r.block_bytes,
                r.blocks,
                r.path(),
                r.entry(),
                r.read_gbps_median(),
                r.memcpy_gbps_median(),
                r.ratio(),
                r.wire_bytes_per_block,
                r.stage_gbps_median()
            ));
        }
        out
    }

    /// The report as JSON (written by hand: every value is a number, a bool or `transport`'s
    /// fixed name, so nothing needs escaping).
    pub fn json(&self, transport: TransportKind) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                let passes: Vec<String> = r.read_gbps.iter().map(|&v| number(v)).collect();
                let stages: Vec<String> = r.stage_gbps.iter().map(|&v| number(v)).collect();
                format!(
                    "    {{\"block_bytes\": {}, \"blocks\": {}, \"batch\": {}, \"repeats\": {}, \
                     \"path\": \"{}\", \"entry\": \"{}\", \"read_gbps\": [{}], \"read_gbps_median\": {}, \
                     \"memcpy_gbps_median\": {}, \"memcpy_one_copy_gbps\": {}, \"ratio\": {}, \
                     \"wire_bytes_per_block\": {}, \"stage_gbps\": [{}], \"stage_gbps_median\": {}}}",
                    r.block_bytes,
                    r.blocks,
                    r.batch,
                    r.repeats,
                    r.path(),
                    r.entry(),
                    passes.join(", "),
                    number(r.read_gbps_median()),
                    number(r.memcpy_gbps_median()),
                    number(r.memcpy_one_copy_gbps),
                    number(r.ratio()),
                    number(r.wire_bytes_per_block),
                    stages.join(", "),
                    number(r.stage_gbps_median()),
                )
            })
            .collect();
        format!(
            "{{\n  \"transport\": \"{}\",\n  \"rma\": {},\n  \"rows\": [\n{}\n  ]\n}}\n",
            transport.name(),
            self.rma,
            rows.join(",\n")
        )
    }
}

/// A JSON number (`null` where there is none: a NaN or infinite figure).
fn number(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.4}")
    } else {
        "null".into()
    }
}

/// The median (the mean of the middle two of an even count); NaN of nothing.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Measure every block size of `config` on `client`'s daemon, one after the other (each
/// staged, read and released before the next, so the daemon holds one size's bytes at a time).
///
/// # Errors
/// [`Error::Config`] from [`BenchConfig::plan`] before anything is staged, or when a batch of
/// the largest block passes the client's frame limit (lower `--batch`), a size's request passes
/// the daemon's whole budget (lower `--total`), or the payload cannot be allocated;
/// [`Error::ReadMismatch`] when a block read back is not the one staged; [`Error::Remote`] with
/// the entry's code when the daemon could not serve one; the daemon's refusals of the staging
/// (`busy`, `out_of_memory`, their message naming the whole request's size); transport errors.
pub async fn run<C: RmaConnection>(
    client: &mut Client<C>,
    config: &BenchConfig,
) -> Result<BenchReport> {
    let geometries = config.plan()?;
    // Every size against the frame limit before any is staged, so a refusal costs nothing.
    let fits = geometries
        .iter()
        .map(|g| fit(g, config.batch, client.max_frame()))
        .collect::<Result<Vec<_>>>()?;
    let rma = match config.rma {
        None => client.rma(),
        Some(false) => false,
        Some(true) if client.rma() => true,
        Some(true) => {
            return Err(Error::Unavailable(
                "--path rma needs a ucx connection to a daemon that offers rma reads".into(),
            ))
        }
    };
    // Each size's request against the daemon's whole budget, before any is staged. The daemon
    // sees the request in frames and could only name the frame it refused.
    let budget = client.stats().await?.budget_bytes;
    for g in &geometries {
        let need = request_bytes(g);
        if need > budget {
            return Err(Error::Config(format!(
                "--total {}: {} blocks of {} bytes are a request of {need} bytes as the daemon \
                 counts them, past its staging budget of {budget} bytes: lower --total, or give \
                 the daemon more --memory",
                config.total_bytes,
                g.num_blocks,
                g.block_bytes()
            )));
        }
    }
    let mut rows = Vec::with_capacity(geometries.len());
    for (g, fit) in geometries.into_iter().zip(fits) {
        rows.push(run_one(client, config, g, fit, rma).await?);
    }
    Ok(BenchReport { rma, rows })
}

/// The bytes the daemon's pool accounts for a request of `g` staged whole (blocks and their
/// per-entry and per-request overheads).
pub fn request_bytes(g: &Geometry) -> u64 {
    REQUEST_OVERHEAD_BYTES + u64::from(g.num_blocks) * (g.block_bytes() + ENTRY_OVERHEAD_BYTES)
}

/// How one block size's calls fit the frame limit.
#[derive(Clone, Copy, Debug)]
struct Fit {
    /// Keys per read call: the configured batch, at most the blocks there are.
    batch: usize,
    /// Blocks per staging frame.
    per_frame: u32,
}

fn fit(g: &Geometry, batch: usize, max_frame: u32) -> Result<Fit> {
    let block_bytes = g.block_bytes();
    let max = u64::from(max_frame);
    let batch = batch.min(g.num_blocks as usize);
    // The reply of a batch (or, by RMA, the bytes this client takes in one call) must fit.
    let reply = REPLY_FRAME_OVERHEAD + batch as u64 * (REPLY_ENTRY_OVERHEAD + block_bytes);
    if reply > max {
        return Err(Error::Config(format!(
            "--batch {batch} of {block_bytes}-byte blocks needs {reply}-byte replies, past the \
             frame limit of {max} bytes: lower --batch"
        )));
    }
    let room = max
        .min(STAGE_FRAME_BYTES.max(STAGE_FRAME_OVERHEAD + STAGE_BLOCK_OVERHEAD + block_bytes))
        .saturating_sub(STAGE_FRAME_OVERHEAD);
    let per_frame = (room / (STAGE_BLOCK_OVERHEAD + block_bytes)).min(MAX_ENTRIES as u64) as u32;
    if per_frame == 0 {
        return Err(Error::Config(format!(
            "a {block_bytes}-byte block does not fit a frame of {max} bytes: lower --block-bytes"
        )));
    }
    Ok(Fit { batch, per_frame })
}

async fn run_one<C: RmaConnection>(
    client: &mut Client<C>,
    config: &BenchConfig,
    g: Geometry,
    fit: Fit,
    rma: bool,
) -> Result<BenchRow> {
    let request = request_id(g.block_bytes());
    let payload = payload(request, u64::from(g.num_blocks) * g.block_bytes())?;
    let measured = measure(client, config, g, fit, rma, request, &payload).await;
    // Release whatever was staged, also after a failure, while the connection lives.
    match measured {
        Ok(row) => {
            client.release(request).await?;
            Ok(row)
        }
        Err(e) => {
            if client.is_connected() {
                let _ = client.release(request).await;
            }
            Err(e)
        }
    }
}

async fn measure<C: RmaConnection>(
    client: &mut Client<C>,
    config: &BenchConfig,
    g: Geometry,
    Fit { batch, per_frame }: Fit,
    rma: bool,
    request: u64,
    payload: &Bytes,
) -> Result<BenchRow> {
    let block_bytes = g.block_bytes();
    let blocks = g.num_blocks;
    let slice = |b: u32| {
        let at = b as usize * block_bytes as usize;
        payload.slice(at..at + block_bytes as usize)
    };

    // Stage in frames under the limit (zero-copy slices of the payload): once untimed, then
    // `repeats` timed passes that replace every block.
    let payload_bytes = blocks as u64 * block_bytes;
    // A refusal names the whole request, not the frame it came at.
    let refused = |e: Error, first: u32| match e {
        Error::Remote { code, message } => Error::Remote {
            code,
            message: format!(
                "{message} (staging a request of {blocks} blocks of {block_bytes} bytes, \
                 {payload_bytes} bytes of payload, {} as the daemon counts them; refused \
                 at block {first})",
                request_bytes(&g)
            ),
        },
        e => e,
    };
    let mut stage_gbps = Vec::with_capacity(config.repeats);
    for pass in 0..=config.repeats {
        let start = Instant::now();
        let mut first = 0u32;
        while first < blocks {
            let end = first.saturating_add(per_frame).min(blocks);
            let staged = (first..end)
                .map(|b| StagedBlock {
                    layer: 0,
                    block: b,
                    data: slice(b),
                })
                .collect();
            client
                .stage_blocks(request, g, staged)
                .await
                .map_err(|e| refused(e, first))?;
            first = end;
        }
        if pass > 0 {
            stage_gbps.push(gbps(payload_bytes, start.elapsed()));
        }
    }

    // Whole blocks, or each head of each block (K rows, then V rows: [2][heads][rows] staged).
    let heads: Vec<u16> = if config.per_head {
        (0..g.num_kv_heads).collect()
    } else {
        vec![ALL_HEADS]
    };
    let keys: Vec<BlockKey> = (0..blocks)
        .flat_map(|block| {
            heads.iter().map(move |&head| BlockKey {
                request,
                layer: 0,
                block,
                head,
            })
        })
        .collect();
    let batches: Vec<&[BlockKey]> = keys.chunks(batch).collect();
    let entry_bytes = if config.per_head {
        HEAD_BLOCK_BYTES
    } else {
        block_bytes
    };
    let expected = |key: &BlockKey| -> Vec<u8> {
        let block = slice(key.block);
        if key.head == ALL_HEADS {
            return block.to_vec();
        }
        let half = (HEAD_BLOCK_BYTES / 2) as usize;
        let (h, n) = (usize::from(key.head), usize::from(g.num_kv_heads));
        [
            &block[h * half..(h + 1) * half],
            &block[(n + h) * half..(n + h + 1) * half],
        ]
        .concat()
    };

    // The untimed pass: every byte against the staging (and a warm connection for the rest).
    for keys in &batches {
        let got = read(client, rma, keys).await?;
        for (key, entry) in keys.iter().zip(&got) {
            check_entry(key, entry, entry_bytes, Some(&expected(key)))?;
        }
    }

    let wire_before = client.wire_bytes();
    let mut read_gbps = Vec::with_capacity(config.repeats);
    for _ in 0..config.repeats {
        let start = Instant::now();
        for keys in &batches {
            let got = read(client, rma, keys).await?;
            for (key, entry) in keys.iter().zip(&got) {
                check_entry(key, entry, entry_bytes, None)?;
            }
        }
        read_gbps.push(gbps(payload_bytes, start.elapsed()));
    }
    let wire_after = client.wire_bytes();
    let wire = (wire_after.0 - wire_before.0) + (wire_after.1 - wire_before.1);
    let reads = blocks as u64 * config.repeats as u64;

    let (memcpy_gbps, memcpy_one_copy_gbps) =
        memcpy(payload, block_bytes as usize, config.repeats)?;
    Ok(BenchRow {
        block_bytes,
        blocks,
        batch,
        repeats: config.repeats,
        rma,
        per_head: config.per_head,
        read_gbps,
        stage_gbps,
        memcpy_gbps,
        memcpy_one_copy_gbps,
        wire_bytes_per_block: wire as f64 / reads as f64,
    })
}

async fn read<C: RmaConnection>(
    client: &mut Client<C>,
    rma: bool,
    keys: &[BlockKey],
) -> Result<Vec<std::result::Result<Bytes, ErrorCode>>> {
    if rma {
        client.read_blocks_rma(keys.to_vec()).await
    } else {
        client.read_blocks(keys.to_vec()).await
    }
}

/// One read entry: present, `block_bytes` long and, where `expect` is given, equal to it.
///
/// # Errors
/// [`Error::Remote`] with the entry's code; [`Error::ReadMismatch`].
pub fn check_entry(
    key: &BlockKey,
    entry: &std::result::Result<Bytes, ErrorCode>,
    block_bytes: u64,
    expect: Option<&[u8]>,
) -> Result<()> {
    let mismatch = |reason: String| Error::ReadMismatch {
        request: key.request,
        layer: key.layer,
        block: key.block,
        reason,
    };
    let data = entry.as_ref().map_err(|&code| Error::Remote {
        code,
        message: format!(
            "request {}: block {} of layer {} was staged but not served",
            key.request, key.block, key.layer
        ),
    })?;
    if data.len() as u64 != block_bytes {
        return Err(mismatch(format!(
            "{} bytes, expected {block_bytes}",
            data.len()
        )));
    }
    if let Some(expect) = expect {
        if let Some(at) = data.iter().zip(expect).position(|(a, b)| a != b) {
            return Err(mismatch(format!(
                "bytes differ from the staged ones from offset {at}"
            )));
        }
    }
    Ok(())
}

/// The chunked memcpy's GB/s per pass and the median one-big-copy GB/s: the same bytes as the
/// reads, between two host buffers (the destination written once before, so no pass pays
/// its page faults).
fn memcpy(src: &[u8], chunk: usize, repeats: usize) -> Result<(Vec<f64>, f64)> {
    let mut dst = alloc(src.len() as u64)?;
    let mut chunked = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        std::hint::black_box(&mut dst);
        chunked.push(gbps(src.len() as u64, start.elapsed()));
    }
    let mut one = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(src));
        std::hint::black_box(&mut dst);
        one.push(gbps(src.len() as u64, start.elapsed()));
    }
    Ok((chunked, median(&one)))
}

fn gbps(bytes: u64, took: Duration) -> f64 {
    // A pass shorter than the clock's resolution is not a measurement of infinite speed.
    bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9
}

/// `len` zeroed bytes, or a typed error where the allocation fails (a large `--total`).
fn alloc(len: u64) -> Result<Vec<u8>> {
    let too_large = || {
        Error::Config(format!(
            "cannot allocate {len} bytes for the bench payload: lower --total"
        ))
    };
    let len = usize::try_from(len).map_err(|_| too_large())?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| too_large())?;
    v.resize(len, 0);
    Ok(v)
}

/// Deterministic, nonzero bytes of `request` (a splitmix64 stream): every block differs, so a
/// block served in another's place is caught.
fn payload(request: u64, len: u64) -> Result<Bytes> {
    let mut v = alloc(len)?;
    let mut x = request;
    for word in v.chunks_mut(8) {
        x = splitmix64(x);
        word.copy_from_slice(&x.to_le_bytes()[..word.len()]);
    }
    Ok(Bytes::from(v))
}

/// A request id unlikely to meet another client's: the clock, the process and the size mixed.
fn request_id(block_bytes: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    splitmix64(nanos ^ block_bytes.rotate_left(32) ^ (u64::from(std::process::id()) << 16))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(block_bytes: &[u64]) -> BenchConfig {
        BenchConfig {
            block_bytes: block_bytes.to_vec(),
            ..BenchConfig::default()
        }
    }

    #[test]
    fn geometries_of_the_default_sizes() {
        let g = BenchConfig::default().plan().unwrap();
        assert_eq!(g[0].num_kv_heads, 1);
        assert_eq!(g[0].block_bytes(), 8 << 10);
        assert_eq!(g[0].num_blocks, 32768);
        assert_eq!(g[1].num_kv_heads, 8);
        assert_eq!(g[1].block_bytes(), 64 << 10);
        assert_eq!(g[1].num_blocks, 4096);
        // Less than a block in total: one block.
        let small = BenchConfig {
            total_bytes: 1,
            ..cfg(&[8192])
        };
        assert_eq!(small.plan().unwrap()[0].num_blocks, 1);
    }

    #[test]
    fn bad_configs_name_the_flag() {
        let refused = |c: BenchConfig, flag: &str| match c.plan() {
            Err(Error::Config(m)) => assert!(m.contains(flag), "{m}"),
            other => panic!("{c:?}: {other:?}"),
        };
        refused(cfg(&[12345]), "--block-bytes 12345");
        refused(cfg(&[0]), "multiple of 8192");
        refused(cfg(&[8192, 4096]), "--block-bytes 4096");
        refused(cfg(&[257 * 8192]), "lower --block-bytes");
        refused(cfg(&[]), "--block-bytes");
        refused(
            BenchConfig {
                total_bytes: 1 << 40,
                ..cfg(&[8192])
            },
            "lower --total",
        );
        refused(
            BenchConfig {
                batch: 0,
                ..BenchConfig::default()
            },
            "--batch",
        );
        refused(
            BenchConfig {
                repeats: 0,
                ..BenchConfig::default()
            },
            "--repeats",
        );
    }

    #[test]
    fn entries_are_checked() {
        let key = BlockKey {
            request: 9,
            layer: 0,
            block: 3,
            head: ALL_HEADS,
        };
        let good = Bytes::from(vec![7u8; 16]);
        assert!(check_entry(&key, &Ok(good.clone()), 16, Some(&good)).is_ok());
        let short = check_entry(&key, &Ok(Bytes::from(vec![7u8; 8])), 16, None).unwrap_err();
        assert!(
            matches!(short, Error::ReadMismatch { block: 3, .. }),
            "{short}"
        );
        let mut bad = vec![7u8; 16];
        bad[5] = 0;
        let differ = check_entry(&key, &Ok(Bytes::from(bad)), 16, Some(&good)).unwrap_err();
        assert!(differ.to_string().contains("offset 5"), "{differ}");
        let missing = check_entry(&key, &Err(ErrorCode::MissingBlock), 16, None).unwrap_err();
        assert_eq!(missing.code(), ErrorCode::MissingBlock);
    }

    #[test]
    fn payloads_are_deterministic_and_nonzero() {
        let a = payload(5, 1000).unwrap();
        assert_eq!(a, payload(5, 1000).unwrap());
        assert_ne!(a, payload(6, 1000).unwrap());
        assert!(a.chunks(8).all(|w| w.iter().any(|&b| b != 0)));
        assert_ne!(request_id(8192), request_id(65536));
    }

    #[test]
    fn medians_and_json() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let report = BenchReport {
            rma: false,
            rows: vec![BenchRow {
                block_bytes: 8192,
                blocks: 4,
                batch: 2,
                repeats: 2,
                rma: false,
                per_head: true,
                read_gbps: vec![1.0, 3.0],
                stage_gbps: vec![2.0, 4.0, 9.0],
                memcpy_gbps: vec![10.0, 10.0],
                memcpy_one_copy_gbps: f64::INFINITY,
                wire_bytes_per_block: 8214.5,
            }],
        };
        let j = report.json(TransportKind::Tcp);
        for needle in [
            "\"transport\": \"tcp\"",
            "\"rma\": false",
            "\"read_gbps\": [1.0000, 3.0000]",
            "\"read_gbps_median\": 2.0000",
            "\"ratio\": 0.2000",
            "\"memcpy_one_copy_gbps\": null",
            "\"stage_gbps_median\": 4.0000",
            "\"entry\": \"head\"",
        ] {
            assert!(j.contains(needle), "{needle} in {j}");
        }
        let t = report.table();
        assert_eq!(t.lines().count(), 2);
        assert!(t.lines().nth(1).unwrap().contains("frames"), "{t}");
        assert!(t.lines().nth(1).unwrap().contains("head"), "{t}");
    }
}
