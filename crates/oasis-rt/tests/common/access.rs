//! Bodies: who may connect and for how long. The token (and the protocol version) in the
//! hello, non-loopback addresses that need a token, connections that never say hello (the
//! handshake timeout, the connection limit) and connections that go quiet (the idle timeout).

use std::time::{Duration, Instant};

use bytes::Bytes;
use oasis_rt::protocol::{encode_frame, Hello, Message, PROTOCOL_VERSION};
use oasis_rt::transport::{Connection, Transport};
use oasis_rt::{Error, ErrorCode, Server, ServerConfig};

use super::*;

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
