//! The test requests' bytes: one small geometry, deterministic block and summary-row contents
//! per (request, layer, block), and staging a whole request through a client.

use bytes::Bytes;
use oasis_rt::protocol::{Geometry, KvFormat, StagedBlock, SummaryRun};
use oasis_rt::transport::Connection;
use oasis_rt::Client;

/// 4 layers, 2 KV heads, 16 tokens, head_dim 32, 2-byte elements: 4 KiB blocks, 256 B rows.
pub fn geometry() -> Geometry {
    Geometry {
        num_layers: 4,
        num_kv_heads: 2,
        block_size: 16,
        head_dim: 32,
        dtype_bytes: 2,
        num_blocks: 64,
        kv_format: KvFormat::Plain,
    }
}

/// Deterministic bytes that differ per (request, layer, block, offset).
pub fn pattern(request: u64, layer: u16, block: u32, len: usize) -> Bytes {
    let mut x = request
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(layer) << 32 | u64::from(block))
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

pub fn block(request: u64, layer: u16, block: u32) -> StagedBlock {
    StagedBlock {
        layer,
        block,
        data: pattern(request, layer, block, geometry().block_bytes() as usize),
    }
}

pub fn row(request: u64, layer: u16, block: u32) -> Bytes {
    pattern(
        request ^ 0xabcd,
        layer,
        block,
        geometry().summary_row_bytes() as usize,
    )
}

/// Stage every block (layers 0..4, blocks 0..n) and every summary row of `request`.
pub async fn stage_request<C: Connection>(c: &mut Client<C>, request: u64, n: u32) {
    let g = geometry();
    for layers in [0u16..2, 2..4] {
        let blocks = layers
            .clone()
            .flat_map(|l| (0..n).map(move |b| block(request, l, b)))
            .collect();
        c.stage_blocks(request, g, blocks)
            .await
            .expect("stage blocks");
    }
    let runs = (0..4)
        .map(|l| {
            let mut data = Vec::new();
            for b in 0..n {
                data.extend_from_slice(&row(request, l, b));
            }
            SummaryRun {
                layer: l,
                first_block: 0,
                data: data.into(),
            }
        })
        .collect();
    c.stage_summaries(request, g, runs)
        .await
        .expect("stage summaries");
}

pub fn head_slice(data: &[u8], head: usize) -> Vec<u8> {
    let g = geometry();
    let hb = g.head_bytes() as usize;
    let v = g.num_kv_heads as usize + head;
    [
        &data[head * hb..(head + 1) * hb],
        &data[v * hb..(v + 1) * hb],
    ]
    .concat()
}
