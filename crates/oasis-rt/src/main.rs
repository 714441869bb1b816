//! The `oasis-rt` binary: `serve` runs the staging daemon, `stats` asks a running one, `bench`
//! measures its block reads against a host memcpy (the logic is `oasis_rt::bench`).
//!
//! The command line is [`Cli`], parsed by `clap` (derive): `--help` and `--version` on the
//! binary and on each subcommand, clap's errors (exit 2) for unknown flags and bad values.
//! Checks that need more than one flag (a bench plan, the token file) end the same way: one
//! `error:` line and exit 2. Failures at run time exit 1.
//!
//! The binary's modules (the library is `lib.rs`):
//!
//! ```text
//! main.rs           main, exit codes (Failure), what every command shares: the runtime, the
//!                   transport asked for
//! cli.rs            the flags (Cli, clap derive), their parsers, flags to configurations
//! cli/serve.rs      `serve`: the daemon until SIGINT/SIGTERM
//! cli/remote.rs     `stats` and `bench`: a client session against a running daemon
//! cli/tests.rs      the flags' names, defaults, bounds and help
//! ```

mod cli;

use std::process::ExitCode;
#[cfg(feature = "ucx")]
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use cli::{Cli, Command, TransportArg};
use oasis_rt::transport::TransportKind;
use oasis_rt::Error;

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
        Command::Serve(a) => cli::serve(&a),
        Command::Stats(a) => cli::stats(&a),
        Command::Bench(a) => cli::bench(&a),
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

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Runtime(format!("cannot start the runtime: {e}")))
}
