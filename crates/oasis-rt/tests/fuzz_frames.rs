//! Fuzzing the frame decoder: random byte strings and mutated valid frames. No input may make
//! it panic, and none may make it allocate more than a small multiple of the input (a counting
//! global allocator measures every decode).
//!
//! Cases per property: `OASIS_RT_FUZZ_CASES` (default 3000; CI keeps the default, a longer
//! recorded run sets e.g. 200000).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use oasis_rt::protocol::{
    decode_body, decode_frame, encode_frame, Admission, BlockKey, Blocks, BlocksRma, ErrorReply,
    FetchAdmission, Geometry, Hello, HelloOk, KvFormat, LayerBlock, Message, ReadBlocks,
    ReadBlocksRma, RemoteRegion, RmaRange, Section, StageAdmission, StageBlocks, StageSummaries,
    StagedBlock, StatsSnapshot, SummaryRun, PROTOCOL_VERSION,
};
use oasis_rt::transport::read_frame;
use oasis_rt::ErrorCode;
use proptest::prelude::*;

/// Counts the bytes this thread has live, and their peak, while `TRACKING` is set.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = LIVE.try_with(|l| {
                let v = l.get() + delta;
                l.set(v);
                let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; the bookkeeping touches only
// const-initialised thread-locals (no allocation, no panic: `try_with`).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak bytes allocated (net) while running `f`.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let out = f();
    TRACKING.with(|t| t.set(false));
    (out, PEAK.with(Cell::get).max(0) as usize)
}

const MAX_FRAME: u32 = 1 << 20;

/// The bound: decoded entries cost at most a few times the wire bytes they consumed (a
/// `StagedBlock` is 40 bytes for >= 6 wire bytes plus its data), plus a constant.
fn bound(input: usize) -> usize {
    8 * input + 4096
}

/// Counts the cases each property ran and prints the total after its last one (visible with
/// `--nocapture`): the number to report.
fn tally(counter: &AtomicU32, name: &str) {
    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
    if n == cases() {
        eprintln!("fuzz {name}: {n} cases, no failure");
    }
}

static RANDOM: AtomicU32 = AtomicU32::new(0);
static VALID: AtomicU32 = AtomicU32::new(0);
static MUTATED: AtomicU32 = AtomicU32::new(0);
static STREAM: AtomicU32 = AtomicU32::new(0);

fn cases() -> u32 {
    std::env::var("OASIS_RT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// Decode both ways; when it succeeds, the frame re-encodes to something that decodes equal.
fn check(input: &[u8]) -> Result<(), TestCaseError> {
    let buf = Bytes::copy_from_slice(input);
    let (r, peak) = peak_of(|| decode_frame(buf.clone(), MAX_FRAME));
    prop_assert!(
        peak <= bound(input.len()),
        "decode_frame allocated {peak} for {} bytes",
        input.len()
    );
    if input.len() >= 4 {
        let body = buf.slice(4..);
        let (r2, peak) = peak_of(|| decode_body(body, MAX_FRAME));
        prop_assert!(peak <= bound(input.len()), "decode_body allocated {peak}");
        if let Ok(f) = &r {
            prop_assert_eq!(r2.as_ref().ok(), Some(f));
        }
    }
    if let Ok(f) = r {
        let again = encode_frame(f.seq, &f.message, MAX_FRAME)
            .map_err(|e| TestCaseError::fail(format!("re-encode: {e}")))?;
        let f2 = decode_frame(Bytes::from(again), MAX_FRAME)
            .map_err(|e| TestCaseError::fail(format!("re-decode: {e}")))?;
        prop_assert_eq!(f2, f);
    }
    Ok(())
}

/// Geometries of both block formats; fp8 with a 1-byte dtype (which the encoder refuses) now
/// and then, so the refusal is exercised too.
fn geometry() -> impl Strategy<Value = Geometry> {
    (
        1u16..4,
        1u16..3,
        1u16..5,
        1u16..5,
        prop_oneof![Just(1u8), Just(2), Just(4)],
        1u32..6,
        prop_oneof![Just(KvFormat::Plain), Just(KvFormat::Fp8E4m3)],
    )
        .prop_map(
            |(
                num_layers,
                num_kv_heads,
                block_size,
                head_dim,
                dtype_bytes,
                num_blocks,
                kv_format,
            )| {
                Geometry {
                    num_layers,
                    num_kv_heads,
                    block_size,
                    head_dim,
                    dtype_bytes,
                    num_blocks,
                    kv_format,
                }
            },
        )
}

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn block_keys() -> impl Strategy<Value = Vec<BlockKey>> {
    proptest::collection::vec(any::<(u64, u16, u32, u16)>(), 0..6).prop_map(|v| {
        v.into_iter()
            .map(|(request, layer, block, head)| BlockKey {
                request,
                layer,
                block,
                head,
            })
            .collect()
    })
}

fn sections() -> impl Strategy<Value = Vec<Section>> {
    proptest::collection::vec(
        ("[a-z0-9_./:-]{1,12}", bytes(40)).prop_map(|(name, data)| Section { name, data }),
        0..3,
    )
}

fn staged_blocks(g: Geometry) -> impl Strategy<Value = Vec<StagedBlock>> {
    let bb = g.block_bytes() as usize;
    proptest::collection::vec(
        (
            0..g.num_layers,
            0..g.num_blocks,
            proptest::collection::vec(any::<u8>(), bb..=bb),
        ),
        0..4,
    )
    .prop_map(|v| {
        v.into_iter()
            .map(|(layer, block, data)| StagedBlock {
                layer,
                block,
                data: data.into(),
            })
            .collect()
    })
}

fn runs(g: Geometry) -> impl Strategy<Value = Vec<SummaryRun>> {
    let row = g.summary_row_bytes() as usize;
    proptest::collection::vec(
        (0..g.num_layers, 0..g.num_blocks, 1u32..3, any::<u8>()),
        0..3,
    )
    .prop_map(move |v| {
        v.into_iter()
            .map(|(layer, first_block, n, fill)| {
                let n = n.min(g.num_blocks - first_block) as usize;
                SummaryRun {
                    layer,
                    first_block,
                    data: Bytes::from(vec![fill; n * row]),
                }
            })
            .collect()
    })
}

/// A valid `BlocksRma`: regions anywhere in the address space, entries inside them.
fn blocks_rma() -> impl Strategy<Value = Message> {
    (
        any::<u32>(),
        proptest::collection::vec(
            (
                1u64..(1 << 47),
                1u64..(1 << 20),
                bytes(24).prop_filter("rkey", |k| !k.is_empty()),
            ),
            1..4,
        ),
        proptest::collection::vec(
            (
                any::<bool>(),
                any::<u8>(),
                any::<u64>(),
                any::<u64>(),
                any::<bool>(),
            ),
            0..6,
        ),
    )
        .prop_map(|(lease, regions, entries)| {
            let regions: Vec<RemoteRegion> = regions
                .into_iter()
                .map(|(base, len, rkey)| RemoteRegion { base, len, rkey })
                .collect();
            let entries = entries
                .into_iter()
                .map(|(ok, region, a, b, two)| {
                    if !ok {
                        return Err(ErrorCode::UnknownRequest);
                    }
                    let region = u32::from(region) % regions.len() as u32;
                    let len = regions[region as usize].len;
                    let range = |x: u64, y: u64| {
                        let offset = x % len;
                        let n = (y % (len - offset + 1)).min(u64::from(u32::MAX)) as u32;
                        RmaRange {
                            region,
                            offset,
                            len: n,
                        }
                    };
                    let mut v = vec![range(a, b)];
                    if two {
                        v.push(range(b, a));
                    }
                    Ok(v)
                })
                .collect();
            Message::BlocksRma(BlocksRma {
                lease,
                regions,
                entries,
            })
        })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        blocks_rma(),
        (any::<u32>(), block_keys())
            .prop_map(|(lease, keys)| Message::ReadBlocksRma(ReadBlocksRma { lease, keys })),
        any::<u32>().prop_map(|lease| Message::Ack { lease }),
        any::<u32>().prop_map(|lease| Message::Acked { lease }),
        (any::<u16>(), any::<u32>(), any::<bool>()).prop_map(|(version, max_frame, rma)| {
            Message::HelloOk(HelloOk {
                version,
                max_frame,
                rma,
            })
        }),
        (any::<u16>(), bytes(40))
            .prop_map(|(version, token)| Message::Hello(Hello { version, token })),
        (any::<u64>(), geometry()).prop_flat_map(|(r, g)| staged_blocks(g).prop_map(
            move |blocks| Message::StageBlocks(StageBlocks {
                request: r,
                geometry: g,
                blocks
            })
        )),
        (any::<u64>(), geometry()).prop_flat_map(|(r, g)| runs(g).prop_map(move |runs| {
            Message::StageSummaries(StageSummaries {
                request: r,
                geometry: g,
                runs,
            })
        })),
        (
            any::<u64>(),
            proptest::collection::vec((any::<u16>(), any::<u32>()), 0..5),
            sections()
        )
            .prop_map(
                |(request, sel, sections)| Message::StageAdmission(StageAdmission {
                    request,
                    selected: sel
                        .into_iter()
                        .map(|(layer, block)| LayerBlock { layer, block })
                        .collect(),
                    sections,
                })
            ),
        (any::<u64>(), any::<u16>(), any::<u16>(), any::<bool>()).prop_map(
            |(request, first_layer, num_layers, include_sections)| {
                Message::FetchAdmission(FetchAdmission {
                    request,
                    first_layer,
                    num_layers,
                    include_sections,
                })
            }
        ),
        block_keys().prop_map(|keys| Message::ReadBlocks(ReadBlocks { keys })),
        any::<u64>().prop_map(|request| Message::Release { request }),
        Just(Message::Stats),
        geometry().prop_flat_map(|g| (runs(g), staged_blocks(g), sections()).prop_map(
            move |(summaries, blocks, sections)| {
                Message::Admission(Admission {
                    geometry: g,
                    summaries,
                    blocks,
                    sections,
                })
            }
        )),
        proptest::collection::vec(
            prop_oneof![bytes(30).prop_map(Ok), Just(Err(ErrorCode::MissingBlock))],
            0..5
        )
        .prop_map(|entries| Message::Blocks(Blocks { entries })),
        any::<[u64; 2]>().prop_map(|v| Message::StatsReply(StatsSnapshot {
            used_bytes: v[0],
            bytes_served: v[1],
            ..Default::default()
        })),
        "[ -~]{0,40}".prop_map(|message| Message::Error(ErrorReply {
            code: ErrorCode::Busy,
            message
        })),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        xor: u8,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Overwrite a little-endian u32 (counts, lengths, ids live in those).
    Word {
        at: usize,
        value: u32,
    },
    /// Overwrite a u16 (layers, heads, geometry).
    Half {
        at: usize,
        value: u16,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let extreme32 = prop_oneof![
        Just(0u32),
        Just(1),
        Just(u32::MAX),
        Just(1 << 16),
        Just(1 << 20),
        Just(1 << 30),
        any::<u32>()
    ];
    let extreme16 = prop_oneof![
        Just(0u16),
        Just(1),
        Just(u16::MAX),
        Just(1024),
        any::<u16>()
    ];
    prop_oneof![
        4 => (any::<usize>(), 1u8..).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (any::<usize>(), extreme32).prop_map(|(at, value)| Mutation::Word { at, value }),
        2 => (any::<usize>(), extreme16).prop_map(|(at, value)| Mutation::Half { at, value }),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    let n = frame.len();
    match m {
        Mutation::Flip { at, xor } => frame[at % n] ^= xor,
        Mutation::Truncate { at } => frame.truncate(at % n),
        Mutation::Insert { at, bytes } => {
            let at = at % (n + 1);
            frame.splice(at..at, bytes.iter().copied());
        }
        Mutation::Word { at, value } if n >= 4 => {
            let at = at % (n - 3);
            frame[at..at + 4].copy_from_slice(&value.to_le_bytes());
        }
        Mutation::Half { at, value } if n >= 2 => {
            let at = at % (n - 1);
            frame[at..at + 2].copy_from_slice(&value.to_le_bytes());
        }
        _ => {}
    }
}

/// Keep the length prefix consistent with the body half of the time, so mutations reach the
/// payload decoder instead of stopping at the prefix check.
fn maybe_fix_prefix(frame: &mut [u8], fix: bool) {
    if fix && frame.len() >= 4 {
        let len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&len.to_le_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(input in proptest::collection::vec(any::<u8>(), 0..2048), fix in any::<bool>(), kind in any::<u8>()) {
        let mut input = input;
        // Give random payloads a plausible header now and then.
        if fix && input.len() >= 8 {
            input[4] = PROTOCOL_VERSION;
            input[5] = kind;
            input[6] = 0;
            input[7] = 0;
        }
        maybe_fix_prefix(&mut input, fix);
        check(&input)?;
        tally(&RANDOM, "random_bytes");
    }

    #[test]
    fn valid_frames_round_trip(m in message(), seq in any::<u32>()) {
        // Not every generated message is valid (a Hello of any version is, a layer past the
        // geometry is not); whatever encodes must decode to itself.
        if let Ok(f) = encode_frame(seq, &m, MAX_FRAME) {
            let d = decode_frame(Bytes::from(f), MAX_FRAME).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(d.message, m);
            prop_assert_eq!(d.seq, seq);
        }
        tally(&VALID, "valid_frames_round_trip");
    }

    #[test]
    fn mutated_frames(m in message(), muts in proptest::collection::vec(mutation(), 1..4), fix in any::<bool>()) {
        let Ok(mut frame) = encode_frame(1, &m, MAX_FRAME) else {
            tally(&MUTATED, "mutated_frames");
            return Ok(());
        };
        for mu in &muts {
            apply(&mut frame, mu);
            if frame.is_empty() {
                break;
            }
        }
        maybe_fix_prefix(&mut frame, fix);
        check(&frame)?;
        tally(&MUTATED, "mutated_frames");
    }

    /// The stream reader: any bytes give a body, or an error, promptly.
    #[test]
    fn stream_reader(input in proptest::collection::vec(any::<u8>(), 0..512), max in 8u32..4096) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let t = Duration::from_millis(100);
        let r = rt.block_on(async {
            let mut s = &input[..];
            read_frame(&mut s, max, Some(t), t).await
        });
        if let Ok(body) = r {
            prop_assert!(body.len() <= max as usize && body.len() + 4 <= input.len());
        }
        tally(&STREAM, "stream_reader");
    }
}

#[test]
fn the_allocation_meter_measures() {
    let (v, peak) = peak_of(|| vec![0u8; 100_000]);
    assert!(peak >= 100_000, "{peak}");
    drop(v);
    // A frame declaring 65536 keys with none behind it allocates nothing for them.
    let mut f = encode_frame(1, &Message::ReadBlocks(ReadBlocks { keys: vec![] }), 1024).unwrap();
    let n = f.len();
    f[n - 4..].copy_from_slice(&65536u32.to_le_bytes());
    let buf = Bytes::from(f);
    let (r, peak) = peak_of(|| decode_frame(buf.clone(), MAX_FRAME));
    assert!(r.is_err());
    assert!(peak < 1024, "{peak}");
}
