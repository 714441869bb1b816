//! `oasis-rt serve`: the daemon, over the transport asked for, until SIGINT or SIGTERM.

use oasis_rt::transport::TransportKind;
use oasis_rt::Server;

use super::{server_config, ServeArgs};
#[cfg(feature = "ucx")]
use crate::ucx_transport;
use crate::{runtime, transport_kind, Failure};

pub(crate) fn serve(a: &ServeArgs) -> Result<(), Failure> {
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
