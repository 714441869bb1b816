//! The command line of the `oasis-rt` binary: [`Cli`] and its subcommands' flags (clap derive),
//! the parsers of their values (sizes, the budget, the frame limit), and what the flags become:
//! the daemon's [`ServerConfig`], a client's [`ClientConfig`], a bench plan (a module of the
//! binary, not of the library). The commands themselves run in `cli/serve.rs` (`serve`) and
//! `cli/remote.rs` (`stats`, `bench`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use oasis_rt::bench::BenchConfig;
use oasis_rt::protocol::{
    HARD_MAX_FRAME_BYTES, MAX_ENTRIES, MAX_TOKEN_BYTES, PREAUTH_MAX_FRAME_BYTES,
};
use oasis_rt::server::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_LEASE, DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS,
};
use oasis_rt::{ClientConfig, ServerConfig};

use crate::Failure;

mod remote;
mod serve;
#[cfg(test)]
mod tests;

pub(crate) use remote::{bench, stats};
pub(crate) use serve::serve;

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
