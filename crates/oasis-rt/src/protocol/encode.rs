//! Encoding: [`encode_frame`] (validated as the decoder validates) and the payload writer.

use super::checks::*;
use super::*;

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
