//! A test network ([`Net`]: the daemon's transport and the clients') and an in-process daemon
//! on it ([`Daemon`]: its address, handle, task and stop signal), plus the clients' config.

use std::time::{Duration, Instant};

use oasis_rt::transport::Transport;
use oasis_rt::{Client, ClientConfig, Server, ServerConfig, ServerHandle};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::T;

/// The two ends of a test network: the daemon's transport and the clients' (separate UCX
/// workers, as two processes would have).
#[derive(Clone)]
pub struct Net<T> {
    pub server: T,
    pub client: T,
}

pub struct Daemon<T: Transport> {
    pub addr: String,
    pub handle: ServerHandle,
    pub task: JoinHandle<oasis_rt::Result<()>>,
    pub stop: Option<oneshot::Sender<()>>,
    pub net: Net<T>,
}

impl<T: Transport + Clone> Net<T> {
    pub async fn start(&self, config: ServerConfig) -> Daemon<T> {
        let server = Server::bind_with(
            &self.server,
            ServerConfig {
                listen: "127.0.0.1:0".into(),
                ..config
            },
        )
        .await
        .expect("bind");
        let addr = server.local_addr();
        let handle = server.handle();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Daemon {
            addr,
            handle,
            task,
            stop: Some(tx),
            net: self.clone(),
        }
    }

    pub async fn connect(
        &self,
        addr: &str,
        config: ClientConfig,
    ) -> oasis_rt::Result<Client<T::Conn>> {
        Client::connect_with(&self.client, addr, config).await
    }
}

impl<T: Transport + Clone> Daemon<T> {
    pub async fn client(&self) -> Client<T::Conn> {
        self.net
            .connect(&self.addr, cfg(None))
            .await
            .expect("connect")
    }

    /// Wait until the daemon sees exactly `n` open connections.
    pub async fn settle(&self, n: u64) {
        let start = Instant::now();
        while self.handle.stats().connections_active != n {
            assert!(
                start.elapsed() < T,
                "connections_active stuck at {}",
                self.handle.stats().connections_active
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

pub fn cfg(token: Option<&[u8]>) -> ClientConfig {
    ClientConfig {
        token: token.map(<[u8]>::to_vec),
        connect_timeout: T,
        request_timeout: T,
        ..ClientConfig::default()
    }
}
