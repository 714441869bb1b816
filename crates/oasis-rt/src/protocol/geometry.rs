//! The shape of a request's staged KV ([`Geometry`]) and the format of its block elements
//! ([`KvFormat`]): the arithmetic every block, block-head and summary row length follows from.
//!
//! A block is `[2 (K, V)][num_kv_heads]` head segments, the K segments first. A head segment is
//! that head's `[block_size][head_dim]` rows:
//!
//! | `kv_format` | head segment | [`Geometry::head_bytes`] |
//! | --- | --- | --- |
//! | 0 [`KvFormat::Plain`] | elements of `dtype_bytes` | `block_size * head_dim * dtype_bytes` |
//! | 1 [`KvFormat::Fp8E4m3`] | 1-byte E4M3 codes, then the head's `f32` LE scale | `block_size * head_dim + 4` |
//!
//! so a head's K (or V) rows stay one contiguous range in either format, and a block-head read
//! (K then V) is two ranges, as RMA reads want. `dtype_bytes` is always the model dtype's size:
//! summary rows (`[num_kv_heads][2 (min, max)][head_dim]`) and the admission's query are in it
//! whatever the blocks' format (the summaries bound the keys before quantization).

use crate::error::{Error, Result};
use crate::protocol::HARD_MAX_FRAME_BYTES;

/// Bounds of [`Geometry`] (arbitrary, generous: today's models are far below).
pub const MAX_LAYERS: u16 = 1024;
pub const MAX_KV_HEADS: u16 = 256;
pub const MAX_BLOCK_SIZE: u16 = 1024;
pub const MAX_HEAD_DIM: u16 = 1024;
pub const MAX_BLOCKS_PER_REQUEST: u32 = 1 << 24;
/// Bytes of the scale that ends a head segment of an fp8 block: one `f32`, little-endian.
pub const FP8_SCALE_BYTES: u64 = 4;

/// How a block's elements are stored (the geometry's `kv_format` byte).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvFormat {
    /// Elements of `dtype_bytes` (the model dtype), no scales.
    #[default]
    Plain = 0,
    /// 1-byte E4M3 codes; each head segment ends with its power-of-two `f32` scale (the value is
    /// `code x scale`), as an fp8 host pool stores them (`KvConfig(host_kv_dtype="fp8_e4m3")`).
    Fp8E4m3 = 1,
}

impl KvFormat {
    /// The wire byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The format of a wire byte.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a byte that names no format (a newer peer's).
    pub fn from_u8(v: u8) -> Result<Self> {
        match v {
            0 => Ok(KvFormat::Plain),
            1 => Ok(KvFormat::Fp8E4m3),
            _ => Err(Error::Invalid {
                field: "kv_format",
                reason: "must be 0 (plain) or 1 (fp8_e4m3)",
            }),
        }
    }

    /// Lowercase name (`plain`, `fp8_e4m3`), as `KvConfig` spells the fp8 one.
    pub const fn name(self) -> &'static str {
        match self {
            KvFormat::Plain => "plain",
            KvFormat::Fp8E4m3 => "fp8_e4m3",
        }
    }
}

/// Shape of one request's staged KV; every block id, layer and head is checked against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    pub num_layers: u16,
    pub num_kv_heads: u16,
    /// Tokens per block.
    pub block_size: u16,
    pub head_dim: u16,
    /// Bytes per element of the model dtype: 1, 2 or 4 (summary rows and the query; the block
    /// elements too with [`KvFormat::Plain`]).
    pub dtype_bytes: u8,
    /// Logical blocks of the request (its context), so block ids are `< num_blocks`.
    pub num_blocks: u32,
    /// How the blocks' elements are stored.
    pub kv_format: KvFormat,
}

impl Geometry {
    /// Bytes of a geometry on the wire: `num_layers u16, num_kv_heads u16, block_size u16,
    /// head_dim u16, dtype_bytes u8, num_blocks u32, kv_format u8`.
    pub const WIRE_BYTES: usize = 14;

    /// Check every field against its bound, and the format against the dtype.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] or [`Error::Invalid`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        range_nonzero("num_layers", self.num_layers.into(), MAX_LAYERS.into())?;
        range_nonzero(
            "num_kv_heads",
            self.num_kv_heads.into(),
            MAX_KV_HEADS.into(),
        )?;
        range_nonzero("block_size", self.block_size.into(), MAX_BLOCK_SIZE.into())?;
        range_nonzero("head_dim", self.head_dim.into(), MAX_HEAD_DIM.into())?;
        range_nonzero(
            "num_blocks",
            self.num_blocks.into(),
            MAX_BLOCKS_PER_REQUEST.into(),
        )?;
        if !matches!(self.dtype_bytes, 1 | 2 | 4) {
            return Err(Error::Invalid {
                field: "dtype_bytes",
                reason: "must be 1, 2 or 4",
            });
        }
        if self.kv_format == KvFormat::Fp8E4m3 && self.dtype_bytes == 1 {
            // The codes are the 1-byte elements; the model dtype (summaries, query) is a float.
            return Err(Error::Invalid {
                field: "kv_format",
                reason: "fp8_e4m3 blocks need dtype_bytes 2 or 4 (the model dtype of the summary \
                         rows and the query)",
            });
        }
        if self.block_bytes() > u64::from(HARD_MAX_FRAME_BYTES) / 2 {
            return Err(Error::OutOfRange {
                field: "block_bytes",
                value: self.block_bytes(),
                limit: u64::from(HARD_MAX_FRAME_BYTES) / 2,
            });
        }
        Ok(())
    }

    /// Bytes of one stored element of a block: `dtype_bytes`, or 1 for an E4M3 code.
    pub fn elem_bytes(&self) -> u64 {
        match self.kv_format {
            KvFormat::Plain => self.dtype_bytes.into(),
            KvFormat::Fp8E4m3 => 1,
        }
    }

    /// Bytes of the scale ending each head segment: 0, or [`FP8_SCALE_BYTES`].
    pub fn scale_bytes(&self) -> u64 {
        match self.kv_format {
            KvFormat::Plain => 0,
            KvFormat::Fp8E4m3 => FP8_SCALE_BYTES,
        }
    }

    /// Bytes of one head's K (or V) segment of one block: `block_size * head_dim` elements of
    /// [`Self::elem_bytes`], then [`Self::scale_bytes`].
    pub fn head_bytes(&self) -> u64 {
        u64::from(self.block_size) * u64::from(self.head_dim) * self.elem_bytes()
            + self.scale_bytes()
    }

    /// Offsets in a block of head `head`'s K segment and of its V segment (each
    /// [`Self::head_bytes`] long): the block is `[2][num_kv_heads]` segments.
    pub fn head_offsets(&self, head: u16) -> [u64; 2] {
        let hb = self.head_bytes();
        let h = u64::from(head);
        [h * hb, (u64::from(self.num_kv_heads) + h) * hb]
    }

    /// Bytes of one block, K and V of every head.
    pub fn block_bytes(&self) -> u64 {
        2 * u64::from(self.num_kv_heads) * self.head_bytes()
    }

    /// Bytes of one block's summary row (min and max of the keys per head, in the model dtype).
    pub fn summary_row_bytes(&self) -> u64 {
        u64::from(self.num_kv_heads) * 2 * u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }

    /// Bytes a [`BlockKey`](super::BlockKey) with this `head` reads.
    pub fn read_bytes(&self, head: u16) -> u64 {
        if head == super::ALL_HEADS {
            self.block_bytes()
        } else {
            2 * self.head_bytes()
        }
    }

    /// # Errors
    /// [`Error::OutOfRange`] unless `layer < num_layers`.
    pub fn check_layer(&self, layer: u16) -> Result<()> {
        below("layer", layer.into(), self.num_layers.into())
    }

    /// # Errors
    /// [`Error::OutOfRange`] unless `block < num_blocks`.
    pub fn check_block(&self, block: u32) -> Result<()> {
        below("block", block.into(), self.num_blocks.into())
    }

    /// # Errors
    /// [`Error::OutOfRange`] unless `head < num_kv_heads` or `head == ALL_HEADS`.
    pub fn check_head(&self, head: u16) -> Result<()> {
        if head == super::ALL_HEADS {
            return Ok(());
        }
        below("head", head.into(), self.num_kv_heads.into())
    }
}

fn below(field: &'static str, value: u64, limit: u64) -> Result<()> {
    if value < limit {
        Ok(())
    } else {
        Err(Error::OutOfRange {
            field,
            value,
            limit,
        })
    }
}

fn range_nonzero(field: &'static str, value: u64, max: u64) -> Result<()> {
    if value == 0 {
        return Err(Error::Invalid {
            field,
            reason: "must be nonzero",
        });
    }
    if value > max {
        return Err(Error::OutOfRange {
            field,
            value,
            limit: max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        decode_frame, encode_frame, Admission, Message, StageBlocks, StagedBlock, SummaryRun,
        ALL_HEADS, DEFAULT_MAX_FRAME_BYTES,
    };
    use bytes::Bytes;

    /// 3 layers, 2 KV heads, 16 tokens, head_dim 8, bf16.
    fn bf16() -> Geometry {
        Geometry {
            num_layers: 3,
            num_kv_heads: 2,
            block_size: 16,
            head_dim: 8,
            dtype_bytes: 2,
            num_blocks: 10,
            kv_format: KvFormat::Plain,
        }
    }

    fn fp8() -> Geometry {
        Geometry {
            kv_format: KvFormat::Fp8E4m3,
            ..bf16()
        }
    }

    #[test]
    fn fp8_arithmetic() {
        let (p, q) = (bf16(), fp8());
        // A head segment: 16 x 8 codes and a 4-byte scale, against 16 x 8 bf16 elements.
        assert_eq!(p.head_bytes(), 256);
        assert_eq!(q.head_bytes(), 128 + 4);
        assert_eq!(q.elem_bytes(), 1);
        assert_eq!(q.scale_bytes(), 4);
        assert_eq!(q.block_bytes(), 2 * 2 * 132);
        // The segments lie back to back: head 1's K right after head 0's, V after every K.
        assert_eq!(q.head_offsets(0), [0, 2 * 132]);
        assert_eq!(q.head_offsets(1), [132, 3 * 132]);
        assert_eq!(q.read_bytes(1), 2 * 132);
        assert_eq!(q.read_bytes(ALL_HEADS), q.block_bytes());
        // Summary rows stay in the model dtype.
        assert_eq!(q.summary_row_bytes(), p.summary_row_bytes());
        assert_eq!(q.summary_row_bytes(), 2 * 2 * 8 * 2);
        // The ratio a disaggregated fp8 request moves: (b*d + 4) / (2*b*d) per head segment.
        assert_eq!(q.block_bytes() * 2 * 128, p.block_bytes() * 132);
        // Every head's K and V segments tile the block exactly once.
        for g in [p, q] {
            let mut covered = vec![0u8; g.block_bytes() as usize];
            for h in 0..g.num_kv_heads {
                for at in g.head_offsets(h) {
                    for x in &mut covered[at as usize..(at + g.head_bytes()) as usize] {
                        *x += 1;
                    }
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{g:?}");
        }
    }

    #[test]
    fn formats_are_validated() {
        assert!(bf16().validate().is_ok());
        assert!(fp8().validate().is_ok());
        assert!(Geometry {
            dtype_bytes: 4,
            ..fp8()
        }
        .validate()
        .is_ok());
        assert!(matches!(
            Geometry {
                dtype_bytes: 1,
                ..fp8()
            }
            .validate(),
            Err(Error::Invalid {
                field: "kv_format",
                ..
            })
        ));
        // A plain 1-byte dtype stays allowed (int8 caches, tests).
        assert!(Geometry {
            dtype_bytes: 1,
            ..bf16()
        }
        .validate()
        .is_ok());
        for v in 0..=u8::MAX {
            match KvFormat::from_u8(v) {
                Ok(f) => assert_eq!(f.as_u8(), v),
                Err(e) => {
                    assert!(v > 1);
                    assert!(matches!(
                        e,
                        Error::Invalid {
                            field: "kv_format",
                            ..
                        }
                    ));
                }
            }
        }
        assert_eq!(KvFormat::Fp8E4m3.name(), "fp8_e4m3");
    }

    proptest::proptest! {
        /// For every valid geometry: the K and V segments of the heads tile the block exactly,
        /// a head read is two segments, and an fp8 block is a 1-byte plain block plus a scale
        /// per segment.
        #[test]
        fn segments_tile_the_block(
            heads in 1u16..=MAX_KV_HEADS,
            block_size in 1u16..=64,
            head_dim in 1u16..=256,
            dtype_bytes in proptest::prop_oneof![proptest::strategy::Just(2u8), proptest::strategy::Just(4)],
            fp8 in proptest::prelude::any::<bool>(),
        ) {
            let g = Geometry {
                num_layers: 1,
                num_kv_heads: heads,
                block_size,
                head_dim,
                dtype_bytes,
                num_blocks: 1,
                kv_format: if fp8 { KvFormat::Fp8E4m3 } else { KvFormat::Plain },
            };
            proptest::prop_assume!(g.validate().is_ok());
            let hb = g.head_bytes();
            let mut starts: Vec<u64> = (0..heads).flat_map(|h| g.head_offsets(h)).collect();
            starts.sort_unstable();
            for (i, s) in starts.iter().enumerate() {
                proptest::prop_assert_eq!(*s, i as u64 * hb);
            }
            proptest::prop_assert_eq!(starts.len() as u64 * hb, g.block_bytes());
            proptest::prop_assert_eq!(g.read_bytes(heads - 1), 2 * hb);
            let plain1 = Geometry { dtype_bytes: 1, kv_format: KvFormat::Plain, ..g };
            let scales = if fp8 { 2 * u64::from(heads) * FP8_SCALE_BYTES } else { 0 };
            let elems = if fp8 { plain1.block_bytes() } else { Geometry { kv_format: KvFormat::Plain, ..g }.block_bytes() };
            proptest::prop_assert_eq!(g.block_bytes(), elems + scales);
        }
    }

    #[test]
    fn fp8_frames_round_trip_and_check_lengths() {
        let g = fp8();
        let block = StagedBlock {
            layer: 1,
            block: 9,
            data: Bytes::from(vec![7u8; g.block_bytes() as usize]),
        };
        let run = SummaryRun {
            layer: 0,
            first_block: 0,
            data: Bytes::from(vec![1u8; 3 * g.summary_row_bytes() as usize]),
        };
        for m in [
            Message::StageBlocks(StageBlocks {
                request: 4,
                geometry: g,
                blocks: vec![block.clone()],
            }),
            Message::Admission(Admission {
                geometry: g,
                summaries: vec![run],
                blocks: vec![block],
                sections: vec![],
            }),
        ] {
            let f = encode_frame(3, &m, DEFAULT_MAX_FRAME_BYTES).unwrap();
            assert_eq!(
                decode_frame(Bytes::from(f), DEFAULT_MAX_FRAME_BYTES)
                    .unwrap()
                    .message,
                m
            );
        }
        // A bf16-sized block under an fp8 geometry is refused, both ways.
        let wrong = Message::StageBlocks(StageBlocks {
            request: 4,
            geometry: g,
            blocks: vec![StagedBlock {
                layer: 0,
                block: 0,
                data: Bytes::from(vec![0u8; bf16().block_bytes() as usize]),
            }],
        });
        assert!(encode_frame(0, &wrong, DEFAULT_MAX_FRAME_BYTES).is_err());
    }

    /// The geometry's bytes on the wire: `kv_format` last; a byte naming no format, or fp8 with
    /// a 1-byte dtype, is refused by the decoder.
    #[test]
    fn the_kv_format_byte_is_decoded_and_checked() {
        let m = Message::StageBlocks(StageBlocks {
            request: 1,
            geometry: fp8(),
            blocks: vec![],
        });
        let f = encode_frame(0, &m, 1 << 20).unwrap();
        // prefix 4, header 8, request 8, then the geometry.
        let at = 4 + 8 + 8;
        assert_eq!(f[at + 8], 2, "dtype_bytes");
        assert_eq!(
            u32::from_le_bytes(f[at + 9..at + 13].try_into().unwrap()),
            10
        );
        assert_eq!(f[at + 13], 1, "kv_format");
        assert_eq!(f.len(), at + Geometry::WIRE_BYTES + 4);
        let mut bad = f.clone();
        bad[at + 13] = 2;
        assert!(matches!(
            decode_frame(Bytes::from(bad), 1 << 20),
            Err(Error::Invalid {
                field: "kv_format",
                ..
            })
        ));
        let mut one_byte = f;
        one_byte[at + 8] = 1;
        assert!(matches!(
            decode_frame(Bytes::from(one_byte), 1 << 20),
            Err(Error::Invalid {
                field: "kv_format",
                ..
            })
        ));
    }
}
