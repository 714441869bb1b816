//! The tests of the wire format: round trips, refusals, bounds.

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
    let mut buf =
        encode_frame(1, &Message::ReadBlocks(ReadBlocks { keys: vec![] }), 1024).expect("encode");
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
