//! Bodies: the data path. A round trip (stage, fetch the admission, read blocks across
//! requests, release), many clients at once, staging past the budget, and a daemon killed in
//! the middle of a transfer.

use std::time::{Duration, Instant};

use bytes::Bytes;
use oasis_rt::protocol::{BlockKey, Geometry, LayerBlock, Section, StagedBlock, ALL_HEADS};
use oasis_rt::transport::Transport;
use oasis_rt::{ClientConfig, Error, ErrorCode, ServerConfig};
use tokio::sync::oneshot;

use super::*;

pub async fn round_trip_stage_fetch_read_release<T: Transport + Clone>(net: &Net<T>) {
    let d = net.start(ServerConfig::default()).await;
    let mut prefill = d.client().await;
    stage_request(&mut prefill, 7, 64).await;
    stage_request(&mut prefill, 8, 16).await;
    let selected: Vec<LayerBlock> = (0..4u16)
        .flat_map(|layer| [0u32, 5, 63].map(|block| LayerBlock { layer, block }))
        .collect();
    let draft = pattern(7, 99, 99, 3000);
    prefill
        .stage_admission(
            7,
            selected.clone(),
            vec![Section {
                name: "draft_kv".into(),
                data: draft.clone(),
            }],
        )
        .await
        .expect("stage admission");
    let used = prefill.stats().await.unwrap().used_bytes;
    assert!(used > 64 * 4 * 4096);

    // Another connection: the decode side.
    let mut decode = d.client().await;
    let a = decode
        .fetch_admission(7, 0, 4, true)
        .await
        .expect("admission");
    assert_eq!(a.geometry, geometry());
    assert_eq!(a.sections.len(), 1);
    assert_eq!(a.sections[0].data, draft);
    assert_eq!(a.blocks.len(), selected.len());
    for b in &a.blocks {
        assert_eq!(
            b.data,
            block(7, b.layer, b.block).data,
            "block {} {}",
            b.layer,
            b.block
        );
    }
    assert_eq!(a.summaries.len(), 4, "one run per layer");
    for run in &a.summaries {
        let expect: Vec<u8> = (0..64)
            .flat_map(|b| row(7, run.layer, b).to_vec())
            .collect();
        assert_eq!(run.first_block, 0);
        assert_eq!(&run.data[..], &expect[..]);
    }
    // A layer range: only its blocks and rows, no sections.
    let part = decode.fetch_admission(7, 2, 1, false).await.unwrap();
    assert!(part.sections.is_empty());
    assert!(part.blocks.iter().all(|b| b.layer == 2) && part.blocks.len() == 3);
    assert!(part.summaries.iter().all(|r| r.layer == 2));

    // One layer's batch across both requests, whole blocks and single heads.
    let keys = vec![
        BlockKey {
            request: 7,
            layer: 1,
            block: 40,
            head: ALL_HEADS,
        },
        BlockKey {
            request: 8,
            layer: 1,
            block: 15,
            head: 1,
        },
        BlockKey {
            request: 8,
            layer: 1,
            block: 16,
            head: 0,
        }, // not staged
        BlockKey {
            request: 7,
            layer: 1,
            block: 64,
            head: 0,
        }, // out of range
        BlockKey {
            request: 9,
            layer: 1,
            block: 0,
            head: 0,
        }, // unknown request
    ];
    let got = decode.read_blocks(keys).await.expect("read");
    assert_eq!(got[0].as_ref().unwrap(), &block(7, 1, 40).data);
    assert_eq!(
        got[1].as_ref().unwrap()[..],
        head_slice(&block(8, 1, 15).data, 1)[..]
    );
    assert_eq!(got[2], Err(ErrorCode::MissingBlock));
    assert_eq!(got[3], Err(ErrorCode::BadRequest));
    assert_eq!(got[4], Err(ErrorCode::UnknownRequest));

    let s = decode.stats().await.unwrap();
    assert_eq!((s.live_requests, s.used_bytes), (2, used));
    assert!(s.bytes_served >= 64 * 4 * 256 + 12 * 4096 + 3000 + 4096);

    // Release frees everything.
    let freed = decode.release(7).await.unwrap() + decode.release(8).await.unwrap();
    assert_eq!(freed, used);
    assert_eq!(decode.release(8).await.unwrap(), 0, "release is idempotent");
    let s = prefill.stats().await.unwrap();
    assert_eq!((s.used_bytes, s.live_requests, s.staged_blocks), (0, 0, 0));
    let err = decode.fetch_admission(7, 0, 4, true).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::UnknownRequest);
    assert!(
        decode.is_connected(),
        "a refused request keeps the connection"
    );
    d.handle.audit().unwrap();
}

pub async fn many_clients_at_once<T: Transport + Clone>(net: &Net<T>) {
    let d = net.start(ServerConfig::default()).await;
    let tasks: Vec<_> = (0..16u64)
        .map(|r| {
            let addr = d.addr.clone();
            let net = net.clone();
            tokio::spawn(async move {
                let mut c = net.connect(&addr, cfg(None)).await.unwrap();
                stage_request(&mut c, r, 8).await;
                for layer in 0..4 {
                    let keys = (0..8)
                        .map(|b| BlockKey {
                            request: r,
                            layer,
                            block: b,
                            head: ALL_HEADS,
                        })
                        .collect();
                    let got = c.read_blocks(keys).await.unwrap();
                    for (b, e) in got.iter().enumerate() {
                        assert_eq!(e.as_ref().unwrap(), &block(r, layer, b as u32).data);
                    }
                }
                c.release(r).await.unwrap()
            })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap() > 0);
    }
    let s = d.handle.stats();
    assert_eq!((s.used_bytes, s.live_requests), (0, 0));
    d.handle.audit().unwrap();
}

pub async fn staging_past_the_budget_is_refused_and_live_data_kept<T: Transport + Clone>(
    net: &Net<T>,
) {
    // Room for one request of 64 blocks x 4 layers (1 MiB + overheads), not two.
    let d = net
        .start(ServerConfig {
            budget_bytes: 1_200_000,
            ..ServerConfig::default()
        })
        .await;
    let mut c = d.client().await;
    stage_request(&mut c, 1, 64).await;
    let used = c.stats().await.unwrap().used_bytes;
    let g = geometry();
    let blocks: Vec<StagedBlock> = (0..64).map(|b| block(2, 0, b)).collect();
    let err = c.stage_blocks(2, g, blocks).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Busy, "{err}");
    // A request that alone passes the budget: out of memory (never fits).
    let mut c2 = d.client().await;
    let mut refused = 0;
    for chunk in 0..2 {
        let blocks: Vec<StagedBlock> = (0..4u16)
            .flat_map(|l| (0..64).map(move |b| block(3, l, b)))
            .skip(chunk * 128)
            .take(128)
            .collect();
        match c2.stage_blocks(3, g, blocks).await {
            Err(e) => {
                assert!(
                    matches!(e.code(), ErrorCode::Busy | ErrorCode::OutOfMemory),
                    "{e}"
                );
                refused += 1;
            }
            Ok(_) => panic!("staged past the budget"),
        }
    }
    assert_eq!(refused, 2);
    // The live request is whole and the accounting unchanged.
    let keys = (0..64)
        .map(|b| BlockKey {
            request: 1,
            layer: 3,
            block: b,
            head: ALL_HEADS,
        })
        .collect();
    let got = c.read_blocks(keys).await.unwrap();
    for (b, e) in got.iter().enumerate() {
        assert_eq!(e.as_ref().unwrap(), &block(1, 3, b as u32).data);
    }
    let s = c.stats().await.unwrap();
    assert_eq!(
        (s.used_bytes, s.live_requests, s.refused_stages),
        (used, 1, 3)
    );
    assert!(s.used_bytes <= s.budget_bytes);
    // After a release the same staging fits.
    c.release(1).await.unwrap();
    let blocks: Vec<StagedBlock> = (0..64).map(|b| block(2, 0, b)).collect();
    c.stage_blocks(2, g, blocks)
        .await
        .expect("fits after release");
    d.handle.audit().unwrap();
}

pub async fn killed_daemon_mid_transfer_gives_a_typed_error_in_time<T: Transport + Clone>(
    net: &Net<T>,
) {
    let d = net.start(ServerConfig::default()).await;
    let mut c = d.client().await;
    // 32 MiB staged in 8 MiB frames; each read below moves 8 MiB.
    let g = Geometry {
        num_blocks: 2048,
        ..geometry()
    };
    for chunk in 0..4u32 {
        let blocks = (0..2048)
            .map(|b| StagedBlock {
                layer: chunk as u16,
                block: b,
                data: Bytes::from(vec![chunk as u8; 4096]),
            })
            .collect();
        c.stage_blocks(1, g, blocks).await.unwrap();
    }
    let timeout = Duration::from_secs(2);
    let mut reader = net
        .connect(
            &d.addr,
            ClientConfig {
                request_timeout: timeout,
                ..cfg(None)
            },
        )
        .await
        .unwrap();
    let (first_tx, first_rx) = oneshot::channel();
    let read = tokio::spawn(async move {
        let mut first = Some(first_tx);
        loop {
            let keys = (0..2048)
                .map(|b| BlockKey {
                    request: 1,
                    layer: (b % 4) as u16,
                    block: b,
                    head: ALL_HEADS,
                })
                .collect();
            if let Err(e) = reader.read_blocks(keys).await {
                return (e, Instant::now(), reader.is_connected());
            }
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
    });
    first_rx.await.expect("one read went through");
    tokio::time::sleep(Duration::from_millis(3)).await;
    let killed = Instant::now();
    d.task.abort();
    let (err, at, connected) = tokio::time::timeout(timeout + Duration::from_secs(2), read)
        .await
        .expect("the client hung")
        .unwrap();
    let took = at.saturating_duration_since(killed);
    eprintln!("killed daemon: client got `{err}` {took:?} after the abort");
    assert!(
        took <= timeout + Duration::from_millis(500),
        "took {took:?}"
    );
    assert!(
        matches!(
            err,
            Error::Closed | Error::Truncated { .. } | Error::Io(_) | Error::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(!connected, "a broken connection is dropped");
    // And the daemon is gone for new clients too.
    let err = net
        .connect(&d.addr, cfg(None))
        .await
        .err()
        .expect("connected to a dead daemon");
    assert!(matches!(err, Error::Unreachable { .. }), "{err:?}");
}
