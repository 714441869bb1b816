//! The daemon's metrics, their exposition through the `prometheus-client` crate, and the tiny
//! HTTP/1.1 handler that serves them at `GET /metrics`.
//!
//! # Why `prometheus-client`
//! Of the two maintained Rust clients, `prometheus-client` is the Prometheus project's own
//! (github.com/prometheus/client_rust) and `prometheus` is TiKV's. This crate takes the former:
//! it writes the OpenMetrics text format that Prometheus negotiates by default (and whose
//! `_total`, `_bucket`, `# UNIT` and `# EOF` rules it applies for us), keeps no global registry
//! (one [`Registry`] per daemon, so two daemons in one test process do not share counters), has
//! no protobuf dependency, and its per-scrape registries fit the pool's numbers, which live in
//! the pool and are read once per scrape rather than mirrored into atomics.
//!
//! # Series
//! Every name starts with `oasis_rt_`. Counters (`_total`): `requests_total{kind}`,
//! `errors_total{code}`, `bytes_served_total`, `bytes_staged_total`, `bad_frames_total`,
//! `connections_total`, `connections_refused_total`, `handshake_timeouts_total`,
//! `evicted_requests_total`, `evicted_bytes_total`, `refused_stages_total`. Histogram:
//! `request_duration_seconds{kind}`. Gauges: `budget_bytes`, `used_bytes`, `live_requests`,
//! `expired_requests`, `staged_blocks`, `connections_active`, `connection_slots`. Every label
//! value (each request kind, each error code) is present from the start, at zero.
//!
//! Live counters are the client library's atomics (relaxed: a scrape is not a snapshot of one
//! instant); the pool's counters and gauges come from one [`StatsSnapshot`] per scrape.
//!
//! # The endpoint
//! [`serve_http`] reads one request head (bounded, with a deadline), answers and closes the
//! connection; it is deliberately not a web framework. `GET` and `HEAD /metrics` are served;
//! another method on `/metrics` is `405` with `Allow: GET, HEAD`; another path `404`. When the
//! daemon has a token, `/metrics` needs it as `Authorization: Bearer TOKEN` (`401` otherwise, the
//! token compared in constant time), as frame clients need it in their `Hello`.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::error::ErrorCode;
use crate::protocol::StatsSnapshot;

/// The prefix of every series name.
pub const PREFIX: &str = "oasis_rt";

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

/// The content type of the exposition (OpenMetrics text, what `prometheus-client` writes).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Largest HTTP request head the metrics handler reads.
const MAX_HTTP_HEAD: usize = 8192;
/// Deadline for a metrics client to send its request and read the reply (arbitrary).
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// Metrics connections served at once; past it a new one is closed at once (arbitrary: a
/// scraper or two, and room for a person with curl).
pub const MAX_HTTP_CONNECTIONS: usize = 64;

/// One label set of a family: `[("kind", "read_blocks")]`, `[("code", "busy")]`.
type Label = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Everything the daemon counts, registered in its own [`Registry`].
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// One counter per [`REQUEST_KINDS`] entry (handles into the registry's family).
    requests: Vec<Counter>,
    /// One histogram per [`REQUEST_KINDS`] entry.
    latency: Vec<Histogram>,
    /// One counter per [`ErrorCode::ALL`] entry.
    errors: Vec<Counter>,
    /// Payload bytes sent in replies (blocks, rows, sections).
    pub bytes_served: Counter,
    /// Frames refused as malformed (the connection was closed).
    pub bad_frames: Counter,
    pub connections_total: Counter,
    pub connections_active: Gauge<u64, AtomicU64>,
    /// Connections refused: handshake (token, version, timeout) or the connection limit.
    pub connections_refused: Counter,
    /// Connections closed because no whole `Hello` came within the handshake timeout.
    pub handshake_timeouts: Counter,
    /// The connection limit (`--max-connections`).
    pub connection_slots: Gauge<u64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Every series registered, every label value present at zero.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix(PREFIX);
        let requests = Family::<Label, Counter>::default();
        let latency =
            Family::<Label, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let errors = Family::<Label, Counter>::default();
        let m = Metrics {
            requests: REQUEST_KINDS
                .iter()
                .map(|k| requests.get_or_create_owned(&[("kind", *k)]))
                .collect(),
            latency: REQUEST_KINDS
                .iter()
                .map(|k| latency.get_or_create_owned(&[("kind", *k)]))
                .collect(),
            errors: ErrorCode::ALL
                .iter()
                .map(|c| errors.get_or_create_owned(&[("code", c.name())]))
                .collect(),
            bytes_served: Counter::default(),
            bad_frames: Counter::default(),
            connections_total: Counter::default(),
            connections_active: Gauge::default(),
            connections_refused: Counter::default(),
            handshake_timeouts: Counter::default(),
            connection_slots: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "requests served, by kind", requests);
        registry.register("errors", "error replies, by code", errors);
        registry.register_with_unit(
            "request_duration",
            "time from a decoded request to its reply written, by kind",
            Unit::Seconds,
            latency,
        );
        let counters = [
            (
                "bytes_served",
                "payload bytes sent in replies",
                &m.bytes_served,
            ),
            (
                "bad_frames",
                "malformed frames (connection closed)",
                &m.bad_frames,
            ),
            ("connections", "connections accepted", &m.connections_total),
            (
                "connections_refused",
                "connections refused (handshake, token, limit)",
                &m.connections_refused,
            ),
            (
                "handshake_timeouts",
                "connections closed for sending no hello within the handshake timeout",
                &m.handshake_timeouts,
            ),
        ];
        for (name, help, c) in counters {
            // A clone shares the value: the registry encodes what the daemon counts.
            registry.register(name, help, c.clone());
        }
        registry.register(
            "connections_active",
            "open connections",
            m.connections_active.clone(),
        );
        registry.register(
            "connection_slots",
            "the connection limit (--max-connections)",
            m.connection_slots.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Count one served request of `kind` (an index into [`REQUEST_KINDS`]) and its latency.
    pub fn observe(&self, kind: usize, latency: Duration) {
        if let (Some(c), Some(h)) = (self.requests.get(kind), self.latency.get(kind)) {
            c.inc();
            h.observe(latency.as_secs_f64());
        }
    }

    /// Count one error reply.
    pub fn error(&self, code: ErrorCode) {
        if let Some(i) = ErrorCode::ALL.iter().position(|c| *c == code) {
            self.errors[i].inc();
        }
    }

    pub fn requests_total(&self) -> u64 {
        self.requests.iter().map(Counter::get).sum()
    }

    pub fn errors_total(&self) -> u64 {
        self.errors.iter().map(Counter::get).sum()
    }

    /// The exposition (OpenMetrics text, [`CONTENT_TYPE`]): the live series, then the pool's
    /// from `pool`, then `# EOF`.
    pub fn render(&self, pool: &StatsSnapshot) -> String {
        let mut s = String::with_capacity(16 << 10);
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut s, &self.registry);
        let _ = encode_registry(&mut s, &pool_registry(pool));
        let _ = encode_eof(&mut s);
        s
    }
}

/// The pool's counters and gauges as of `pool`, in a registry of their own (built per scrape).
fn pool_registry(pool: &StatsSnapshot) -> Registry {
    let mut r = Registry::with_prefix(PREFIX);
    let counters = [
        (
            "bytes_staged",
            "bytes added to the staging pool",
            pool.bytes_staged,
        ),
        (
            "evicted_requests",
            "expired requests evicted",
            pool.evicted_requests,
        ),
        (
            "evicted_bytes",
            "bytes of expired requests evicted",
            pool.evicted_bytes,
        ),
        (
            "refused_stages",
            "stagings refused by the budget",
            pool.refused_stages,
        ),
    ];
    for (name, help, v) in counters {
        r.register(name, help, ConstCounter::new(v));
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
    ];
    for (name, help, v) in gauges {
        r.register(name, help, ConstGauge::new(v));
    }
    r
}

/// `expected == got`, in time independent of the bytes' content (the length is not secret
/// enough to hide).
pub(crate) fn token_matches(expected: &[u8], got: &[u8]) -> bool {
    expected.len() == got.len() && expected.iter().zip(got).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
}

/// What one request head asks for, as far as the handler cares.
#[derive(Debug, PartialEq, Eq)]
struct Head<'a> {
    method: &'a [u8],
    path: &'a [u8],
    /// The credentials of the first `Authorization: Bearer ...` header, if any.
    bearer: Option<&'a [u8]>,
}

/// Parse a request head (request line and headers); `None` when the request line is malformed.
fn parse_head(head: &[u8]) -> Option<Head<'_>> {
    let mut lines = head
        .split(|c| *c == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let mut parts = lines.next()?.split(|c| *c == b' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if method.is_empty() || !target.starts_with(b"/") || !version.starts_with(b"HTTP/") {
        return None;
    }
    // The path without its query string.
    let path = target.split(|c| *c == b'?').next().unwrap_or(target);
    let bearer = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| {
            let colon = l.iter().position(|c| *c == b':')?;
            let (name, value) = (&l[..colon], l[colon + 1..].trim_ascii());
            name.trim_ascii()
                .eq_ignore_ascii_case(b"authorization")
                .then_some(value)
        })
        .next()
        .and_then(|v| {
            let space = v.iter().position(|c| *c == b' ')?;
            v[..space]
                .eq_ignore_ascii_case(b"bearer")
                .then(|| v[space + 1..].trim_ascii())
        });
    Some(Head {
        method,
        path,
        bearer,
    })
}

/// The reply to one request head: status line, extra headers, body (`body()` only when it is
/// served).
fn respond(
    head: &[u8],
    token: Option<&[u8]>,
    body: impl FnOnce() -> String,
) -> (&'static str, String, String) {
    let text = |s: &str| s.to_string();
    let Some(h) = parse_head(head) else {
        return ("400 Bad Request", String::new(), text("bad request\n"));
    };
    if h.path != b"/metrics" {
        return ("404 Not Found", String::new(), text("not found\n"));
    }
    if h.method != b"GET" && h.method != b"HEAD" {
        return (
            "405 Method Not Allowed",
            "Allow: GET, HEAD\r\n".into(),
            text("method not allowed: GET /metrics\n"),
        );
    }
    if let Some(token) = token {
        if !h.bearer.is_some_and(|got| token_matches(token, got)) {
            return (
                "401 Unauthorized",
                "WWW-Authenticate: Bearer realm=\"oasis-rt\"\r\n".into(),
                text("unauthorized: send the daemon's token as Authorization: Bearer TOKEN\n"),
            );
        }
    }
    let ctype = format!("Content-Type: {CONTENT_TYPE}\r\n");
    ("200 OK", ctype, body())
}

/// Answer one HTTP connection (module docs): `GET /metrics` gets `body()`, with `token`'s
/// bearer check where the daemon has one.
pub async fn serve_http(
    mut stream: TcpStream,
    token: Option<&[u8]>,
    body: impl FnOnce() -> String,
) {
    let reply = tokio::time::timeout(HTTP_TIMEOUT, async {
        let mut head = Vec::with_capacity(1024);
        let mut chunk = [0u8; 1024];
        let mut too_large = false;
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            if head.len() + n > MAX_HTTP_HEAD {
                too_large = true;
                break;
            }
            head.extend_from_slice(&chunk[..n]);
        }
        let is_head = head.starts_with(b"HEAD ");
        let (status, headers, text) = if too_large {
            (
                "431 Request Header Fields Too Large",
                String::new(),
                "request head too large\n".to_string(),
            )
        } else {
            respond(&head, token, body)
        };
        let headers = if headers.contains("Content-Type") {
            headers
        } else {
            format!("{headers}Content-Type: text/plain\r\n")
        };
        let mut msg = format!(
            "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
            text.len()
        );
        if !is_head {
            msg.push_str(&text);
        }
        stream.write_all(msg.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
    if let Ok(Err(e)) = reply {
        tracing::debug!(error = %e, "metrics connection failed");
    }
}

/// Accept metrics connections until the future is dropped (which aborts the ones in flight);
/// at most [`MAX_HTTP_CONNECTIONS`] at once.
pub async fn run_http(
    listener: TcpListener,
    token: Option<Vec<u8>>,
    body: impl Fn() -> String + Clone + Send + 'static,
) {
    let token: Option<std::sync::Arc<[u8]>> = token.map(Into::into);
    let slots = std::sync::Arc::new(Semaphore::new(MAX_HTTP_CONNECTIONS));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "metrics connection limit reached, closing");
                    drop(stream);
                    continue;
                };
                let body = body.clone();
                let token = token.clone();
                tasks.spawn(async move {
                    serve_http(stream, token.as_deref(), body).await;
                    drop(permit);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_parse() {
        let h = parse_head(
            b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nauthorization:  bearer  t0k \r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            h,
            Head {
                method: b"GET",
                path: b"/metrics",
                bearer: Some(b"t0k"),
            }
        );
        // Only the first Authorization header counts; another scheme is no bearer token.
        let h = parse_head(b"GET /metrics HTTP/1.1\r\nAuthorization: Basic eDp5\r\nAuthorization: Bearer t\r\n\r\n")
            .unwrap();
        assert_eq!(h.bearer, None);
        // Headers after the blank line are body, not headers.
        let h = parse_head(b"GET /metrics HTTP/1.1\r\n\r\nAuthorization: Bearer t\r\n").unwrap();
        assert_eq!(h.bearer, None);
        for bad in [
            &b""[..],
            b"GET",
            b"GET metrics HTTP/1.1",
            b"GET /metrics",
            b" /metrics HTTP/1.1",
        ] {
            assert_eq!(parse_head(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn routes_methods_and_the_token() {
        let status = |head: &[u8], token: Option<&[u8]>| respond(head, token, || "body".into()).0;
        assert_eq!(status(b"GET /metrics HTTP/1.1\r\n\r\n", None), "200 OK");
        assert_eq!(status(b"HEAD /metrics HTTP/1.1\r\n\r\n", None), "200 OK");
        let (s, headers, _) = respond(b"POST /metrics HTTP/1.1\r\n\r\n", None, String::new);
        assert_eq!(
            (s, headers.as_str()),
            ("405 Method Not Allowed", "Allow: GET, HEAD\r\n")
        );
        assert_eq!(
            status(b"GET /other HTTP/1.1\r\n\r\n", None),
            "404 Not Found"
        );
        assert_eq!(status(b"garbage\r\n\r\n", None), "400 Bad Request");
        let t = Some(&b"s3cret"[..]);
        for (head, want) in [
            (&b"GET /metrics HTTP/1.1\r\n\r\n"[..], "401 Unauthorized"),
            (
                b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cre\r\n\r\n",
                "401 Unauthorized",
            ),
            (
                b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cretX\r\n\r\n",
                "401 Unauthorized",
            ),
            (
                b"GET /metrics HTTP/1.1\r\nAuthorization: s3cret\r\n\r\n",
                "401 Unauthorized",
            ),
            (
                b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n",
                "200 OK",
            ),
            // A wrong method is 405 whatever the token (nothing is served either way).
            (
                b"DELETE /metrics HTTP/1.1\r\n\r\n",
                "405 Method Not Allowed",
            ),
        ] {
            assert_eq!(status(head, t), want, "{}", String::from_utf8_lossy(head));
        }
        // The body is rendered only when it is served.
        let (_, _, body) = respond(b"GET /metrics HTTP/1.1\r\n\r\n", t, || panic!("rendered"));
        assert!(body.starts_with("unauthorized"), "{body}");
    }

    /// Every sample, `name{labels}` (labels sorted by name: the encoder's order is its own) to
    /// its value; each name at most once.
    fn samples(text: &str) -> std::collections::HashMap<String, f64> {
        let mut out = std::collections::HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let series = match series.split_once('{') {
                Some((name, labels)) => {
                    let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                    labels.sort_unstable();
                    format!("{name}{{{}}}", labels.join(","))
                }
                None => series.to_string(),
            };
            let old = out.insert(series, value.parse::<f64>().unwrap());
            assert!(old.is_none(), "{line} twice");
        }
        out
    }

    #[test]
    fn every_series_is_exposed_and_counters_move() {
        let m = Metrics::new();
        let pool = StatsSnapshot {
            budget_bytes: 1 << 30,
            used_bytes: 4096,
            bytes_staged: 8192,
            ..StatsSnapshot::default()
        };
        let text = m.render(&pool);
        assert!(text.ends_with("# EOF\n"), "{text}");
        let before = samples(&text);
        for kind in REQUEST_KINDS {
            assert_eq!(
                before[&format!("oasis_rt_requests_total{{kind=\"{kind}\"}}")],
                0.0
            );
            let count = format!("oasis_rt_request_duration_seconds_count{{kind=\"{kind}\"}}");
            assert_eq!(before[&count], 0.0);
            let inf =
                format!("oasis_rt_request_duration_seconds_bucket{{kind=\"{kind}\",le=\"+Inf\"}}");
            assert_eq!(before[&inf], 0.0);
        }
        for code in ErrorCode::ALL {
            let name = format!("oasis_rt_errors_total{{code=\"{}\"}}", code.name());
            assert_eq!(before[&name], 0.0);
        }
        for name in [
            "bytes_served_total",
            "bytes_staged_total",
            "bad_frames_total",
            "connections_total",
            "connections_refused_total",
            "handshake_timeouts_total",
            "evicted_requests_total",
            "evicted_bytes_total",
            "refused_stages_total",
            "budget_bytes",
            "used_bytes",
            "live_requests",
            "expired_requests",
            "staged_blocks",
            "connections_active",
            "connection_slots",
        ] {
            assert!(
                before.contains_key(&format!("oasis_rt_{name}")),
                "{name} in\n{text}"
            );
        }
        for (name, kind) in [
            ("requests", "counter"),
            ("request_duration_seconds", "histogram"),
            ("used_bytes", "gauge"),
            ("bytes_staged", "counter"),
        ] {
            assert!(
                text.contains(&format!("# TYPE oasis_rt_{name} {kind}\n")),
                "{name}: {text}"
            );
        }
        assert!(
            text.contains("# UNIT oasis_rt_request_duration_seconds seconds\n"),
            "{text}"
        );
        assert_eq!(before["oasis_rt_used_bytes"], 4096.0);
        assert_eq!(before["oasis_rt_bytes_staged_total"], 8192.0);
        assert_eq!(before["oasis_rt_budget_bytes"], (1u64 << 30) as f64);

        m.observe(5, Duration::from_micros(300));
        m.observe(5, Duration::from_secs(10));
        m.observe(99, Duration::from_secs(1)); // not a kind: ignored
        m.error(ErrorCode::Busy);
        m.bytes_served.inc_by(4096);
        m.connections_active.inc();
        let after = samples(&m.render(&pool));
        let rb = |s: &str| format!("oasis_rt_request_duration_seconds_{s}{{kind=\"read_blocks\"");
        assert_eq!(after["oasis_rt_requests_total{kind=\"read_blocks\"}"], 2.0);
        assert_eq!(after[&format!("{}}}", rb("count"))], 2.0);
        assert_eq!(after[&format!("{},le=\"0.00025\"}}", rb("bucket"))], 0.0);
        assert_eq!(after[&format!("{},le=\"0.0005\"}}", rb("bucket"))], 1.0);
        assert_eq!(after[&format!("{},le=\"2.5\"}}", rb("bucket"))], 1.0);
        assert_eq!(after[&format!("{},le=\"+Inf\"}}", rb("bucket"))], 2.0);
        assert!((after[&format!("{}}}", rb("sum"))] - 10.0003).abs() < 1e-9);
        assert_eq!(after["oasis_rt_errors_total{code=\"busy\"}"], 1.0);
        assert_eq!(after["oasis_rt_bytes_served_total"], 4096.0);
        assert_eq!(after["oasis_rt_connections_active"], 1.0);
        assert_eq!((m.requests_total(), m.errors_total()), (2, 1));
        // Nothing else moved.
        let others = [
            "oasis_rt_errors_total{code=\"busy\"}",
            "oasis_rt_bytes_served_total",
            "oasis_rt_connections_active",
        ];
        for (name, v) in &before {
            if !name.contains("kind=\"read_blocks\"") && !others.contains(&name.as_str()) {
                assert_eq!(after[name], *v, "{name} moved");
            }
        }
    }
}
