//! The coordinator against an in-process daemon (`oasis_rt::Server` on loopback TCP): bytes
//! land in the pool before their entries are present, failures stay with their requests, a
//! layer's wait returns while later layers are in flight, and the pools are re-registered.

mod common;

use std::time::{Duration, Instant};

use common::*;
use oasis_coord::{CoordConfig, Coordinator, ALL_HEADS};

#[test]
fn reads_land_in_the_pool_and_only_then_are_present() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let slow = Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(300))),
        broken: None,
    };
    let c = coordinator(slow, 1, &mut pools);
    admit(&c, 1, 7, &[3, 4, 5]);
    assert_eq!(c.missing(), (3 * LAYERS * HEADS) as u64);
    // Layer 0: one head of row 3; layer 2: every head of row 5 (one whole block).
    let got = c
        .submit(&[e(0, 3, 1), e(2, 5, ALL_HEADS), e(0, 3, 1)])
        .unwrap();
    assert_eq!(got, vec![1, 0, 2, 0]);
    // In flight: not present yet, and a second submit reads nothing again.
    assert!(!c.is_present(e(0, 3, 1)).unwrap());
    assert_eq!(c.pending(0), 1);
    assert_eq!(c.submit(&[e(0, 3, 1)]).unwrap(), vec![0; LAYERS]);
    c.wait_layer(0).unwrap();
    assert!(c.is_present(e(0, 3, 1)).unwrap());
    assert!(!c.is_present(e(0, 3, 0)).unwrap());
    c.drain();
    assert_eq!(pools.head(0, 3, 1), staged_head(7, 0, 0, 1));
    assert_eq!(pools.head(0, 3, 0), vec![0; 2 * HB], "only the head read");
    for h in 0..HEADS {
        assert_eq!(pools.head(2, 5, h), staged_head(7, 2, 2, h));
        assert!(c.is_present(e(2, 5, h as u16)).unwrap());
    }
    let s = c.stats();
    assert_eq!((s.sent_entries, s.entries, s.frames), (3, 3, 2));
    let landed = c.take_landed();
    assert_eq!(landed.len(), 1);
    assert_eq!((landed[0].0, landed[0].1), (1, 3));
    assert_eq!(landed[0].2, s.wire_bytes);
    assert!(c.take_landed().is_empty());
    assert!(s.wire_bytes > (3 * 2 * HB) as u64);
    assert!(s.wait_seconds > 0.2, "{s:?}");
    assert_eq!(c.missing(), (3 * LAYERS * HEADS - 3) as u64);
    assert!(c.take_failed().is_empty());
    assert_eq!(c.end(1, &[3, 4, 5]).unwrap(), 3);
    assert_eq!(c.missing(), 0);
}

#[test]
fn wait_layer_returns_while_later_layers_are_in_flight() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    // Slot 0 is fast, slot 1 answers after 800 ms: layer 0's frame goes to slot 0, layer 1's
    // to slot 1 (frames never span layers; round robin in layer order).
    let k = Faulty {
        tcp: d.tcp(),
        slow: Some((1, Duration::from_millis(800))),
        broken: None,
    };
    let c = coordinator(k, 2, &mut pools);
    admit(&c, 1, 7, &[0, 1]);
    c.submit(&[e(0, 0, 0), e(1, 1, 0)]).unwrap();
    let t0 = Instant::now();
    c.wait_layer(0).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.pending(1), 1, "layer 1 still in flight");
    assert!(!c.is_present(e(1, 1, 0)).unwrap());
    assert_eq!(pools.head(0, 0, 0), staged_head(7, 0, 0, 0));
    c.wait_layer(1).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(700));
    assert_eq!(pools.head(1, 1, 0), staged_head(7, 1, 1, 0));
}

#[test]
fn a_failed_connection_fails_only_the_requests_of_its_entries() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    d.stage(8, HEAD_DIM);
    let mut pools = Pools::new();
    let k = Faulty {
        tcp: d.tcp(),
        slow: None,
        broken: Some(1),
    };
    let c = Coordinator::start(
        k,
        CoordConfig {
            connections: 2,
            retries: 2,
            ..CoordConfig::default()
        },
        LAYERS,
        HEADS,
    )
    .unwrap();
    // SAFETY: as in `coordinator`.
    unsafe { c.register_pools(pools.layout()).unwrap() };
    // Request 1's entries are in layer 0 (slot 0), request 2's in layer 1 (slot 1, broken).
    admit(&c, 1, 7, &[0]);
    admit(&c, 2, 8, &[1]);
    c.submit(&[e(0, 0, 0), e(1, 1, 0), e(1, 1, 1)]).unwrap();
    c.drain();
    let failed = c.take_failed();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 2);
    assert!(failed[0].1.contains("staging daemon"), "{}", failed[0].1);
    assert!(c.is_present(e(0, 0, 0)).unwrap());
    assert_eq!(pools.head(0, 0, 0), staged_head(7, 0, 0, 0));
    assert!(
        !c.is_present(e(1, 1, 0)).unwrap(),
        "a failed read marks nothing"
    );
    assert_eq!(pools.head(1, 1, 0), vec![0; 2 * HB], "nothing written");
    // A failed request is not read again; the other still is.
    assert_eq!(
        c.submit(&[e(2, 1, 0), e(2, 0, 1)]).unwrap(),
        vec![0, 0, 1, 0]
    );
    c.drain();
    assert!(c.take_failed().is_empty());
    assert_eq!(c.stats().failed_entries, 2);
    // Its rows come back whole at its end.
    c.end(2, &[1]).unwrap();
    c.end(1, &[0]).unwrap();
    assert_eq!(c.missing(), 0);
}

#[test]
fn a_wrong_size_or_a_released_request_fails_that_request_alone() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    d.stage(8, 2 * HEAD_DIM); // twice the pool's entry
    d.stage(9, HEAD_DIM);
    d.release(9);
    let mut pools = Pools::new();
    let c = coordinator(d.tcp(), 1, &mut pools);
    admit(&c, 1, 7, &[0]);
    admit(&c, 2, 8, &[1]);
    admit(&c, 3, 9, &[2]);
    // All three in one frame.
    c.submit(&[e(0, 0, 0), e(0, 1, 0), e(0, 2, 0)]).unwrap();
    c.wait_layer(0).unwrap();
    let failed = c.take_failed();
    assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), vec![2, 3]);
    assert!(failed[0].1.contains("size_mismatch"), "{}", failed[0].1);
    assert!(failed[1].1.contains("unknown_request"), "{}", failed[1].1);
    assert!(c.is_present(e(0, 0, 0)).unwrap());
    assert!(!c.is_present(e(0, 1, 0)).unwrap());
    assert_eq!(pools.head(0, 1, 0), vec![0; 2 * HB]);
    assert_eq!(pools.head(0, 0, 0), staged_head(7, 0, 0, 0));
}

#[test]
fn a_dead_daemon_fails_the_reads_within_the_retries_and_the_pools_re_register() {
    let mut d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = Coordinator::start(
        d.tcp(),
        CoordConfig {
            retries: 1,
            ..CoordConfig::default()
        },
        LAYERS,
        HEADS,
    )
    .unwrap();
    // SAFETY: as in `coordinator`.
    unsafe { c.register_pools(pools.layout()).unwrap() };
    admit(&c, 1, 7, &[0]);
    c.submit(&[e(0, 0, 0)]).unwrap();
    c.drain();
    assert!(c.take_failed().is_empty());
    // Larger pools (the engine grew them): registered again, the map follows.
    let mut bigger = Pools {
        k: vec![vec![0; 2 * ROWS * HEADS * HB]; LAYERS],
        v: vec![vec![0; 2 * ROWS * HEADS * HB]; LAYERS],
    };
    let mut layout = bigger.layout();
    layout.rows = 2 * ROWS;
    // SAFETY: `bigger` is dropped after `c` (the explicit drops below).
    unsafe { c.register_pools(layout).unwrap() };
    c.take_row(ROWS as u32 + 1, 1, 1).unwrap();
    let _ = d.stop.take().map(|s| s.send(()));
    std::thread::sleep(Duration::from_millis(100));
    c.submit(&[e(1, ROWS as u32 + 1, 0)]).unwrap();
    let t0 = Instant::now();
    c.drain();
    assert!(t0.elapsed() < 2 * T);
    let failed = c.take_failed();
    assert_eq!(failed.len(), 1);
    assert!(failed[0].1.contains("failed"), "{}", failed[0].1);
    c.close();
    assert!(c.submit(&[e(0, 0, 1)]).is_err());
    drop(c);
    drop(bigger);
}

#[test]
fn the_caller_s_mistakes_are_errors_that_say_what_to_pass() {
    let d = Daemon::start();
    let c = Coordinator::start(d.tcp(), CoordConfig::default(), LAYERS, HEADS).unwrap();
    let err = c.submit(&[e(0, 0, 0)]).unwrap_err().to_string();
    assert!(err.contains("register the pools"), "{err}");
    let mut pools = Pools::new();
    let mut bad = pools.layout();
    bad.heads = 3;
    // SAFETY: refused before any read (heads mismatch).
    let err = unsafe { c.register_pools(bad) }.unwrap_err().to_string();
    assert!(err.contains("KV heads"), "{err}");
    assert!(c.wait_layer(LAYERS).is_err());
    let none = CoordConfig {
        connections: 0,
        ..CoordConfig::default()
    };
    assert!(Coordinator::start(d.tcp(), none, LAYERS, HEADS).is_err());
}

#[test]
fn wait_request_waits_for_that_request_s_reads_alone() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    d.stage(8, HEAD_DIM);
    let mut pools = Pools::new();
    // Round robin per frame: request 1's frame goes to slot 0 (fast), request 2's two frames
    // to slot 1 (800 ms a reply) and slot 0.
    let k = Faulty {
        tcp: d.tcp(),
        slow: Some((1, Duration::from_millis(800))),
        broken: None,
    };
    let c = coordinator(k, 2, &mut pools);
    admit(&c, 1, 7, &[0]);
    admit(&c, 2, 8, &[1]);
    c.submit(&[e(0, 0, ALL_HEADS)]).unwrap();
    c.submit(&[e(0, 1, ALL_HEADS)]).unwrap();
    c.submit(&[e(2, 1, ALL_HEADS)]).unwrap();
    assert_eq!(c.in_flight(2, None), 2);
    assert_eq!(c.in_flight(2, Some(1)), 0);
    let t0 = Instant::now();
    c.wait_request(1, None).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.in_flight(1, None), 0);
    assert_eq!(pools.head(0, 0, 1), staged_head(7, 0, 0, 1));
    // Request 2's layer 2 (slot 0) lands before its layer 0 (slot 1).
    c.wait_request(2, Some(2)).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.in_flight(2, Some(0)), 1);
    assert!(c.is_present(e(2, 1, 0)).unwrap() && !c.is_present(e(0, 1, 0)).unwrap());
    c.wait_request(2, Some(0)).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(700));
    assert_eq!(pools.head(0, 1, 0), staged_head(8, 0, 0, 0));
    assert!(c.wait_request(2, Some(LAYERS)).is_err());
    assert!(c.stats().wait_seconds > 0.6);
}

#[test]
fn a_failed_or_ending_request_s_queued_frames_are_not_sent() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let slow = || Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(300))),
        broken: None,
    };
    let c = coordinator(slow(), 1, &mut pools);
    admit(&c, 1, 7, &[0, 1]);
    // Four frames queued on one connection: the first is read, the rest are dropped unsent.
    for layer in 0..LAYERS as u16 {
        c.submit(&[e(layer, 0, ALL_HEADS)]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100)); // the first frame is being read
    c.fail(1, "failed by the test".into());
    let t0 = Instant::now();
    c.wait_request(1, None).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    let s = c.stats();
    assert_eq!((s.frames, s.failed_entries), (1, 3 * HEADS as u64), "{s:?}");
    assert!(
        c.is_present(e(0, 0, 0)).unwrap(),
        "the frame being read lands"
    );
    assert!(!c.is_present(e(1, 0, 0)).unwrap());
    assert_eq!(pools.head(1, 0, 0), vec![0; 2 * HB], "nothing written");
    assert_eq!(c.take_failed(), vec![(1, "failed by the test".to_string())]);
    c.end(1, &[0, 1]).unwrap();
    // An ending request waits for its frame being read, not for the ones queued behind it.
    admit(&c, 2, 7, &[2, 3]);
    for layer in 0..LAYERS as u16 {
        c.submit(&[e(layer, 2, ALL_HEADS), e(layer, 3, ALL_HEADS)])
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    c.end(2, &[2, 3]).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert!(
        c.take_failed().is_empty(),
        "an ended request reports nothing"
    );
    assert_eq!(c.missing(), 0);
    assert_eq!(c.stats().frames, 2);
}

#[test]
fn background_reads_are_not_a_step_s_to_wait_for() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    d.stage(8, HEAD_DIM);
    let mut pools = Pools::new();
    // Slot 0 answers after 500 ms (request 1's stream: the first frame), slot 1 at once
    // (request 2's step: the second).
    let k = Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(500))),
        broken: None,
    };
    let c = coordinator(k, 2, &mut pools);
    admit(&c, 1, 7, &[0, 1]);
    admit(&c, 2, 8, &[2]);
    let got = c
        .submit_background(&[e(1, 0, ALL_HEADS), e(1, 1, ALL_HEADS)])
        .unwrap();
    assert_eq!(got, vec![0, 2 * HEADS as u32, 0, 0]);
    assert_eq!(c.pending(1), 0, "no step waits for them");
    assert_eq!((c.in_flight(1, None), c.in_flight(1, Some(1))), (2, 2));
    let t0 = Instant::now();
    assert_eq!(c.submit(&[e(1, 2, 1)]).unwrap(), vec![0, 1, 0, 0]);
    c.wait_layer(1).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    assert!(c.is_present(e(1, 2, 1)).unwrap());
    assert!(!c.is_present(e(1, 0, 0)).unwrap());
    // An entry whose background frame is on the wire is not read again: the step waits for
    // that frame (its whole block's heads).
    assert_eq!(
        c.submit(&[e(1, 0, 0)]).unwrap(),
        vec![0, HEADS as u32, 0, 0]
    );
    c.wait_layer(1).unwrap();
    assert!(c.is_present(e(1, 0, 0)).unwrap());
    c.wait_request(1, Some(1)).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    for row in 0..2 {
        for h in 0..HEADS {
            assert_eq!(pools.head(1, row, h), staged_head(7, 1, row as u32, h));
        }
    }
    assert_eq!(c.in_flight(1, None), 0);
}

/// Poll `done` until it holds (3 s at most).
fn eventually(done: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < T {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn a_release_goes_from_a_connection_s_task_and_never_blocks_the_caller() {
    let mut d = Daemon::start();
    d.stage(7, HEAD_DIM);
    let mut pools = Pools::new();
    let c = coordinator(d.tcp(), 1, &mut pools);
    admit(&c, 1, 7, &[0]);
    c.submit(&[e(0, 0, ALL_HEADS)]).unwrap();
    c.end(1, &[0]).unwrap();
    c.release(7).unwrap();
    assert!(eventually(|| c.stats().releases == 1), "{:?}", c.stats());
    // The daemon no longer holds it: a read of it fails (unknown_request).
    admit(&c, 2, 7, &[1]);
    c.submit(&[e(0, 1, 0)]).unwrap();
    c.drain();
    let failed = c.take_failed();
    assert!(failed[0].1.contains("unknown_request"), "{failed:?}");
    // A daemon gone: the release returns at once and is counted as failed.
    let _ = d.stop.take().map(|s| s.send(()));
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    c.release(8).unwrap();
    assert!(t0.elapsed() < Duration::from_millis(50));
    assert!(
        eventually(|| c.stats().failed_releases == 1),
        "{:?}",
        c.stats()
    );
    c.close();
    assert!(c.release(9).is_err());
}

#[test]
fn a_step_s_frames_go_before_the_background_ones_queued_on_its_connection() {
    let d = Daemon::start();
    d.stage(7, HEAD_DIM);
    d.stage(8, HEAD_DIM);
    let mut pools = Pools::new();
    // One connection, 250 ms a reply: request 1 streams four frames in the background, then a
    // step asks for one entry of request 2.
    let k = Faulty {
        tcp: d.tcp(),
        slow: Some((0, Duration::from_millis(250))),
        broken: None,
    };
    let c = coordinator(k, 1, &mut pools);
    admit(&c, 1, 7, &[0]);
    admit(&c, 2, 8, &[1]);
    let t0 = Instant::now();
    for layer in 0..LAYERS as u16 {
        c.submit_background(&[e(layer, 0, ALL_HEADS)]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50)); // the first background frame is being read
    c.submit(&[e(2, 1, 0)]).unwrap();
    c.wait_layer(2).unwrap();
    // Behind the background frame being read only, not behind the three queued after it.
    assert!(
        t0.elapsed() < Duration::from_millis(850),
        "{:?}",
        t0.elapsed()
    );
    assert!(c.in_flight(1, None) >= 2, "the stream is still in flight");
    assert_eq!(pools.head(2, 1, 0), staged_head(8, 2, 0, 0));
    c.wait_request(1, None).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(1200),
        "{:?}",
        t0.elapsed()
    );
    for l in 0..LAYERS {
        assert_eq!(pools.head(l, 0, 1), staged_head(7, l as u16, 0, 1));
    }
}
