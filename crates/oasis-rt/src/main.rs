//! The `oasis-rt` binary: `serve` runs the staging daemon, `stats` asks a running one, `bench`
//! measures its block reads against a host memcpy (the logic is `oasis_rt::bench`).

use std::process::ExitCode;
use std::time::Duration;

use oasis_rt::bench::{self, BenchConfig};
use oasis_rt::protocol::{DEFAULT_MAX_FRAME_BYTES, MAX_TOKEN_BYTES};
use oasis_rt::server::{DEFAULT_LEASE, DEFAULT_LISTEN};
use oasis_rt::transport::{RmaConnection, TransportKind};
use oasis_rt::{Client, ClientConfig, Error, ErrorCode, Server, ServerConfig};

const USAGE: &str = "\
usage:
  oasis-rt serve [--listen ADDR] [--memory SIZE] [--token-file FILE] [--metrics ADDR]
                 [--lease SECS] [--max-frame SIZE] [--log LEVEL] [--transport tcp|ucx]
  oasis-rt stats --connect HOST:PORT [--token-file FILE] [--timeout SECS] [--transport tcp|ucx]
  oasis-rt bench --connect HOST:PORT [--token-file FILE] [--timeout SECS] [--transport tcp|ucx]
                 [--block-bytes 8KiB,64KiB] [--total 256MiB] [--batch 64] [--repeats 5]
                 [--path auto|rma|frames] [--entries block|head] [--json PATH]

serve   run the KV staging daemon. --listen defaults to 127.0.0.1:7470; a non-loopback
        address requires --token-file (a shared secret every client presents).
        --memory is the staging budget (e.g. 64GiB; default 1GiB). --metrics serves
        Prometheus text at http://ADDR/metrics. --lease: seconds after which an untouched
        request may be evicted under memory pressure (0: never; default 600).
        --log: error, warn, info (default), debug, trace. Stops on SIGINT/SIGTERM.
        --transport ucx: frames over UCX (libucp loaded at run time; builds with feature
        `ucx`; UCX_TLS etc. choose UCX's transports). Default tcp.
stats   print a running daemon's counters, one `name value` per line.
bench   stage --total bytes of each --block-bytes size (multiples of 8KiB: one KV head of a
        16-token block, head_dim 128, bf16) on a running daemon, read them back --repeats
        times in batches of --batch blocks (by RMA over ucx where the daemon offers it,
        in reply frames otherwise; --path rma|frames forces one; --entries head reads
        each KV head of a block as its own entry, as a decode engine reads its misses),
        and copy the same bytes host to host in the same run;
        prints the median GB/s of each and their ratio, releases what it staged. --json
        writes every pass too.";

fn transport_kind(flags: &Flags) -> Result<TransportKind, Failure> {
    match flags.get("--transport").unwrap_or("tcp") {
        "tcp" => Ok(TransportKind::Tcp),
        "ucx" if cfg!(feature = "ucx") => Ok(TransportKind::Ucx),
        "ucx" => Err(Failure::Config(
            "this oasis-rt was built without UCX: rebuild with `cargo build --features ucx`".into(),
        )),
        other => Err(Usage(format!("--transport must be tcp or ucx, got '{other}'")).into()),
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

/// A command-line mistake: usage and exit code 2.
struct Usage(String);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(m)) => {
            eprintln!("oasis-rt: {m}\n{USAGE}");
            ExitCode::from(2)
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

enum Failure {
    Usage(String),
    Config(String),
    Runtime(String),
}

impl From<Usage> for Failure {
    fn from(u: Usage) -> Self {
        Failure::Usage(u.0)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(m) => Failure::Config(m),
            e => Failure::Runtime(e.to_string()),
        }
    }
}

/// `--flag value` pairs after the subcommand; every flag at most once.
struct Flags(Vec<(String, String)>);

impl Flags {
    fn parse(args: &[String], allowed: &[&str]) -> Result<Flags, Usage> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let (name, inline) = match a.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (a.as_str(), None),
            };
            if !allowed.contains(&name) {
                return Err(Usage(format!("unknown argument '{a}'")));
            }
            let value = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| Usage(format!("{name} needs a value")))?,
            };
            if out.iter().any(|(n, _)| n == name) {
                return Err(Usage(format!("{name} given twice")));
            }
            out.push((name.to_string(), value));
        }
        Ok(Flags(out))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `64GiB`, `512MiB`, `1.5GB`-style sizes are not accepted (integers only): `64GiB`, `1000MB`,
/// `4096`.
fn parse_size(s: &str) -> Result<u64, Usage> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| Usage(format!("bad size '{s}' (e.g. 64GiB)")))?;
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
            return Err(Usage(format!(
                "bad size unit in '{s}' (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| Usage(format!("size '{s}' too large")))
}

fn parse_secs(s: &str, what: &str) -> Result<u64, Usage> {
    s.parse().map_err(|_| {
        Usage(format!(
            "{what} must be a whole number of seconds, got '{s}'"
        ))
    })
}

fn read_token(path: &str) -> Result<Vec<u8>, Failure> {
    let raw = std::fs::read(path)
        .map_err(|e| Failure::Config(format!("cannot read token file {path}: {e}")))?;
    let token = raw.trim_ascii().to_vec();
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(Failure::Config(format!(
            "token file {path} must hold 1..={MAX_TOKEN_BYTES} bytes"
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(path) {
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path, "token file is readable by others (chmod 600)");
            }
        }
    }
    Ok(token)
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Runtime(format!("cannot start the runtime: {e}")))
}

fn run(args: &[String]) -> Result<(), Failure> {
    let Some((cmd, rest)) = args.split_first() else {
        return Err(Usage("missing command".into()).into());
    };
    match cmd.as_str() {
        "serve" => serve(rest),
        "stats" => stats(rest),
        "bench" => bench(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        "-V" | "--version" => {
            println!("oasis-rt {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        other => Err(Usage(format!("unknown command '{other}'")).into()),
    }
}

fn init_logs(level: &str) -> Result<(), Usage> {
    let level: tracing::Level = level
        .parse()
        .map_err(|_| Usage(format!("bad log level '{level}'")))?;
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}

fn serve(args: &[String]) -> Result<(), Failure> {
    let flags = Flags::parse(
        args,
        &[
            "--listen",
            "--memory",
            "--token-file",
            "--metrics",
            "--lease",
            "--max-frame",
            "--log",
            "--transport",
        ],
    )?;
    let kind = transport_kind(&flags)?;
    init_logs(flags.get("--log").unwrap_or("info"))?;
    let mut config = ServerConfig {
        listen: flags.get("--listen").unwrap_or(DEFAULT_LISTEN).to_string(),
        metrics: flags.get("--metrics").map(str::to_string),
        ..ServerConfig::default()
    };
    if let Some(m) = flags.get("--memory") {
        config.budget_bytes = parse_size(m)?;
    }
    if let Some(f) = flags.get("--max-frame") {
        config.max_frame = u32::try_from(parse_size(f)?)
            .map_err(|_| Usage(format!("--max-frame {f} too large")))?;
    } else {
        config.max_frame = DEFAULT_MAX_FRAME_BYTES;
    }
    config.lease = match flags.get("--lease") {
        Some(s) => match parse_secs(s, "--lease")? {
            0 => None,
            n => Some(Duration::from_secs(n)),
        },
        None => Some(DEFAULT_LEASE),
    };
    if let Some(path) = flags.get("--token-file") {
        config.token = Some(read_token(path)?);
    }
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
fn client_config(flags: &Flags) -> Result<ClientConfig, Failure> {
    let mut config = ClientConfig::default();
    if let Some(t) = flags.get("--timeout") {
        let secs = parse_secs(t, "--timeout")?.max(1);
        config.request_timeout = Duration::from_secs(secs);
        config.connect_timeout = Duration::from_secs(secs);
    }
    if let Some(path) = flags.get("--token-file") {
        config.token = Some(read_token(path)?);
    }
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

fn stats(args: &[String]) -> Result<(), Failure> {
    let flags = Flags::parse(
        args,
        &["--connect", "--token-file", "--timeout", "--transport"],
    )?;
    let kind = transport_kind(&flags)?;
    let addr = flags
        .get("--connect")
        .ok_or_else(|| Usage("stats needs --connect HOST:PORT".into()))?
        .to_string();
    let config = client_config(&flags)?;
    let s = connect_and_run(kind, &addr, config, StatsSession)??;
    for (name, value) in s.fields() {
        println!("{name} {value}");
    }
    Ok(())
}

fn parse_count(s: &str, what: &str) -> Result<usize, Usage> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Usage(format!(
            "{what} must be a positive whole number, got '{s}'"
        ))),
    }
}

fn bench(args: &[String]) -> Result<(), Failure> {
    let flags = Flags::parse(
        args,
        &[
            "--connect",
            "--token-file",
            "--timeout",
            "--transport",
            "--block-bytes",
            "--total",
            "--batch",
            "--repeats",
            "--path",
            "--entries",
            "--json",
        ],
    )?;
    let kind = transport_kind(&flags)?;
    let addr = flags
        .get("--connect")
        .ok_or_else(|| Usage("bench needs --connect HOST:PORT".into()))?
        .to_string();
    let mut plan = BenchConfig::default();
    if let Some(list) = flags.get("--block-bytes") {
        plan.block_bytes = list
            .split(',')
            .map(|s| parse_size(s.trim()))
            .collect::<Result<_, _>>()?;
    }
    if let Some(t) = flags.get("--total") {
        plan.total_bytes = parse_size(t)?;
    }
    if let Some(b) = flags.get("--batch") {
        plan.batch = parse_count(b, "--batch")?;
    }
    if let Some(r) = flags.get("--repeats") {
        plan.repeats = parse_count(r, "--repeats")?;
    }
    plan.rma = match flags.get("--path").unwrap_or("auto") {
        "auto" => None,
        "rma" => Some(true),
        "frames" => Some(false),
        other => {
            return Err(Usage(format!("--path must be auto, rma or frames, got '{other}'")).into())
        }
    };
    plan.per_head = match flags.get("--entries").unwrap_or("block") {
        "block" => false,
        "head" => true,
        other => {
            return Err(Usage(format!("--entries must be block or head, got '{other}'")).into())
        }
    };
    // Refuse a bad plan before connecting to anything.
    plan.plan().map_err(|e| match e {
        Error::Config(m) => Failure::Usage(m),
        e => Failure::from(e),
    })?;
    let json = flags.get("--json").map(str::to_string);
    let config = client_config(&flags)?;
    let report =
        connect_and_run(kind, &addr, config, BenchSession(&plan))?.map_err(|e| match e.code() {
            ErrorCode::Busy | ErrorCode::OutOfMemory => Failure::Runtime(format!(
                "{e}: lower --total, or give the daemon more --memory"
            )),
            _ => Failure::from(e),
        })?;
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
    if let Some(path) = json {
        std::fs::write(&path, report.json(kind))
            .map_err(|e| Failure::Runtime(format!("cannot write {path}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64GiB").ok(), Some(64 << 30));
        assert_eq!(parse_size("1000MB").ok(), Some(1_000_000_000));
        assert_eq!(parse_size("4096").ok(), Some(4096));
        assert!(parse_size("1.5GiB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert!(parse_size("12XB").is_err());
    }

    #[test]
    fn flags() {
        let a: Vec<String> = ["--listen", "x", "--memory=1GiB"]
            .map(String::from)
            .to_vec();
        let f = Flags::parse(&a, &["--listen", "--memory"]).ok().unwrap();
        assert_eq!(f.get("--memory"), Some("1GiB"));
        assert!(Flags::parse(&a, &["--listen"]).is_err());
        let twice: Vec<String> = ["--listen", "x", "--listen", "y"]
            .map(String::from)
            .to_vec();
        assert!(Flags::parse(&twice, &["--listen"]).is_err());
        let missing: Vec<String> = ["--listen"].map(String::from).to_vec();
        assert!(Flags::parse(&missing, &["--listen"]).is_err());
    }
}
