//! The coordinator against a plain model (proptest): random sequences of submissions, waits,
//! evictions, rows taken again and failed requests, over an in-process daemon. After every wait
//! the coordinator's presence equals the model's, every present entry of a staged row holds the
//! daemon's bytes in the pool, nothing is sent twice, and `missing` counts the model's absent
//! entries.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use oasis_coord::{Coordinator, Entry, ALL_HEADS};
use proptest::prelude::*;

/// Owners 1..=3 (daemon ids 7..=9), four rows each from row 4 on, logical block = row % 4.
const OWNERS: [i64; 3] = [1, 2, 3];

fn daemon_of(owner: i64) -> u64 {
    owner as u64 + 6
}

#[derive(Clone, Debug)]
enum Op {
    /// Submit these `(layer, row, head)` keys (head `HEADS`: every head).
    Submit(Vec<(u16, u32, u16)>),
    WaitLayer(usize),
    Drain,
    /// Evict the block of this row (if it holds one).
    Forget(u32),
    /// The row holds a staged block again (if it holds none): logical `row % 4 + 4`.
    Retake(u32),
    Fail(i64),
}

fn op() -> impl Strategy<Value = Op> {
    let key = (0..LAYERS as u16, 4..ROWS as u32, 0..=HEADS as u16);
    prop_oneof![
        4 => prop::collection::vec(key, 1..12).prop_map(Op::Submit),
        2 => (0..LAYERS).prop_map(Op::WaitLayer),
        1 => Just(Op::Drain),
        1 => (4..ROWS as u32).prop_map(Op::Forget),
        1 => (4..ROWS as u32).prop_map(Op::Retake),
        1 => (1..=3i64).prop_map(Op::Fail),
    ]
}

/// What the model knows: per staged row its owner and logical block, the present entries, the
/// entries submitted and not yet seen landed (per layer), the failed owners, and the entries in
/// flight when their owner failed (`maybe`: the frame being read lands, the queued ones are
/// dropped unsent; which is a race the model leaves to the coordinator, checking the bytes of
/// whichever landed).
struct Model {
    rows: HashMap<u32, (i64, u32)>,
    present: HashSet<(u16, u32, u16)>,
    inflight: HashSet<(u16, u32, u16)>,
    maybe: HashSet<(u16, u32, u16)>,
    dead: HashSet<i64>,
}

impl Model {
    fn land(&mut self, layer: Option<u16>) {
        let done: Vec<_> = self
            .inflight
            .iter()
            .copied()
            .filter(|e| layer.is_none_or(|l| e.0 == l))
            .collect();
        for e in done {
            self.inflight.remove(&e);
            self.present.insert(e);
        }
    }

    /// The entries of a failed owner that were in flight, once waited for (`layer`, or all): as
    /// the coordinator says.
    fn settle(&mut self, c: &Coordinator, layer: Option<u16>) {
        self.settle_where(c, |e| layer.is_none_or(|l| e.0 == l));
    }

    /// As [`Model::settle`], the entries of `row` (its owner waited for).
    fn settle_row(&mut self, c: &Coordinator, row: u32) {
        self.settle_where(c, |e| e.1 == row);
    }

    fn settle_where(&mut self, c: &Coordinator, pick: impl Fn(&(u16, u32, u16)) -> bool) {
        let done: Vec<_> = self.maybe.iter().copied().filter(|e| pick(e)).collect();
        for e in done {
            self.maybe.remove(&e);
            let (layer, row, head) = e;
            if c.is_present(Entry { layer, row, head }).unwrap() {
                self.present.insert(e);
            }
        }
    }

    fn missing(&self) -> u64 {
        (self.rows.len() * LAYERS * HEADS - self.present.len()) as u64
    }
}

/// Presence and bytes of every entry of `layers` agree with the model.
fn check(c: &Coordinator, m: &Model, pools: &Pools, layers: &[u16]) {
    for &layer in layers {
        for (&row, &(owner, logical)) in &m.rows {
            for head in 0..HEADS as u16 {
                let want = m.present.contains(&(layer, row, head));
                let e = Entry { layer, row, head };
                assert_eq!(c.is_present(e).unwrap(), want, "{e:?}");
                if want {
                    let bytes = pools.head(layer as usize, row as usize, head as usize);
                    let staged = staged_head(daemon_of(owner), layer, logical, head as usize);
                    assert!(bytes == staged, "{e:?} present without its bytes");
                }
            }
        }
    }
}

fn run(ops: Vec<Op>) {
    let d = Daemon::start();
    for o in OWNERS {
        d.stage(daemon_of(o), HEAD_DIM);
    }
    let mut pools = Pools::new();
    let c = coordinator(d.tcp(), 2, &mut pools);
    let mut m = Model {
        rows: HashMap::new(),
        present: HashSet::new(),
        inflight: HashSet::new(),
        maybe: HashSet::new(),
        dead: HashSet::new(),
    };
    for o in OWNERS {
        let rows: Vec<u32> = (0..4).map(|i| 4 * o as u32 + i).collect();
        admit(&c, o, daemon_of(o), &rows);
        for &r in &rows {
            m.rows.insert(r, (o, r % 4));
        }
    }
    for op in ops {
        match op {
            Op::Submit(keys) => {
                let keys: Vec<Entry> = keys
                    .into_iter()
                    .map(|(layer, row, h)| Entry {
                        layer,
                        row,
                        head: if usize::from(h) == HEADS {
                            ALL_HEADS
                        } else {
                            h
                        },
                    })
                    .collect();
                let sent = c.submit(&keys).unwrap();
                let mut want = vec![0u32; LAYERS];
                for k in &keys {
                    let Some(&(owner, _)) = m.rows.get(&k.row) else {
                        continue;
                    };
                    if m.dead.contains(&owner) {
                        continue;
                    }
                    let heads = if k.head == ALL_HEADS {
                        0..HEADS as u16
                    } else {
                        k.head..k.head + 1
                    };
                    for h in heads {
                        let e = (k.layer, k.row, h);
                        if !m.present.contains(&e) && m.inflight.insert(e) {
                            want[usize::from(k.layer)] += 1;
                        }
                    }
                }
                assert_eq!(sent, want, "what went out");
            }
            Op::WaitLayer(l) => {
                c.wait_layer(l).unwrap();
                m.land(Some(l as u16));
                m.settle(&c, Some(l as u16));
                check(&c, &m, &pools, &[l as u16]);
            }
            Op::Drain => {
                c.drain();
                m.land(None);
                m.settle(&c, None);
                check(&c, &m, &pools, &[0, 1, 2, 3]);
                assert_eq!(c.missing(), m.missing());
            }
            Op::Forget(row) => {
                if let Some((owner, _)) = m.rows.get(&row).copied() {
                    // The coordinator waits for the owner's reads; so does the model (first, so
                    // that a failed owner's reads in flight are settled).
                    c.wait_request(owner, None).unwrap();
                    m.settle_row(&c, row);
                    m.rows.remove(&row);
                    let had = c.forget_row(row).unwrap();
                    let landed: Vec<_> =
                        m.inflight.iter().copied().filter(|e| e.1 == row).collect();
                    for e in landed {
                        m.inflight.remove(&e);
                        m.present.insert(e);
                    }
                    let before = m.present.len();
                    m.present.retain(|e| e.1 != row);
                    assert_eq!(had, (before - m.present.len()) as u64);
                }
            }
            Op::Retake(row) => {
                m.rows.entry(row).or_insert_with(|| {
                    let owner = OWNERS[(row / 4 - 1) as usize];
                    c.take_row(row, owner, row % 4 + 4).unwrap();
                    (owner, row % 4 + 4)
                });
            }
            Op::Fail(owner) => {
                c.fail(owner, "failed by the test".into());
                m.dead.insert(owner);
                let theirs: Vec<_> = m
                    .inflight
                    .iter()
                    .copied()
                    .filter(|e| m.rows.get(&e.1).is_some_and(|r| r.0 == owner))
                    .collect();
                for e in theirs {
                    m.inflight.remove(&e);
                    m.maybe.insert(e);
                }
            }
        }
    }
    c.drain();
    m.land(None);
    m.settle(&c, None);
    check(&c, &m, &pools, &[0, 1, 2, 3]);
    assert_eq!(c.missing(), m.missing());
    let s = c.stats();
    assert_eq!(
        s.sent_entries,
        s.entries + s.failed_entries,
        "every entry sent landed once or failed (a failed owner's, unsent): {s:?}"
    );
    drop(c);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn the_coordinator_follows_the_plain_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops);
    }
}
