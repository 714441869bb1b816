//! The `oasis-rt` binary: help and version, refusals, `serve` + `stats`, the token (frames and
//! `/metrics`), the handshake timeout, SIGTERM, `bench` (and against a small budget).

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_oasis-rt");

#[test]
fn non_loopback_without_a_token_exits_with_an_error() {
    for addr in ["0.0.0.0:0", "[::]:0"] {
        let out = Command::new(BIN)
            .args(["serve", "--listen", addr, "--memory", "1GiB"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{addr}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains("token") && err.contains(addr), "{err}");
    }
}

#[test]
fn help_and_version_on_the_binary_and_each_subcommand() {
    for (args, needles) in [
        (
            &["--help"][..],
            &["serve", "stats", "bench", "--version"][..],
        ),
        (&["help"], &["serve", "stats", "bench"]),
        (
            &["serve", "--help"],
            &[
                "--listen",
                "--memory",
                "--token-file",
                "--metrics",
                "--lease",
                "--max-frame",
                "--log",
                "--transport",
                "--idle-timeout-s",
                "--handshake-timeout-s",
                "--max-connections",
                "[default: 3600]",
                "[default: 1024]",
            ],
        ),
        (&["serve", "-h"], &["--idle-timeout-s"]),
        (&["stats", "--help"], &["--connect", "--timeout"]),
        (
            &["bench", "--help"],
            &[
                "--block-bytes",
                "--total",
                "--batch",
                "--repeats",
                "--path",
                "--entries",
                "--json",
            ],
        ),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for n in needles {
            assert!(text.contains(n), "{args:?}: {n} in\n{text}");
        }
    }
    // clap names a subcommand's version `oasis-rt-serve 0.1.0`.
    for (args, name) in [
        (&["--version"][..], "oasis-rt"),
        (&["-V"], "oasis-rt"),
        (&["serve", "--version"], "oasis-rt-serve"),
        (&["bench", "-V"], "oasis-rt-bench"),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION")),
            "{args:?}"
        );
    }
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["serve", "--memory", "lots"][..],
        &["serve", "--bogus", "1"],
        &["serve", "--idle-timeout-s", "0"],
        &["serve", "--idle-timeout-s", "86401"],
        &["serve", "--handshake-timeout-s", "0"],
        &["serve", "--max-connections", "0"],
        &["serve", "--log", "loud"],
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
        ],
        &["stats"],
        &["stats", "--connect", "127.0.0.1:1", "--timeout", "soon"],
        &["bench"],
        &["bench", "--connect", "127.0.0.1:1", "--batch", "0"],
        &["bench", "--connect", "127.0.0.1:1", "--total", "0"],
        &["bench", "--connect", "127.0.0.1:1", "--entries", "rows"],
        &[],
        &["frobnicate"],
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        // clap's format: an `error:` line (or, with no command at all, the help), on stderr.
        let err = String::from_utf8_lossy(&out.stderr);
        let want = if args.is_empty() { "Usage:" } else { "error:" };
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
    let out = Command::new(BIN)
        .args(["serve", "--token-file", "/nonexistent/token"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("token file"));
}

#[test]
fn serve_stats_token_and_sigterm() {
    serve_stats_token_and_sigterm_over("tcp");
}

/// The same over UCX (feature `ucx`); without libucp it says so and passes, unless
/// `OASIS_REQUIRE_UCX=1`.
#[cfg(feature = "ucx")]
#[test]
fn serve_stats_token_and_sigterm_over_ucx() {
    if let Err(e) = oasis_rt::ucx::probe() {
        let required = std::env::var("OASIS_REQUIRE_UCX").is_ok_and(|v| v == "1");
        assert!(!required, "OASIS_REQUIRE_UCX=1: {e}");
        eprintln!("SKIPPED (no UCX): {e}");
        return;
    }
    serve_stats_token_and_sigterm_over("ucx");
}

/// Without the feature, `--transport ucx` is refused with a line saying how to get it.
#[cfg(not(feature = "ucx"))]
#[test]
fn ucx_needs_the_feature() {
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--transport", "ucx"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--features ucx"), "{err}");
}

fn serve_stats_token_and_sigterm_over(transport: &str) {
    let dir = std::env::temp_dir().join(format!("oasis-rt-cli-{transport}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "correct horse\n").unwrap();
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "battery staple\n").unwrap();

    let (child, addr) = spawn_serve(
        transport,
        "64MiB",
        &["--token-file".as_ref(), token.as_ref()],
    );
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let stats = |t: &std::path::Path| {
        Command::new(BIN)
            .args([
                "stats",
                "--connect",
                &addr,
                "--timeout",
                "5",
                "--transport",
                transport,
                "--token-file",
            ])
            .arg(t)
            .output()
            .unwrap()
    };
    let out = stats(&token);
    assert!(out.status.success(), "{out:?}");
    if transport == "ucx" {
        // The other transport does not reach a UCX daemon.
        let out = Command::new(BIN)
            .args(["stats", "--connect", &addr, "--timeout", "2"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("budget_bytes {}", 64u64 << 20)),
        "{text}"
    );
    assert!(text.contains("used_bytes 0"), "{text}");
    let out = stats(&wrong);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthorized"));

    // SIGTERM: a clean exit, promptly.
    terminate(child);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `oasis-rt serve` on a loopback port of its choosing with a `memory` budget, and the address it
/// printed.
fn spawn_serve(transport: &str, memory: &str, extra: &[&OsStr]) -> (Child, String) {
    let (child, mut lines) = spawn_serve_lines(transport, memory, extra);
    (child, lines.remove(0))
}

/// As [`spawn_serve`], with the address of every line the daemon printed before serving (the
/// frames' address, then the metrics' where `--metrics` was given).
fn spawn_serve_lines(transport: &str, memory: &str, extra: &[&OsStr]) -> (Child, Vec<String>) {
    let metrics = extra.iter().any(|a| *a == "--metrics");
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--memory",
            memory,
            "--log",
            "warn",
            "--transport",
            transport,
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let mut addrs = vec![line
        .trim()
        .strip_prefix("oasis-rt listening on ")
        .expect(&line)
        .to_string()];
    if metrics {
        line.clear();
        out.read_line(&mut line).unwrap();
        let m = line.trim().strip_prefix("oasis-rt metrics on http://");
        addrs.push(m.expect(&line).trim_end_matches("/metrics").to_string());
    }
    (child, addrs)
}

/// One HTTP/1.1 GET of `/metrics` with `headers`; the whole reply.
fn get_metrics(addr: &str, headers: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n{headers}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The flags of finding 6 reach the daemon: `/metrics` needs the token, a silent connection is
/// closed at `--handshake-timeout-s`, `--max-connections` is the slot count.
#[test]
fn metrics_token_and_connection_flags() {
    let dir = std::env::temp_dir().join(format!("oasis-rt-cli-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "correct horse\n").unwrap();
    let (child, addrs) = spawn_serve_lines(
        "tcp",
        "64MiB",
        &[
            "--token-file".as_ref(),
            token.as_ref(),
            "--metrics".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--handshake-timeout-s".as_ref(),
            "1".as_ref(),
            "--idle-timeout-s".as_ref(),
            "30".as_ref(),
            "--max-connections".as_ref(),
            "7".as_ref(),
        ],
    );
    let (addr, maddr) = (&addrs[0], &addrs[1]);
    let r = get_metrics(maddr, "");
    assert!(r.starts_with("HTTP/1.1 401"), "{r}");
    let r = get_metrics(maddr, "Authorization: Bearer correct horse\r\n");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("\noasis_rt_connection_slots 7\n"), "{r}");
    // A connection that sends nothing: refused and closed after about a second.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let start = Instant::now();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}"
    );
    assert!(!rest.is_empty(), "no refusal frame");
    let r = get_metrics(maddr, "Authorization: Bearer correct horse\r\n");
    assert!(r.contains("\noasis_rt_handshake_timeouts_total 1\n"), "{r}");
    terminate(child);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Against a budget smaller than the request, `bench` names the request's size (what the
/// daemon would account for all of `--total`), not one staging frame's (finding 6).
#[test]
fn bench_against_a_small_budget_names_the_request_s_size() {
    let (child, addr) = spawn_serve("tcp", "1MiB", &[]);
    let out = Command::new(BIN)
        .args(["bench", "--connect", &addr, "--block-bytes", "8KiB"])
        .args(["--total", "64MiB", "--repeats", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    // 8192 blocks of 8 KiB and their overheads; a staging frame is at most 4 MiB.
    let whole = 512 + 8192 * (8192 + 64);
    assert!(
        err.contains(&format!("a request of {whole} bytes")),
        "{err}"
    );
    assert!(
        err.contains("budget of 1048576 bytes") && err.contains("lower --total"),
        "{err}"
    );
    let out = Command::new(BIN)
        .args(["stats", "--connect", &addr])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("bytes_staged 0"), "nothing staged: {text}");
    terminate(child);
}

/// SIGTERM, then a clean exit within 10 s.
fn terminate(mut child: Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            assert!(s.success(), "{s:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bench_prints_a_table_and_writes_json() {
    bench_over("tcp");
}

/// The same over UCX, where the blocks come by RMA (feature `ucx`; skipped without libucp
/// unless `OASIS_REQUIRE_UCX=1`).
#[cfg(feature = "ucx")]
#[test]
fn bench_over_ucx_reads_by_rma() {
    if let Err(e) = oasis_rt::ucx::probe() {
        let required = std::env::var("OASIS_REQUIRE_UCX").is_ok_and(|v| v == "1");
        assert!(!required, "OASIS_REQUIRE_UCX=1: {e}");
        eprintln!("SKIPPED (no UCX): {e}");
        return;
    }
    bench_over("ucx");
}

fn bench_over(transport: &str) {
    let (child, addr) = spawn_serve(transport, "64MiB", &[]);
    let json = std::env::temp_dir().join(format!(
        "oasis-rt-bench-{transport}-{}.json",
        std::process::id()
    ));
    let out = Command::new(BIN)
        .args([
            "bench",
            "--connect",
            &addr,
            "--transport",
            transport,
            "--timeout",
            "10",
            "--block-bytes",
            "8KiB,64KiB",
            "--total",
            "2MiB",
            "--batch",
            "16",
            "--repeats",
            "2",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let path = if transport == "ucx" { "rma" } else { "frames" };
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("block_bytes"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for (row, (bytes, blocks)) in rows.iter().zip([("8192", "256"), ("65536", "32")]) {
        assert_eq!(row.len(), 9, "{text}");
        assert_eq!(&row[..4], [bytes, blocks, path, "block"], "{text}");
        for v in &row[4..] {
            assert!(v.parse::<f64>().is_ok_and(|v| v > 0.0), "{text}");
        }
    }
    let j = std::fs::read_to_string(&json).unwrap();
    for needle in [
        format!("\"transport\": \"{transport}\""),
        format!("\"rma\": {}", transport == "ucx"),
        "\"block_bytes\": 8192, \"blocks\": 256, \"batch\": 16, \"repeats\": 2".into(),
        "\"block_bytes\": 65536, \"blocks\": 32".into(),
        "\"read_gbps_median\": ".into(),
        "\"stage_gbps_median\": ".into(),
        "\"memcpy_one_copy_gbps\": ".into(),
    ] {
        assert!(j.contains(&needle), "{needle} in {j}");
    }
    assert!(!j.contains("null"), "{j}");
    // Nothing left on the daemon.
    let out = Command::new(BIN)
        .args(["stats", "--connect", &addr, "--transport", transport])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("used_bytes 0"),
        "{out:?}"
    );
    // A block size that is no multiple of 8 KiB: a usage error, before any connection.
    let out = Command::new(BIN)
        .args(["bench", "--connect", &addr, "--block-bytes", "8KiB,12345"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 8192"));
    terminate(child);
    let _ = std::fs::remove_file(&json);
}
