//! Property tests for selection and eviction: `delta_select` invariants on random states, the
//! gather that follows it, top-K against a full sort, and a multi-step decode simulation (append
//! with write-through, attention over the working set, scoring, top-K, delta selection, gather)
//! checked against attention over exactly the blocks the head-wise mapping names.

use std::collections::{HashMap, HashSet};

use oasis_core::kernels::{
    append_kv, build_summaries, decode_attention, delta_select, gather_blocks, score_blocks,
    topk_blocks, ExtraKv, PagedKv, SelectStats,
};
use oasis_core::{BlockPool, KvGeometry, Tier};
use proptest::prelude::*;

mod common;
use common::Rng;

/// A random selection state: `num_seqs` sequences of `nblocks[s]` logical blocks, `budget` slots
/// each in distinct, scrambled pages; each (seq, head) holds a random set of distinct blocks.
#[derive(Debug, Clone)]
struct Case {
    h_kv: usize,
    budget: usize,
    num_pred: usize,
    fetch_cap: usize,
    nblocks: Vec<usize>,
    slot_pages: Vec<i32>,
    page_map: Vec<i32>,
    last: Vec<i32>,
    predicted: Vec<i32>,
}

fn make_case(seed: u64, h_kv: usize, num_seqs: usize, budget: usize, spare_pages: usize) -> Case {
    let mut rng = Rng(seed);
    let num_pages = num_seqs * budget + spare_pages;
    let mut pages: Vec<i32> = (0..num_pages as i32).collect();
    rng.shuffle(&mut pages);
    let slot_pages = pages[..num_seqs * budget].to_vec();
    let nblocks: Vec<usize> = (0..num_seqs)
        .map(|_| 1 + rng.below(3 * budget + 2))
        .collect();
    let mut page_map = vec![-1; num_pages * h_kv];
    let mut last: Vec<i32> = (0..num_pages * h_kv)
        .map(|_| rng.below(8) as i32 - 1)
        .collect();
    for s in 0..num_seqs {
        for h in 0..h_kv {
            let mut blocks: Vec<i32> = (0..nblocks[s] as i32).collect();
            rng.shuffle(&mut blocks);
            for i in 0..budget {
                let p = slot_pages[s * budget + i] as usize;
                // Some slots empty (-1, sometimes another negative value).
                if rng.below(4) == 0 || i >= blocks.len() {
                    page_map[p * h_kv + h] = if rng.below(2) == 0 { -1 } else { -7 };
                } else {
                    page_map[p * h_kv + h] = blocks[i];
                }
            }
        }
    }
    // Pages outside every slot list hold junk that must never change.
    for p in &pages[num_seqs * budget..] {
        for h in 0..h_kv {
            page_map[*p as usize * h_kv + h] = 1000 + h as i32;
            last[*p as usize * h_kv + h] = 1000;
        }
    }
    let num_pred = rng.below(budget + 1);
    let fetch_cap = rng.below(budget + 2);
    let mut predicted = Vec::new();
    for &n in &nblocks {
        for _ in 0..h_kv * num_pred {
            // Mostly valid blocks, some padding and duplicates.
            predicted.push(if rng.below(6) == 0 {
                -1
            } else {
                rng.below(n) as i32
            });
        }
    }
    Case {
        h_kv,
        budget,
        num_pred,
        fetch_cap,
        nblocks,
        slot_pages,
        page_map,
        last,
        predicted,
    }
}

const STEP: i32 = 50;

struct Outcome {
    map: Vec<i32>,
    last: Vec<i32>,
    plan_slots: Vec<i32>,
    plan_blocks: Vec<i32>,
    stats: SelectStats,
}

fn run_select(c: &Case) -> Outcome {
    let num_seqs = c.nblocks.len();
    let mut map = c.page_map.clone();
    let mut last = c.last.clone();
    let mut plan_slots = vec![99; num_seqs * c.h_kv * c.fetch_cap];
    let mut plan_blocks = vec![99; num_seqs * c.h_kv * c.fetch_cap];
    let stats = delta_select(
        c.h_kv,
        &c.predicted,
        c.num_pred,
        &c.slot_pages,
        c.budget,
        &mut map,
        &mut last,
        STEP,
        c.fetch_cap,
        &mut plan_slots,
        &mut plan_blocks,
    )
    .expect("valid case");
    Outcome {
        map,
        last,
        plan_slots,
        plan_blocks,
        stats,
    }
}

/// Check every invariant of one delta_select call against an independent reading of the rules.
fn check_select(c: &Case, o: &Outcome, step: i32) -> Result<(), TestCaseError> {
    let (h_kv, budget, cap) = (c.h_kv, c.budget, c.fetch_cap);
    let mut stats = SelectStats::default();
    let mut touched = HashSet::new();
    for s in 0..c.nblocks.len() {
        for h in 0..h_kv {
            let pred = &c.predicted[(s * h_kv + h) * c.num_pred..][..c.num_pred];
            let mut wanted: Vec<i32> = Vec::new(); // S in prediction order
            for &b in pred {
                if b >= 0 && !wanted.contains(&b) {
                    wanted.push(b);
                }
            }
            let entry = |i: usize| c.slot_pages[s * budget + i] as usize * h_kv + h;
            let before: Vec<i32> = (0..budget).map(|i| c.page_map[entry(i)]).collect();
            let after: Vec<i32> = (0..budget).map(|i| o.map[entry(i)]).collect();
            let old_last: Vec<i32> = (0..budget).map(|i| c.last[entry(i)]).collect();
            for i in 0..budget {
                touched.insert(entry(i));
            }
            let missing: Vec<i32> = wanted
                .iter()
                .copied()
                .filter(|b| !before.contains(b))
                .collect();
            let victims = (0..budget)
                .filter(|&i| !wanted.contains(&before[i]))
                .count();
            let n = missing.len().min(victims).min(cap);

            // The plan: n entries, then -1; the changed slots are exactly the planned ones.
            let ps = &o.plan_slots[(s * h_kv + h) * cap..][..cap];
            let pb = &o.plan_blocks[(s * h_kv + h) * cap..][..cap];
            prop_assert!(ps[n..].iter().all(|&x| x == -1) && pb[n..].iter().all(|&x| x == -1));
            prop_assert_eq!(
                &pb[..n],
                &missing[..n],
                "missing blocks fetched in prediction order"
            );
            let planned: HashSet<usize> = ps[..n].iter().map(|&x| x as usize).collect();
            prop_assert_eq!(planned.len(), n, "a slot planned twice");
            for i in 0..budget {
                if let Some(k) = ps[..n].iter().position(|&x| x as usize == i) {
                    prop_assert!(!wanted.contains(&before[i]), "evicted a predicted block");
                    prop_assert_eq!(after[i], pb[k]);
                    prop_assert_eq!(o.last[entry(i)], step);
                } else {
                    prop_assert_eq!(after[i], before[i], "unplanned slot changed");
                    // Predicted blocks already resident stay in their slot and are touched.
                    let kept = before[i] >= 0 && wanted.contains(&before[i]);
                    prop_assert_eq!(o.last[entry(i)], if kept { step } else { old_last[i] });
                }
            }
            // Cap per head and step.
            prop_assert!((0..budget).filter(|&i| after[i] != before[i]).count() <= cap);
            // No block in two slots of one (seq, head).
            let resident: Vec<i32> = after.iter().copied().filter(|&b| b >= 0).collect();
            let distinct: HashSet<i32> = resident.iter().copied().collect();
            prop_assert_eq!(distinct.len(), resident.len(), "a block sits in two slots");
            // Empty slots before evictions; least recently selected first among the rest.
            let evicted: Vec<usize> = ps[..n].iter().map(|&x| x as usize).collect();
            let key = |i: usize| (before[i] >= 0, old_last[i], i);
            prop_assert!(
                evicted.windows(2).all(|w| key(w[0]) < key(w[1])),
                "victims not taken in eviction order"
            );
            let empty_unused = (0..budget).any(|i| before[i] < 0 && !evicted.contains(&i));
            for &i in &evicted {
                if before[i] < 0 {
                    continue;
                }
                prop_assert!(
                    !empty_unused,
                    "evicted a block while an empty slot was left"
                );
                for j in 0..budget {
                    let candidate =
                        before[j] >= 0 && !wanted.contains(&before[j]) && !evicted.contains(&j);
                    if candidate {
                        prop_assert!(
                            old_last[i] <= old_last[j],
                            "evicted slot {i} is not least recently selected"
                        );
                    }
                }
            }
            stats.pairs += n;
            stats.kept += wanted.len() - missing.len();
            stats.missing += missing.len();
        }
    }
    prop_assert_eq!(stats, o.stats);
    // Entries of pages outside this batch's slots never change.
    for e in 0..c.page_map.len() {
        if !touched.contains(&e) {
            prop_assert_eq!(o.map[e], c.page_map[e]);
            prop_assert_eq!(o.last[e], c.last[e]);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn delta_select_invariants(
        seed in any::<u64>(),
        h_kv in 1usize..4,
        num_seqs in 1usize..4,
        budget in 1usize..9,
        spare in 0usize..3,
    ) {
        let c = make_case(seed, h_kv, num_seqs, budget, spare);
        let o = run_select(&c);
        check_select(&c, &o, STEP)?;
    }

    /// After gather_blocks, every resident (slot, head) entry holds exactly the host block the
    /// mapping names.
    #[test]
    fn gather_makes_pages_match_the_mapping(
        seed in any::<u64>(),
        h_kv in 1usize..4,
        num_seqs in 1usize..4,
        budget in 1usize..7,
        bs in 1usize..4,
    ) {
        let c = make_case(seed, h_kv, num_seqs, budget, 1);
        let g = KvGeometry::new(h_kv, h_kv, 3, bs).unwrap();
        let entry = g.entry_elems();
        let mut rng = Rng(seed ^ 0xABCD);
        // Host blocks of each seq, in a scrambled host pool.
        let total: usize = c.nblocks.iter().sum();
        let mut host_ids: Vec<i32> = (0..total as i32 + 2).collect();
        rng.shuffle(&mut host_ids);
        let mut indptr = vec![0i32];
        for &n in &c.nblocks {
            indptr.push(indptr.last().unwrap() + n as i32);
        }
        let host_indices = host_ids[..total].to_vec();
        let num_host = total + 2;
        let host_k: Vec<f32> = (0..num_host * g.page_elems()).map(|_| rng.f32()).collect();
        let host_v: Vec<f32> = (0..num_host * g.page_elems()).map(|_| rng.f32()).collect();
        let num_pages = c.page_map.len() / h_kv;
        // Pages start consistent with the initial mapping (garbage where empty).
        let mut k_pages: Vec<f32> = (0..num_pages * g.page_elems()).map(|_| rng.f32()).collect();
        let mut v_pages: Vec<f32> = (0..num_pages * g.page_elems()).map(|_| rng.f32()).collect();
        let host_of = |s: usize, b: i32| host_indices[indptr[s] as usize + b as usize] as usize;
        let fill = |map: &[i32], kp: &mut [f32], vp: &mut [f32], only_check: bool| -> Result<(), TestCaseError> {
            for s in 0..c.nblocks.len() {
                for i in 0..budget {
                    let p = c.slot_pages[s * budget + i] as usize;
                    for h in 0..h_kv {
                        let b = map[p * h_kv + h];
                        if b < 0 {
                            continue;
                        }
                        let src = (host_of(s, b) * h_kv + h) * entry;
                        let dst = (p * h_kv + h) * entry;
                        if only_check {
                            prop_assert_eq!(&kp[dst..dst + entry], &host_k[src..src + entry]);
                            prop_assert_eq!(&vp[dst..dst + entry], &host_v[src..src + entry]);
                        } else {
                            kp[dst..dst + entry].copy_from_slice(&host_k[src..src + entry]);
                            vp[dst..dst + entry].copy_from_slice(&host_v[src..src + entry]);
                        }
                    }
                }
            }
            Ok(())
        };
        fill(&c.page_map, &mut k_pages, &mut v_pages, false)?;
        let o = run_select(&c);
        let copied = gather_blocks(
            &g, &o.plan_slots, &o.plan_blocks, c.fetch_cap, &c.slot_pages, budget, &indptr, &host_indices,
            &host_k, &host_v, &mut k_pages, &mut v_pages,
        ).unwrap();
        prop_assert_eq!(copied, o.stats.pairs);
        fill(&o.map, &mut k_pages, &mut v_pages, true)?;
    }

    /// Top-K equals a full sort (score desc, index asc), and every selected score is >= every
    /// unselected one.
    #[test]
    fn topk_is_a_sorted_prefix(
        seed in any::<u64>(),
        h_kv in 1usize..4,
        lens in proptest::collection::vec(0usize..20, 1..4),
        k in 0usize..12,
        levels in 1usize..6,
    ) {
        let mut rng = Rng(seed);
        let nnz: usize = lens.iter().sum();
        // Few distinct levels: many ties.
        let scores: Vec<f32> = (0..nnz * h_kv).map(|_| rng.below(levels) as f32 - 2.0).collect();
        let mut indptr = vec![0i32];
        for &n in &lens {
            indptr.push(indptr.last().unwrap() + n as i32);
        }
        let mut out = vec![42; lens.len() * h_kv * k];
        topk_blocks(h_kv, &scores, &indptr, k, &mut out).unwrap();
        for (s, &n) in lens.iter().enumerate() {
            for h in 0..h_kv {
                let col: Vec<f32> = (0..n).map(|j| scores[(indptr[s] as usize + j) * h_kv + h]).collect();
                let mut want: Vec<i32> = (0..n as i32).collect();
                want.sort_by(|&a, &b| col[b as usize].partial_cmp(&col[a as usize]).unwrap().then(a.cmp(&b)));
                want.truncate(k);
                want.resize(k, -1);
                prop_assert_eq!(&out[(s * h_kv + h) * k..][..k], want.as_slice());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Multi-step decode simulation.

/// Naive attention for one (seq, query head) over an explicit list of (k, v) rows, in f64.
fn naive_attend(q: &[f32], rows: &[(Vec<f32>, Vec<f32>)], scale: f32) -> Vec<f64> {
    let logits: Vec<f64> = rows
        .iter()
        .map(|(k, _)| {
            k.iter()
                .zip(q)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale as f64
        })
        .collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    (0..q.len())
        .map(|x| {
            rows.iter()
                .zip(&w)
                .map(|((_, v), w)| w * v[x] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

struct Seq {
    ctx: usize,
    host_blocks: Vec<i32>, // logical block -> host block
    local_page: usize,
    slots: Vec<i32>, // budget pages
}

#[allow(clippy::too_many_arguments)]
fn simulate(
    seed: u64,
    h_kv: usize,
    gs: usize,
    d: usize,
    bs: usize,
    num_seqs: usize,
    budget: usize,
    fetch_cap: usize,
    steps: usize,
) -> Result<(), TestCaseError> {
    let g = KvGeometry::new(h_kv * gs, h_kv, d, bs).unwrap();
    let (hq, pe, ee) = (g.num_qo_heads, g.page_elems(), g.entry_elems());
    let mut rng = Rng(seed);
    let max_blocks = 1 + (3 * bs + steps) / bs;
    let mut host_pool = BlockPool::new(Tier::Host, num_seqs * max_blocks);
    let mut gpu_pool = BlockPool::new(Tier::Gpu, num_seqs * (budget + 1));
    let num_host = host_pool.num_blocks();
    let num_pages = gpu_pool.num_blocks();
    let mut host_k = vec![0.0f32; num_host * pe];
    let mut host_v = vec![0.0f32; num_host * pe];
    let mut summaries = vec![0.0f32; num_host * h_kv * 2 * d];
    let mut k_pages: Vec<f32> = (0..num_pages * pe).map(|_| rng.f32()).collect();
    let mut v_pages: Vec<f32> = (0..num_pages * pe).map(|_| rng.f32()).collect();
    let mut page_map = vec![-1i32; num_pages * h_kv];
    let mut last_sel = vec![-1i32; num_pages * h_kv];

    // Prefill: a random context already on the host; the local page holds its last block.
    let mut seqs = Vec::new();
    for _ in 0..num_seqs {
        let ctx = 1 + rng.below(3 * bs);
        let nb = ctx.div_ceil(bs);
        let host_blocks: Vec<i32> = host_pool
            .allocate(nb)
            .unwrap()
            .into_iter()
            .map(|b| b as i32)
            .collect();
        for (b, &hb) in host_blocks.iter().enumerate() {
            let n = if b + 1 == nb { ctx - b * bs } else { bs };
            for h in 0..h_kv {
                for t in 0..n {
                    let at = ((hb as usize * h_kv + h) * bs + t) * d;
                    for x in 0..d {
                        host_k[at + x] = rng.f32();
                        host_v[at + x] = rng.f32();
                    }
                }
            }
            build_summaries(&g, &host_k, &[hb], None, &[n as i32], &mut summaries).unwrap();
        }
        let pages: Vec<i32> = gpu_pool
            .allocate(budget + 1)
            .unwrap()
            .into_iter()
            .map(|p| p as i32)
            .collect();
        let local_page = pages[budget] as usize;
        let hb = *host_blocks.last().unwrap() as usize;
        k_pages[local_page * pe..(local_page + 1) * pe]
            .copy_from_slice(&host_k[hb * pe..(hb + 1) * pe]);
        v_pages[local_page * pe..(local_page + 1) * pe]
            .copy_from_slice(&host_v[hb * pe..(hb + 1) * pe]);
        for h in 0..h_kv {
            page_map[local_page * h_kv + h] = nb as i32 - 1;
        }
        seqs.push(Seq {
            ctx,
            host_blocks,
            local_page,
            slots: pages[..budget].to_vec(),
        });
    }

    let scale = 1.0 / (d as f32).sqrt() * 2.0;
    for step in 0..steps as i32 {
        // 1. Append the current token (write-through to the host, summary update).
        let mut page_ids = Vec::new();
        let mut offsets = Vec::new();
        let mut hbs = Vec::new();
        for sq in seqs.iter_mut() {
            let off = sq.ctx % bs;
            if off == 0 {
                let hb = host_pool.allocate(1).unwrap()[0] as i32;
                sq.host_blocks.push(hb);
                for h in 0..h_kv {
                    page_map[sq.local_page * h_kv + h] = sq.host_blocks.len() as i32 - 1;
                }
            }
            page_ids.push(sq.local_page as i32);
            offsets.push(off as i32);
            hbs.push(*sq.host_blocks.last().unwrap());
            sq.ctx += 1;
        }
        let k_new: Vec<f32> = (0..num_seqs * h_kv * d).map(|_| rng.f32()).collect();
        let v_new: Vec<f32> = (0..num_seqs * h_kv * d).map(|_| rng.f32()).collect();
        append_kv(
            &g,
            &k_new,
            &v_new,
            &page_ids,
            &offsets,
            &hbs,
            None,
            &mut k_pages,
            &mut v_pages,
            &mut host_k,
            &mut host_v,
            &mut summaries,
        )
        .unwrap();
        // The incremental summary equals a full recompute.
        let mut fresh = summaries.clone();
        let lens: Vec<i32> = offsets.iter().map(|o| o + 1).collect();
        build_summaries(&g, &host_k, &hbs, None, &lens, &mut fresh).unwrap();
        prop_assert_eq!(&fresh, &summaries);

        // 2. Attention of [current; lookahead] rows over the working set + local page.
        let num_rows = 2;
        let q: Vec<f32> = (0..num_seqs * num_rows * hq * d)
            .map(|_| rng.f32())
            .collect();
        let ek: Vec<f32> = (0..num_seqs * h_kv * d).map(|_| rng.f32()).collect();
        let ev: Vec<f32> = (0..num_seqs * h_kv * d).map(|_| rng.f32()).collect();
        let mut indptr = vec![0i32];
        let mut indices = Vec::new();
        let mut last_len = Vec::new();
        for sq in &seqs {
            // Slots in a scrambled order: the result must not depend on it.
            let mut slots = sq.slots.clone();
            rng.shuffle(&mut slots);
            indices.extend(slots);
            indices.push(sq.local_page as i32);
            indptr.push(indices.len() as i32);
            last_len.push((sq.ctx - (sq.host_blocks.len() - 1) * bs) as i32);
        }
        let kv = PagedKv {
            k_pages: &k_pages,
            v_pages: &v_pages,
            kv_indptr: &indptr,
            kv_indices: &indices,
            kv_last_page_len: &last_len,
            page_map: Some(&page_map),
        };
        let extra = ExtraKv { k: &ek, v: &ev };
        let mut out = vec![0.0f32; q.len()];
        decode_attention(&g, &q, num_rows, &kv, Some(&extra), scale, &mut out).unwrap();

        for (s, sq) in seqs.iter().enumerate() {
            let nb = sq.host_blocks.len();
            for h in 0..h_kv {
                // The local block is always resident, and in no budget slot.
                prop_assert_eq!(page_map[sq.local_page * h_kv + h], nb as i32 - 1);
                let mut blocks: Vec<i32> = sq
                    .slots
                    .iter()
                    .map(|&p| page_map[p as usize * h_kv + h])
                    .filter(|&b| b >= 0)
                    .collect();
                prop_assert!(!blocks.contains(&(nb as i32 - 1)));
                blocks.sort_unstable();
                blocks.push(nb as i32 - 1);
                // Reference 1: the same kernel on a dense single-head table of exactly those
                // blocks, read from the host pool: bit-identical.
                let g1 = KvGeometry::new(gs, 1, d, bs).unwrap();
                let mut dk = Vec::new();
                let mut dv = Vec::new();
                let mut rows = Vec::new();
                for &b in &blocks {
                    let hb = sq.host_blocks[b as usize] as usize;
                    let at = (hb * h_kv + h) * ee;
                    dk.extend_from_slice(&host_k[at..at + ee]);
                    dv.extend_from_slice(&host_v[at..at + ee]);
                    let n = if b as usize + 1 == nb {
                        *last_len.get(s).unwrap() as usize
                    } else {
                        bs
                    };
                    for t in 0..n {
                        rows.push((
                            host_k[at + t * d..at + (t + 1) * d].to_vec(),
                            host_v[at + t * d..at + (t + 1) * d].to_vec(),
                        ));
                    }
                }
                let mut q1 = Vec::new();
                for r in 0..num_rows {
                    let at = ((s * num_rows + r) * hq + h * gs) * d;
                    q1.extend_from_slice(&q[at..at + gs * d]);
                }
                let e_at = (s * h_kv + h) * d;
                let extra1 = ExtraKv {
                    k: &ek[e_at..e_at + d],
                    v: &ev[e_at..e_at + d],
                };
                let ind1: Vec<i32> = (0..blocks.len() as i32).collect();
                let kv1 = PagedKv {
                    k_pages: &dk,
                    v_pages: &dv,
                    kv_indptr: &[0, blocks.len() as i32],
                    kv_indices: &ind1,
                    kv_last_page_len: &last_len[s..s + 1],
                    page_map: None,
                };
                let mut out1 = vec![0.0f32; q1.len()];
                decode_attention(&g1, &q1, num_rows, &kv1, Some(&extra1), scale, &mut out1)
                    .unwrap();
                for r in 0..num_rows {
                    let got = &out[((s * num_rows + r) * hq + h * gs) * d..][..gs * d];
                    let want = &out1[r * gs * d..(r + 1) * gs * d];
                    prop_assert!(
                        got.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "step {step} seq {s} head {h} row {r}: not bit-identical"
                    );
                    // Reference 2: naive f64 softmax over the explicit token list.
                    let mut rows_r = rows.clone();
                    if r >= 1 {
                        rows_r.push((extra1.k.to_vec(), extra1.v.to_vec()));
                    }
                    for gi in 0..gs {
                        let qa = ((s * num_rows + r) * hq + h * gs + gi) * d;
                        let want = naive_attend(&q[qa..qa + d], &rows_r, scale);
                        for x in 0..d {
                            let (a, b) = (out[qa + x] as f64, want[x]);
                            prop_assert!((a - b).abs() <= 1e-5 + 1.3e-6 * b.abs(), "{a} vs {b}");
                        }
                    }
                }
            }
        }

        // 3. Score completed blocks with the lookahead query; top-K per KV head.
        let mut blk_indptr = vec![0i32];
        let mut blk_indices = Vec::new();
        let mut q_look = Vec::new();
        for (s, sq) in seqs.iter().enumerate() {
            blk_indices.extend_from_slice(&sq.host_blocks[..sq.host_blocks.len() - 1]);
            blk_indptr.push(blk_indices.len() as i32);
            let at = ((s * num_rows + 1) * hq) * d;
            q_look.extend_from_slice(&q[at..at + hq * d]);
        }
        let mut scores = vec![0.0f32; blk_indices.len() * h_kv];
        score_blocks(
            &g,
            &q_look,
            &summaries,
            &blk_indptr,
            &blk_indices,
            &mut scores,
        )
        .unwrap();
        let num_pred = budget;
        let mut predicted = vec![0i32; num_seqs * h_kv * num_pred];
        topk_blocks(h_kv, &scores, &blk_indptr, num_pred, &mut predicted).unwrap();

        // 4. Delta selection and the gather it plans.
        let slot_pages: Vec<i32> = seqs
            .iter()
            .flat_map(|sq| sq.slots.iter().copied())
            .collect();
        let case = Case {
            h_kv,
            budget,
            num_pred,
            fetch_cap,
            nblocks: seqs.iter().map(|sq| sq.host_blocks.len()).collect(),
            slot_pages: slot_pages.clone(),
            page_map: page_map.clone(),
            last: last_sel.clone(),
            predicted: predicted.clone(),
        };
        let mut plan_slots = vec![0; num_seqs * h_kv * fetch_cap];
        let mut plan_blocks = vec![0; num_seqs * h_kv * fetch_cap];
        let stats = delta_select(
            h_kv,
            &predicted,
            num_pred,
            &slot_pages,
            budget,
            &mut page_map,
            &mut last_sel,
            step,
            fetch_cap,
            &mut plan_slots,
            &mut plan_blocks,
        )
        .unwrap();
        let host_indptr: Vec<i32> = std::iter::once(0)
            .chain(seqs.iter().scan(0, |acc, sq| {
                *acc += sq.host_blocks.len() as i32;
                Some(*acc)
            }))
            .collect();
        let host_indices: Vec<i32> = seqs
            .iter()
            .flat_map(|sq| sq.host_blocks.iter().copied())
            .collect();
        let copied = gather_blocks(
            &g,
            &plan_slots,
            &plan_blocks,
            fetch_cap,
            &slot_pages,
            budget,
            &host_indptr,
            &host_indices,
            &host_k,
            &host_v,
            &mut k_pages,
            &mut v_pages,
        )
        .unwrap();
        prop_assert_eq!(copied, stats.pairs);
        let o = Outcome {
            map: page_map.clone(),
            last: last_sel.clone(),
            plan_slots,
            plan_blocks,
            stats,
        };
        check_select(&case, &o, step)?;
        // The slot contents match the mapping.
        let mut seen: HashMap<(usize, usize), i32> = HashMap::new();
        for (s, sq) in seqs.iter().enumerate() {
            for &p in &sq.slots {
                for h in 0..h_kv {
                    let b = page_map[p as usize * h_kv + h];
                    if b < 0 {
                        continue;
                    }
                    prop_assert!(seen.insert((s * 1000 + h, b as usize), p).is_none());
                    let hb = sq.host_blocks[b as usize] as usize;
                    let (src, dst) = ((hb * h_kv + h) * ee, (p as usize * h_kv + h) * ee);
                    prop_assert_eq!(&k_pages[dst..dst + ee], &host_k[src..src + ee]);
                    prop_assert_eq!(&v_pages[dst..dst + ee], &host_v[src..src + ee]);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn decode_simulation_matches_the_mapping(
        seed in any::<u64>(),
        h_kv in 1usize..4,
        gs in 1usize..4,
        d in prop::sample::select(vec![1usize, 4, 5, 8, 16]),
        bs in 1usize..5,
        num_seqs in 1usize..3,
        budget in 1usize..5,
        cap_frac in 0usize..5,
        steps in 1usize..14,
    ) {
        let fetch_cap = 1 + cap_frac % budget;
        simulate(seed, h_kv, gs, d, bs, num_seqs, budget, fetch_cap, steps)?;
    }
}

#[test]
fn simulation_long_context_small_budget() {
    // A deterministic longer run: context far beyond the budget, cap 1.
    simulate(7, 2, 2, 8, 4, 2, 3, 1, 40).unwrap();
    simulate(8, 1, 3, 4, 2, 1, 6, 2, 30).unwrap();
}

#[test]
fn select_stats_are_summed() {
    let c = make_case(3, 2, 3, 4, 1);
    let o = run_select(&c);
    assert!(o.stats.pairs <= o.stats.missing);
    assert!(o.stats.pairs <= c.fetch_cap * 2 * 3);
}
