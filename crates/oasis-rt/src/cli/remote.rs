//! `oasis-rt stats` and `oasis-rt bench`: connect to a running daemon as a client, run a
//! [`Session`] on the connection, print what it returns.

use oasis_rt::bench::{self, BenchConfig};
use oasis_rt::transport::{RmaConnection, TransportKind};
use oasis_rt::{Client, ClientConfig, Error, ErrorCode};

use super::{client_config, BenchArgs, StatsArgs};
#[cfg(feature = "ucx")]
use crate::ucx_transport;
use crate::{runtime, transport_kind, Failure};

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

pub(crate) fn stats(a: &StatsArgs) -> Result<(), Failure> {
    let kind = transport_kind(a.client.transport)?;
    let config = client_config(&a.client)?;
    let s = connect_and_run(kind, &a.client.connect, config, StatsSession)??;
    for (name, value) in s.fields() {
        println!("{name} {value}");
    }
    Ok(())
}

pub(crate) fn bench(a: &BenchArgs) -> Result<(), Failure> {
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
