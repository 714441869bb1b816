//! The checks the encoder and the decoder share: counts, lengths against the geometry, section
//! names, RMA ranges against their regions (so a frame the encoder returns always decodes).

use super::*;

/// Wire bytes of a key list (count, then 16 bytes a key), within [`MAX_ENTRIES`].
pub(super) fn check_keys(keys: &[BlockKey]) -> Result<u64> {
    check_count("key count", keys.len(), MAX_ENTRIES)?;
    Ok(4 + 16 * keys.len() as u64)
}

pub(super) fn check_count(field: &'static str, n: usize, max: usize) -> Result<()> {
    if n > max {
        return Err(Error::OutOfRange {
            field,
            value: n as u64,
            limit: max as u64,
        });
    }
    Ok(())
}

pub(super) fn check_len(field: &'static str, got: u64, expected: u64) -> Result<()> {
    if got != expected {
        return Err(Error::OutOfRange {
            field,
            value: got,
            limit: expected,
        });
    }
    Ok(())
}

pub(super) fn check_name(name: &[u8]) -> Result<()> {
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

pub(super) fn check_blocks(g: &Geometry, blocks: &[StagedBlock]) -> Result<u64> {
    check_count("block count", blocks.len(), MAX_ENTRIES)?;
    for b in blocks {
        g.check_layer(b.layer)?;
        g.check_block(b.block)?;
        check_len("block bytes", b.data.len() as u64, g.block_bytes())?;
    }
    Ok(4 + blocks.len() as u64 * (6 + g.block_bytes()))
}

pub(super) fn check_runs(g: &Geometry, runs: &[SummaryRun]) -> Result<u64> {
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

pub(super) fn check_sections(sections: &[Section]) -> Result<u64> {
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
pub(super) fn check_blocks_rma(m: &BlocksRma) -> Result<u64> {
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
pub(super) fn check_ranges(regions: &[RemoteRegion], ranges: &[RmaRange]) -> Result<()> {
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

/// Error messages longer than the limit are cut at a character boundary.
pub(super) fn truncated_message(m: &str) -> &str {
    if m.len() <= MAX_MESSAGE_BYTES {
        return m;
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    &m[..end]
}
