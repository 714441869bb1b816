//! Shared by the coordinator's tests: an in-process daemon (`oasis_rt::Server` on loopback
//! TCP) with staged requests of deterministic bytes, plain host pools in `Vec`s, and what the
//! daemon holds for a block-head.

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use oasis_coord::{
    Connector, CoordConfig, Coordinator, Entry, LayerPool, PoolLayout, TcpConnector,
};
use oasis_rt::protocol::{Geometry, KvFormat, RemoteRegion, StagedBlock};
use oasis_rt::transport::{Connection, RmaConnection, TcpConnection};
use oasis_rt::{Client, ClientConfig, Server, ServerConfig};

pub const LAYERS: usize = 4;
pub const HEADS: usize = 2;
pub const BLOCK: u16 = 16;
pub const HEAD_DIM: u16 = 32;
/// Bytes of one head's rows of one block: 16 x 32 x 2.
pub const HB: usize = 1024;
pub const ROWS: usize = 16;
pub const T: Duration = Duration::from_secs(3);

pub fn geometry(head_dim: u16) -> Geometry {
    Geometry {
        num_layers: LAYERS as u16,
        num_kv_heads: HEADS as u16,
        block_size: BLOCK,
        head_dim,
        dtype_bytes: 2,
        num_blocks: 8,
        kv_format: KvFormat::Plain,
    }
}

/// Deterministic, non-zero bytes per (request, layer, block).
pub fn pattern(request: u64, layer: u16, block: u32, len: usize) -> Vec<u8> {
    let mut x = request.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (u64::from(layer) << 32 | u64::from(block))
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u8) | 1
        })
        .collect()
}

pub struct Daemon {
    pub rt: tokio::runtime::Runtime,
    pub addr: String,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Daemon {
    pub fn start() -> Daemon {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (addr, stop) = rt.block_on(async {
            let server = Server::bind(ServerConfig {
                listen: "127.0.0.1:0".into(),
                ..ServerConfig::default()
            })
            .await
            .unwrap();
            let addr = server.local_addr();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(server.run(async move {
                let _ = rx.await;
            }));
            (addr, tx)
        });
        Daemon {
            rt,
            addr,
            stop: Some(stop),
        }
    }

    pub fn config() -> ClientConfig {
        ClientConfig {
            connect_timeout: T,
            request_timeout: T,
            ..ClientConfig::default()
        }
    }

    /// Stage every block of `request` (8 blocks, every layer) with `head_dim`.
    pub fn stage(&self, request: u64, head_dim: u16) {
        let g = geometry(head_dim);
        self.rt.block_on(async {
            let mut c = Client::connect(&self.addr, Self::config()).await.unwrap();
            let blocks = (0..LAYERS as u16)
                .flat_map(|l| {
                    (0..8).map(move |b| StagedBlock {
                        layer: l,
                        block: b,
                        data: Bytes::from(pattern(request, l, b, g.block_bytes() as usize)),
                    })
                })
                .collect();
            c.stage_blocks(request, g, blocks).await.unwrap();
        });
    }

    pub fn release(&self, request: u64) {
        self.rt.block_on(async {
            let mut c = Client::connect(&self.addr, Self::config()).await.unwrap();
            c.release(request).await.unwrap();
        });
    }

    pub fn tcp(&self) -> TcpConnector {
        TcpConnector {
            addr: self.addr.clone(),
            config: Self::config(),
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Plain pools `[ROWS, HEADS, 16, 32]` of 2-byte elements, zeroed, per layer K and V.
pub struct Pools {
    pub k: Vec<Vec<u8>>,
    pub v: Vec<Vec<u8>>,
}

impl Pools {
    pub fn new() -> Pools {
        Pools {
            k: vec![vec![0; ROWS * HEADS * HB]; LAYERS],
            v: vec![vec![0; ROWS * HEADS * HB]; LAYERS],
        }
    }

    pub fn layout(&mut self) -> PoolLayout {
        PoolLayout {
            layers: self
                .k
                .iter_mut()
                .zip(self.v.iter_mut())
                .map(|(k, v)| LayerPool {
                    k: k.as_mut_ptr() as usize,
                    v: v.as_mut_ptr() as usize,
                    scales: None,
                })
                .collect(),
            rows: ROWS,
            heads: HEADS,
            head_bytes: HB,
        }
    }

    /// Head `head` of `row` in `layer`, K then V.
    pub fn head(&self, layer: usize, row: usize, head: usize) -> Vec<u8> {
        let at = (row * HEADS + head) * HB;
        [&self.k[layer][at..at + HB], &self.v[layer][at..at + HB]].concat()
    }
}

/// What the daemon holds for head `head` of `block` of `layer`: its K rows then its V rows.
pub fn staged_head(request: u64, layer: u16, block: u32, head: usize) -> Vec<u8> {
    let data = pattern(request, layer, block, 2 * HEADS * HB);
    let v = HEADS + head;
    [
        &data[head * HB..(head + 1) * HB],
        &data[v * HB..(v + 1) * HB],
    ]
    .concat()
}

pub fn coordinator<K: Connector>(k: K, connections: usize, pools: &mut Pools) -> Coordinator {
    let c = Coordinator::start(
        k,
        CoordConfig {
            connections,
            ..CoordConfig::default()
        },
        LAYERS,
        HEADS,
    )
    .unwrap();
    // SAFETY: `pools` outlives the coordinator in every test (dropped after it), its vectors
    // are never resized, and the tests read them only after wait_layer / drain.
    unsafe { c.register_pools(pools.layout()).unwrap() };
    c
}

/// Engine request `owner` holds rows `rows` = its logical blocks 0.., staged as `daemon`.
pub fn admit(c: &Coordinator, owner: i64, daemon: u64, rows: &[u32]) {
    c.stage(owner, daemon);
    for (logical, &row) in rows.iter().enumerate() {
        c.take_row(row, owner, logical as u32).unwrap();
    }
}

pub fn e(layer: u16, row: u32, head: u16) -> Entry {
    Entry { layer, row, head }
}

/// A TCP connector whose connection slot `slow` waits `delay` before every reply it reads,
/// and whose slot `broken` never connects.
pub struct Faulty {
    pub tcp: TcpConnector,
    pub slow: Option<(usize, Duration)>,
    pub broken: Option<usize>,
}

pub struct SlowConn {
    inner: TcpConnection,
    delay: Duration,
}

impl Connection for SlowConn {
    async fn send_frame(&mut self, frame: &[u8]) -> oasis_rt::Result<()> {
        self.inner.send_frame(frame).await
    }

    async fn recv_frame(&mut self, max: u32, idle: Option<Duration>) -> oasis_rt::Result<Bytes> {
        tokio::time::sleep(self.delay).await;
        self.inner.recv_frame(max, idle).await
    }

    fn peer(&self) -> String {
        self.inner.peer()
    }
}

impl RmaConnection for SlowConn {
    fn can_rma(&self) -> bool {
        false
    }

    async fn get_many(&mut self, r: Vec<(RemoteRegion, u64, u64)>) -> oasis_rt::Result<Vec<Bytes>> {
        self.inner.get_many(r).await
    }
}

impl Connector for Faulty {
    type Conn = SlowConn;

    async fn connect(&self, index: usize) -> oasis_rt::Result<Client<SlowConn>> {
        if self.broken == Some(index) {
            return Err(oasis_rt::Error::Closed);
        }
        let delay = match self.slow {
            Some((i, d)) if i == index => d,
            _ => Duration::ZERO,
        };
        let transport = oasis_rt::transport::TcpTransport::default();
        let inner = oasis_rt::transport::Transport::connect(&transport, &self.tcp.addr).await?;
        Client::handshake(SlowConn { inner, delay }, &self.tcp.config).await
    }
}
