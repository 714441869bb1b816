//! The daemon over real loopback TCP: the shared bodies of `common` (round trips, concurrency,
//! the budget, a killed daemon, bad frames, the token, metrics and graceful shutdown, oversized
//! frames), plus what only a byte stream can do (stalled, closing and absent fake daemons;
//! frames cut inside their length prefix or body).

mod common;

use std::time::{Duration, Instant};

use common::*;
use oasis_rt::protocol::{encode_frame, HelloOk, Message};
use oasis_rt::transport::{read_frame, Connection, TcpConfig, TcpTransport};
use oasis_rt::{Client, ClientConfig, Error, ErrorCode, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn tcp() -> Net<TcpTransport> {
    Net {
        server: TcpTransport::default(),
        client: TcpTransport::default(),
    }
}

macro_rules! over_tcp {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            common::$name(&tcp()).await;
        }
    )*};
}

over_tcp!(
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
    silent_connections_lose_their_slot_at_the_handshake_timeout,
    idle_connections_are_closed_at_the_idle_timeout,
);

/// A hello cut short (inside its length prefix, or inside its body) holds the connection only
/// until the handshake timeout, not the 30 s I/O timeout: a slow sender cannot keep a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_cut_short_is_closed_at_the_handshake_timeout() {
    let limit = Duration::from_millis(300);
    let d = tcp()
        .start(ServerConfig {
            handshake_timeout: limit,
            ..ServerConfig::default()
        })
        .await;
    let hello = oasis_rt::protocol::Message::Hello(oasis_rt::protocol::Hello {
        version: oasis_rt::protocol::PROTOCOL_VERSION.into(),
        token: bytes::Bytes::new(),
    });
    let frame = encode_frame(1, &hello, 4096).unwrap();
    for cut in [2, 6, frame.len() - 1] {
        let mut s = TcpStream::connect(&d.addr).await.unwrap();
        let start = Instant::now();
        s.write_all(&frame[..cut]).await.unwrap();
        let body = read_frame(&mut s, 4096, Some(T), T)
            .await
            .expect("a refusal");
        let refusal = oasis_rt::protocol::decode_body(body, 4096).unwrap();
        match refusal.message {
            Message::Error(e) => assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}"),
            other => panic!("cut at {cut}: {other:?}"),
        }
        let mut rest = Vec::new();
        let n = tokio::time::timeout(T, s.read_to_end(&mut rest))
            .await
            .unwrap();
        assert_eq!(n.ok(), Some(0), "cut at {cut}: left open");
        let took = start.elapsed();
        assert!(
            took >= limit && took < limit + Duration::from_secs(2),
            "cut at {cut}: closed after {took:?}"
        );
    }
    d.settle(0).await;
}

/// A fake daemon: answers the handshake, then runs `after` on the stream.
async fn fake_daemon<F, Fut>(after: F) -> String
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let body = read_frame(&mut s, 4096, Some(T), T).await.unwrap();
        let hello = oasis_rt::protocol::decode_body(body, 4096).unwrap();
        let ok = Message::HelloOk(HelloOk {
            version: oasis_rt::protocol::PROTOCOL_VERSION.into(),
            max_frame: 1 << 20,
            rma: false,
        });
        s.write_all(&encode_frame(hello.seq, &ok, 1 << 20).unwrap())
            .await
            .unwrap();
        after(s).await;
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_closing_and_absent_daemons() {
    let short = ClientConfig {
        request_timeout: Duration::from_millis(300),
        ..cfg(None)
    };
    // Sends half a reply, then stalls: a timeout, on time.
    let addr = fake_daemon(|mut s| async move {
        let _ = read_frame(&mut s, 1 << 20, Some(T), T).await;
        let reply = Message::Released(oasis_rt::protocol::Released { freed_bytes: 1 });
        let f = encode_frame(1, &reply, 1 << 20).unwrap();
        s.write_all(&f[..f.len() / 2]).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let mut c = Client::connect(&addr, short.clone()).await.unwrap();
    let start = Instant::now();
    let err = c.release(1).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        start.elapsed() < Duration::from_millis(1000),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(c.stats().await, Err(Error::Closed)),
        "the broken connection was dropped"
    );

    // Closes in the middle of a reply: a typed error at once.
    let addr = fake_daemon(|mut s| async move {
        let _ = read_frame(&mut s, 1 << 20, Some(T), T).await;
        let reply = Message::Released(oasis_rt::protocol::Released { freed_bytes: 1 });
        let f = encode_frame(2, &reply, 1 << 20).unwrap();
        s.write_all(&f[..f.len() - 3]).await.unwrap();
    })
    .await;
    let mut c = Client::connect(&addr, short.clone()).await.unwrap();
    let err = c.release(1).await.unwrap_err();
    assert!(
        matches!(err, Error::Truncated { .. } | Error::Closed),
        "{err:?}"
    );

    // Never answers the handshake.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let hold = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    });
    let start = Instant::now();
    let err = Client::connect(&addr, short.clone()).await.err().unwrap();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(start.elapsed() < Duration::from_millis(1000));
    hold.abort();

    // Nobody there.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let err = Client::connect(&addr, short).await.err().unwrap();
    assert!(matches!(err, Error::Unreachable { .. }), "{err:?}");
    assert_eq!(err.code(), ErrorCode::Internal);
}

/// Bytes cut inside a frame on the stream: the daemon drops that connection, serves the others
/// and leaks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_cut_on_the_stream() {
    let io_timeout = Duration::from_millis(300);
    let net = Net {
        server: TcpTransport {
            config: TcpConfig {
                io_timeout,
                ..TcpConfig::default()
            },
        },
        client: TcpTransport::default(),
    };
    let d = net
        .start(ServerConfig {
            io_timeout,
            ..ServerConfig::default()
        })
        .await;
    let mut good = d.client().await;
    stage_request(&mut good, 1, 8).await;
    d.settle(1).await;
    let before = d.handle.stats();
    let frame = valid_stage_frame();
    // Half a frame, then the peer shuts its side (or stalls inside the frame, then goes).
    for close in [true, false] {
        let mut s = TcpStream::connect(&d.addr).await.unwrap();
        let hello = Message::Hello(oasis_rt::protocol::Hello {
            version: oasis_rt::protocol::PROTOCOL_VERSION.into(),
            token: bytes::Bytes::new(),
        });
        s.write_all(&encode_frame(1, &hello, 4096).unwrap())
            .await
            .unwrap();
        read_frame(&mut s, 4096, Some(T), T).await.unwrap();
        s.write_all(&frame[..frame.len() / 2]).await.unwrap();
        if close {
            s.shutdown().await.unwrap();
        }
        // Either way the daemon closes it: on EOF at once, when stalled after its I/O timeout.
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut buf))
            .await
            .expect("not closed");
    }
    // Only the prefix of a frame before the handshake, then the first bytes of a prefix.
    let mut s = TcpStream::connect(&d.addr).await.unwrap();
    s.write_all(&(1u32 << 20).to_le_bytes()).await.unwrap();
    let body = read_frame(&mut s, 4096, Some(T), T).await.unwrap();
    let reply = oasis_rt::protocol::decode_body(body, 4096).unwrap();
    assert!(
        matches!(reply.message, Message::Error(ref e) if e.code == ErrorCode::Unauthorized),
        "{reply:?}"
    );
    let mut s = TcpStream::connect(&d.addr).await.unwrap();
    s.write_all(&[8, 0]).await.unwrap();
    drop(s);
    d.settle(1).await;
    let after = d.handle.stats();
    assert_eq!(after.used_bytes, before.used_bytes);
    assert_eq!(after.staged_blocks, before.staged_blocks);
    d.handle.audit().unwrap();
    let got = good
        .read_blocks(vec![oasis_rt::protocol::BlockKey {
            request: 1,
            layer: 2,
            block: 3,
            head: oasis_rt::protocol::ALL_HEADS,
        }])
        .await
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &block(1, 2, 3).data);
}

/// Over TCP the daemon offers no RMA reads: `hello_ok.rma` is 0, the client says so without
/// asking, and a `ReadBlocksRma` sent anyway is refused while the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_reads_are_refused_over_tcp() {
    use oasis_rt::protocol::{BlockKey, ReadBlocksRma, ALL_HEADS};
    let net = tcp();
    let d = net.start(ServerConfig::default()).await;
    let mut c = d.client().await;
    assert!(!c.rma());
    stage_request(&mut c, 1, 2).await;
    let key = BlockKey {
        request: 1,
        layer: 0,
        block: 0,
        head: ALL_HEADS,
    };
    let err = c.read_blocks_rma(vec![key]).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    let mut s = raw(&net, &d.addr, b"").await;
    let m = Message::ReadBlocksRma(ReadBlocksRma {
        lease: 1,
        keys: vec![key],
    });
    s.send_frame(&encode_frame(2, &m, 4096).unwrap())
        .await
        .unwrap();
    let reply = recv(&mut s).await.unwrap().message;
    assert!(
        matches!(&reply, Message::Error(e) if e.code == ErrorCode::BadRequest),
        "{reply:?}"
    );
    assert_eq!(
        c.read_blocks(vec![key]).await.unwrap()[0],
        Ok(block(1, 0, 0).data)
    );
    d.handle.audit().unwrap();
}
