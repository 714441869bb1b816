//! The tests of the decode attention twins (float and kv8 pages) against float64 references.

use super::*;
use crate::kernels::validate::leading_rows;
use half::{bf16, f16};

/// The loop as it was before kv8 (frozen copy), to check the refactor is bit-identical.
#[allow(clippy::too_many_arguments)]
fn decode_attention_frozen<T: KvElem>(
    geo: &KvGeometry,
    q: &[T], // [num_seqs, num_rows, num_qo_heads, head_dim]
    num_rows: usize,
    kv: &PagedKv<T>,
    extra: Option<&ExtraKv<T>>, // requires num_rows >= 2
    sm_scale: f32,
    out: &mut [T], // [num_seqs, num_rows, num_qo_heads, head_dim]
) -> Result<()> {
    geo.validate()?;
    let (hq, h_kv, bs, d) = (
        geo.num_qo_heads,
        geo.num_kv_heads,
        geo.block_size,
        geo.head_dim,
    );
    let gs = geo.group_size();
    ensure!(
        num_rows >= 1,
        "num_rows must be at least 1 (row 0 is the current token)"
    );
    let num_seqs = csr("kv_indptr", kv.kv_indptr, "kv_indices", kv.kv_indices.len())?;
    check_len("q", q.len(), &[num_seqs, num_rows, hq, d])?;
    check_len("out", out.len(), &[num_seqs, num_rows, hq, d])?;
    check_len("kv_last_page_len", kv.kv_last_page_len.len(), &[num_seqs])?;
    let num_pages = leading_rows("k_pages", kv.k_pages.len(), &[h_kv, bs, d])?;
    check_len("v_pages", kv.v_pages.len(), &[num_pages, h_kv, bs, d])?;
    if let Some(pm) = kv.page_map {
        check_len("page_map", pm.len(), &[num_pages, h_kv])?;
    }
    if let Some(e) = extra {
        ensure!(
            num_rows >= 2,
            "extra K,V is attended by lookahead rows only, but num_rows = {num_rows} (need >= 2)"
        );
        check_len("extra_k", e.k.len(), &[num_seqs, h_kv, d])?;
        check_len("extra_v", e.v.len(), &[num_seqs, h_kv, d])?;
    }
    all_indices("kv_indices", kv.kv_indices, num_pages)?;
    let mut max_tokens = 0usize;
    for s in 0..num_seqs {
        let pages = csr_range(kv.kv_indptr, s).len();
        ensure!(
            pages >= 1,
            "sequence {s} has no pages (every sequence needs at least its last page)"
        );
        let last = length("kv_last_page_len", s, kv.kv_last_page_len[s], bs)?;
        let tokens = (pages - 1)
            .checked_mul(bs)
            .and_then(|t| t.checked_add(last));
        max_tokens = max_tokens.max(tokens.ok_or_else(|| too_large("tokens in a sequence"))?);
    }

    if num_seqs == 0 {
        // NOTE: also keeps absurd `num_rows` / head counts from sizing the scratch below; with
        // at least one sequence they are bounded by `q.len()`.
        return Ok(());
    }

    // Scratch, sized once for the longest sequence and reused for every (seq, kv head).
    let nq = num_rows * gs; // query vectors sharing one KV head
    let cols = max_tokens
        .checked_add(1)
        .and_then(|c| c.checked_mul(nq))
        .ok_or_else(|| too_large("scores"))?;
    let mut scores: Vec<f32> = Vec::new();
    scores
        .try_reserve_exact(cols)
        .map_err(|_| too_large("scores"))?;
    let mut entries: Vec<(i32, u32)> = Vec::new();
    let mut qf = vec![0.0f32; nq * d];
    let mut acc = vec![0.0f32; nq * d];
    let mut sums = vec![0.0f32; nq];
    let mut row = vec![0.0f32; d];

    let page_elems = geo.page_elems();
    let entry_elems = geo.entry_elems();
    for s in 0..num_seqs {
        let range = csr_range(kv.kv_indptr, s);
        let pages = &kv.kv_indices[range];
        let last_pos = pages.len() - 1;
        let last_len = kv.kv_last_page_len[s] as usize; // validated
        let tokens_of = |pos: usize| if pos == last_pos { last_len } else { bs };
        for h in 0..h_kv {
            // Visit order: ascending logical block; position in the list breaks ties.
            entries.clear();
            for (pos, &page) in pages.iter().enumerate() {
                // pos < nnz <= i32::MAX, page validated.
                let key = match kv.page_map {
                    Some(pm) => pm[page as usize * h_kv + h],
                    None => pos as i32,
                };
                if key >= 0 {
                    entries.push((key, pos as u32));
                }
            }
            if kv.page_map.is_some() {
                entries.sort_unstable();
            }
            let ntok: usize = entries
                .iter()
                .map(|&(_, pos)| tokens_of(pos as usize))
                .sum();
            let extra_kv = extra.map(|e| {
                let at = (s * h_kv + h) * d;
                (&e.k[at..at + d], &e.v[at..at + d])
            });
            let ncols = ntok + 1; // column `ntok` holds the extra key's score
            scores.clear();
            scores.resize(nq * ncols, 0.0);

            for r in 0..num_rows {
                for gi in 0..gs {
                    let src = ((s * num_rows + r) * hq + h * gs + gi) * d;
                    load(&mut qf[(r * gs + gi) * d..][..d], &q[src..src + d]);
                }
            }

            // Pass 1: scores.
            let mut col = 0;
            for &(_, pos) in &entries {
                let base = pages[pos as usize] as usize * page_elems + h * entry_elems;
                for t in 0..tokens_of(pos as usize) {
                    load(&mut row, &kv.k_pages[base + t * d..][..d]);
                    for qi in 0..nq {
                        scores[qi * ncols + col] = dot(&qf[qi * d..][..d], &row) * sm_scale;
                    }
                    col += 1;
                }
            }
            if let Some((ek, _)) = extra_kv {
                load(&mut row, ek);
                for qi in gs..nq {
                    scores[qi * ncols + ntok] = dot(&qf[qi * d..][..d], &row) * sm_scale;
                }
            }

            // Softmax numerators and denominators, f32, in visit order.
            for qi in 0..nq {
                let n = if qi >= gs && extra_kv.is_some() {
                    ntok + 1
                } else {
                    ntok
                };
                let p = &mut scores[qi * ncols..][..n];
                let m = p.iter().copied().fold(f32::NEG_INFINITY, max_nan);
                let mut l = 0.0f32;
                for x in p.iter_mut() {
                    *x = (*x - m).exp();
                    l += *x;
                }
                sums[qi] = l;
            }

            // Pass 2: weighted sum of V.
            acc.fill(0.0);
            let mut col = 0;
            for &(_, pos) in &entries {
                let base = pages[pos as usize] as usize * page_elems + h * entry_elems;
                for t in 0..tokens_of(pos as usize) {
                    load(&mut row, &kv.v_pages[base + t * d..][..d]);
                    for qi in 0..nq {
                        axpy(&mut acc[qi * d..][..d], scores[qi * ncols + col], &row);
                    }
                    col += 1;
                }
            }
            if let Some((_, ev)) = extra_kv {
                load(&mut row, ev);
                for qi in gs..nq {
                    axpy(&mut acc[qi * d..][..d], scores[qi * ncols + ntok], &row);
                }
            }

            for r in 0..num_rows {
                for gi in 0..gs {
                    let qi = r * gs + gi;
                    let dst = ((s * num_rows + r) * hq + h * gs + gi) * d;
                    let l = sums[qi];
                    let a = &acc[qi * d..][..d];
                    for (o, &x) in out[dst..dst + d].iter_mut().zip(a) {
                        // Nothing attended (l == 0): zeros rather than 0/0. A NaN l stays NaN.
                        *o = T::from_f32(if l != 0.0 { x / l } else { 0.0 });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Deterministic pseudo-random values in [-1, 1).
fn rand_vec<T: KvElem>(n: usize, seed: u64) -> Vec<T> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// Naive reference in f64: walks the table, assembles the explicit list of (k, v) rows of
/// each (seq, kv head) in logical order, then a textbook softmax.
#[allow(clippy::too_many_arguments)]
fn naive<T: KvElem>(
    g: &KvGeometry,
    q: &[T],
    num_rows: usize,
    kv: &PagedKv<T>,
    extra: Option<&ExtraKv<T>>,
    sm_scale: f32,
) -> Vec<f64> {
    let (hq, h_kv, bs, d) = (g.num_qo_heads, g.num_kv_heads, g.block_size, g.head_dim);
    let num_seqs = kv.kv_indptr.len() - 1;
    let mut out = vec![0.0f64; num_seqs * num_rows * hq * d];
    for s in 0..num_seqs {
        let pages: Vec<usize> = (kv.kv_indptr[s] as usize..kv.kv_indptr[s + 1] as usize)
            .map(|j| kv.kv_indices[j] as usize)
            .collect();
        for qh in 0..hq {
            let h = qh / (hq / h_kv);
            let mut blocks: Vec<(i64, usize, usize)> = Vec::new(); // (logical, page, ntok)
            for (pos, &p) in pages.iter().enumerate() {
                let logical = kv.page_map.map_or(pos as i64, |pm| pm[p * h_kv + h] as i64);
                let ntok = if pos + 1 == pages.len() {
                    kv.kv_last_page_len[s] as usize
                } else {
                    bs
                };
                if logical >= 0 {
                    blocks.push((logical, p, ntok));
                }
            }
            blocks.sort();
            let mut rows: Vec<(Vec<f64>, Vec<f64>)> = Vec::new();
            for &(_, p, ntok) in &blocks {
                for t in 0..ntok {
                    let at = ((p * h_kv + h) * bs + t) * d;
                    let k = kv.k_pages[at..at + d]
                        .iter()
                        .map(|x| x.to_f32() as f64)
                        .collect();
                    let v = kv.v_pages[at..at + d]
                        .iter()
                        .map(|x| x.to_f32() as f64)
                        .collect();
                    rows.push((k, v));
                }
            }
            for r in 0..num_rows {
                let mut rows = rows.clone();
                if let (Some(e), true) = (extra, r >= 1) {
                    let at = (s * h_kv + h) * d;
                    rows.push((
                        e.k[at..at + d].iter().map(|x| x.to_f32() as f64).collect(),
                        e.v[at..at + d].iter().map(|x| x.to_f32() as f64).collect(),
                    ));
                }
                let qa = ((s * num_rows + r) * hq + qh) * d;
                let qv: Vec<f64> = q[qa..qa + d].iter().map(|x| x.to_f32() as f64).collect();
                let logits: Vec<f64> = rows
                    .iter()
                    .map(|(k, _)| {
                        k.iter().zip(&qv).map(|(a, b)| a * b).sum::<f64>() * sm_scale as f64
                    })
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for x in 0..d {
                    let num: f64 = rows.iter().zip(&w).map(|((_, v), w)| w * v[x]).sum();
                    out[qa + x] = if z > 0.0 { num / z } else { 0.0 };
                }
            }
        }
    }
    out
}

/// (atol, rtol) per dtype: the house tolerance table.
fn tol<T: KvElem>() -> (f64, f64) {
    match T::DTYPE {
        crate::DType::F32 => (1e-5, 1.3e-6),
        crate::DType::F16 => (1e-3, 1e-3),
        crate::DType::BF16 => (1e-3, 1.6e-2),
    }
}

fn assert_close<T: KvElem>(got: &[T], want: &[f64]) {
    let (atol, rtol) = tol::<T>();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "element {i}: got {g}, want {w} ({:?})",
            T::DTYPE
        );
    }
}

/// A batch of sequences with `blocks[s]` logical blocks each, stored densely (pages in
/// logical order, seq after seq) in a pool with a couple of spare pages.
struct Dense<T> {
    k: Vec<T>,
    v: Vec<T>,
    indptr: Vec<i32>,
    indices: Vec<i32>,
    last: Vec<i32>,
}

fn dense<T: KvElem>(g: &KvGeometry, blocks: &[usize], last: &[i32], seed: u64) -> Dense<T> {
    let total: usize = blocks.iter().sum();
    let num_pages = total + 2;
    let mut indptr = vec![0];
    let mut indices = Vec::new();
    // Pages in reverse pool order, to make sure no code assumes page id == logical block.
    let mut next = num_pages as i32 - 1;
    for &b in blocks {
        for _ in 0..b {
            indices.push(next);
            next -= 1;
        }
        indptr.push(indices.len() as i32);
    }
    Dense {
        k: rand_vec(num_pages * g.page_elems(), seed),
        v: rand_vec(num_pages * g.page_elems(), seed + 1),
        indptr,
        indices,
        last: last.to_vec(),
    }
}

fn run_case<T: KvElem>(
    g: &KvGeometry,
    blocks: &[usize],
    last: &[i32],
    num_rows: usize,
    with_extra: bool,
) {
    let num_seqs = blocks.len();
    let dn = dense::<T>(g, blocks, last, 11);
    let q: Vec<T> = rand_vec(num_seqs * num_rows * g.num_qo_heads * g.head_dim, 5);
    let ek: Vec<T> = rand_vec(num_seqs * g.num_kv_heads * g.head_dim, 7);
    let ev: Vec<T> = rand_vec(num_seqs * g.num_kv_heads * g.head_dim, 8);
    let extra = ExtraKv { k: &ek, v: &ev };
    let extra = with_extra.then_some(&extra);
    let kv = PagedKv {
        k_pages: &dn.k,
        v_pages: &dn.v,
        kv_indptr: &dn.indptr,
        kv_indices: &dn.indices,
        kv_last_page_len: &dn.last,
        page_map: None,
    };
    let scale = 1.0 / (g.head_dim as f32).sqrt() * 3.0;
    let mut out = vec![T::from_f32(f32::NAN); q.len()];
    decode_attention(g, &q, num_rows, &kv, extra, scale, &mut out).unwrap();
    assert_close(&out, &naive(g, &q, num_rows, &kv, extra, scale));
}

#[test]
fn matches_naive_dense() {
    for (hq, h_kv, d, bs) in [(4, 4, 16, 4), (6, 2, 9, 5), (8, 1, 32, 16), (3, 3, 1, 1)] {
        let g = KvGeometry::new(hq, h_kv, d, bs).unwrap();
        let bs = bs as i32;
        let blocks = [3, 1, 7];
        let last = [bs, 1, (bs + 1) / 2];
        run_case::<f32>(&g, &blocks, &last, 1, false);
        run_case::<f32>(&g, &blocks, &last, 2, true);
        run_case::<f32>(&g, &blocks, &last, 3, false);
        run_case::<bf16>(&g, &blocks, &last, 2, true);
        run_case::<f16>(&g, &blocks, &last, 3, true);
    }
}

/// The working set holds every logical block of each sequence, each KV head in its own random
/// slot order, plus empty slots with garbage; the partial local block is the last page.
fn shuffled_equals_dense<T: KvElem>() {
    let g = KvGeometry::new(6, 3, 8, 4).unwrap();
    let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
    let blocks = [5usize, 1, 3];
    let last = [2, 3, 4];
    let num_rows = 2;
    let dn = dense::<T>(&g, &blocks, &last, 21);
    let spare = 2; // empty slots per sequence
    let num_pages: usize = blocks.iter().map(|b| b + spare).sum::<usize>() + 1;
    let mut wk: Vec<T> = rand_vec(num_pages * g.page_elems(), 99); // garbage everywhere
    let mut wv: Vec<T> = rand_vec(num_pages * g.page_elems(), 98);
    let mut page_map = vec![-1i32; num_pages * h_kv];
    let mut indptr = vec![0i32];
    let mut indices = Vec::new();
    // Pages handed out in a scrambled order.
    let mut free: Vec<usize> = (0..num_pages).map(|i| (i * 7 + 3) % num_pages).collect();
    let mut seed = 1u64;
    for (s, &nb) in blocks.iter().enumerate() {
        let slots: Vec<usize> = (0..nb - 1 + spare).map(|_| free.pop().unwrap()).collect();
        let local = free.pop().unwrap();
        let logical_of = |b: usize| dn.indices[dn.indptr[s] as usize + b] as usize;
        for h in 0..h_kv {
            // A per-head permutation of the slots: block b -> slots[perm[b]].
            let mut perm: Vec<usize> = (0..slots.len()).collect();
            for i in (1..perm.len()).rev() {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                perm.swap(i, (seed >> 33) as usize % (i + 1));
            }
            for b in 0..nb - 1 {
                let page = slots[perm[b]];
                page_map[page * h_kv + h] = b as i32;
                let (src, dst) = (
                    (logical_of(b) * h_kv + h) * bs * d,
                    (page * h_kv + h) * bs * d,
                );
                wk[dst..dst + bs * d].copy_from_slice(&dn.k[src..src + bs * d]);
                wv[dst..dst + bs * d].copy_from_slice(&dn.v[src..src + bs * d]);
            }
            page_map[local * h_kv + h] = nb as i32 - 1;
        }
        let src = logical_of(nb - 1) * g.page_elems();
        let dst = local * g.page_elems();
        wk[dst..dst + g.page_elems()].copy_from_slice(&dn.k[src..src + g.page_elems()]);
        wv[dst..dst + g.page_elems()].copy_from_slice(&dn.v[src..src + g.page_elems()]);
        indices.extend(slots.iter().map(|&p| p as i32));
        indices.push(local as i32);
        indptr.push(indices.len() as i32);
    }
    let q: Vec<T> = rand_vec(blocks.len() * num_rows * g.num_qo_heads * d, 3);
    let ek: Vec<T> = rand_vec(blocks.len() * h_kv * d, 4);
    let ev: Vec<T> = rand_vec(blocks.len() * h_kv * d, 5);
    let extra = ExtraKv { k: &ek, v: &ev };
    let scale = 0.7;
    let dense_kv = PagedKv {
        k_pages: &dn.k,
        v_pages: &dn.v,
        kv_indptr: &dn.indptr,
        kv_indices: &dn.indices,
        kv_last_page_len: &dn.last,
        page_map: None,
    };
    let ws_kv = PagedKv {
        k_pages: &wk,
        v_pages: &wv,
        kv_indptr: &indptr,
        kv_indices: &indices,
        kv_last_page_len: &last,
        page_map: Some(&page_map),
    };
    for extra in [None, Some(&extra)] {
        let mut a = vec![T::from_f32(0.0); q.len()];
        let mut b = vec![T::from_f32(1.0); q.len()];
        decode_attention(&g, &q, num_rows, &dense_kv, extra, scale, &mut a).unwrap();
        decode_attention(&g, &q, num_rows, &ws_kv, extra, scale, &mut b).unwrap();
        let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{:?}", T::DTYPE);
        assert_close(&b, &naive(&g, &q, num_rows, &ws_kv, extra, scale));
    }
}

/// The row-reader loop gives the same bits as the loop before kv8, over random tables with
/// holes in the head-wise mapping, lookahead rows and every storage dtype.
fn same_as_frozen<T: KvElem>() {
    let mut seed = 17u64;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as usize) % n.max(1)
    };
    for case in 0..24 {
        let (hq, h_kv) = [(4, 4), (8, 2), (6, 3), (8, 1)][case % 4];
        let (d, bs) = [(16, 4), (9, 5), (32, 8)][case % 3];
        let g = KvGeometry::new(hq, h_kv, d, bs).unwrap();
        let num_pages = 6 + next(6);
        let num_seqs = 1 + next(3);
        let num_rows = 1 + next(3);
        let mut indptr = vec![0i32];
        let mut indices = Vec::new();
        let mut last = Vec::new();
        for _ in 0..num_seqs {
            for _ in 0..1 + next(4) {
                indices.push(next(num_pages) as i32);
            }
            indptr.push(indices.len() as i32);
            last.push(1 + next(bs) as i32);
        }
        let pm: Vec<i32> = (0..num_pages * h_kv).map(|_| next(12) as i32 - 3).collect();
        let k: Vec<T> = rand_vec(num_pages * g.page_elems(), case as u64);
        let v: Vec<T> = rand_vec(num_pages * g.page_elems(), case as u64 + 100);
        let q: Vec<T> = rand_vec(num_seqs * num_rows * hq * d, case as u64 + 200);
        let ek: Vec<T> = rand_vec(num_seqs * h_kv * d, case as u64 + 300);
        let ev: Vec<T> = rand_vec(num_seqs * h_kv * d, case as u64 + 400);
        let extra = ExtraKv { k: &ek, v: &ev };
        for page_map in [None, Some(&pm[..])] {
            let kv = PagedKv {
                k_pages: &k,
                v_pages: &v,
                kv_indptr: &indptr,
                kv_indices: &indices,
                kv_last_page_len: &last,
                page_map,
            };
            let extra = (num_rows >= 2).then_some(&extra);
            let mut a = vec![T::from_f32(0.0); q.len()];
            let mut b = vec![T::from_f32(1.0); q.len()];
            decode_attention(&g, &q, num_rows, &kv, extra, 0.3, &mut a).unwrap();
            decode_attention_frozen(&g, &q, num_rows, &kv, extra, 0.3, &mut b).unwrap();
            let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "case {case} {:?}", T::DTYPE);
        }
    }
}

#[test]
fn row_reader_loop_is_bit_identical_to_the_old_loop() {
    same_as_frozen::<f32>();
    same_as_frozen::<bf16>();
    same_as_frozen::<f16>();
}

#[test]
fn shuffled_working_set_is_bit_exact_with_dense() {
    shuffled_equals_dense::<f32>();
    shuffled_equals_dense::<bf16>();
    shuffled_equals_dense::<f16>();
}

#[test]
fn empty_head_gives_zeros_or_the_extra_value() {
    let g = KvGeometry::new(2, 2, 4, 2).unwrap();
    let k = rand_vec::<f32>(g.page_elems(), 1);
    let page_map = [3, -1]; // head 1's only slot is empty
    let kv = PagedKv {
        k_pages: &k,
        v_pages: &k,
        kv_indptr: &[0, 1],
        kv_indices: &[0],
        kv_last_page_len: &[2],
        page_map: Some(&page_map),
    };
    let q = rand_vec::<f32>(2 * 2 * 4, 2);
    let ev = [0.25f32, -0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let extra = ExtraKv { k: &ev, v: &ev };
    let mut out = vec![f32::NAN; q.len()];
    decode_attention(&g, &q, 2, &kv, Some(&extra), 1.0, &mut out).unwrap();
    // Row 0, head 1: nothing to attend to.
    assert_eq!(&out[4..8], &[0.0; 4]);
    // Row 1, head 1: only its own value.
    assert_eq!(&out[12..16], &ev[4..8]);
    assert_close(&out, &naive(&g, &q, 2, &kv, Some(&extra), 1.0));
}

/// NaN in, NaN out for exactly the outputs that see it; the others stay finite. (The softmax
/// max used to skip NaN and the output test `l > 0` turned the NaN sum into zeros.)
#[test]
fn nan_propagates_to_the_outputs_that_see_it() {
    // 2 sequences of 2 pages, 4 query heads over 2 KV heads, 2 rows (row 1 sees the extra K,V).
    let g = KvGeometry::new(4, 2, 4, 2).unwrap();
    let (hq, d) = (4, 4);
    let k = rand_vec::<f32>(4 * g.page_elems(), 3);
    let v = rand_vec::<f32>(4 * g.page_elems(), 4);
    let q = rand_vec::<f32>(2 * 2 * hq * d, 5);
    let ek = rand_vec::<f32>(2 * 2 * d, 6);
    let ev = rand_vec::<f32>(2 * 2 * d, 7);
    let run = |q: &[f32], k: &[f32], v: &[f32], ek: &[f32]| {
        let kv = PagedKv {
            k_pages: k,
            v_pages: v,
            kv_indptr: &[0, 2, 4],
            kv_indices: &[0, 1, 2, 3],
            kv_last_page_len: &[2, 1],
            page_map: None,
        };
        let extra = ExtraKv { k: ek, v: &ev };
        let mut out = vec![0.0f32; q.len()];
        decode_attention(&g, q, 2, &kv, Some(&extra), 0.5, &mut out).unwrap();
        out
    };
    // out[s, r, qh, :] holds NaN exactly for the listed (s, r, qh); `value`: from a NaN value.
    let check = |out: &[f32], nan: &[(usize, usize, usize)], value: bool| {
        for s in 0..2 {
            for r in 0..2 {
                for qh in 0..hq {
                    let at = ((s * 2 + r) * hq + qh) * d;
                    let row = &out[at..at + d];
                    if nan.contains(&(s, r, qh)) {
                        // A NaN score spoils every element; a NaN value its own element.
                        let n = row.iter().filter(|x| x.is_nan()).count();
                        assert_eq!(
                            n,
                            if value { 1 } else { d },
                            "out[{s}, {r}, {qh}] = {row:?}"
                        );
                    } else {
                        assert!(
                            row.iter().all(|x| x.is_finite()),
                            "out[{s}, {r}, {qh}] = {row:?}"
                        );
                    }
                }
            }
        }
    };
    check(&run(&q, &k, &v, &ek), &[], false);

    // A NaN in one query vector (seq 0, row 0, query head 1): only that output.
    let mut qn = q.clone();
    qn[d + 2] = f32::NAN;
    check(&run(&qn, &k, &v, &ek), &[(0, 0, 1)], false);

    // A NaN key in page 3 (seq 1), KV head 1, token 0: every row of query heads 2 and 3.
    let mut kn = k.clone();
    kn[3 * g.page_elems() + g.entry_elems()] = f32::NAN;
    check(
        &run(&q, &kn, &v, &ek),
        &[(1, 0, 2), (1, 0, 3), (1, 1, 2), (1, 1, 3)],
        false,
    );

    // A NaN value in page 0 (seq 0), KV head 0, token 1.
    let mut vn = v.clone();
    vn[d + 1] = f32::NAN;
    check(
        &run(&q, &k, &vn, &ek),
        &[(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)],
        true,
    );

    // A NaN in the extra key of seq 0, KV head 1: row 1 only (row 0 does not see it).
    let mut ekn = ek.clone();
    ekn[d] = f32::NAN;
    check(&run(&q, &k, &v, &ekn), &[(0, 1, 2), (0, 1, 3)], false);
}

#[test]
fn validation_errors() {
    let g = KvGeometry::new(4, 2, 4, 2).unwrap();
    let k = vec![0.5f32; 3 * g.page_elems()];
    let q = vec![0.1f32; 2 * 4 * 4];
    let ex = vec![0.0f32; 2 * 2 * 4];
    let pm = vec![0i32; 3 * 2];
    let base = PagedKv {
        k_pages: &k,
        v_pages: &k,
        kv_indptr: &[0, 2, 3],
        kv_indices: &[0, 1, 2],
        kv_last_page_len: &[1, 2],
        page_map: Some(&pm),
    };
    let mut out = vec![7.0f32; q.len()];
    let mut run = |kv: PagedKv<f32>, q: &[f32], rows: usize, extra: Option<&ExtraKv<f32>>| {
        let r = decode_attention(&g, q, rows, &kv, extra, 1.0, &mut out);
        assert!(out.iter().all(|&x| x == 7.0), "out written on error");
        r
    };
    let shape = |r: Result<()>, what: &str| match r {
        Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected shape error for {what}, got {other:?}"),
    };
    let invalid = |r: Result<()>| assert!(matches!(r, Err(OasisError::Invalid(_))), "{r:?}");

    shape(run(base, &q[1..], 1, None), "q");
    shape(
        run(
            PagedKv {
                kv_last_page_len: &[1],
                ..base
            },
            &q,
            1,
            None,
        ),
        "kv_last_page_len",
    );
    shape(
        run(
            PagedKv {
                k_pages: &k[1..],
                ..base
            },
            &q,
            1,
            None,
        ),
        "k_pages",
    );
    shape(
        run(
            PagedKv {
                v_pages: &k[1..],
                ..base
            },
            &q,
            1,
            None,
        ),
        "v_pages",
    );
    shape(
        run(
            PagedKv {
                page_map: Some(&pm[1..]),
                ..base
            },
            &q,
            1,
            None,
        ),
        "page_map",
    );
    shape(
        run(
            PagedKv {
                kv_indices: &[0, 1],
                ..base
            },
            &q,
            1,
            None,
        ),
        "kv_indices",
    );
    shape(
        run(
            PagedKv {
                kv_indptr: &[],
                ..base
            },
            &[],
            1,
            None,
        ),
        "kv_indptr",
    );
    let r = run(
        PagedKv {
            kv_indices: &[0, 3, 1],
            ..base
        },
        &q,
        1,
        None,
    );
    assert!(matches!(
        r,
        Err(OasisError::IndexOutOfRange {
            what: "kv_indices",
            index: 3,
            bound: 3
        })
    ));
    let r = run(
        PagedKv {
            kv_indices: &[0, -1, 1],
            ..base
        },
        &q,
        1,
        None,
    );
    assert!(matches!(
        r,
        Err(OasisError::IndexOutOfRange {
            what: "kv_indices",
            index: -1,
            ..
        })
    ));
    invalid(run(
        PagedKv {
            kv_indptr: &[1, 2, 3],
            ..base
        },
        &q,
        1,
        None,
    ));
    invalid(run(
        PagedKv {
            kv_indptr: &[0, 3, 2],
            ..base
        },
        &q,
        1,
        None,
    ));
    invalid(run(
        PagedKv {
            kv_indptr: &[0, 0, 3],
            ..base
        },
        &q,
        1,
        None,
    )); // empty seq
    invalid(run(
        PagedKv {
            kv_last_page_len: &[0, 2],
            ..base
        },
        &q,
        1,
        None,
    ));
    invalid(run(
        PagedKv {
            kv_last_page_len: &[1, 3],
            ..base
        },
        &q,
        1,
        None,
    ));
    invalid(run(base, &[], 0, None));
    // Extra K,V needs a lookahead row.
    let extra = ExtraKv { k: &ex, v: &ex };
    invalid(run(base, &q, 1, Some(&extra)));
    let q2 = vec![0.1f32; 2 * 2 * 4 * 4];
    let mut out2 = vec![0.0f32; q2.len()];
    let bad = ExtraKv {
        k: &ex[1..],
        v: &ex,
    };
    let r = decode_attention(&g, &q2, 2, &base, Some(&bad), 1.0, &mut out2);
    shape(r, "extra_k");
    let bad = ExtraKv {
        k: &ex,
        v: &ex[1..],
    };
    shape(
        decode_attention(&g, &q2, 2, &base, Some(&bad), 1.0, &mut out2),
        "extra_v",
    );
    shape(
        decode_attention(&g, &q, 2, &base, None, 1.0, &mut out2),
        "q",
    );
    shape(
        decode_attention(&g, &q2, 2, &base, None, 1.0, &mut out2[1..]),
        "out",
    );
    decode_attention(&g, &q2, 2, &base, Some(&extra), 1.0, &mut out2).unwrap();
    // No sequences at all is a valid, empty call.
    let none = PagedKv {
        kv_indptr: &[0],
        kv_indices: &[],
        kv_last_page_len: &[],
        ..base
    };
    decode_attention(&g, &[], 1, &none, None, 1.0, &mut []).unwrap();
}
