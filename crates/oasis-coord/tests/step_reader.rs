//! The step reader against an in-process daemon, with the test in the GPU's place: it publishes
//! each layer's plan and epoch into the mailbox and waits for the layer's landed word, as the
//! captured step's copies and wait kernel do. A layer is marked landed only once its missing
//! block-heads are in the pool; a failed read still marks it (its request fails); a begun step
//! that never ran is dropped; bad tables are refused at `begin_step`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use oasis_coord::step_reader::entries_of;
use oasis_coord::{CoordError, MailboxLayout, StepPlan, StepReader};

const CAP: usize = 64;

/// The mailbox in plain host memory: per layer `CAP` slots and blocks, the ready and landed
/// words.
struct Mailbox {
    slots: Vec<Vec<i32>>,
    blocks: Vec<Vec<i32>>,
    ready: Vec<AtomicU64>,
    landed: Vec<AtomicU64>,
}

impl Mailbox {
    fn new() -> Box<Mailbox> {
        Box::new(Mailbox {
            slots: vec![vec![-1; CAP]; LAYERS],
            blocks: vec![vec![-1; CAP]; LAYERS],
            ready: (0..LAYERS).map(|_| AtomicU64::new(0)).collect(),
            landed: (0..LAYERS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn layout(&mut self) -> MailboxLayout {
        MailboxLayout {
            slots: self
                .slots
                .iter_mut()
                .map(|v| v.as_mut_ptr() as usize)
                .collect(),
            blocks: self
                .blocks
                .iter_mut()
                .map(|v| v.as_mut_ptr() as usize)
                .collect(),
            capacity: CAP,
            ready: self.ready.as_ptr() as usize,
            landed: self.landed.as_ptr() as usize,
        }
    }

    /// The GPU's part for `layer`: the plan `(index into [rows, HEADS, cap], slot, block)`
    /// written, then the epoch.
    fn publish(&mut self, layer: usize, epoch: u64, plan: &[(usize, i32, i32)]) {
        self.slots[layer].fill(-1);
        self.blocks[layer].fill(-1);
        for &(i, s, b) in plan {
            self.slots[layer][i] = s;
            self.blocks[layer][i] = b;
        }
        self.ready[layer].store(epoch, Ordering::Release);
    }

    fn landed(&self, layer: usize) -> u64 {
        self.landed[layer].load(Ordering::Acquire)
    }

    /// The wait kernel's part: until `landed[layer] >= epoch`, within `T`.
    fn wait(&self, layer: usize, epoch: u64) -> Duration {
        let t0 = Instant::now();
        while self.landed(layer) < epoch {
            assert!(t0.elapsed() < T, "layer {layer} never landed epoch {epoch}");
            std::thread::sleep(Duration::from_micros(100));
        }
        t0.elapsed()
    }
}

/// One request (owner 1, daemon's 7) holding rows 3, 4, 5 as logical blocks 0, 1, 2.
fn plan(epoch: u64) -> StepPlan {
    StepPlan {
        epoch,
        rows: 1,
        caps: vec![2; LAYERS],
        indptr: vec![0, 3],
        indices: vec![3, 4, 5],
    }
}

fn setup<K: oasis_coord::Connector>(
    k: K,
    pools: &mut Pools,
    mb: &mut Mailbox,
) -> (Arc<oasis_coord::Coordinator>, StepReader) {
    let c = Arc::new(coordinator(k, 1, pools));
    admit(&c, 1, 7, &[3, 4, 5]);
    // SAFETY: the mailbox (boxed, never resized) outlives the reader in every test (stopped
    // before it is dropped).
    let r = unsafe { StepReader::start(Arc::clone(&c), mb.layout(), HEADS, 0).unwrap() };
    (c, r)
}

#[test]
fn a_published_plan_is_read_and_its_layer_marked_landed() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let (c, mut r) = setup(d.tcp(), &mut pools, &mut mb);
    r.begin_step(plan(1)).unwrap();
    // Layer 0: head 0 fetches logical block 1 (row 4) into slot 0, head 1 block 2 (row 5).
    mb.publish(0, 1, &[(0, 0, 1), (2, 1, 2)]);
    mb.wait(0, 1);
    assert_eq!(pools.head(0, 4, 0), staged_head(7, 0, 1, 0));
    assert_eq!(pools.head(0, 5, 1), staged_head(7, 0, 2, 1));
    assert_eq!(
        pools.head(0, 4, 1),
        vec![0; 2 * HB],
        "only the planned heads"
    );
    // The other layers plan nothing: landed at once.
    for l in 1..LAYERS {
        mb.publish(l, 1, &[]);
        mb.wait(l, 1);
    }
    let t0 = Instant::now();
    while r.queued() > 0 {
        assert!(t0.elapsed() < T);
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = r.stats();
    assert_eq!(
        (s.steps, s.layers, s.entries, s.bad_entries),
        (1, LAYERS as u64, 2, 0)
    );
    // A second step plans the same block-heads again: present, read nothing, landed at once.
    r.begin_step(plan(2)).unwrap();
    let sent = c.stats().sent_entries;
    for l in 0..LAYERS {
        mb.publish(l, 2, if l == 0 { &[(0, 0, 1), (2, 1, 2)] } else { &[] });
        mb.wait(l, 2);
    }
    assert_eq!(c.stats().sent_entries, sent);
    r.stop();
    assert!(c.take_failed().is_empty());
}

#[test]
fn a_layer_is_marked_landed_only_once_its_slow_read_is_in_the_pool() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let slow = Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(400))),
        broken: None,
    };
    let (c, mut r) = setup(slow, &mut pools, &mut mb);
    r.begin_step(plan(1)).unwrap();
    // Layer 1 first (plans come per background stream, not in layer order), then layer 0.
    mb.publish(1, 1, &[]);
    mb.publish(0, 1, &[(1, 3, 0)]);
    mb.wait(1, 1);
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(mb.landed(0), 0, "landed before its read");
    let waited = mb.wait(0, 1);
    assert!(waited > Duration::from_millis(100), "{waited:?}");
    // Landed implies the bytes are there.
    assert_eq!(pools.head(0, 3, 0), staged_head(7, 0, 0, 0));
    for l in 2..LAYERS {
        mb.publish(l, 1, &[]);
        mb.wait(l, 1);
    }
    r.stop();
    assert!(r.stats().read_seconds > 0.2);
    assert!(c.take_failed().is_empty());
}

#[test]
fn a_failed_read_marks_its_layer_landed_and_fails_the_request() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let broken = Faulty {
        tcp: d.tcp(),
        slow: None,
        broken: Some(0),
    };
    let (c, mut r) = setup(broken, &mut pools, &mut mb);
    r.begin_step(plan(1)).unwrap();
    for l in 0..LAYERS {
        mb.publish(l, 1, &[(0, 0, 2)]);
        mb.wait(l, 1);
    }
    r.stop();
    let failed = c.take_failed();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 1);
    assert_eq!(pools.head(0, 5, 0), vec![0; 2 * HB], "nothing written");
}

#[test]
fn a_begun_step_that_never_ran_is_dropped() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let (_c, mut r) = setup(d.tcp(), &mut pools, &mut mb);
    r.begin_step(plan(1)).unwrap();
    r.begin_step(plan(2)).unwrap();
    // Step 1's launch failed: the GPU publishes step 2's plans.
    for l in 0..LAYERS {
        mb.publish(l, 2, &[(0, 0, 0)]);
        mb.wait(l, 2);
    }
    assert_eq!(pools.head(3, 3, 0), staged_head(7, 3, 0, 0));
    r.stop();
    let s = r.stats();
    assert_eq!((s.steps, s.stale_steps), (1, 1), "{s:?}");
}

#[test]
fn stop_marks_the_served_steps_layers_landed() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let (_c, mut r) = setup(d.tcp(), &mut pools, &mut mb);
    r.begin_step(plan(5)).unwrap();
    mb.publish(0, 5, &[]);
    mb.wait(0, 5);
    r.stop();
    for l in 0..LAYERS {
        assert_eq!(mb.landed(l), 5, "no GPU wait left hanging");
    }
    assert!(matches!(r.begin_step(plan(6)), Err(CoordError::Closed)));
}

#[test]
fn begin_step_refuses_bad_tables() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let (_c, mut r) = setup(d.tcp(), &mut pools, &mut mb);
    r.begin_step(plan(3)).unwrap();
    let bad = [
        plan(3), // not above the last epoch
        StepPlan {
            rows: 17,
            ..plan(4)
        }, // 17 x 2 x 2 > 64 entries
        StepPlan {
            indptr: vec![0, 4],
            ..plan(4)
        }, // past the indices
        StepPlan {
            indptr: vec![1, 3],
            ..plan(4)
        }, // not from 0
        StepPlan {
            indptr: vec![0],
            ..plan(4)
        }, // not rows + 1
        StepPlan {
            caps: vec![2; LAYERS - 1],
            ..plan(4)
        }, // not a cap per layer
    ];
    for p in bad {
        assert!(
            matches!(r.begin_step(p.clone()), Err(CoordError::Invalid(_))),
            "{p:?}"
        );
    }
    r.stop();
}

#[test]
fn start_refuses_a_bad_mailbox() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut mb = Mailbox::new();
    let c = Arc::new(coordinator(d.tcp(), 1, &mut pools));
    let good = mb.layout();
    let bad = [
        MailboxLayout {
            slots: good.slots[..1].to_vec(),
            ..good.clone()
        },
        MailboxLayout {
            capacity: 0,
            ..good.clone()
        },
        MailboxLayout {
            ready: good.ready + 4,
            ..good.clone()
        },
        MailboxLayout {
            landed: 0,
            ..good.clone()
        },
    ];
    for l in bad {
        // SAFETY: refused before any address is read.
        let got = unsafe { StepReader::start(Arc::clone(&c), l, HEADS, 0) };
        assert!(matches!(got, Err(CoordError::Invalid(_))));
    }
}

#[test]
fn entries_of_reads_the_block_table_and_counts_entries_outside_it() {
    // Two requests: seq 0 holds rows 10, 11; seq 1 holds row 20. Two heads, two slots each.
    let p = StepPlan {
        epoch: 1,
        rows: 2,
        caps: vec![1, 1, 2],
        indptr: vec![0, 2, 3],
        indices: vec![10, 11, 20],
    };
    let mut slots = vec![-1; 8];
    let mut blocks = vec![-1; 8];
    for (i, s, b) in [(0, 0, 1), (3, 5, 0), (4, 1, 0), (7, 2, 1), (5, -1, 0)] {
        slots[i] = s;
        blocks[i] = b;
    }
    let (got, bad) = entries_of(2, 2, &p, &slots, &blocks); // layer 2: two slots per head
    assert_eq!(got, vec![e(2, 11, 0), e(2, 10, 1), e(2, 20, 0)]);
    assert_eq!(bad, 1, "seq 1's logical block 1 is past its one block");
}
