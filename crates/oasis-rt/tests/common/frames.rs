//! Bodies: frames the daemon must refuse. Malformed, out-of-range and misplaced frames (each
//! refused and its connection closed while a good client goes on), and requests and replies
//! past the frame limit (refused without breaking the connection).

use bytes::Bytes;
use oasis_rt::protocol::{
    encode_frame, BlockKey, Geometry, Hello, Message, ReadBlocks, StagedBlock, ALL_HEADS,
    PROTOCOL_VERSION,
};
use oasis_rt::transport::{Connection, Transport};
use oasis_rt::{Error, ErrorCode, ServerConfig};

use super::*;

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
