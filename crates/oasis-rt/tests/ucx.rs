//! The daemon over UCX on loopback (feature `ucx`): the shared bodies of `common` that
//! `daemon.rs` runs over TCP, plus what is UCX's own (struct layouts against the system headers,
//! rendezvous frames refused before their bytes move, a peer that floods a connection).
//!
//! Without libucp these tests print `SKIPPED (no UCX)` and pass, unless `OASIS_REQUIRE_UCX=1`
//! (what `make test-ucx` sets), which turns a missing libucp into a failure. UCX picks its
//! transports itself (`UCX_TLS` to choose: `tcp`, `sm`, `self`... all work on loopback).

#![cfg(feature = "ucx")]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use oasis_rt::protocol::{encode_frame, Hello, Message, PREAUTH_MAX_FRAME_BYTES};
use oasis_rt::transport::{Connection, Listener, Transport};
use oasis_rt::ucx::worker::MAX_QUEUED_FRAMES;
use oasis_rt::{Error, ErrorCode, ServerConfig, UcxConfig, UcxTransport};

fn required() -> bool {
    std::env::var("OASIS_REQUIRE_UCX").is_ok_and(|v| v == "1")
}

/// Say so on the real stderr (the harness captures `eprintln!` of passing tests).
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED (no UCX): {why}; set OASIS_REQUIRE_UCX=1 to make this a failure"
    );
}

/// Two UCX transports (two workers, two progress threads), or `None` when libucp is absent and
/// not required.
fn ucx() -> Option<Net<UcxTransport>> {
    let make = || UcxTransport::new(UcxConfig::default());
    match (make(), make()) {
        (Ok(server), Ok(client)) => Some(Net { server, client }),
        (Err(e), _) | (_, Err(e)) => {
            assert!(
                !required(),
                "OASIS_REQUIRE_UCX=1 but the UCX transport cannot start: {e}"
            );
            skipped(&e.to_string());
            None
        }
    }
}

/// Stop both progress threads before the test returns (not at process exit).
async fn shutdown(net: Net<UcxTransport>) {
    tokio::task::spawn_blocking(move || {
        net.client.shutdown_blocking();
        net.server.shutdown_blocking();
    })
    .await
    .unwrap();
}

macro_rules! over_ucx {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(net) = ucx() {
                common::$name(&net).await;
                shutdown(net).await;
            }
        }
    )*};
}

over_ucx!(
    round_trip_stage_fetch_read_release,
    many_clients_at_once,
    staging_past_the_budget_is_refused_and_live_data_kept,
    killed_daemon_mid_transfer_gives_a_typed_error_in_time,
    bad_frames_are_rejected_and_the_daemon_goes_on,
    the_token_is_required_when_configured,
    non_loopback_needs_a_token,
    metrics_endpoint_and_graceful_shutdown,
    oversized_requests_and_replies_are_refused_cleanly,
    metrics_need_the_token_when_the_daemon_has_one,
);

#[test]
fn the_library_reports_a_version() {
    match oasis_rt::ucx::probe() {
        Ok(v) => assert!(v.major >= 1 && (v.major, v.minor) >= (1, 10), "{v:?}"),
        Err(e) => {
            assert!(!required(), "OASIS_REQUIRE_UCX=1: {e}");
            assert!(e.to_string().contains("libucp"), "{e}");
        }
    }
}

/// A pre-authentication frame of 1 MiB, sent rendezvous: refused on its length alone (its
/// bytes never cross), the connection closed, the daemon unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_frame_is_refused_before_its_bytes_move() {
    let Some(net) = ucx() else { return };
    let d = net.start(ServerConfig::default()).await;
    let mut good = d.client().await;
    stage_request(&mut good, 1, 4).await;
    let mut big = vec![0u8; 1 << 20];
    const { assert!(PREAUTH_MAX_FRAME_BYTES < (1 << 20)) };
    big[..4].copy_from_slice(&((1u32 << 20) - 4).to_le_bytes());
    for _ in 0..3 {
        let mut s = net.client.connect(&d.addr).await.unwrap();
        s.send_frame(&big).await.unwrap();
        expect_refused(s, ErrorCode::Unauthorized, "1 MiB before hello").await;
    }
    // After the handshake, a frame past the daemon's limit: too_large.
    let d2 = net
        .start(ServerConfig {
            max_frame: 256 << 10,
            ..ServerConfig::default()
        })
        .await;
    let mut s = raw(&net, &d2.addr, b"").await;
    s.send_frame(&big).await.unwrap();
    expect_refused(s, ErrorCode::TooLarge, "1 MiB past a 256 KiB limit").await;
    d2.settle(0).await;
    let st = good.stats().await.unwrap();
    assert!(st.live_requests == 1 && st.used_bytes > 0, "{st:?}");
    assert_eq!(d.handle.stats().connections_active, 1);
    // The served bytes are what crossed: nothing of the refused frames reached the pool.
    d.handle.audit().unwrap();
    shutdown(net).await;
}

/// Frames of every size around the rendezvous switch arrive whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_of_every_size_arrive_whole() {
    let Some(net) = ucx() else { return };
    let mut l = net.server.bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    let mut tx = net.client.connect(&addr).await.unwrap();
    let mut rx = tokio::time::timeout(T, l.accept()).await.unwrap().unwrap();
    let rndv = oasis_rt::ucx::worker::RNDV_FRAME_BYTES;
    let sizes = [8, 9, 100, 4095, rndv - 1, rndv, rndv + 1, 3 << 20, 8];
    for (i, &n) in sizes.iter().enumerate() {
        let mut f: Vec<u8> = (0..n + 4).map(|j| (i * 31 + j * 7) as u8).collect();
        f[..4].copy_from_slice(&(n as u32).to_le_bytes());
        // A rendezvous send completes once the reader pulled it: both at once.
        let (sent, body) = tokio::join!(tx.send_frame(&f), rx.recv_frame(4 << 20, Some(T)));
        sent.unwrap();
        assert_eq!(&body.unwrap()[..], &f[4..], "frame {i} of {n} bytes");
    }
    // Both directions.
    let f = encode_frame(9, &Message::Stats, 1024).unwrap();
    rx.send_frame(&f).await.unwrap();
    assert_eq!(&tx.recv_frame(1024, Some(T)).await.unwrap()[..], &f[4..]);
    // A reader's limit applies to each frame, eager or rendezvous, and breaks nothing else.
    for n in [1000, rndv + 10] {
        let mut f = vec![0u8; n + 4];
        f[..4].copy_from_slice(&(n as u32).to_le_bytes());
        // Refused on its length: a rendezvous send completes without its bytes being pulled.
        let (sent, got) = tokio::join!(tx.send_frame(&f), rx.recv_frame(999, Some(T)));
        sent.unwrap();
        let err = got.unwrap_err();
        assert!(matches!(err, Error::FrameTooLarge { .. }), "{n}: {err:?}");
    }
    // Idle: a timeout, on time.
    let start = Instant::now();
    let err = rx
        .recv_frame(1024, Some(Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(start.elapsed() < Duration::from_millis(1000));
    // The peer goes: the reader sees Closed, and so does a sender.
    drop(tx);
    let err = rx.recv_frame(1024, Some(T)).await.unwrap_err();
    assert!(matches!(err, Error::Closed), "{err:?}");
    assert!(rx.send_frame(&f).await.is_err());
    shutdown(net).await;
}

/// A peer that sends frame after frame without waiting for replies is cut off after
/// `MAX_QUEUED_FRAMES` unread ones: its frames do not pile up in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_peer_is_disconnected() {
    let Some(net) = ucx() else { return };
    let mut l = net.server.bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    let mut tx = net.client.connect(&addr).await.unwrap();
    let mut rx = tokio::time::timeout(T, l.accept()).await.unwrap().unwrap();
    let hello = encode_frame(
        1,
        &Message::Hello(Hello {
            version: oasis_rt::protocol::PROTOCOL_VERSION.into(),
            token: Bytes::new(),
        }),
        4096,
    )
    .unwrap();
    let n = MAX_QUEUED_FRAMES * 4;
    for _ in 0..n {
        if tx.send_frame(&hello).await.is_err() {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut frames = 0;
    let err = loop {
        match rx.recv_frame(4096, Some(T)).await {
            Ok(_) => frames += 1,
            Err(e) => break e,
        }
    };
    assert!(
        frames <= MAX_QUEUED_FRAMES,
        "{frames} frames queued, limit {MAX_QUEUED_FRAMES}"
    );
    assert!(
        err.to_string().contains("queued more than"),
        "{err:?} after {frames} frames"
    );
    shutdown(net).await;
}

/// An address nobody listens on: `Unreachable`, quickly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_daemon_is_unreachable() {
    let Some(net) = ucx() else { return };
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let start = Instant::now();
    let err = net.connect(&addr, cfg(None)).await.err().unwrap();
    assert!(matches!(err, Error::Unreachable { .. }), "{err:?}");
    assert!(start.elapsed() < T, "{:?}", start.elapsed());
    shutdown(net).await;
}

/// The `repr(C)` declarations against the installed `ucp.h`: a C program prints every size
/// and offset the Rust side pins. Needs a C compiler and `libucx-dev`; without them the test
/// says so (and fails under `OASIS_REQUIRE_UCX=1`).
#[test]
fn struct_layouts_match_the_system_headers() {
    let header = std::path::Path::new("/usr/include/ucp/api/ucp.h");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if !header.exists() {
        assert!(
            !required(),
            "OASIS_REQUIRE_UCX=1 but {header:?} is missing (libucx-dev)"
        );
        skipped(&format!("{header:?} missing (install libucx-dev)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("oasis-ucx-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    std::fs::write(&src, oasis_rt::ucx::sys::layout_c()).unwrap();
    let exe = dir.join("layout");
    let out = std::process::Command::new(&cc)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        other => {
            assert!(
                !required(),
                "OASIS_REQUIRE_UCX=1 but `{cc}` failed: {other:?}"
            );
            skipped(&format!(
                "cannot compile against ucp.h with `{cc}`: {other:?}"
            ));
            return;
        }
    };
    drop(out);
    let run = std::process::Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let c: Vec<(String, i64)> = String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect();
    let rust = oasis_rt::ucx::sys::layout();
    assert_eq!(
        c.len(),
        rust.len(),
        "the C program and the Rust table differ in length"
    );
    for ((ck, cv), (rk, rv)) in c.iter().zip(&rust) {
        assert_eq!(ck, rk);
        eprintln!("{ck} = {cv}");
        assert_eq!(cv, rv, "{ck}: C says {cv}, Rust has {rv}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// RMA: a registered region is read back by ranges with `get`, bit-exact (8 KiB and 64 KiB
/// blocks, the odd tail, the whole region); ranges outside what the region advertises are
/// refused before UCX sees them and leave the connection usable; two regions (two rkeys) at
/// once; frames still flow on the same connection; the peer gone, a get fails typed and fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_get_reads_a_registered_region() {
    let Some(net) = ucx() else { return };
    let mut l = net.server.bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    let mut c = net.client.connect(&addr).await.unwrap();
    let mut s = tokio::time::timeout(T, l.accept()).await.unwrap().unwrap();
    let n = (3 << 20) + 97;
    let data = Bytes::from((0..n).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>());
    let region = net.server.register(data.clone()).await.unwrap();
    let remote = region.remote().clone();
    assert_eq!(remote.len, n as u64);
    assert!(!remote.rkey.is_empty() && remote.rkey.len() <= oasis_rt::ucx::MAX_RKEY_BYTES);
    let ranges = [
        (0, 8 << 10),
        (5 * (8 << 10), 64 << 10),
        (n - 97, 97),
        (12345, 1),
        (0, n),
        (n, 0),
    ];
    for (off, len) in ranges {
        let got = c.get(&remote, off as u64, len as u64).await.unwrap();
        assert_eq!(&got[..], &data[off..off + len], "get {len} at {off}");
    }
    for (off, len) in [
        (n as u64, 1),
        (0, n as u64 + 1),
        (u64::MAX, 2),
        (1, u64::MAX),
    ] {
        let err = c.get(&remote, off, len).await.unwrap_err();
        assert!(
            matches!(err, Error::OutOfRange { .. }),
            "{off} {len}: {err:?}"
        );
    }
    let forged = oasis_rt::ucx::RemoteRegion {
        rkey: Bytes::new(),
        ..remote.clone()
    };
    assert!(matches!(
        c.get(&forged, 0, 1).await,
        Err(Error::Invalid { .. })
    ));
    // A second region beside the first: both rkeys live on the connection.
    let small = Bytes::from_static(b"a second, small region");
    let region2 = net.server.register(small.clone()).await.unwrap();
    let got = c
        .get(region2.remote(), 0, small.len() as u64)
        .await
        .unwrap();
    assert_eq!(got, small);
    assert_eq!(&c.get(&remote, 7, 9).await.unwrap()[..], &data[7..16]);
    // Frames still flow both ways.
    let f = encode_frame(9, &Message::Stats, 1024).unwrap();
    c.send_frame(&f).await.unwrap();
    assert_eq!(&s.recv_frame(1024, Some(T)).await.unwrap()[..], &f[4..]);
    assert!(matches!(
        net.server.register(Bytes::new()).await,
        Err(Error::Invalid { .. })
    ));
    drop(region2);
    // The peer closes: the client sees it, and a get fails at once.
    drop(s);
    let err = c.recv_frame(1024, Some(T)).await.unwrap_err();
    assert!(matches!(err, Error::Closed), "{err:?}");
    let start = Instant::now();
    assert!(c.get(&remote, 0, 8).await.is_err());
    assert!(start.elapsed() < T);
    drop(region);
    shutdown(net).await;
}

/// The keys of a mixed read: whole blocks and heads of two requests, an unknown request, a
/// block never staged, a head past the geometry.
fn mixed_keys() -> Vec<oasis_rt::protocol::BlockKey> {
    use oasis_rt::protocol::{BlockKey, ALL_HEADS};
    let k = |request, layer, block, head| BlockKey {
        request,
        layer,
        block,
        head,
    };
    vec![
        k(1, 0, 0, ALL_HEADS),
        k(1, 3, 9, 1),
        k(2, 2, 4, 0),
        k(2, 1, 4, ALL_HEADS),
        k(9, 0, 0, ALL_HEADS),
        k(1, 0, 12, ALL_HEADS),
        k(1, 0, 1, 7),
        k(1, 3, 9, 0),
    ]
}

/// Block reads by RMA through the daemon: the daemon's staged blocks are registered, the
/// reply names ranges of them, the client reads them and acknowledges; the entries equal what
/// frame reads return, failures included; many reads in a row (past the lease limit: each is
/// acknowledged); the bytes count as received; nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_reads_through_the_daemon_equal_frame_reads() {
    let Some(net) = ucx() else { return };
    let d = net.start(ServerConfig::default()).await;
    let mut c = d.client().await;
    assert!(c.rma());
    stage_request(&mut c, 1, 10).await;
    stage_request(&mut c, 2, 5).await;
    let keys = mixed_keys();
    let by_frame = c.read_blocks(keys.clone()).await.unwrap();
    let before = c.wire_bytes().1;
    let by_rma = c.read_blocks_rma(keys.clone()).await.unwrap();
    assert_eq!(by_rma, by_frame);
    let data: u64 = by_rma.iter().flatten().map(|b| b.len() as u64).sum();
    assert!(c.wire_bytes().1 - before > data);
    assert!(by_rma[0].is_ok() && by_rma[4] == Err(ErrorCode::UnknownRequest));
    assert_eq!(by_rma[5], Err(ErrorCode::MissingBlock));
    assert_eq!(by_rma[6], Err(ErrorCode::BadRequest));
    for _ in 0..2 * oasis_rt::server::MAX_LEASES {
        assert_eq!(c.read_blocks_rma(keys.clone()).await.unwrap(), by_frame);
    }
    // Past this client's frame limit: refused, the lease acknowledged, the connection kept.
    let mut small = net
        .connect(
            &d.addr,
            oasis_rt::ClientConfig {
                max_frame: 4096,
                ..cfg(None)
            },
        )
        .await
        .unwrap();
    let err = small.read_blocks_rma(keys.clone()).await.unwrap_err();
    assert!(matches!(err, Error::FrameTooLarge { .. }), "{err:?}");
    assert!(small.is_connected());
    small.stats().await.unwrap();
    assert!(c.release(1).await.unwrap() > 0 && c.release(2).await.unwrap() > 0);
    assert_eq!(d.handle.stats().used_bytes, 0);
    d.handle.audit().unwrap();
    drop((c, small));
    shutdown(net).await;
}

/// A lease keeps the ranges alive and registered until it is acknowledged, even when the
/// request is released in between; a lease number in use and too many unacknowledged leases
/// are refused (the connection goes on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rma_lease_outlives_a_release_until_acked() {
    use oasis_rt::protocol::{BlocksRma, Frame, ReadBlocksRma};
    let Some(net) = ucx() else { return };
    let d = net.start(ServerConfig::default()).await;
    let mut c = d.client().await;
    stage_request(&mut c, 1, 10).await;
    let mut s = raw(&net, &d.addr, b"").await;
    let keys = mixed_keys()[..2].to_vec();
    let read = |lease| {
        encode_frame(
            lease,
            &Message::ReadBlocksRma(ReadBlocksRma {
                lease,
                keys: keys.clone(),
            }),
            1 << 20,
        )
        .unwrap()
    };
    s.send_frame(&read(5)).await.unwrap();
    let Some(Frame {
        message:
            Message::BlocksRma(BlocksRma {
                lease: 5,
                regions,
                entries,
            }),
        ..
    }) = recv(&mut s).await
    else {
        panic!("no blocks_rma reply");
    };
    // Released: the pool forgets it, the lease still holds its bytes.
    assert!(c.release(1).await.unwrap() > 0);
    assert_eq!(d.handle.stats().used_bytes, 0);
    let mut got = Vec::new();
    for e in &entries {
        let mut entry = Vec::new();
        for r in e.as_ref().unwrap() {
            let region = &regions[r.region as usize];
            entry.extend_from_slice(&s.get(region, r.offset, r.len.into()).await.unwrap());
        }
        got.push(entry);
    }
    assert_eq!(got[0], block(1, 0, 0).data);
    assert_eq!(got[1], head_slice(&block(1, 3, 9).data, 1));
    // The same lease number again while held: refused, the connection stays.
    s.send_frame(&read(5)).await.unwrap();
    let reply = recv(&mut s).await.unwrap().message;
    assert!(
        matches!(&reply, Message::Error(e) if e.code == ErrorCode::BadRequest),
        "{reply:?}"
    );
    s.send_frame(&encode_frame(6, &Message::Ack { lease: 5 }, 64).unwrap())
        .await
        .unwrap();
    assert_eq!(
        recv(&mut s).await.unwrap().message,
        Message::Acked { lease: 5 }
    );
    // Leases past the limit are refused `busy`.
    let max = oasis_rt::server::MAX_LEASES as u32;
    for lease in 100..100 + max {
        s.send_frame(&read(lease)).await.unwrap();
        let m = recv(&mut s).await.unwrap().message;
        assert!(matches!(m, Message::BlocksRma(_)), "{m:?}");
    }
    s.send_frame(&read(100 + max)).await.unwrap();
    let reply = recv(&mut s).await.unwrap().message;
    assert!(
        matches!(&reply, Message::Error(e) if e.code == ErrorCode::Busy),
        "{reply:?}"
    );
    drop(s);
    d.settle(1).await;
    d.handle.audit().unwrap();
    drop(c);
    shutdown(net).await;
}
