//! The `oasis-rt` binary: `serve` runs the staging daemon, `stats` asks a running one, `bench`
//! measures its block reads against a host memcpy (the logic is `oasis_rt::bench`).
//!
//! The command line is [`Cli`], parsed by `clap` (derive): `--help` and `--version` on the
//! binary and on each subcommand, clap's errors (exit 2) for unknown flags and bad values.
//! Checks that need more than one flag (a bench plan, the token file) end the same way: one
//! `error:` line and exit 2. Failures at run time exit 1.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use oasis_rt::bench::{self, BenchConfig};
use oasis_rt::protocol::{
    HARD_MAX_FRAME_BYTES, MAX_ENTRIES, MAX_TOKEN_BYTES, PREAUTH_MAX_FRAME_BYTES,
};
use oasis_rt::server::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_LEASE, DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS,
};
use oasis_rt::transport::{RmaConnection, TransportKind};
use oasis_rt::{Client, ClientConfig, Error, ErrorCode, Server, ServerConfig};

/// Longest `--idle-timeout-s` (a day; arbitrary bound: a longer idle connection is a leak).
const MAX_IDLE_TIMEOUT_S: u64 = 86_400;
/// Longest `--handshake-timeout-s` (arbitrary: a hello is one small frame).
const MAX_HANDSHAKE_TIMEOUT_S: u64 = 300;
/// Most `--max-connections` (arbitrary: each is a task and a socket; file limits bite first).
const MAX_CONNECTIONS: u64 = 65_536;
/// Longest `--timeout` of the client commands (a day; arbitrary).
const MAX_CLIENT_TIMEOUT_S: u64 = 86_400;
/// Most `--repeats` of `bench` (arbitrary).
const MAX_REPEATS: u64 = 10_000;

/// OasisKV's KV staging daemon, its counters, and its block-read benchmark.
#[derive(Parser, Debug)]
#[command(name = "oasis-rt", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the KV staging daemon (stops on SIGINT/SIGTERM).
    ///
    /// Prints `oasis-rt listening on ADDR` (and `oasis-rt metrics on http://ADDR/metrics`) on
    /// stdout once bound; logs go to stderr. A non-loopback --listen or --metrics address
    /// requires --token-file (a shared secret every client presents, and /metrics requires as
    /// `Authorization: Bearer TOKEN`). Without a token any local process may connect: keep
    /// --max-connections and --idle-timeout-s to what your engines need.
    Serve(ServeArgs),
    /// Print a running daemon's counters, one `name value` per line.
    Stats(StatsArgs),
    /// Measure a running daemon's block reads against a host memcpy of the same bytes.
    ///
    /// Stages --total bytes of each --block-bytes size (multiples of 8KiB: one KV head of a
    /// 16-token block, head_dim 128, bf16), reads them back --repeats times in batches of
    /// --batch blocks (by RMA over ucx where the daemon offers it, in reply frames otherwise),
    /// copies the same bytes host to host in the same run, prints the median GB/s of each and
    /// their ratio, and releases what it staged.
    Bench(BenchArgs),
}

/// The transports: `tcp`, or `ucx` (frames over UCX, libucp loaded at run time; needs a build
/// with feature `ucx`; UCX_TLS etc. choose UCX's transports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// TCP (tokio).
    #[default]
    Tcp,
    /// UCX: libucp loaded at run time, in a build with feature `ucx`.
    Ucx,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    fn level(self) -> tracing::Level {
        match self {
            LogLevel::Error => tracing::Level::ERROR,
            LogLevel::Warn => tracing::Level::WARN,
            LogLevel::Info => tracing::Level::INFO,
            LogLevel::Debug => tracing::Level::DEBUG,
            LogLevel::Trace => tracing::Level::TRACE,
        }
    }
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Where to listen (HOST:PORT; port 0 picks a free one).
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub listen: String,
    /// The staging budget (e.g. 64GiB): bytes of blocks, summaries and sections held at once.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_budget)]
    pub memory: u64,
    /// A file holding the shared token (1..=256 bytes, surrounding whitespace ignored).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Seconds after which an untouched request may be evicted under memory pressure (0: never).
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_LEASE.as_secs())]
    pub lease: u64,
    /// The largest frame either side may send (4KiB..=1GiB).
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_max_frame)]
    pub max_frame: u32,
    /// Log level (to stderr).
    #[arg(
        long,
        value_enum,
        value_name = "LEVEL",
        default_value_t,
        ignore_case = true
    )]
    pub log: LogLevel,
    /// The frame transport.
    #[arg(long, value_enum, default_value_t)]
    pub transport: TransportArg,
    /// Seconds an authenticated connection may sit between frames before it is closed.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=MAX_IDLE_TIMEOUT_S),
    )]
    pub idle_timeout_s: u64,
    /// Seconds a new connection has to send its whole hello before it is closed.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = DEFAULT_HANDSHAKE_TIMEOUT.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=MAX_HANDSHAKE_TIMEOUT_S),
    )]
    pub handshake_timeout_s: u64,
    /// Connections served at once; past it a new one is answered `busy` and closed.
    #[arg(
        long,
        value_name = "N",
        default_value_t = DEFAULT_MAX_CONNECTIONS as u64,
        value_parser = clap::value_parser!(u64).range(1..=MAX_CONNECTIONS),
    )]
    pub max_connections: u64,
}

/// How `stats` and `bench` reach the daemon.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// The daemon's address.
    #[arg(long, value_name = "HOST:PORT")]
    pub connect: String,
    /// A file holding the daemon's token.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Seconds to connect, and for each request [default: 5 to connect, 30 per request].
    #[arg(
        long,
        value_name = "SECS",
        value_parser = clap::value_parser!(u64).range(1..=MAX_CLIENT_TIMEOUT_S),
    )]
    pub timeout: Option<u64>,
    /// The frame transport (the daemon's).
    #[arg(long, value_enum, default_value_t)]
    pub transport: TransportArg,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
}

/// How `bench` gets the blocks back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ReadPath {
    /// RMA where the connection offers it (ucx), reply frames otherwise.
    #[default]
    Auto,
    /// RMA only (refused where the connection has none).
    Rma,
    /// Inside reply frames, even over ucx.
    Frames,
}

/// What one `bench` read entry is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Entries {
    /// A whole block.
    #[default]
    Block,
    /// One KV head of a block (K rows then V rows), as a decode engine reads its misses.
    Head,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Block sizes, comma-separated, each a multiple of 8KiB.
    #[arg(
        long,
        value_name = "SIZES",
        value_delimiter = ',',
        default_value = "8KiB,64KiB",
        value_parser = parse_size,
    )]
    pub block_bytes: Vec<u64>,
    /// Bytes staged and read per pass, per block size.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_size)]
    pub total: u64,
    /// Keys per read call.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(1..=MAX_ENTRIES as u64),
    )]
    pub batch: u64,
    /// Timed passes (reads and memcpy each).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..=MAX_REPEATS),
    )]
    pub repeats: u64,
    /// How the blocks come back.
    #[arg(long, value_enum, default_value_t)]
    pub path: ReadPath,
    /// What one read entry is.
    #[arg(long, value_enum, default_value_t)]
    pub entries: Entries,
    /// Also write every pass as JSON here.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

impl BenchArgs {
    fn plan(&self) -> BenchConfig {
        BenchConfig {
            block_bytes: self.block_bytes.clone(),
            total_bytes: self.total,
            batch: self.batch as usize,
            repeats: self.repeats as usize,
            rma: match self.path {
                ReadPath::Auto => None,
                ReadPath::Rma => Some(true),
                ReadPath::Frames => Some(false),
            },
            per_head: self.entries == Entries::Head,
        }
    }
}

/// `64GiB`, `1000MB`, `4096`: a whole number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB,
/// GB, TB; any case). `1.5GiB` is refused.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad size '{s}' (a whole number and a unit, e.g. 64GiB)"))?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "bad size unit in '{s}' (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size '{s}' too large"))
}

fn parse_budget(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("the staging budget must be positive".into()),
        n => Ok(n),
    }
}

fn parse_max_frame(s: &str) -> Result<u32, String> {
    let n = parse_size(s)?;
    let (lo, hi) = (PREAUTH_MAX_FRAME_BYTES, HARD_MAX_FRAME_BYTES);
    match u32::try_from(n) {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("must be within {lo}..={hi} bytes (4KiB..=1GiB)")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // clap's format and exit code (2), as for the flags it checks itself, with the
        // subcommand's usage line.
        Err(Failure::Usage(sub, m)) => {
            let mut cli = Cli::command();
            cli.build();
            match cli.find_subcommand_mut(sub) {
                Some(cmd) => cmd.error(ErrorKind::ValueValidation, m).exit(),
                None => cli.error(ErrorKind::ValueValidation, m).exit(),
            }
        }
        Err(Failure::Config(m)) => {
            eprintln!("oasis-rt: error: {m}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(m)) => {
            eprintln!("oasis-rt: error: {m}");
            ExitCode::from(1)
        }
    }
}

/// Why a command failed: a mistake in the command line (exit 2, clap's format), a
/// configuration the daemon or this build refuses (exit 2), or a failure at run time (exit 1).
#[derive(Debug)]
enum Failure {
    /// The subcommand, and what is wrong with its flags.
    Usage(&'static str, String),
    Config(String),
    Runtime(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(m) => Failure::Config(m),
            e => Failure::Runtime(e.to_string()),
        }
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Serve(a) => serve(&a),
        Command::Stats(a) => stats(&a),
        Command::Bench(a) => bench(&a),
    }
}

fn transport_kind(t: TransportArg) -> Result<TransportKind, Failure> {
    match t {
        TransportArg::Tcp => Ok(TransportKind::Tcp),
        TransportArg::Ucx if cfg!(feature = "ucx") => Ok(TransportKind::Ucx),
        TransportArg::Ucx => Err(Failure::Config(
            "this oasis-rt was built without UCX: rebuild with `cargo build --features ucx`".into(),
        )),
    }
}

#[cfg(feature = "ucx")]
fn ucx_transport(
    io_timeout: Duration,
    connect_timeout: Duration,
    max_frame: u32,
) -> Result<oasis_rt::UcxTransport, Failure> {
    oasis_rt::UcxTransport::new(oasis_rt::UcxConfig {
        io_timeout,
        connect_timeout,
        max_frame,
    })
    .map_err(|e| Failure::Runtime(e.to_string()))
}

fn read_token(path: &Path) -> Result<Vec<u8>, Failure> {
    let shown = path.display();
    let raw = std::fs::read(path)
        .map_err(|e| Failure::Config(format!("cannot read token file {shown}: {e}")))?;
    let token = raw.trim_ascii().to_vec();
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(Failure::Config(format!(
            "token file {shown} must hold 1..={MAX_TOKEN_BYTES} bytes"
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(path) {
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %shown, "token file is readable by others (chmod 600)");
            }
        }
    }
    Ok(token)
}

/// The daemon's configuration from `serve`'s flags (the token file read).
fn server_config(a: &ServeArgs) -> Result<ServerConfig, Failure> {
    Ok(ServerConfig {
        listen: a.listen.clone(),
        metrics: a.metrics.clone(),
        budget_bytes: a.memory,
        token: a.token_file.as_deref().map(read_token).transpose()?,
        max_frame: a.max_frame,
        lease: (a.lease > 0).then(|| Duration::from_secs(a.lease)),
        idle_timeout: Some(Duration::from_secs(a.idle_timeout_s)),
        handshake_timeout: Duration::from_secs(a.handshake_timeout_s),
        max_connections: a.max_connections as usize,
        ..ServerConfig::default()
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Runtime(format!("cannot start the runtime: {e}")))
}

fn serve(a: &ServeArgs) -> Result<(), Failure> {
    let kind = transport_kind(a.transport)?;
    tracing_subscriber::fmt()
        .with_max_level(a.log.level())
        .with_writer(std::io::stderr)
        .init();
    let config = server_config(a)?;
    let rt = runtime()?;
    match kind {
        TransportKind::Tcp => rt.block_on(async move {
            let server = Server::bind(config).await?;
            run_server(server, "tcp").await
        })?,
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => {
            let transport = ucx_transport(
                config.io_timeout,
                oasis_rt::transport::DEFAULT_CONNECT_TIMEOUT,
                config.max_frame,
            )?;
            let served = rt.block_on(async {
                let server = Server::bind_with(&transport, config).await?;
                run_server(server, "ucx").await
            });
            // UCX goes down before the process exits (not under its running thread).
            drop(rt);
            transport.shutdown_blocking();
            served?
        }
        #[cfg(not(feature = "ucx"))]
        TransportKind::Ucx => unreachable!("refused by transport_kind"),
    }
    Ok(())
}

async fn run_server<L: oasis_rt::transport::Listener>(
    server: Server<L>,
    transport: &str,
) -> oasis_rt::Result<()> {
    // One line on stdout for scripts (the port is real when --listen asked for port 0).
    println!("oasis-rt listening on {}", server.local_addr());
    tracing::info!(transport, "transport");
    if let Some(m) = server.metrics_addr() {
        println!("oasis-rt metrics on http://{m}/metrics");
    }
    server.run(shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT"),
        _ = term => tracing::info!("SIGTERM"),
    }
}

/// `--timeout` and `--token-file` of `stats` and `bench`.
fn client_config(a: &ClientArgs) -> Result<ClientConfig, Failure> {
    let mut config = ClientConfig::default();
    if let Some(secs) = a.timeout {
        config.request_timeout = Duration::from_secs(secs);
        config.connect_timeout = Duration::from_secs(secs);
    }
    config.token = a.token_file.as_deref().map(read_token).transpose()?;
    Ok(config)
}

/// What a client command does once connected, over whichever transport it connected with.
trait Session {
    type Out;
    async fn run<C: RmaConnection>(self, client: &mut Client<C>) -> Result<Self::Out, Error>;
}

/// Connect to `addr` over `kind`, run `session`, and shut the transport down (UCX's progress
/// thread) after the runtime is gone. The outer error is the set-up's, the inner the session's.
fn connect_and_run<S: Session>(
    kind: TransportKind,
    addr: &str,
    config: ClientConfig,
    session: S,
) -> Result<Result<S::Out, Error>, Failure> {
    let rt = runtime()?;
    Ok(match kind {
        TransportKind::Tcp => rt.block_on(async {
            let mut client = Client::connect(addr, config).await?;
            session.run(&mut client).await
        }),
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => {
            let transport = ucx_transport(
                config.request_timeout,
                config.connect_timeout,
                config.max_frame,
            )?;
            let out = rt.block_on(async {
                let mut client = Client::connect_with(&transport, addr, config).await?;
                session.run(&mut client).await
            });
            drop(rt);
            transport.shutdown_blocking();
            out
        }
        #[cfg(not(feature = "ucx"))]
        TransportKind::Ucx => unreachable!("refused by transport_kind"),
    })
}

struct StatsSession;

impl Session for StatsSession {
    type Out = oasis_rt::protocol::StatsSnapshot;
    async fn run<C: RmaConnection>(self, client: &mut Client<C>) -> Result<Self::Out, Error> {
        client.stats().await
    }
}

struct BenchSession<'a>(&'a BenchConfig);

impl Session for BenchSession<'_> {
    type Out = bench::BenchReport;
    async fn run<C: RmaConnection>(self, client: &mut Client<C>) -> Result<Self::Out, Error> {
        bench::run(client, self.0).await
    }
}

fn stats(a: &StatsArgs) -> Result<(), Failure> {
    let kind = transport_kind(a.client.transport)?;
    let config = client_config(&a.client)?;
    let s = connect_and_run(kind, &a.client.connect, config, StatsSession)??;
    for (name, value) in s.fields() {
        println!("{name} {value}");
    }
    Ok(())
}

fn bench(a: &BenchArgs) -> Result<(), Failure> {
    let kind = transport_kind(a.client.transport)?;
    let plan = a.plan();
    // Refuse a bad plan before connecting to anything.
    plan.plan().map_err(|e| match e {
        Error::Config(m) => Failure::Usage("bench", m),
        e => Failure::from(e),
    })?;
    let config = client_config(&a.client)?;
    let report = connect_and_run(kind, &a.client.connect, config, BenchSession(&plan))?.map_err(
        |e| match e.code() {
            ErrorCode::Busy | ErrorCode::OutOfMemory => Failure::Runtime(format!(
                "{e}: lower --total, or give the daemon more --memory"
            )),
            _ => Failure::from(e),
        },
    )?;
    println!(
        "# {} ({}), {} timed passes per size; GB/s = 1e9 payload bytes per second, medians",
        kind.name(),
        if report.rma {
            "block bytes by rma"
        } else {
            "block bytes in reply frames"
        },
        plan.repeats
    );
    print!("{}", report.table());
    if let Some(path) = &a.json {
        std::fs::write(path, report.json(kind))
            .map_err(|e| Failure::Runtime(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
