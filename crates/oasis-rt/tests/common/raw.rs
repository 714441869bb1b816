//! Talking to the real daemon below the [`Client`](oasis_rt::Client): raw frames (a
//! hand-made hello, one frame back, a refusal that closes the connection, a valid frame to
//! patch) and raw HTTP to the metrics endpoint (with its samples parsed).

use bytes::Bytes;
use oasis_rt::protocol::{
    encode_frame, Frame, Hello, Message, StageBlocks, HARD_MAX_FRAME_BYTES, PROTOCOL_VERSION,
};
use oasis_rt::transport::{Connection, Transport};
use oasis_rt::{Error, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{block, geometry, Net, T};

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
