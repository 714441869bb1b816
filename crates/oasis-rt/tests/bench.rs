//! `oasis_rt::bench` against an in-process daemon over loopback TCP: rows for 8 KiB and 64 KiB
//! blocks with every byte checked, refusals before anything is staged, nothing left staged.

mod common;

use common::*;
use oasis_rt::bench::{self, BenchConfig};
use oasis_rt::transport::TcpTransport;
use oasis_rt::{Error, ServerConfig};

fn tcp() -> Net<TcpTransport> {
    Net {
        server: TcpTransport::default(),
        client: TcpTransport::default(),
    }
}

/// 2 MiB per size: 256 blocks of 8 KiB, 32 of 64 KiB.
fn small() -> BenchConfig {
    BenchConfig {
        total_bytes: 2 << 20,
        batch: 16,
        repeats: 3,
        ..BenchConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_for_8_and_64_kib_blocks_over_frames() {
    let d = tcp().start(ServerConfig::default()).await;
    let mut c = d.client().await;
    let report = bench::run(&mut c, &small()).await.expect("bench");
    assert!(!report.rma, "tcp has no rma");
    let sizes: Vec<(u64, u32)> = report
        .rows
        .iter()
        .map(|r| (r.block_bytes, r.blocks))
        .collect();
    assert_eq!(sizes, [(8192, 256), (65536, 32)]);
    for r in &report.rows {
        assert_eq!((r.batch, r.repeats, r.path()), (16, 3, "frames"));
        assert_eq!(r.read_gbps.len(), 3);
        assert_eq!(r.stage_gbps.len(), 3);
        assert!(r.stage_gbps.iter().all(|v| v.is_finite() && *v > 0.0));
        assert_eq!(r.memcpy_gbps.len(), 3);
        assert!(r.read_gbps.iter().all(|v| v.is_finite() && *v > 0.0));
        assert!(r.read_gbps_median() > 0.0 && r.memcpy_gbps_median() > 0.0);
        assert!(r.memcpy_one_copy_gbps > 0.0 && r.ratio() > 0.0);
        // A block in a frame costs its bytes plus a little (entry, key, amortised headers).
        let extra = r.wire_bytes_per_block - r.block_bytes as f64;
        assert!(extra > 0.0 && extra < 64.0, "{r:?}");
    }
    let json = report.json(oasis_rt::transport::TransportKind::Tcp);
    assert!(json.contains("\"block_bytes\": 65536"), "{json}");
    // Released: the daemon holds nothing, the connection is usable.
    let s = c.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests), (0, 0));
    assert!(s.bytes_served >= 2 * 4 * (2 << 20), "{s:?}");
    d.handle.audit().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_block_size_is_refused_before_staging() {
    let d = tcp().start(ServerConfig::default()).await;
    let mut c = d.client().await;
    for sizes in [vec![8192, 12345], vec![0], vec![4096]] {
        let err = bench::run(
            &mut c,
            &BenchConfig {
                block_bytes: sizes.clone(),
                ..small()
            },
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, Error::Config(m) if m.contains("multiple of 8192")),
            "{sizes:?}: {err}"
        );
    }
    let s = c.stats().await.unwrap();
    assert_eq!((s.bytes_staged, s.live_requests), (0, 0));
}

/// A batch whose reply passes the daemon's frame limit is refused (naming --batch) before
/// anything is staged; so is a request past the daemon's whole budget (naming the request's
/// size, not a frame's: finding 6); a staging refused part-way by live data comes back as the
/// daemon's refusal naming the whole request, and what was staged is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_and_budget_limits_are_errors_and_nothing_stays_staged() {
    let d = tcp()
        .start(ServerConfig {
            max_frame: 256 << 10,
            budget_bytes: 3 << 20,
            ..ServerConfig::default()
        })
        .await;
    let mut c = d.client().await;
    // 8 KiB blocks would fit; 64 KiB ones not: refused before the 8 KiB ones are staged.
    let err = bench::run(
        &mut c,
        &BenchConfig {
            total_bytes: 512 << 10,
            batch: 8,
            ..small()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("lower --batch")),
        "{err}"
    );
    assert_eq!(c.stats().await.unwrap().bytes_staged, 0);
    // 4 MiB into a 3 MiB budget, which the daemon would see in 256 KiB frames: refused before
    // staging, naming the request's size (4 MiB and its overheads), not a frame's.
    let err = bench::run(
        &mut c,
        &BenchConfig {
            block_bytes: vec![8 << 10],
            total_bytes: 4 << 20,
            ..small()
        },
    )
    .await
    .unwrap_err();
    let whole = 512 + 512 * (8192 + 64);
    assert!(
        matches!(&err, Error::Config(m) if m.contains(&format!("a request of {whole} bytes"))
            && m.contains(&format!("budget of {}", 3 << 20)) && m.contains("lower --total")),
        "{err}"
    );
    assert_eq!(c.stats().await.unwrap().bytes_staged, 0);
    // 2 MiB fits the budget, but 1 MiB of another request's live data leaves less: refused
    // part-way (busy), the message naming the whole request; what was staged is released.
    let mut other = d.client().await;
    for layer in 0..4 {
        for first in [0, 32] {
            let blocks = (first..first + 32).map(|b| block(5, layer, b)).collect();
            other.stage_blocks(5, geometry(), blocks).await.unwrap();
        }
    }
    let live = c.stats().await.unwrap().used_bytes;
    assert!(live > (3 << 20) - (512 + 256 * (8192 + 64)), "{live}");
    let err = bench::run(
        &mut c,
        &BenchConfig {
            block_bytes: vec![8 << 10],
            ..small()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), oasis_rt::ErrorCode::Busy, "{err}");
    assert!(err.to_string().contains("staging a request of"), "{err}");
    assert!(c.is_connected());
    let s = c.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests), (live, 1), "{s:?}");
    d.handle.audit().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_path_is_taken_or_refused() {
    let d = tcp().start(ServerConfig::default()).await;
    let mut c = d.client().await;
    // Frames asked for: what tcp does anyway.
    let report = bench::run(
        &mut c,
        &BenchConfig {
            rma: Some(false),
            ..small()
        },
    )
    .await
    .expect("bench");
    assert!(!report.rma && report.rows.iter().all(|r| r.path() == "frames"));
    // RMA asked for where there is none: refused, nothing staged.
    let err = bench::run(
        &mut c,
        &BenchConfig {
            rma: Some(true),
            ..small()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable(m) if m.contains("--path rma")),
        "{err}"
    );
    let s = c.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests), (0, 0));
    d.handle.audit().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_head_entries_are_each_head_s_k_then_v_rows() {
    let d = tcp().start(ServerConfig::default()).await;
    let mut c = d.client().await;
    let config = BenchConfig {
        block_bytes: vec![64 << 10],
        per_head: true,
        ..small()
    };
    // Every byte of every head's entry is checked against the staged block in the untimed pass.
    let report = bench::run(&mut c, &config).await.expect("bench");
    let r = &report.rows[0];
    assert!(r.per_head && r.entry() == "head" && r.blocks == 32);
    // Eight entries per block: each with its entry overhead and its share of the keys.
    let extra = r.wire_bytes_per_block - r.block_bytes as f64;
    assert!(extra > 8.0 * 6.0 && extra < 8.0 * 64.0, "{r:?}");
    let s = c.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests), (0, 0));
    d.handle.audit().unwrap();
}
