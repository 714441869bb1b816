//! Decoding: the frame length check, [`decode_frame`] / [`decode_body`] and the payload reader,
//! every count and length bounded before it is trusted.

use super::checks::*;
use super::*;

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
        kind::HELLO => Message::Hello(r.hello()?),
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
        kind::STAGE_ADMISSION => Message::StageAdmission(r.stage_admission()?),
        kind::FETCH_ADMISSION => Message::FetchAdmission(FetchAdmission {
            request: r.u64("request")?,
            first_layer: r.u16("first_layer")?,
            num_layers: r.u16("num_layers")?,
            include_sections: r.flag("include_sections")?,
        }),
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
        kind::BLOCKS_RMA => Message::BlocksRma(r.blocks_rma()?),
        kind::HELLO_OK => Message::HelloOk(HelloOk {
            version: r.u16("version")?,
            max_frame: r.u32("max_frame")?,
            rma: r.flag("rma")?,
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
        kind::BLOCKS => Message::Blocks(r.blocks_reply()?),
        kind::RELEASED => Message::Released(Released {
            freed_bytes: r.u64("freed_bytes")?,
        }),
        kind::STATS_REPLY => Message::StatsReply(r.stats_reply()?),
        kind::ERROR => Message::Error(r.error_reply()?),
        other => return Err(Error::UnknownKind(other)),
    })
}

/// The payloads of [`decode_payload`]'s longer arms, each read in wire order.
impl Reader {
    /// A 0 / 1 byte as a bool; anything else is invalid.
    fn flag(&mut self, field: &'static str) -> Result<bool> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Error::Invalid {
                field,
                reason: "must be 0 or 1",
            }),
        }
    }

    /// A u16 length, at most `limit`, then that many bytes.
    fn bounded_bytes(
        &mut self,
        len_field: &'static str,
        field: &'static str,
        limit: usize,
    ) -> Result<Bytes> {
        let n = self.u16(len_field)?;
        if usize::from(n) > limit {
            return Err(Error::OutOfRange {
                field: len_field,
                value: n.into(),
                limit: limit as u64,
            });
        }
        self.take(field, n.into())
    }

    fn hello(&mut self) -> Result<Hello> {
        let version = self.u16("hello version")?;
        let token = self.bounded_bytes("token length", "token", MAX_TOKEN_BYTES)?;
        Ok(Hello { version, token })
    }

    fn stage_admission(&mut self) -> Result<StageAdmission> {
        let request = self.u64("request")?;
        let n = self.count("selected count", MAX_ENTRIES, 6)?;
        let mut selected = Vec::with_capacity(n);
        for _ in 0..n {
            selected.push(LayerBlock {
                layer: self.u16("layer")?,
                block: self.u32("block")?,
            });
        }
        let sections = self.sections()?;
        Ok(StageAdmission {
            request,
            selected,
            sections,
        })
    }

    fn blocks_rma(&mut self) -> Result<BlocksRma> {
        let lease = self.u32("lease")?;
        let m = self.count("region count", MAX_REGIONS, 19)?;
        let mut regions = Vec::with_capacity(m);
        for _ in 0..m {
            let base = self.u64("region base")?;
            let len = self.u64("region length")?;
            let rkey = self.bounded_bytes("rkey length", "rkey", MAX_RKEY_BYTES)?;
            let region = RemoteRegion { base, len, rkey };
            region.validate()?;
            regions.push(region);
        }
        let n = self.count("entry count", MAX_ENTRIES, 2)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let code = self.u16("entry code")?;
            if code != 0 {
                entries.push(Err(ErrorCode::from_u16(code)));
                continue;
            }
            let k = self.u8("ranges per entry")?;
            let k = self.bound_count("ranges per entry", k.into(), 2, 16)?;
            let mut ranges = Vec::with_capacity(k);
            for _ in 0..k {
                ranges.push(RmaRange {
                    region: self.u32("range region")?,
                    offset: self.u64("range offset")?,
                    len: self.u32("range length")?,
                });
            }
            check_ranges(&regions, &ranges)?;
            entries.push(Ok(ranges));
        }
        Ok(BlocksRma {
            lease,
            regions,
            entries,
        })
    }

    fn blocks_reply(&mut self) -> Result<Blocks> {
        let n = self.count("entry count", MAX_ENTRIES, 2)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let code = self.u16("entry code")?;
            if code == 0 {
                let len = self.u32("entry length")?;
                entries.push(Ok(self.take("entry bytes", len.into())?));
            } else {
                entries.push(Err(ErrorCode::from_u16(code)));
            }
        }
        Ok(Blocks { entries })
    }

    fn stats_reply(&mut self) -> Result<StatsSnapshot> {
        let n = usize::from(self.u8("stats count")?);
        if n < StatsSnapshot::FIELDS {
            return Err(Error::OutOfRange {
                field: "stats count",
                value: n as u64,
                limit: StatsSnapshot::FIELDS as u64,
            });
        }
        let mut v = [0u64; StatsSnapshot::FIELDS];
        for x in v.iter_mut() {
            *x = self.u64("stat")?;
        }
        // A newer daemon may send more counters: skip them.
        self.take("extra stats", 8 * (n - StatsSnapshot::FIELDS) as u64)?;
        Ok(StatsSnapshot::from_values(&v))
    }

    fn error_reply(&mut self) -> Result<ErrorReply> {
        let code = ErrorCode::from_u16(self.u16("error code")?);
        let raw = self.bounded_bytes("message length", "message", MAX_MESSAGE_BYTES)?;
        let message = String::from_utf8_lossy(&raw).into_owned();
        Ok(ErrorReply { code, message })
    }
}
