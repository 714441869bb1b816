//! Prefetch against an in-process daemon: a step's prefetch lands in the background with the
//! right bytes and counts as hits later, the budget bounds what is in flight, a step takes
//! over a queued prefetch instead of waiting behind it, and prefetches that may have missed a
//! move of the pools are read again.

mod common;

use std::time::{Duration, Instant};

use common::*;
use oasis_coord::Coordinator;

fn slow(d: &Daemon, ms: u64, pools: &mut Pools) -> Coordinator {
    let k = Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(ms))),
        broken: None,
    };
    let c = coordinator(k, 1, pools);
    c.stage(99, 7);
    c.take_row(15, 99, 0).unwrap();
    c.submit(&[e(3, 15, 1)]).unwrap(); // connected (its handshake is slow too) before the test
    c.wait_layer(3).unwrap();
    c
}

fn present(c: &Coordinator, keys: &[(u16, u32, u16)]) -> Vec<bool> {
    keys.iter()
        .map(|&(l, r, h)| c.is_present(e(l, r, h)).unwrap())
        .collect()
}

#[test]
fn a_step_prefetches_successors_and_recent_blocks_then_hits_them() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = coordinator(d.tcp(), 1, &mut pools);
    admit(&c, 1, 7, &[0, 1, 2, 3, 4, 5]); // logical blocks 0..6 in rows 0..6
                                          // The step plans block 1, head 0 of layer 0: the successor (block 2) and the two most
                                          // recent blocks (5, 4) come in the background.
    assert_eq!(c.submit_step(&[e(0, 1, 0)], 16).unwrap(), vec![1, 0, 0, 0]);
    c.wait_layer(0).unwrap();
    c.drain();
    let s = c.stats();
    assert_eq!(
        (s.step_entries, s.prefetch_entries, s.prefetched_entries),
        (1, 3, 3)
    );
    assert_eq!(
        present(
            &c,
            &[
                (0, 2, 0),
                (0, 4, 0),
                (0, 5, 0),
                (0, 3, 0),
                (0, 2, 1),
                (1, 2, 0)
            ]
        ),
        vec![true, true, true, false, false, false]
    );
    for (row, block) in [(2, 2), (4, 4), (5, 5)] {
        assert_eq!(pools.head(0, row, 0), staged_head(7, 0, block, 0));
    }
    // A later step that plans them reads nothing and counts hits.
    assert_eq!(
        c.submit_step(&[e(0, 2, 0), e(0, 5, 0)], 0).unwrap(),
        vec![0; LAYERS]
    );
    let s = c.stats();
    assert_eq!((s.step_entries, s.prefetch_hits), (1, 2));
    // No prefetch without a budget, nor for a background submission.
    c.submit_step(&[e(2, 0, 1)], 0).unwrap();
    c.submit_background(&[e(3, 0, 1)]).unwrap();
    c.drain();
    assert_eq!(c.stats().prefetch_entries, 3);
}

#[test]
fn the_budget_bounds_the_prefetches_in_flight() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = slow(&d, 200, &mut pools);
    admit(&c, 1, 7, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let t0 = Instant::now();
    c.submit_step(&[e(0, 0, 0), e(0, 1, 0), e(0, 2, 0)], 2)
        .unwrap();
    // The step's wait covers its own reads only.
    c.wait_layer(0).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.stats().prefetch_entries, 2);
    // Two prefetches in flight: the next step adds none.
    c.submit_step(&[e(1, 0, 0)], 2).unwrap();
    assert_eq!(c.stats().prefetch_entries, 2);
    c.drain();
    // Successors first: block 3 (block 2's), then the most recent block (7).
    assert_eq!(
        present(&c, &[(0, 3, 0), (0, 7, 0), (0, 6, 0)]),
        vec![true, true, false]
    );
    c.submit_step(&[e(2, 0, 0)], 2).unwrap();
    assert_eq!(c.stats().prefetch_entries, 4);
    c.drain();
}

#[test]
fn a_step_takes_over_a_queued_prefetch_instead_of_waiting_behind_it() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = slow(&d, 300, &mut pools);
    admit(&c, 1, 7, &[0, 1, 2, 3, 4, 5]);
    // Step A's own frame goes on the wire (300 ms); its prefetch (blocks 2, 5, 4) waits queued.
    c.submit_step(&[e(0, 1, 0)], 16).unwrap();
    // Step B needs block 2, queued as a prefetch: it reads it on the step queue.
    assert_eq!(c.submit_step(&[e(0, 2, 0)], 0).unwrap(), vec![1, 0, 0, 0]);
    let t0 = Instant::now();
    c.wait_layer(0).unwrap();
    // Behind A's frame on the wire (<= 300 ms) and its own (300 ms), not the prefetch's.
    assert!(
        t0.elapsed() < Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(present(&c, &[(0, 1, 0), (0, 2, 0)]), vec![true, true]);
    assert_eq!(pools.head(0, 2, 0), staged_head(7, 0, 2, 0));
    c.drain();
    let s = c.stats();
    assert_eq!(
        (s.prefetch_taken, s.prefetched_entries, s.failed_entries),
        (1, 2, 0)
    );
    assert_eq!(present(&c, &[(0, 4, 0), (0, 5, 0)]), vec![true, true]);
    assert_eq!(c.in_flight(1, None), 0);
}

#[test]
fn prefetches_that_may_have_missed_a_move_of_the_pools_are_read_again() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let mut moved = Pools::new();
    let c = coordinator(d.tcp(), 1, &mut pools);
    admit(&c, 1, 7, &[0, 1, 2, 3]);
    c.submit_step(&[e(0, 0, 1)], 16).unwrap();
    c.wait_layer(0).unwrap();
    c.drain();
    assert_eq!(
        present(&c, &[(0, 1, 1), (0, 3, 1), (0, 2, 1)]),
        vec![true; 3]
    );
    // The same pools again: nothing moved.
    // SAFETY: both pools outlive the coordinator (declared before it) and are not resized.
    assert!(unsafe { c.register_pools(pools.layout()) }
        .unwrap()
        .is_empty());
    let dropped = unsafe { c.register_pools(moved.layout()) }.unwrap();
    assert_eq!(dropped, vec![(1, 3)]);
    assert_eq!(
        present(&c, &[(0, 1, 1), (0, 3, 1), (0, 2, 1), (0, 0, 1)]),
        vec![false, false, false, true]
    );
    assert_eq!(c.stats().prefetch_dropped, 3);
    // A step's submission since: nothing more to drop.
    c.submit_step(&[e(0, 1, 1)], 0).unwrap();
    c.wait_layer(0).unwrap();
    assert_eq!(moved.head(0, 1, 1), staged_head(7, 0, 1, 1));
    assert!(unsafe { c.register_pools(pools.layout()) }
        .unwrap()
        .is_empty());
}

#[test]
fn a_request_that_ends_drops_its_queued_prefetches() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = slow(&d, 300, &mut pools);
    admit(&c, 1, 7, &[0, 1, 2, 3, 4, 5]);
    let started = c.stats().frames_started;
    c.submit_step(&[e(0, 1, 0)], 16).unwrap();
    // Once its step frame is on the wire (300 ms; a queued one would be dropped unsent and
    // count as failed), its prefetch frame, queued behind it, is not waited for.
    let t_wire = Instant::now();
    while c.stats().frames_started == started {
        assert!(
            t_wire.elapsed() < Duration::from_secs(10),
            "the step frame never went out"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    c.end(1, &[0, 1, 2, 3, 4, 5]).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    c.drain();
    let s = c.stats();
    assert_eq!(
        (
            s.prefetch_entries,
            s.prefetch_cancelled,
            s.prefetched_entries,
            s.failed_entries
        ),
        (3, 3, 0, 0)
    );
    assert_eq!(c.in_flight(1, None), 0);
    assert!(c.is_present(e(0, 2, 0)).unwrap()); // released: local again
}
