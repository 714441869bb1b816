//! Bodies: the metrics endpoint (its samples, methods and paths, and the bearer token when the
//! daemon has one) and graceful shutdown (run returns, clients and scrapers see it closed).

use oasis_rt::protocol::{BlockKey, ALL_HEADS};
use oasis_rt::transport::Transport;
use oasis_rt::{Error, Server, ServerConfig};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::*;

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
