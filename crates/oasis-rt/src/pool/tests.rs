//! The tests of [`StagingPool`](super::StagingPool): staging, reads, leases, eviction, accounting.

use super::*;
use proptest::prelude::*;

fn g() -> Geometry {
    Geometry {
        num_layers: 2,
        num_kv_heads: 2,
        block_size: 2,
        head_dim: 4,
        dtype_bytes: 1,
        num_blocks: 8,
        kv_format: crate::protocol::KvFormat::Plain,
    }
}

fn blocks(layer: u16, ids: &[u32], fill: u8) -> Vec<StagedBlock> {
    ids.iter()
        .map(|&block| StagedBlock {
            layer,
            block,
            data: Bytes::from(vec![fill; g().block_bytes() as usize]),
        })
        .collect()
}

fn per_block() -> u64 {
    g().block_bytes() + ENTRY_OVERHEAD_BYTES
}

fn pool(budget: u64, lease: Option<Duration>) -> StagingPool {
    StagingPool::new(PoolConfig {
        budget_bytes: budget,
        lease,
    })
}

#[test]
fn stage_read_release_accounting() {
    let t = Instant::now();
    let mut p = pool(1 << 20, None);
    let added = p.stage_blocks(1, g(), blocks(0, &[0, 1, 2], 7), t).unwrap();
    assert_eq!(added, REQUEST_OVERHEAD_BYTES + 3 * per_block());
    // Restaging a block adds nothing.
    assert_eq!(p.stage_blocks(1, g(), blocks(0, &[1], 9), t).unwrap(), 0);
    p.audit().unwrap();
    let key = |block, head| BlockKey {
        request: 1,
        layer: 0,
        block,
        head,
    };
    let out = p
        .read_blocks(
            &[key(1, ALL_HEADS), key(5, ALL_HEADS), key(0, 1)],
            1 << 20,
            t,
        )
        .unwrap();
    assert_eq!(out[0].as_ref().unwrap()[0], 9);
    assert_eq!(out[1], Err(ErrorCode::MissingBlock));
    assert_eq!(out[2].as_ref().unwrap().len() as u64, 2 * g().head_bytes());
    assert_eq!(p.release(1), added);
    assert_eq!(p.used_bytes(), 0);
    assert_eq!(p.release(1), 0);
    p.audit().unwrap();
}

#[test]
fn head_reads_slice_k_then_v() {
    let t = Instant::now();
    let mut p = pool(1 << 20, None);
    let bb = g().block_bytes() as usize;
    let data: Vec<u8> = (0..bb).map(|i| i as u8).collect();
    let b = vec![StagedBlock {
        layer: 1,
        block: 3,
        data: Bytes::from(data.clone()),
    }];
    p.stage_blocks(4, g(), b, t).unwrap();
    let hb = g().head_bytes() as usize; // 8
    let out = p
        .read_blocks(
            &[BlockKey {
                request: 4,
                layer: 1,
                block: 3,
                head: 1,
            }],
            1 << 20,
            t,
        )
        .unwrap();
    let got = out[0].as_ref().unwrap();
    // Head 1 of K is rows [hb, 2hb); head 1 of V is [3hb, 4hb) (2 heads).
    assert_eq!(&got[..hb], &data[hb..2 * hb]);
    assert_eq!(&got[hb..], &data[3 * hb..4 * hb]);
}

#[test]
fn out_of_memory_names_the_request_s_size_not_the_last_part_s() {
    let t = Instant::now();
    let budget = REQUEST_OVERHEAD_BYTES + 4 * per_block();
    let mut p = pool(budget, None);
    p.stage_blocks(4, g(), blocks(0, &[0, 1, 2], 2), t).unwrap();
    // Two more blocks: each part fits the budget, the request does not.
    let err = p
        .stage_blocks(4, g(), blocks(0, &[3, 4], 2), t)
        .unwrap_err();
    let whole = REQUEST_OVERHEAD_BYTES + 5 * per_block();
    assert!(
        matches!(err, Error::OutOfMemory { requested, budget: b } if requested == whole && b == budget),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains(&format!("request of {whole} bytes")),
        "{err}"
    );
    // All or nothing: the three blocks are still there, the refused two are not.
    let s = p.stats(t);
    assert_eq!((s.staged_blocks, s.refused_stages), (3, 1));
    p.audit().unwrap();
}

#[test]
fn live_data_is_never_evicted() {
    let t = Instant::now();
    let budget = REQUEST_OVERHEAD_BYTES + 4 * per_block();
    let mut p = pool(budget, Some(Duration::from_secs(60)));
    p.stage_blocks(1, g(), blocks(0, &[0, 1, 2, 3], 1), t)
        .unwrap();
    let err = p
        .stage_blocks(2, g(), blocks(0, &[0], 2), t + Duration::from_secs(1))
        .unwrap_err();
    assert!(matches!(err, Error::Busy { .. }), "{err}");
    // A request that alone passes the budget can never fit.
    let err = p
        .stage_blocks(3, g(), blocks(0, &[0, 1, 2, 3, 4], 2), t)
        .unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    // Request 1 still whole.
    let s = p.stats(t);
    assert_eq!(
        (s.live_requests, s.staged_blocks, s.refused_stages),
        (1, 4, 2)
    );
    assert!(!p.contains(2));
    p.audit().unwrap();
}

#[test]
fn expired_requests_are_evicted_oldest_first() {
    let t = Instant::now();
    let lease = Duration::from_secs(10);
    let budget = 2 * (REQUEST_OVERHEAD_BYTES + 2 * per_block());
    let mut p = pool(budget, Some(lease));
    p.stage_blocks(1, g(), blocks(0, &[0, 1], 1), t).unwrap();
    p.stage_blocks(2, g(), blocks(0, &[0, 1], 1), t + Duration::from_secs(5))
        .unwrap();
    // At t+12 request 1 expired (12 > 10), request 2 did not (7).
    let later = t + Duration::from_secs(12);
    p.stage_blocks(3, g(), blocks(0, &[0, 1], 1), later)
        .unwrap();
    assert!(!p.contains(1) && p.contains(2) && p.contains(3));
    let s = p.stats(later);
    assert_eq!(s.evicted_requests, 1);
    // Nothing else expired: the next one is refused, request 2 kept.
    let err = p
        .stage_blocks(4, g(), blocks(0, &[0], 1), later)
        .unwrap_err();
    assert!(matches!(err, Error::Busy { .. }));
    assert!(p.contains(2));
    p.audit().unwrap();
}

#[test]
fn a_refusal_evicts_nothing() {
    let t = Instant::now();
    let budget = 2 * (REQUEST_OVERHEAD_BYTES + 2 * per_block());
    let mut p = pool(budget, Some(Duration::from_secs(1)));
    p.stage_blocks(1, g(), blocks(0, &[0, 1], 1), t).unwrap();
    p.stage_blocks(2, g(), blocks(0, &[0, 1], 1), t + Duration::from_secs(5))
        .unwrap();
    // At t+5.5 request 1 has expired, but freeing it cannot make room for 3 blocks + 2 live.
    let now = t + Duration::from_millis(5500);
    let err = p
        .stage_blocks(3, g(), blocks(0, &[0, 1, 2, 3], 1), now)
        .unwrap_err();
    assert!(matches!(err, Error::Busy { .. }), "{err}");
    assert!(p.contains(1), "evicted for nothing");
}

/// A region as the daemon's transport would make it: this process's memory (kept alive).
#[derive(Debug)]
struct Local(RemoteRegion, #[allow(dead_code)] Bytes);

impl Registered for Local {
    fn remote(&self) -> &RemoteRegion {
        &self.0
    }
}

/// Stage `blocks` the way the daemon does over RMA: copied into one arena, registered.
fn stage_registered(p: &mut StagingPool, request: u64, mut blocks: Vec<StagedBlock>) {
    let arena = Bytes::from(
        blocks
            .iter()
            .flat_map(|b| b.data.to_vec())
            .collect::<Vec<_>>(),
    );
    let mut at = 0;
    for b in &mut blocks {
        b.data = arena.slice(at..at + b.data.len());
        at += b.data.len();
    }
    let region = RemoteRegion {
        base: arena.as_ptr() as u64,
        len: arena.len() as u64,
        rkey: Bytes::from_static(b"k"),
    };
    p.stage_blocks(request, g(), blocks, Instant::now())
        .unwrap();
    p.attach_region(request, Arc::new(Local(region, arena)));
}

/// RMA reads name ranges of the registered arenas that hold exactly what `read_blocks`
/// returns; the pins outlive a release; a block staged without a region fails `internal`;
/// the batch is bounded.
#[test]
fn rma_reads_name_the_registered_bytes() {
    let t = Instant::now();
    let mut p = pool(1 << 20, None);
    let mut b = blocks(0, &[0, 1], 0);
    for (i, x) in b.iter_mut().enumerate() {
        x.data = Bytes::from(
            (0..x.data.len())
                .map(|j| (i * 50 + j) as u8)
                .collect::<Vec<_>>(),
        );
    }
    stage_registered(&mut p, 1, b);
    stage_registered(&mut p, 1, blocks(1, &[3], 9));
    p.stage_blocks(2, g(), blocks(0, &[0], 5), t).unwrap();
    let key = |request, layer, block, head| BlockKey {
        request,
        layer,
        block,
        head,
    };
    let keys = [
        key(1, 0, 1, ALL_HEADS),
        key(1, 0, 0, 1),
        key(1, 1, 3, 0),
        key(1, 1, 4, ALL_HEADS),
        key(2, 0, 0, ALL_HEADS),
        key(3, 0, 0, ALL_HEADS),
    ];
    let frames = p.read_blocks(&keys, 1 << 20, t).unwrap();
    let read = p.read_blocks_rma(&keys, 1 << 20, t).unwrap();
    assert_eq!(read.regions.len(), 2);
    assert_eq!(read.pins.len(), 3);
    p.release(1);
    p.audit().unwrap();
    for (i, (e, f)) in read.entries.iter().zip(&frames).enumerate() {
        match (e, f) {
            (Ok(ranges), Ok(bytes)) => {
                let mut got = Vec::new();
                for r in ranges {
                    let rr = read.regions[r.region as usize].remote();
                    let addr = rr.check(r.offset, r.len.into()).unwrap();
                    // SAFETY: the range is inside a region whose arena `read` pins.
                    got.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(addr as *const u8, r.len as usize)
                    });
                }
                assert_eq!(&got[..], &bytes[..], "entry {i}");
            }
            (Err(code), _) if i == 4 => assert_eq!(*code, ErrorCode::Internal),
            (Err(a), Err(b)) => assert_eq!(a, b, "entry {i}"),
            other => panic!("entry {i}: {other:?}"),
        }
    }
    assert!(matches!(
        p.read_blocks_rma(&[key(2, 0, 0, ALL_HEADS)], 10, t),
        Err(Error::FrameTooLarge { .. })
    ));
}

#[test]
fn admission_needs_its_blocks() {
    let t = Instant::now();
    let mut p = pool(1 << 20, None);
    let err = p.stage_admission(1, vec![], vec![], t).unwrap_err();
    assert!(matches!(err, Error::UnknownRequest(1)));
    p.stage_blocks(1, g(), blocks(1, &[2], 5), t).unwrap();
    let row = g().summary_row_bytes() as usize;
    p.stage_summaries(
        1,
        g(),
        vec![
            SummaryRun {
                layer: 0,
                first_block: 0,
                data: Bytes::from(vec![1; 3 * row]),
            },
            SummaryRun {
                layer: 1,
                first_block: 5,
                data: Bytes::from(vec![2; row]),
            },
        ],
        t,
    )
    .unwrap();
    let sel = vec![
        LayerBlock { layer: 1, block: 2 },
        LayerBlock { layer: 1, block: 4 },
    ];
    p.stage_admission(1, sel, vec![], t).unwrap();
    let err = p.fetch_admission(1, 0, 2, true, 1 << 20, t).unwrap_err();
    assert!(matches!(
        err,
        Error::MissingBlock {
            layer: 1,
            block: 4,
            ..
        }
    ));
    p.stage_admission(1, vec![LayerBlock { layer: 1, block: 2 }], vec![], t)
        .unwrap();
    let a = p.fetch_admission(1, 0, 2, true, 1 << 20, t).unwrap();
    assert_eq!(a.summaries.len(), 2);
    assert_eq!(a.summaries[0].data.len(), 3 * row);
    assert_eq!(a.blocks.len(), 1);
    let a = p.fetch_admission(1, 0, 1, false, 1 << 20, t).unwrap();
    assert_eq!((a.summaries.len(), a.blocks.len()), (1, 0));
    // No layers: the sections alone.
    p.stage_admission(
        1,
        vec![LayerBlock { layer: 1, block: 2 }],
        vec![Section {
            name: "meta".into(),
            data: Bytes::from_static(b"{}"),
        }],
        t,
    )
    .unwrap();
    let a = p.fetch_admission(1, 1, 0, true, 1 << 20, t).unwrap();
    assert_eq!(
        (a.summaries.len(), a.blocks.len(), a.sections.len()),
        (0, 0, 1)
    );
    assert!(p.fetch_admission(1, 3, 0, true, 1 << 20, t).is_err());
    assert!(p.fetch_admission(1, 1, 2, false, 1 << 20, t).is_err());
    assert!(matches!(
        p.fetch_admission(1, 0, 2, false, 100, t),
        Err(Error::FrameTooLarge { .. })
    ));
    p.audit().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Stage {
        request: u64,
        layer: u16,
        ids: Vec<u32>,
    },
    Summaries {
        request: u64,
        first: u32,
        n: u32,
    },
    Admission {
        request: u64,
        n_sel: usize,
        section: usize,
    },
    Release {
        request: u64,
    },
    Advance {
        secs: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..5, 0u16..2, proptest::collection::vec(0u32..8, 0..6))
            .prop_map(|(request, layer, ids)| Op::Stage { request, layer, ids }),
        2 => (0u64..5, 0u32..8, 1u32..4)
            .prop_map(|(request, first, n)| Op::Summaries { request, first, n }),
        1 => (0u64..5, 0usize..4, 0usize..300)
            .prop_map(|(request, n_sel, section)| Op::Admission { request, n_sel, section }),
        1 => (0u64..5).prop_map(|request| Op::Release { request }),
        1 => (0u64..20).prop_map(|secs| Op::Advance { secs }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random operation sequences: the accounting always matches a recount, stays within
    /// the budget, and a live request is never evicted.
    #[test]
    fn accounting_invariants(ops in proptest::collection::vec(op(), 1..60),
                             budget_blocks in 2u64..30) {
        let lease = Duration::from_secs(15);
        let budget = REQUEST_OVERHEAD_BYTES * 2 + budget_blocks * per_block();
        let mut p = pool(budget, Some(lease));
        let start = Instant::now();
        let mut now = start;
        // request -> last touch, per the model
        let mut touched: HashMap<u64, Instant> = HashMap::new();
        for op in ops {
            let mut before: Vec<u64> = touched
                .iter()
                .filter(|(_, t)| now.saturating_duration_since(**t) <= lease)
                .map(|(id, _)| *id)
                .collect();
            let (request, res) = match op {
                Op::Stage { request, layer, ids } => {
                    let r = p.stage_blocks(request, g(), blocks(layer, &ids, 1), now);
                    (Some(request), r.map(|_| ()))
                }
                Op::Summaries { request, first, n } => {
                    let n = n.min(8 - first);
                    let data = Bytes::from(vec![0; (n as u64 * g().summary_row_bytes()) as usize]);
                    let run = SummaryRun { layer: 0, first_block: first, data };
                    let r = p.stage_summaries(request, g(), vec![run], now);
                    (Some(request), r.map(|_| ()))
                }
                Op::Admission { request, n_sel, section } => {
                    let sel = (0..n_sel as u32).map(|b| LayerBlock { layer: 0, block: b }).collect();
                    let sections = vec![Section { name: "draft".into(), data: Bytes::from(vec![0; section]) }];
                    let r = p.stage_admission(request, sel, sections, now);
                    (Some(request), r.map(|_| ()))
                }
                Op::Release { request } => {
                    p.release(request);
                    touched.remove(&request);
                    before.retain(|id| *id != request);
                    (None, Ok(()))
                }
                Op::Advance { secs } => {
                    now += Duration::from_secs(secs);
                    (None, Ok(()))
                }
            };
            if let (Some(request), Ok(())) = (request, &res) {
                touched.insert(request, now);
            }
            if let Err(e) = &res {
                prop_assert!(matches!(e, Error::Busy { .. } | Error::OutOfMemory { .. }
                    | Error::UnknownRequest(_)), "unexpected error {e}");
            }
            p.audit().map_err(TestCaseError::fail)?;
            for id in before {
                prop_assert!(p.contains(id), "live request {id} evicted");
            }
            touched.retain(|id, _| p.contains(*id));
        }
        let ids: Vec<u64> = touched.keys().copied().collect();
        for id in ids {
            p.release(id);
        }
        for id in 0..5 {
            p.release(id);
        }
        prop_assert_eq!(p.used_bytes(), 0);
    }
}
