//! The daemon's counters, and their Prometheus text exposition over a tiny HTTP/1.1 handler.
//!
//! Counters are relaxed atomics (each is independent; a scrape is not a snapshot of one
//! instant). The HTTP handler reads one request head (bounded, with a deadline), answers
//! `GET /metrics` and closes the connection; it is deliberately not a web framework.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::ErrorCode;
use crate::protocol::StatsSnapshot;

/// Request kinds the daemon serves, in metric label order.
pub const REQUEST_KINDS: [&str; 10] = [
    "hello",
    "stage_blocks",
    "stage_summaries",
    "stage_admission",
    "fetch_admission",
    "read_blocks",
    "release",
    "stats",
    "read_blocks_rma",
    "ack",
];

/// Upper bounds of the latency histogram buckets, in seconds (arbitrary, 50 µs to 2.5 s).
pub const LATENCY_BUCKETS: [f64; 13] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 2.5,
];

/// Largest HTTP request head the metrics handler reads.
const MAX_HTTP_HEAD: usize = 8192;
/// Deadline for a metrics client to send its request and read the reply (arbitrary).
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
}

/// Everything the daemon counts.
#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; REQUEST_KINDS.len()],
    latency: [Histogram; REQUEST_KINDS.len()],
    errors: [AtomicU64; ErrorCode::ALL.len()],
    /// Payload bytes sent in replies (blocks, rows, sections).
    pub bytes_served: AtomicU64,
    /// Frames refused as malformed (the connection was closed).
    pub bad_frames: AtomicU64,
    pub connections_total: AtomicU64,
    pub connections_active: AtomicU64,
    pub connections_refused: AtomicU64,
}

impl Metrics {
    /// Count one served request of `kind` (an index into [`REQUEST_KINDS`]) and its latency.
    pub fn observe(&self, kind: usize, latency: Duration) {
        if let (Some(c), Some(h)) = (self.requests.get(kind), self.latency.get(kind)) {
            c.fetch_add(1, Relaxed);
            h.observe(latency);
        }
    }

    /// Count one error reply.
    pub fn error(&self, code: ErrorCode) {
        if let Some(i) = ErrorCode::ALL.iter().position(|c| *c == code) {
            self.errors[i].fetch_add(1, Relaxed);
        }
    }

    pub fn requests_total(&self) -> u64 {
        self.requests.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub fn errors_total(&self) -> u64 {
        self.errors.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// The Prometheus text exposition (format 0.0.4), with the pool's gauges from `pool`.
    pub fn render(&self, pool: &StatsSnapshot) -> String {
        let mut s = String::with_capacity(8192);
        header(
            &mut s,
            "requests_total",
            "counter",
            "requests served, by kind",
        );
        for (k, c) in REQUEST_KINDS.iter().zip(&self.requests) {
            let _ = writeln!(
                s,
                "oasis_rt_requests_total{{kind=\"{k}\"}} {}",
                c.load(Relaxed)
            );
        }
        header(&mut s, "errors_total", "counter", "error replies, by code");
        for (c, n) in ErrorCode::ALL.iter().zip(&self.errors) {
            let _ = writeln!(
                s,
                "oasis_rt_errors_total{{code=\"{}\"}} {}",
                c.name(),
                n.load(Relaxed)
            );
        }
        header(
            &mut s,
            "request_duration_seconds",
            "histogram",
            "time from a decoded request to its reply written, by kind",
        );
        for (k, h) in REQUEST_KINDS.iter().zip(&self.latency) {
            let mut cumulative = 0;
            for (b, n) in LATENCY_BUCKETS.iter().zip(&h.buckets) {
                cumulative += n.load(Relaxed);
                let _ = writeln!(
                    s,
                    "oasis_rt_request_duration_seconds_bucket{{kind=\"{k}\",le=\"{b}\"}} {cumulative}"
                );
            }
            let count = h.count.load(Relaxed);
            let _ = writeln!(
                s,
                "oasis_rt_request_duration_seconds_bucket{{kind=\"{k}\",le=\"+Inf\"}} {count}"
            );
            let sum = h.sum_ns.load(Relaxed) as f64 * 1e-9;
            let _ = writeln!(
                s,
                "oasis_rt_request_duration_seconds_sum{{kind=\"{k}\"}} {sum}"
            );
            let _ = writeln!(
                s,
                "oasis_rt_request_duration_seconds_count{{kind=\"{k}\"}} {count}"
            );
        }
        let counters = [
            (
                "bytes_served_total",
                "payload bytes sent in replies",
                self.bytes_served.load(Relaxed),
            ),
            (
                "bytes_staged_total",
                "bytes added to the staging pool",
                pool.bytes_staged,
            ),
            (
                "bad_frames_total",
                "malformed frames (connection closed)",
                self.bad_frames.load(Relaxed),
            ),
            (
                "connections_total",
                "connections accepted",
                self.connections_total.load(Relaxed),
            ),
            (
                "connections_refused_total",
                "connections refused (handshake, token, limit)",
                self.connections_refused.load(Relaxed),
            ),
            (
                "evicted_requests_total",
                "expired requests evicted",
                pool.evicted_requests,
            ),
            (
                "evicted_bytes_total",
                "bytes of expired requests evicted",
                pool.evicted_bytes,
            ),
            (
                "refused_stages_total",
                "stagings refused by the budget",
                pool.refused_stages,
            ),
        ];
        for (name, help, v) in counters {
            header(&mut s, name, "counter", help);
            let _ = writeln!(s, "oasis_rt_{name} {v}");
        }
        let gauges = [
            ("budget_bytes", "staging budget", pool.budget_bytes),
            (
                "used_bytes",
                "staging bytes in use (accounted)",
                pool.used_bytes,
            ),
            (
                "live_requests",
                "staged requests within their lease",
                pool.live_requests,
            ),
            (
                "expired_requests",
                "staged requests past their lease",
                pool.expired_requests,
            ),
            ("staged_blocks", "blocks staged", pool.staged_blocks),
            (
                "connections_active",
                "open connections",
                self.connections_active.load(Relaxed),
            ),
        ];
        for (name, help, v) in gauges {
            header(&mut s, name, "gauge", help);
            let _ = writeln!(s, "oasis_rt_{name} {v}");
        }
        s
    }
}

fn header(s: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(
        s,
        "# HELP oasis_rt_{name} {help}\n# TYPE oasis_rt_{name} {kind}"
    );
}

/// Answer one HTTP connection: `GET /metrics` gets `body()`, anything else a 404 (or 400).
pub async fn serve_http(mut stream: TcpStream, body: impl FnOnce() -> String) {
    let reply = tokio::time::timeout(HTTP_TIMEOUT, async {
        let mut head = Vec::with_capacity(1024);
        let mut chunk = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut chunk).await?;
            if n == 0 || head.len() + n > MAX_HTTP_HEAD {
                break;
            }
            head.extend_from_slice(&chunk[..n]);
        }
        let line = head.split(|c| *c == b'\n').next().unwrap_or_default();
        let mut parts = line.split(|c| *c == b' ');
        let (method, path) = (parts.next(), parts.next());
        let (status, ctype, text) = match (method, path) {
            (Some(b"GET"), Some(b"/metrics")) => ("200 OK", "text/plain; version=0.0.4", body()),
            (Some(_), Some(p)) if p.starts_with(b"/") => ("404 Not Found", "text/plain", "not found\n".to_string()),
            _ => ("400 Bad Request", "text/plain", "bad request\n".to_string()),
        };
        let msg = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
        stream.write_all(msg.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
    if let Ok(Err(e)) = reply {
        tracing::debug!(error = %e, "metrics connection failed");
    }
}

/// Accept metrics connections until the future is dropped (which aborts the ones in flight).
pub async fn run_http(listener: TcpListener, body: impl Fn() -> String + Clone + Send + 'static) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((stream, _)) => {
                let body = body.clone();
                tasks.spawn(async move { serve_http(stream, body).await });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
