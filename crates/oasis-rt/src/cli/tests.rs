//! The flags of every subcommand: their names, defaults and bounds (clap's own errors), what
//! they become (the daemon's and a client's configuration, a bench plan), `--help` and
//! `--version` everywhere.

use super::*;
use clap::error::ErrorKind;
use clap::CommandFactory;
use oasis_rt::protocol::DEFAULT_MAX_FRAME_BYTES;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("oasis-rt").chain(args.iter().copied()))
}

fn serve_args(args: &[&str]) -> ServeArgs {
    match parse(&[&["serve"], args].concat()).unwrap().command {
        Command::Serve(a) => a,
        other => panic!("{other:?}"),
    }
}

fn bench_args(args: &[&str]) -> BenchArgs {
    match parse(&[&["bench", "--connect", "h:1"], args].concat())
        .unwrap()
        .command
    {
        Command::Bench(a) => a,
        other => panic!("{other:?}"),
    }
}

fn kind_of(args: &[&str]) -> ErrorKind {
    parse(args).unwrap_err().kind()
}

#[test]
fn clap_s_own_checks_of_the_command_definition() {
    Cli::command().debug_assert();
}

#[test]
fn sizes() {
    assert_eq!(parse_size("64GiB"), Ok(64 << 30));
    assert_eq!(parse_size("1000MB"), Ok(1_000_000_000));
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("8kib"), Ok(8192));
    assert!(parse_size("1.5GiB").is_err());
    assert!(parse_size("GiB").is_err());
    assert!(parse_size("99999999999TiB").is_err());
    assert!(parse_size("12XB").is_err());
    assert!(parse_budget("0").is_err());
    assert_eq!(parse_max_frame("4KiB"), Ok(4096));
    assert!(parse_max_frame("4095").is_err());
    assert!(parse_max_frame("2GiB").is_err());
}

#[test]
fn serve_defaults_are_the_daemon_s() {
    let a = serve_args(&[]);
    let c = server_config(&a).ok().unwrap();
    let d = ServerConfig::default();
    assert_eq!((c.listen.as_str(), c.metrics), (DEFAULT_LISTEN, None));
    assert_eq!(
        (c.budget_bytes, c.max_frame),
        (1 << 30, DEFAULT_MAX_FRAME_BYTES)
    );
    assert_eq!(
        (c.lease, c.idle_timeout),
        (Some(DEFAULT_LEASE), Some(DEFAULT_IDLE_TIMEOUT))
    );
    assert_eq!(c.handshake_timeout, DEFAULT_HANDSHAKE_TIMEOUT);
    assert_eq!(
        (c.max_connections, c.io_timeout),
        (d.max_connections, d.io_timeout)
    );
    assert_eq!(
        (a.log, a.transport, c.token),
        (LogLevel::Info, TransportArg::Tcp, None)
    );
}

#[test]
fn every_serve_flag_keeps_its_name_and_meaning() {
    // What python/oasiskv/staging_daemon.py passes, and the rest.
    let a = serve_args(&[
        "--listen",
        "127.0.0.1:0",
        "--memory",
        "256MiB",
        "--log",
        "warn",
        "--transport",
        "tcp",
        "--lease",
        "0",
        "--metrics",
        "127.0.0.1:9470",
        "--max-frame",
        "1MiB",
        "--idle-timeout-s",
        "60",
        "--handshake-timeout-s",
        "2",
        "--max-connections",
        "16",
    ]);
    let c = server_config(&a).ok().unwrap();
    assert_eq!(c.listen, "127.0.0.1:0");
    assert_eq!((c.budget_bytes, c.max_frame), (256 << 20, 1 << 20));
    assert_eq!(
        (c.lease, c.metrics.as_deref()),
        (None, Some("127.0.0.1:9470"))
    );
    assert_eq!(c.idle_timeout, Some(Duration::from_secs(60)));
    assert_eq!(c.handshake_timeout, Duration::from_secs(2));
    assert_eq!((c.max_connections, a.log), (16, LogLevel::Warn));
    // `--flag=value`, and the log level in any case (as tracing's parser took it).
    let a = serve_args(&["--memory=2GiB", "--lease=30", "--log=DEBUG"]);
    assert_eq!((a.memory, a.lease, a.log), (2 << 30, 30, LogLevel::Debug));
    assert_eq!(
        server_config(&a).ok().unwrap().lease,
        Some(Duration::from_secs(30))
    );
}

#[test]
fn bad_serve_values_are_clap_errors() {
    for (args, kind) in [
        (
            &["serve", "--memory", "lots"][..],
            ErrorKind::ValueValidation,
        ),
        (&["serve", "--memory", "0"], ErrorKind::ValueValidation),
        (
            &["serve", "--max-frame", "2GiB"],
            ErrorKind::ValueValidation,
        ),
        (&["serve", "--lease", "-1"], ErrorKind::UnknownArgument),
        (&["serve", "--lease", "ten"], ErrorKind::ValueValidation),
        (&["serve", "--log", "loud"], ErrorKind::InvalidValue),
        (&["serve", "--transport", "rdma"], ErrorKind::InvalidValue),
        (
            &["serve", "--idle-timeout-s", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["serve", "--idle-timeout-s", "86401"],
            ErrorKind::ValueValidation,
        ),
        (
            &["serve", "--handshake-timeout-s", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["serve", "--handshake-timeout-s", "301"],
            ErrorKind::ValueValidation,
        ),
        (
            &["serve", "--max-connections", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["serve", "--max-connections", "65537"],
            ErrorKind::ValueValidation,
        ),
        (&["serve", "--bogus", "1"], ErrorKind::UnknownArgument),
        (
            &["serve", "--listen", "a:1", "--listen", "b:1"],
            ErrorKind::ArgumentConflict,
        ),
        (&["serve", "--listen"], ErrorKind::InvalidValue),
    ] {
        assert_eq!(kind_of(args), kind, "{args:?}");
    }
    // Each bound is accepted.
    serve_args(&["--idle-timeout-s", "86400", "--handshake-timeout-s", "300"]);
    serve_args(&["--max-connections", "65536", "--max-frame", "1GiB"]);
}

#[test]
fn client_commands() {
    let Command::Stats(s) = parse(&[
        "stats",
        "--connect",
        "h:7470",
        "--token-file",
        "/t",
        "--timeout",
        "5",
        "--transport",
        "ucx",
    ])
    .unwrap()
    .command
    else {
        panic!()
    };
    assert_eq!(s.client.connect, "h:7470");
    assert_eq!(s.client.token_file.as_deref(), Some(Path::new("/t")));
    assert_eq!(
        (s.client.timeout, s.client.transport),
        (Some(5), TransportArg::Ucx)
    );
    let c = client_config(&ClientArgs {
        token_file: None,
        ..s.client
    })
    .ok()
    .unwrap();
    assert_eq!(c.request_timeout, Duration::from_secs(5));
    assert_eq!(c.connect_timeout, Duration::from_secs(5));
    for (args, kind) in [
        (&["stats"][..], ErrorKind::MissingRequiredArgument),
        (&["bench"], ErrorKind::MissingRequiredArgument),
        (
            &["stats", "--connect", "h:1", "--timeout", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["bench", "--connect", "h:1", "--batch", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["bench", "--connect", "h:1", "--batch", "65537"],
            ErrorKind::ValueValidation,
        ),
        (
            &["bench", "--connect", "h:1", "--repeats", "0"],
            ErrorKind::ValueValidation,
        ),
        (
            &["bench", "--connect", "h:1", "--total", "1.5GiB"],
            ErrorKind::ValueValidation,
        ),
        (
            &["bench", "--connect", "h:1", "--entries", "rows"],
            ErrorKind::InvalidValue,
        ),
        (
            &["bench", "--connect", "h:1", "--path", "dma"],
            ErrorKind::InvalidValue,
        ),
        (
            &["bench", "--connect", "h:1", "--block-bytes", "8KiB,x"],
            ErrorKind::ValueValidation,
        ),
        (&[], ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand),
        (&["frobnicate"], ErrorKind::InvalidSubcommand),
    ] {
        assert_eq!(kind_of(args), kind, "{args:?}");
    }
}

#[test]
fn bench_flags_make_the_plan() {
    assert_eq!(bench_args(&[]).plan(), BenchConfig::default());
    let a = bench_args(&[
        "--block-bytes",
        "8KiB,64KiB,16384",
        "--total",
        "2MiB",
        "--batch",
        "16",
        "--repeats",
        "2",
        "--path",
        "frames",
        "--entries",
        "head",
        "--json",
        "out.json",
    ]);
    let p = a.plan();
    assert_eq!(p.block_bytes, [8192, 65536, 16384]);
    assert_eq!((p.total_bytes, p.batch, p.repeats), (2 << 20, 16, 2));
    assert_eq!((p.rma, p.per_head), (Some(false), true));
    assert_eq!(a.json.as_deref(), Some(Path::new("out.json")));
    assert_eq!(bench_args(&["--path", "rma"]).plan().rma, Some(true));
}

#[test]
fn help_and_version_everywhere() {
    for args in [
        &["--help"][..],
        &["serve", "--help"],
        &["stats", "-h"],
        &["bench", "--help"],
        &["help", "serve"],
    ] {
        assert_eq!(kind_of(args), ErrorKind::DisplayHelp, "{args:?}");
    }
    for args in [
        &["--version"][..],
        &["serve", "--version"],
        &["bench", "-V"],
    ] {
        assert_eq!(kind_of(args), ErrorKind::DisplayVersion, "{args:?}");
    }
    let help = Cli::command()
        .find_subcommand_mut("serve")
        .unwrap()
        .render_long_help()
        .to_string();
    for flag in [
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
    ] {
        assert!(help.contains(flag), "{flag} in\n{help}");
    }
}
