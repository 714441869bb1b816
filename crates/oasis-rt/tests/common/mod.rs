//! Test bodies shared by every transport: `daemon.rs` runs them over TCP, `ucx.rs` over UCX.
//! Each takes a [`Net`] (the daemon's and the clients' transports) and checks the same
//! protocol-level behaviour: round trips, concurrency, the budget, a killed daemon, bad frames,
//! the token, graceful shutdown, oversized requests and replies.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use oasis_rt::protocol::{
    encode_frame, BlockKey, Frame, Geometry, Hello, KvFormat, LayerBlock, Message, ReadBlocks,
    Section, StageBlocks, StagedBlock, SummaryRun, ALL_HEADS, HARD_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
};
use oasis_rt::transport::{Connection, Transport};
use oasis_rt::{Client, ClientConfig, Error, ErrorCode, Server, ServerConfig, ServerHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const T: Duration = Duration::from_secs(3);

/// 4 layers, 2 KV heads, 16 tokens, head_dim 32, 2-byte elements: 4 KiB blocks, 256 B rows.
pub fn geometry() -> Geometry {
    Geometry {
        num_layers: 4,
        num_kv_heads: 2,
        block_size: 16,
        head_dim: 32,
        dtype_bytes: 2,
        num_blocks: 64,
        kv_format: KvFormat::Plain,
    }
}

/// Deterministic bytes that differ per (request, layer, block, offset).
pub fn pattern(request: u64, layer: u16, block: u32, len: usize) -> Bytes {
    let mut x = request
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(layer) << 32 | u64::from(block))
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

pub fn block(request: u64, layer: u16, block: u32) -> StagedBlock {
    StagedBlock {
        layer,
        block,
        data: pattern(request, layer, block, geometry().block_bytes() as usize),
    }
}

pub fn row(request: u64, layer: u16, block: u32) -> Bytes {
    pattern(
        request ^ 0xabcd,
        layer,
        block,
        geometry().summary_row_bytes() as usize,
    )
}

/// The two ends of a test network: the daemon's transport and the clients' (separate UCX
/// workers, as two processes would have).
#[derive(Clone)]
pub struct Net<T> {
    pub server: T,
    pub client: T,
}

pub struct Daemon<T: Transport> {
    pub addr: String,
    pub handle: ServerHandle,
    pub task: JoinHandle<oasis_rt::Result<()>>,
    pub stop: Option<oneshot::Sender<()>>,
    pub net: Net<T>,
}

impl<T: Transport + Clone> Net<T> {
    pub async fn start(&self, config: ServerConfig) -> Daemon<T> {
        let server = Server::bind_with(
            &self.server,
            ServerConfig {
                listen: "127.0.0.1:0".into(),
                ..config
            },
        )
        .await
        .expect("bind");
        let addr = server.local_addr();
        let handle = server.handle();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Daemon {
            addr,
            handle,
            task,
            stop: Some(tx),
            net: self.clone(),
        }
    }

    pub async fn connect(
        &self,
        addr: &str,
        config: ClientConfig,
    ) -> oasis_rt::Result<Client<T::Conn>> {
        Client::connect_with(&self.client, addr, config).await
    }
}

impl<T: Transport + Clone> Daemon<T> {
    pub async fn client(&self) -> Client<T::Conn> {
        self.net
            .connect(&self.addr, cfg(None))
            .await
            .expect("connect")
    }

    /// Wait until the daemon sees exactly `n` open connections.
    pub async fn settle(&self, n: u64) {
        let start = Instant::now();
        while self.handle.stats().connections_active != n {
            assert!(
                start.elapsed() < T,
                "connections_active stuck at {}",
                self.handle.stats().connections_active
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

pub fn cfg(token: Option<&[u8]>) -> ClientConfig {
    ClientConfig {
        token: token.map(<[u8]>::to_vec),
        connect_timeout: T,
        request_timeout: T,
        ..ClientConfig::default()
    }
}

/// Stage every block (layers 0..4, blocks 0..n) and every summary row of `request`.
pub async fn stage_request<C: Connection>(c: &mut Client<C>, request: u64, n: u32) {
    let g = geometry();
    for layers in [0u16..2, 2..4] {
        let blocks = layers
            .clone()
            .flat_map(|l| (0..n).map(move |b| block(request, l, b)))
            .collect();
        c.stage_blocks(request, g, blocks)
            .await
            .expect("stage blocks");
    }
    let runs = (0..4)
        .map(|l| {
            let mut data = Vec::new();
            for b in 0..n {
                data.extend_from_slice(&row(request, l, b));
            }
            SummaryRun {
                layer: l,
                first_block: 0,
                data: data.into(),
            }
        })
        .collect();
    c.stage_summaries(request, g, runs)
        .await
        .expect("stage summaries");
}

pub fn head_slice(data: &[u8], head: usize) -> Vec<u8> {
    let g = geometry();
    let hb = g.head_bytes() as usize;
    let v = g.num_kv_heads as usize + head;
    [
        &data[head * hb..(head + 1) * hb],
        &data[v * hb..(v + 1) * hb],
    ]
    .concat()
}

// ---- raw frames against the real daemon ----

/// A connection that said Hello with `token` and got HelloOk.
pub async fn raw<T: Transport + Clone>(net: &Net<T>, addr: &str, token: &[u8]) -> T::Conn {
    let mut s = net.client.connect(addr).await.unwrap();
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION.into(),
        token: Bytes::copy_from_slice(token),
    });
    s.send_frame(&encode_frame(1, &hello, 4096).unwrap())
        .await
        .unwrap();
    let reply = recv(&mut s).await.expect("hello reply");
    assert!(matches!(reply.message, Message::HelloOk(_)), "{reply:?}");
    s
}

pub async fn recv<C: Connection>(s: &mut C) -> Option<Frame> {
    let body = s.recv_frame(HARD_MAX_FRAME_BYTES, Some(T)).await.ok()?;
    oasis_rt::protocol::decode_body(body, HARD_MAX_FRAME_BYTES).ok()
}

/// The daemon answers `code` and closes the connection.
pub async fn expect_refused<C: Connection>(mut s: C, code: ErrorCode, what: &str) {
    match recv(&mut s).await {
        Some(Frame {
            message: Message::Error(e),
            ..
        }) => assert_eq!(e.code, code, "{what}: {}", e.message),
        other => panic!("{what}: expected an error frame, got {other:?}"),
    }
    match s.recv_frame(HARD_MAX_FRAME_BYTES, Some(T)).await {
        Err(Error::Closed | Error::Truncated { .. } | Error::Io(_)) => {}
        other => panic!("{what}: connection left open ({other:?})"),
    }
}

pub fn valid_stage_frame() -> Vec<u8> {
    let m = Message::StageBlocks(StageBlocks {
        request: 77,
        geometry: geometry(),
        blocks: vec![block(77, 1, 2), block(77, 3, 4)],
    });
    encode_frame(5, &m, 1 << 20).unwrap()
}

/// Every sample of an exposition, `name{labels}` (labels sorted by name: the encoder's order is
/// its own) to its value.
pub fn samples(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(' '))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let series = match series.split_once('{') {
                Some((name, labels)) => {
                    let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                    labels.sort_unstable();
                    format!("{name}{{{}}}", labels.join(","))
                }
                None => series.to_string(),
            };
            (series, value.parse::<f64>().unwrap())
        })
        .collect()
}

/// One HTTP/1.1 request with `headers` (each `Name: value`), the whole reply as text.
pub async fn http(addr: &str, method: &str, path: &str, headers: &[&str]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

pub async fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

// ---- the bodies ----
pub async fn round_trip_stage_fetch_read_release<T: Transport + Clone>(net: &Net<T>) {
    let d = net.start(ServerConfig::default()).await;
    let mut prefill = d.client().await;
    stage_request(&mut prefill, 7, 64).await;
    stage_request(&mut prefill, 8, 16).await;
    let selected: Vec<LayerBlock> = (0..4u16)
        .flat_map(|layer| [0u32, 5, 63].map(|block| LayerBlock { layer, block }))
        .collect();
    let draft = pattern(7, 99, 99, 3000);
    prefill
        .stage_admission(
            7,
            selected.clone(),
            vec![Section {
                name: "draft_kv".into(),
                data: draft.clone(),
            }],
        )
        .await
        .expect("stage admission");
    let used = prefill.stats().await.unwrap().used_bytes;
    assert!(used > 64 * 4 * 4096);

    // Another connection: the decode side.
    let mut decode = d.client().await;
    let a = decode
        .fetch_admission(7, 0, 4, true)
        .await
        .expect("admission");
    assert_eq!(a.geometry, geometry());
    assert_eq!(a.sections.len(), 1);
    assert_eq!(a.sections[0].data, draft);
    assert_eq!(a.blocks.len(), selected.len());
    for b in &a.blocks {
        assert_eq!(
            b.data,
            block(7, b.layer, b.block).data,
            "block {} {}",
            b.layer,
            b.block
        );
    }
    assert_eq!(a.summaries.len(), 4, "one run per layer");
    for run in &a.summaries {
        let expect: Vec<u8> = (0..64)
            .flat_map(|b| row(7, run.layer, b).to_vec())
            .collect();
        assert_eq!(run.first_block, 0);
        assert_eq!(&run.data[..], &expect[..]);
    }
    // A layer range: only its blocks and rows, no sections.
    let part = decode.fetch_admission(7, 2, 1, false).await.unwrap();
    assert!(part.sections.is_empty());
    assert!(part.blocks.iter().all(|b| b.layer == 2) && part.blocks.len() == 3);
    assert!(part.summaries.iter().all(|r| r.layer == 2));

    // One layer's batch across both requests, whole blocks and single heads.
    let keys = vec![
        BlockKey {
            request: 7,
            layer: 1,
            block: 40,
            head: ALL_HEADS,
        },
        BlockKey {
            request: 8,
            layer: 1,
            block: 15,
            head: 1,
        },
        BlockKey {
            request: 8,
            layer: 1,
            block: 16,
            head: 0,
        }, // not staged
        BlockKey {
            request: 7,
            layer: 1,
            block: 64,
            head: 0,
        }, // out of range
        BlockKey {
            request: 9,
            layer: 1,
            block: 0,
            head: 0,
        }, // unknown request
    ];
    let got = decode.read_blocks(keys).await.expect("read");
    assert_eq!(got[0].as_ref().unwrap(), &block(7, 1, 40).data);
    assert_eq!(
        got[1].as_ref().unwrap()[..],
        head_slice(&block(8, 1, 15).data, 1)[..]
    );
    assert_eq!(got[2], Err(ErrorCode::MissingBlock));
    assert_eq!(got[3], Err(ErrorCode::BadRequest));
    assert_eq!(got[4], Err(ErrorCode::UnknownRequest));

    let s = decode.stats().await.unwrap();
    assert_eq!((s.live_requests, s.used_bytes), (2, used));
    assert!(s.bytes_served >= 64 * 4 * 256 + 12 * 4096 + 3000 + 4096);

    // Release frees everything.
    let freed = decode.release(7).await.unwrap() + decode.release(8).await.unwrap();
    assert_eq!(freed, used);
    assert_eq!(decode.release(8).await.unwrap(), 0, "release is idempotent");
    let s = prefill.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests, s.staged_blocks), (0, 0, 0));
    let err = decode.fetch_admission(7, 0, 4, true).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::UnknownRequest);
    assert!(
        decode.is_connected(),
        "a refused request keeps the connection"
    );
    d.handle.audit().unwrap();
}

pub async fn many_clients_at_once<T: Transport + Clone>(net: &Net<T>) {
    let d = net.start(ServerConfig::default()).await;
    let tasks: Vec<_> = (0..16u64)
        .map(|r| {
            let addr = d.addr.clone();
            let net = net.clone();
            tokio::spawn(async move {
                let mut c = net.connect(&addr, cfg(None)).await.unwrap();
                stage_request(&mut c, r, 8).await;
                for layer in 0..4 {
                    let keys = (0..8)
                        .map(|b| BlockKey {
                            request: r,
                            layer,
                            block: b,
                            head: ALL_HEADS,
                        })
                        .collect();
                    let got = c.read_blocks(keys).await.unwrap();
                    for (b, e) in got.iter().enumerate() {
                        assert_eq!(e.as_ref().unwrap(), &block(r, layer, b as u32).data);
                    }
                }
                c.release(r).await.unwrap()
            })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap() > 0);
    }
    let s = d.handle.stats();
    assert_eq!((s.used_bytes, s.live_requests), (0, 0));
    d.handle.audit().unwrap();
}

pub async fn staging_past_the_budget_is_refused_and_live_data_kept<T: Transport + Clone>(
    net: &Net<T>,
) {
    // Room for one request of 64 blocks x 4 layers (1 MiB + overheads), not two.
    let d = net
        .start(ServerConfig {
            budget_bytes: 1_200_000,
            ..ServerConfig::default()
        })
        .await;
    let mut c = d.client().await;
    stage_request(&mut c, 1, 64).await;
    let used = c.stats().await.unwrap().used_bytes;
    let g = geometry();
    let blocks: Vec<StagedBlock> = (0..64).map(|b| block(2, 0, b)).collect();
    let err = c.stage_blocks(2, g, blocks).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Busy, "{err}");
    // A request that alone passes the budget: out of memory (never fits).
    let mut c2 = d.client().await;
    let mut refused = 0;
    for chunk in 0..2 {
        let blocks: Vec<StagedBlock> = (0..4u16)
            .flat_map(|l| (0..64).map(move |b| block(3, l, b)))
            .skip(chunk * 128)
            .take(128)
            .collect();
        match c2.stage_blocks(3, g, blocks).await {
            Err(e) => {
                assert!(
                    matches!(e.code(), ErrorCode::Busy | ErrorCode::OutOfMemory),
                    "{e}"
                );
                refused += 1;
            }
            Ok(_) => panic!("staged past the budget"),
        }
    }
    assert_eq!(refused, 2);
    // The live request is whole and the accounting unchanged.
    let keys = (0..64)
        .map(|b| BlockKey {
            request: 1,
            layer: 3,
            block: b,
            head: ALL_HEADS,
        })
        .collect();
    let got = c.read_blocks(keys).await.unwrap();
    for (b, e) in got.iter().enumerate() {
        assert_eq!(e.as_ref().unwrap(), &block(1, 3, b as u32).data);
    }
    let s = c.stats().await.unwrap();
    assert_eq!(
        (s.used_bytes, s.live_requests, s.refused_stages),
        (used, 1, 3)
    );
    assert!(s.used_bytes <= s.budget_bytes);
    // After a release the same staging fits.
    c.release(1).await.unwrap();
    let blocks: Vec<StagedBlock> = (0..64).map(|b| block(2, 0, b)).collect();
    c.stage_blocks(2, g, blocks)
        .await
        .expect("fits after release");
    d.handle.audit().unwrap();
}

pub async fn killed_daemon_mid_transfer_gives_a_typed_error_in_time<T: Transport + Clone>(
    net: &Net<T>,
) {
    let d = net.start(ServerConfig::default()).await;
    let mut c = d.client().await;
    // 32 MiB staged in 8 MiB frames; each read below moves 8 MiB.
    let g = Geometry {
        num_blocks: 2048,
        ..geometry()
    };
    for chunk in 0..4u32 {
        let blocks = (0..2048)
            .map(|b| StagedBlock {
                layer: chunk as u16,
                block: b,
                data: Bytes::from(vec![chunk as u8; 4096]),
            })
            .collect();
        c.stage_blocks(1, g, blocks).await.unwrap();
    }
    let timeout = Duration::from_secs(2);
    let mut reader = net
        .connect(
            &d.addr,
            ClientConfig {
                request_timeout: timeout,
                ..cfg(None)
            },
        )
        .await
        .unwrap();
    let (first_tx, first_rx) = oneshot::channel();
    let read = tokio::spawn(async move {
        let mut first = Some(first_tx);
        loop {
            let keys = (0..2048)
                .map(|b| BlockKey {
                    request: 1,
                    layer: (b % 4) as u16,
                    block: b,
                    head: ALL_HEADS,
                })
                .collect();
            if let Err(e) = reader.read_blocks(keys).await {
                return (e, Instant::now(), reader.is_connected());
            }
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
    });
    first_rx.await.expect("one read went through");
    tokio::time::sleep(Duration::from_millis(3)).await;
    let killed = Instant::now();
    d.task.abort();
    let (err, at, connected) = tokio::time::timeout(timeout + Duration::from_secs(2), read)
        .await
        .expect("the client hung")
        .unwrap();
    let took = at.saturating_duration_since(killed);
    eprintln!("killed daemon: client got `{err}` {took:?} after the abort");
    assert!(
        took <= timeout + Duration::from_millis(500),
        "took {took:?}"
    );
    assert!(
        matches!(
            err,
            Error::Closed | Error::Truncated { .. } | Error::Io(_) | Error::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(!connected, "a broken connection is dropped");
    // And the daemon is gone for new clients too.
    let err = net
        .connect(&d.addr, cfg(None))
        .await
        .err()
        .expect("connected to a dead daemon");
    assert!(matches!(err, Error::Unreachable { .. }), "{err:?}");
}

pub async fn bad_frames_are_rejected_and_the_daemon_goes_on<T: Transport + Clone>(net: &Net<T>) {
    let d = net
        .start(ServerConfig {
            max_frame: 1 << 20,
            ..ServerConfig::default()
        })
        .await;
    let mut good = d.client().await;
    stage_request(&mut good, 1, 8).await;
    d.settle(1).await;
    let before = d.handle.stats();

    // Offsets in a StageBlocks frame: prefix 4, header 8, request 8, geometry 14 (its
    // kv_format last), count 4, then per block layer u16, block u32, bytes.
    let geo = 4 + 8 + 8;
    let count = geo + Geometry::WIRE_BYTES;
    let first_layer = count + 4;
    let frame = valid_stage_frame();
    let patched = |at: usize, bytes: &[u8]| {
        let mut f = frame.clone();
        f[at..at + bytes.len()].copy_from_slice(bytes);
        f
    };
    let cases: Vec<(&str, Vec<u8>, ErrorCode)> = vec![
        ("bad version", patched(4, &[9]), ErrorCode::BadVersion),
        ("unknown kind", patched(5, &[0x42]), ErrorCode::BadFrame),
        ("reserved bits", patched(6, &[1, 0]), ErrorCode::BadFrame),
        (
            "layer out of range",
            patched(first_layer, &4u16.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "block out of range",
            patched(first_layer + 2, &64u32.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "zero heads",
            patched(geo + 2, &0u16.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        ("bad dtype", patched(geo + 8, &[3]), ErrorCode::BadFrame),
        (
            "unknown kv_format",
            patched(geo + 13, &[2]),
            ErrorCode::BadFrame,
        ),
        // An fp8 geometry whose blocks are plain-sized: the length no longer matches.
        (
            "fp8 geometry, plain block",
            patched(geo + 13, &[1]),
            ErrorCode::BadFrame,
        ),
        (
            "huge geometry",
            patched(geo, &u16::MAX.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "count past the bytes",
            patched(count, &3u32.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "count past the limit",
            patched(count, &u32::MAX.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "prefix past the max",
            patched(0, &((1u32 << 20) + 1).to_le_bytes()),
            ErrorCode::TooLarge,
        ),
        (
            "prefix u32::MAX",
            patched(0, &u32::MAX.to_le_bytes()),
            ErrorCode::TooLarge,
        ),
        (
            "prefix below the header",
            patched(0, &3u32.to_le_bytes()),
            ErrorCode::BadFrame,
        ),
        (
            "a reply sent as a request",
            encode_frame(
                1,
                &Message::Released(oasis_rt::protocol::Released { freed_bytes: 0 }),
                1024,
            )
            .unwrap(),
            ErrorCode::BadFrame,
        ),
        (
            "hello again",
            encode_frame(
                1,
                &Message::Hello(Hello {
                    version: PROTOCOL_VERSION.into(),
                    token: Bytes::new(),
                }),
                1024,
            )
            .unwrap(),
            ErrorCode::BadFrame,
        ),
    ];
    let mut trailing = frame.clone();
    trailing.extend_from_slice(&[0, 0, 0]);
    let len = (trailing.len() - 4) as u32;
    trailing[..4].copy_from_slice(&len.to_le_bytes());
    let n_cases = cases.len() + 1;
    for (what, bytes, code) in
        cases
            .into_iter()
            .chain([("trailing bytes", trailing, ErrorCode::BadFrame)])
    {
        let mut s = raw(net, &d.addr, b"").await;
        s.send_frame(&bytes).await.unwrap();
        expect_refused(s, code, what).await;
        // Meanwhile the good client is served.
        let got = good
            .read_blocks(vec![BlockKey {
                request: 1,
                layer: 2,
                block: 3,
                head: ALL_HEADS,
            }])
            .await
            .unwrap();
        assert_eq!(got[0].as_ref().unwrap(), &block(1, 2, 3).data, "{what}");
    }

    // Half a frame, then the peer goes away (TCP: a truncated frame; UCX: a message shorter
    // than its prefix says).
    let mut s = raw(net, &d.addr, b"").await;
    s.send_frame(&frame[..frame.len() / 2]).await.unwrap();
    drop(s);
    // Garbage before any handshake, an oversized pre-auth frame (its prefix alone), a request
    // before the handshake.
    for (what, bytes) in [
        (
            "garbage instead of hello",
            vec![0xde, 0xad, 0xbe, 0xef, 1, 2, 3],
        ),
        ("big pre-auth prefix", (1u32 << 20).to_le_bytes().to_vec()),
        ("no hello", frame.clone()),
    ] {
        let mut s = net.client.connect(&d.addr).await.unwrap();
        s.send_frame(&bytes).await.unwrap();
        expect_refused(s, ErrorCode::Unauthorized, what).await;
    }

    // Nothing leaked: same bytes, same requests, only the good connection open.
    d.settle(1).await;
    let after = d.handle.stats();
    assert_eq!(after.used_bytes, before.used_bytes);
    assert_eq!(after.live_requests, 1);
    assert_eq!(after.staged_blocks, before.staged_blocks);
    d.handle.audit().unwrap();
    let text = d.handle.render_metrics();
    let bad = text
        .lines()
        .find_map(|l| l.strip_prefix("oasis_rt_bad_frames_total "))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap();
    assert!(bad > n_cases, "bad frames counted: {bad}");
    // The valid frame still works on a fresh connection.
    let mut s = raw(net, &d.addr, b"").await;
    s.send_frame(&frame).await.unwrap();
    let r = recv(&mut s).await.unwrap();
    assert!(matches!(r.message, Message::Staged(_)), "{r:?}");
}

pub async fn the_token_is_required_when_configured<T: Transport + Clone>(net: &Net<T>) {
    let d = net
        .start(ServerConfig {
            token: Some(b"s3cret-token".to_vec()),
            ..ServerConfig::default()
        })
        .await;
    for token in [
        None,
        Some(&b"wrong"[..]),
        Some(&b"s3cret-tokeN"[..]),
        Some(&b"s3cret-token-longer"[..]),
    ] {
        let err = net
            .connect(&d.addr, cfg(token))
            .await
            .err()
            .expect("admitted without the token");
        assert_eq!(err.code(), ErrorCode::Unauthorized, "{err}");
    }
    let mut c = net
        .connect(&d.addr, cfg(Some(b"s3cret-token")))
        .await
        .expect("right token");
    c.stats().await.unwrap();
    // A wrong-version hello is refused too: a version 1 client (before RMA reads, with the
    // right token; its header says 1 as well), a version 2 one (before the geometry's
    // kv_format), and a newer one.
    for (version, header) in [
        (1u16, 1u8),
        (1, PROTOCOL_VERSION),
        (2, 2),
        (2, PROTOCOL_VERSION),
        (4, PROTOCOL_VERSION),
    ] {
        let mut s = net.client.connect(&d.addr).await.unwrap();
        let hello = Message::Hello(Hello {
            version,
            token: Bytes::from_static(b"s3cret-token"),
        });
        let mut f = encode_frame(1, &hello, 4096).unwrap();
        f[4] = header;
        s.send_frame(&f).await.unwrap();
        expect_refused(s, ErrorCode::BadVersion, "an old or newer hello").await;
    }
    d.settle(1).await;
    assert_eq!(d.handle.stats().connections_active, 1);
    assert_eq!(PROTOCOL_VERSION, 3);
}

pub async fn non_loopback_needs_a_token<T: Transport + Clone>(net: &Net<T>) {
    let err = Server::bind_with(
        &net.server,
        ServerConfig {
            listen: "0.0.0.0:0".into(),
            ..ServerConfig::default()
        },
    )
    .await
    .err()
    .expect("bound a public address without a token");
    assert!(
        matches!(err, Error::Config(_)) && err.to_string().contains("token"),
        "{err}"
    );
    let err = Server::bind_with(
        &net.server,
        ServerConfig {
            listen: "127.0.0.1:0".into(),
            metrics: Some("0.0.0.0:0".into()),
            ..ServerConfig::default()
        },
    )
    .await
    .err()
    .expect("public metrics without a token");
    assert!(matches!(err, Error::Config(_)), "{err}");
    Server::bind_with(
        &net.server,
        ServerConfig {
            listen: "0.0.0.0:0".into(),
            token: Some(b"t".to_vec()),
            ..ServerConfig::default()
        },
    )
    .await
    .expect("with a token");
}

pub async fn metrics_endpoint_and_graceful_shutdown<T: Transport + Clone>(net: &Net<T>) {
    let server = Server::bind_with(
        &net.server,
        ServerConfig {
            listen: "127.0.0.1:0".into(),
            metrics: Some("127.0.0.1:0".into()),
            ..ServerConfig::default()
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    let maddr = server.metrics_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let mut c = net.connect(&addr, cfg(None)).await.unwrap();
    stage_request(&mut c, 3, 4).await;
    let keys = vec![BlockKey {
        request: 3,
        layer: 0,
        block: 0,
        head: ALL_HEADS,
    }];
    c.read_blocks(keys).await.unwrap();
    let _ = c.fetch_admission(99, 0, 1, false).await.unwrap_err();
    let text = http_get(&maddr, "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(
        text.contains("Content-Type: application/openmetrics-text; version=1.0.0"),
        "{text}"
    );
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(body.ends_with("# EOF\n"), "{body}");
    let got = samples(body);
    for (series, value) in [
        ("oasis_rt_requests_total{kind=\"read_blocks\"}", 1.0),
        ("oasis_rt_requests_total{kind=\"stage_blocks\"}", 2.0),
        ("oasis_rt_errors_total{code=\"unknown_request\"}", 1.0),
        ("oasis_rt_bytes_served_total", 4096.0),
        (
            "oasis_rt_request_duration_seconds_bucket{kind=\"read_blocks\",le=\"+Inf\"}",
            1.0,
        ),
        (
            "oasis_rt_request_duration_seconds_count{kind=\"stage_summaries\"}",
            1.0,
        ),
        ("oasis_rt_live_requests", 1.0),
        ("oasis_rt_connections_active", 1.0),
        ("oasis_rt_connection_slots", 1024.0),
        ("oasis_rt_handshake_timeouts_total", 0.0),
    ] {
        assert_eq!(got.get(series), Some(&value), "{series} in\n{body}");
    }
    // HEAD: the same headers, no body.
    let head = http(&maddr, "HEAD", "/metrics", &[]).await;
    assert!(
        head.starts_with("HTTP/1.1 200 OK") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // Another method: 405 with the methods that are allowed (finding 6).
    for method in ["POST", "PUT", "DELETE"] {
        let r = http(&maddr, method, "/metrics", &[]).await;
        assert!(
            r.starts_with("HTTP/1.1 405 Method Not Allowed"),
            "{method}: {r}"
        );
        assert!(r.contains("\r\nAllow: GET, HEAD\r\n"), "{method}: {r}");
    }
    assert!(http_get(&maddr, "/nope").await.starts_with("HTTP/1.1 404"));
    assert!(http_get(&maddr, "").await.starts_with("HTTP/1.1 400"));

    // Graceful shutdown: run returns, the idle client sees the connection closed.
    tx.send(()).unwrap();
    tokio::time::timeout(T, task)
        .await
        .expect("shutdown hung")
        .unwrap()
        .unwrap();
    let err = c.stats().await.unwrap_err();
    assert!(
        matches!(err, Error::Closed | Error::Io(_) | Error::Truncated { .. }),
        "{err:?}"
    );
    assert!(
        TcpStream::connect(&maddr).await.is_err(),
        "metrics still served"
    );
}

pub async fn oversized_requests_and_replies_are_refused_cleanly<T: Transport + Clone>(
    net: &Net<T>,
) {
    let d = net
        .start(ServerConfig {
            max_frame: 64 << 10,
            ..ServerConfig::default()
        })
        .await;
    let mut c = d.client().await;
    // The client refuses to send past the daemon's limit, without breaking the connection.
    let blocks: Vec<StagedBlock> = (0..32).map(|b| block(1, 0, b)).collect();
    let err = c.stage_blocks(1, geometry(), blocks).await.unwrap_err();
    assert!(matches!(err, Error::FrameTooLarge { .. }), "{err:?}");
    assert!(c.is_connected());
    // Stage in small frames, then ask for a reply larger than a frame.
    for chunk in 0..4 {
        let blocks = (chunk * 8..chunk * 8 + 8).map(|b| block(1, 0, b)).collect();
        c.stage_blocks(1, geometry(), blocks).await.unwrap();
    }
    let keys: Vec<BlockKey> = (0..32)
        .map(|b| BlockKey {
            request: 1,
            layer: 0,
            block: b,
            head: ALL_HEADS,
        })
        .collect();
    let err = c.read_blocks(keys.clone()).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge, "{err}");
    assert!(c.is_connected());
    let got = c.read_blocks(keys[..8].to_vec()).await.unwrap();
    assert_eq!(got.len(), 8);
    let _ = ReadBlocks { keys };
    d.handle.audit().unwrap();
    drop(d.stop);
}

/// With a token, `/metrics` needs it as a bearer token (finding 6); without one it serves
/// nothing, not even after a wrong method.
pub async fn metrics_need_the_token_when_the_daemon_has_one<T: Transport + Clone>(net: &Net<T>) {
    let server = Server::bind_with(
        &net.server,
        ServerConfig {
            listen: "127.0.0.1:0".into(),
            metrics: Some("127.0.0.1:0".into()),
            token: Some(b"s3cret-token".to_vec()),
            ..ServerConfig::default()
        },
    )
    .await
    .unwrap();
    let maddr = server.metrics_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    for headers in [
        &[][..],
        &["Authorization: Bearer wrong"],
        &["Authorization: Bearer s3cret-tokeN"],
        &["Authorization: Bearer s3cret-token-longer"],
        &["Authorization: Basic czNjcmV0LXRva2Vu"],
        &["Authorization: s3cret-token"],
        &["X-Token: s3cret-token"],
    ] {
        let r = http(&maddr, "GET", "/metrics", headers).await;
        assert!(
            r.starts_with("HTTP/1.1 401 Unauthorized"),
            "{headers:?}: {r}"
        );
        assert!(r.contains("\r\nWWW-Authenticate: Bearer"), "{r}");
        assert!(!r.contains("oasis_rt_"), "{headers:?}: served {r}");
    }
    // The scheme and the header name in any case, as HTTP has them.
    for header in [
        "Authorization: Bearer s3cret-token",
        "authorization: bearer s3cret-token",
    ] {
        let r = http(&maddr, "GET", "/metrics", &[header]).await;
        assert!(r.starts_with("HTTP/1.1 200 OK"), "{header}: {r}");
        assert!(r.contains("\noasis_rt_budget_bytes 1073741824\n"), "{r}");
    }
    let r = http(&maddr, "POST", "/metrics", &[]).await;
    assert!(r.starts_with("HTTP/1.1 405"), "{r}");
    assert!(!r.contains("oasis_rt_"), "{r}");
    tx.send(()).unwrap();
    tokio::time::timeout(T, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Connections that never send a hello hold their slot only until the handshake timeout, far
/// sooner than the I/O timeout; meanwhile the connection limit answers `busy` (finding 6).
pub async fn silent_connections_lose_their_slot_at_the_handshake_timeout<T: Transport + Clone>(
    net: &Net<T>,
) {
    let limit = Duration::from_millis(500);
    let d = net
        .start(ServerConfig {
            handshake_timeout: limit,
            max_connections: 2,
            ..ServerConfig::default()
        })
        .await;
    let start = Instant::now();
    let a = net.client.connect(&d.addr).await.unwrap();
    let b = net.client.connect(&d.addr).await.unwrap();
    d.settle(2).await;
    let err = net
        .connect(&d.addr, cfg(None))
        .await
        .err()
        .expect("admitted past the connection limit");
    assert_eq!(err.code(), ErrorCode::Busy, "{err}");
    expect_refused(a, ErrorCode::Unauthorized, "silent connection").await;
    expect_refused(b, ErrorCode::Unauthorized, "silent connection").await;
    let took = start.elapsed();
    assert!(
        took >= limit && took < limit + Duration::from_secs(2),
        "closed after {took:?}"
    );
    d.settle(0).await;
    // The slots are free again.
    let mut c = d.client().await;
    c.stats().await.unwrap();
    let got = samples(&d.handle.render_metrics());
    assert_eq!(got["oasis_rt_handshake_timeouts_total"], 2.0);
    assert_eq!(got["oasis_rt_connections_refused_total"], 3.0);
    assert_eq!(got["oasis_rt_connection_slots"], 2.0);
    assert_eq!(got["oasis_rt_connections_active"], 1.0);
}

/// An authenticated connection idle past `idle_timeout` is closed; one that keeps talking is not.
pub async fn idle_connections_are_closed_at_the_idle_timeout<T: Transport + Clone>(net: &Net<T>) {
    let idle = Duration::from_millis(400);
    let d = net
        .start(ServerConfig {
            idle_timeout: Some(idle),
            ..ServerConfig::default()
        })
        .await;
    let mut quiet = d.client().await;
    let mut busy = d.client().await;
    d.settle(2).await;
    let start = Instant::now();
    while start.elapsed() < 3 * idle {
        busy.stats().await.expect("a busy connection stays open");
        tokio::time::sleep(idle / 4).await;
    }
    d.settle(1).await;
    assert!(quiet.stats().await.is_err(), "idle connection left open");
    busy.stats().await.unwrap();
}
