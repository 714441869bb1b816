//! How the coordinator's connections are made ([`Connector`]): TCP here ([`TcpConnector`]);
//! the Python binding brings one for either transport (UCX through the process's shared
//! transport); tests wrap connections to slow or break them.

use std::future::Future;

use oasis_rt::transport::{RmaConnection, TcpConnection};
use oasis_rt::{Client, ClientConfig};

/// Opens an authenticated connection to the daemon. `index` is the coordinator's connection
/// slot (`0..connections`), for connectors that treat slots differently (tests).
pub trait Connector: Send + Sync + 'static {
    type Conn: RmaConnection;

    /// A fresh connection for slot `index`.
    ///
    /// # Errors
    /// As [`Client::connect`].
    fn connect(
        &self,
        index: usize,
    ) -> impl Future<Output = oasis_rt::Result<Client<Self::Conn>>> + Send;
}

/// Plain TCP to `addr` (`HOST:PORT`) with `config`'s token and deadlines.
#[derive(Clone, Debug)]
pub struct TcpConnector {
    pub addr: String,
    pub config: ClientConfig,
}

impl Connector for TcpConnector {
    type Conn = TcpConnection;

    async fn connect(&self, _index: usize) -> oasis_rt::Result<Client<TcpConnection>> {
        Client::connect(&self.addr, self.config.clone()).await
    }
}
