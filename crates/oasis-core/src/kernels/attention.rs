//! Decode attention over paged KV with an optional head-wise mapping (the working set).
//!
//! One call serves a whole batch: dense sequences (every head of a page holds the same logical
//! block, `page_map` says so or is `None`) and sparse sequences (each KV head of a budget slot
//! holds its own logical block, `page_map[page, head]`, or nothing). Row 0 of each sequence is
//! the current token; rows `>= 1` are lookahead (draft) rows, which also attend to their own K,V
//! passed in [`ExtraKv`] since it is in no page yet.
//!
//! ## Order of accumulation (why the result does not depend on slot order)
//! For each `(seq, kv head)` the entries are visited in ascending logical-block order (the
//! `page_map` value; the order of `kv_indices` when `page_map` is `None`), tokens within a page
//! in order, the extra K,V last. Scores are computed first (dot products in f32, times
//! `sm_scale`), then a two-pass softmax in f32 (max, then `exp(s - max)` and their sum in visit
//! order), then the weighted sum of V in visit order divided by that sum. A working set holding
//! the whole context in any slot order is therefore bit-identical to the dense table.
//!
//! A `(seq, kv head)` row with nothing to attend to (every slot empty and no extra K,V) yields
//! zeros.
//!
//! ## Non-finite inputs
//! NaN propagates: a NaN score (a NaN in the query or in a key it attends to, or `inf - inf` from
//! infinite ones) makes that query vector's output all NaN, and a NaN value makes the outputs
//! that weigh it NaN. The softmax max is NaN-propagating on purpose: `f32::max` (and CUDA's
//! `fmaxf`) skip NaN, which used to turn a NaN model into zero attention and a run that ended
//! with exit code 0. The GPU kernel does the same.

use crate::dtype::KvElem;
use crate::ensure;
use crate::error::{check_len, OasisError, Result};
use crate::geometry::KvGeometry;
use crate::kernels::kv8::{e4m3_table, Kv8Pages, KvTier, GPU_NAMES};
use crate::kernels::validate::{all_indices, csr, csr_range, length};

/// The paged KV of a batch, CSR over pages (flashinfer's layout) plus the head-wise mapping.
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a, T> {
    /// `[num_pages, num_kv_heads, block_size, head_dim]`
    pub k_pages: &'a [T],
    /// `[num_pages, num_kv_heads, block_size, head_dim]`
    pub v_pages: &'a [T],
    /// `[num_seqs + 1]` CSR over `kv_indices`.
    pub kv_indptr: &'a [i32],
    /// `[nnz]` GPU page ids of each sequence (`>= 1` page per sequence).
    pub kv_indices: &'a [i32],
    /// `[num_seqs]` valid tokens in the LAST page of each seq (`1..=block_size`); others full.
    pub kv_last_page_len: &'a [i32],
    /// `[num_pages, num_kv_heads]` head-wise mapping: logical block held by `(page, head)`;
    /// `< 0` = that head's slot is empty and is skipped. `None` = every entry valid.
    pub page_map: Option<&'a [i32]>,
}

/// The lookahead token's own K,V, `[num_seqs, num_kv_heads, head_dim]` each.
#[derive(Debug, Clone, Copy)]
pub struct ExtraKv<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
}

/// The paged KV of a batch in kv8 pages ([`crate::kernels::kv8`]): [`PagedKv`] with E4M3 codes
/// and per-(page, KV head) scales instead of `T` pages. A row reads as `e4m3_decode(code) *
/// scale`, exactly, and is then attended as in [`decode_attention`].
#[derive(Debug, Clone, Copy)]
pub struct PagedKv8<'a> {
    /// Codes `[num_pages, num_kv_heads, block_size, head_dim]`, scales `[num_pages, num_kv_heads]`.
    pub pages: Kv8Pages<'a>,
    /// `[num_seqs + 1]` CSR over `kv_indices`.
    pub kv_indptr: &'a [i32],
    /// `[nnz]` GPU page ids of each sequence (`>= 1` page per sequence).
    pub kv_indices: &'a [i32],
    /// `[num_seqs]` valid tokens in the LAST page of each seq (`1..=block_size`); others full.
    pub kv_last_page_len: &'a [i32],
    /// `[num_pages, num_kv_heads]` head-wise mapping, as [`PagedKv::page_map`].
    pub page_map: Option<&'a [i32]>,
}

/// Decode attention for stacked query rows (row 0 = current token, rows >= 1 = lookahead rows).
/// All rows attend to every valid (page, head) entry of their sequence; rows >= 1 additionally
/// attend to `extra` (the lookahead token's own K,V). Query head g uses KV head g / group_size.
///
/// NOTE: the CPU twin visits the entries of each (seq, kv head) in ascending logical-block order
/// (page_map value; page order when page_map is None) so that a working set holding the whole
/// context gives bit-identical results to the dense table. The GPU kernel need not.
///
/// # Errors
/// * [`OasisError::Shape`] for a buffer of the wrong size (`q`, `out`, the pools, `page_map`,
///   `kv_last_page_len`, `extra_k`, `extra_v`, `kv_indices` vs `kv_indptr`);
/// * [`OasisError::IndexOutOfRange`] for a page id in `kv_indices` outside the pool;
/// * [`OasisError::Invalid`] for `num_rows == 0`, `extra` with `num_rows < 2`, a malformed
///   `kv_indptr`, a sequence with no pages, or a `kv_last_page_len` outside `1..=block_size`.
///
/// `out` is untouched when an error is returned.
pub fn decode_attention<T: KvElem>(
    geo: &KvGeometry,
    q: &[T], // [num_seqs, num_rows, num_qo_heads, head_dim]
    num_rows: usize,
    kv: &PagedKv<T>,
    extra: Option<&ExtraKv<T>>, // requires num_rows >= 2
    sm_scale: f32,
    out: &mut [T], // [num_seqs, num_rows, num_qo_heads, head_dim]
) -> Result<()> {
    let call = Call {
        geo,
        q,
        num_rows,
        table: Table {
            kv_indptr: kv.kv_indptr,
            kv_indices: kv.kv_indices,
            kv_last_page_len: kv.kv_last_page_len,
            page_map: kv.page_map,
        },
        extra,
        sm_scale,
    };
    let pool = KvTier::Elem {
        k: kv.k_pages,
        v: kv.v_pages,
    };
    let rows = ElemRows {
        k: kv.k_pages,
        v: kv.v_pages,
    };
    attend(&call, || pool.num_pages(geo, &GPU_NAMES), &rows, out)
}

/// [`decode_attention`] over kv8 pages: the same loop, each K and V row read as `decode(code) *
/// scale` (exact in f32); queries, the extra K,V and `out` stay `T`.
///
/// # Errors
/// As [`decode_attention`]; the codes go by `k_pages` / `v_pages` and the scales by `k_scales` /
/// `v_scales` (`[num_pages, num_kv_heads]`). `out` is untouched when an error is returned.
pub fn decode_attention_kv8<T: KvElem>(
    geo: &KvGeometry,
    q: &[T], // [num_seqs, num_rows, num_qo_heads, head_dim]
    num_rows: usize,
    kv: &PagedKv8,
    extra: Option<&ExtraKv<T>>, // requires num_rows >= 2
    sm_scale: f32,
    out: &mut [T], // [num_seqs, num_rows, num_qo_heads, head_dim]
) -> Result<()> {
    let call = Call {
        geo,
        q,
        num_rows,
        table: Table {
            kv_indptr: kv.kv_indptr,
            kv_indices: kv.kv_indices,
            kv_last_page_len: kv.kv_last_page_len,
            page_map: kv.page_map,
        },
        extra,
        sm_scale,
    };
    let pool = KvTier::<T>::Kv8(kv.pages);
    let num_pages = || pool.num_pages(geo, &GPU_NAMES);
    let rows = Kv8Rows {
        pages: kv.pages,
        table: e4m3_table(),
    };
    attend(&call, num_pages, &rows, out)
}

/// The page table of a batch (both entry points).
struct Table<'a> {
    kv_indptr: &'a [i32],
    kv_indices: &'a [i32],
    kv_last_page_len: &'a [i32],
    page_map: Option<&'a [i32]>,
}

/// One call's arguments, less the pages and `out`.
struct Call<'a, T> {
    geo: &'a KvGeometry,
    q: &'a [T],
    num_rows: usize,
    table: Table<'a>,
    extra: Option<&'a ExtraKv<'a, T>>,
    sm_scale: f32,
}

/// How the loop reads a page's K or V row as f32: row at element `at` of entry `e` (= page *
/// num_kv_heads + head).
trait KvRows {
    fn load_k(&self, e: usize, at: usize, row: &mut [f32]);
    fn load_v(&self, e: usize, at: usize, row: &mut [f32]);
}

/// `T` pages: the row converted to f32.
struct ElemRows<'a, T> {
    k: &'a [T],
    v: &'a [T],
}

impl<T: KvElem> KvRows for ElemRows<'_, T> {
    #[inline]
    fn load_k(&self, _e: usize, at: usize, row: &mut [f32]) {
        load(row, &self.k[at..][..row.len()]);
    }
    #[inline]
    fn load_v(&self, _e: usize, at: usize, row: &mut [f32]) {
        load(row, &self.v[at..][..row.len()]);
    }
}

/// kv8 pages: `decode(code) * scale`, from a table of the 256 codes' values.
struct Kv8Rows<'a> {
    pages: Kv8Pages<'a>,
    table: [f32; 256],
}

impl Kv8Rows<'_> {
    #[inline]
    fn dequant(&self, codes: &[u8], scale: f32, row: &mut [f32]) {
        for (o, &c) in row.iter_mut().zip(codes) {
            *o = self.table[usize::from(c)] * scale;
        }
    }
}

impl KvRows for Kv8Rows<'_> {
    #[inline]
    fn load_k(&self, e: usize, at: usize, row: &mut [f32]) {
        let codes = &self.pages.k_codes[at..][..row.len()];
        self.dequant(codes, self.pages.k_scales[e], row);
    }
    #[inline]
    fn load_v(&self, e: usize, at: usize, row: &mut [f32]) {
        let codes = &self.pages.v_codes[at..][..row.len()];
        self.dequant(codes, self.pages.v_scales[e], row);
    }
}

/// Scratch, sized once for the longest sequence and reused for every (seq, kv head).
struct Scratch {
    scores: Vec<f32>,
    entries: Vec<(i32, u32)>,
    qf: Vec<f32>,
    acc: Vec<f32>,
    sums: Vec<f32>,
    row: Vec<f32>,
}

/// Check everything (in the documented order; `num_pages` checks the pools and counts their
/// pages), then attend every (seq, kv head).
fn attend<T: KvElem, R: KvRows>(
    c: &Call<T>,
    num_pages: impl FnOnce() -> Result<usize>,
    rows: &R,
    out: &mut [T],
) -> Result<()> {
    let (geo, kv) = (c.geo, &c.table);
    geo.validate()?;
    let (hq, h_kv, bs, d) = (
        geo.num_qo_heads,
        geo.num_kv_heads,
        geo.block_size,
        geo.head_dim,
    );
    let num_rows = c.num_rows;
    ensure!(
        num_rows >= 1,
        "num_rows must be at least 1 (row 0 is the current token)"
    );
    let num_seqs = csr("kv_indptr", kv.kv_indptr, "kv_indices", kv.kv_indices.len())?;
    check_len("q", c.q.len(), &[num_seqs, num_rows, hq, d])?;
    check_len("out", out.len(), &[num_seqs, num_rows, hq, d])?;
    check_len("kv_last_page_len", kv.kv_last_page_len.len(), &[num_seqs])?;
    let num_pages = num_pages()?;
    if let Some(pm) = kv.page_map {
        check_len("page_map", pm.len(), &[num_pages, h_kv])?;
    }
    if let Some(e) = c.extra {
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

    let nq = num_rows * geo.group_size(); // query vectors sharing one KV head
    let cols = max_tokens
        .checked_add(1)
        .and_then(|c| c.checked_mul(nq))
        .ok_or_else(|| too_large("scores"))?;
    let mut scores: Vec<f32> = Vec::new();
    scores
        .try_reserve_exact(cols)
        .map_err(|_| too_large("scores"))?;
    let mut sc = Scratch {
        scores,
        entries: Vec::new(),
        qf: vec![0.0f32; nq * d],
        acc: vec![0.0f32; nq * d],
        sums: vec![0.0f32; nq],
        row: vec![0.0f32; d],
    };
    for s in 0..num_seqs {
        for h in 0..h_kv {
            attend_head(c, rows, s, h, &mut sc, out);
        }
    }
    Ok(())
}

/// Attention of every query vector of sequence `s` that reads KV head `h` (validated call).
fn attend_head<T: KvElem, R: KvRows>(
    c: &Call<T>,
    rows: &R,
    s: usize,
    h: usize,
    sc: &mut Scratch,
    out: &mut [T],
) {
    let (geo, kv) = (c.geo, &c.table);
    let (hq, h_kv, bs, d) = (
        geo.num_qo_heads,
        geo.num_kv_heads,
        geo.block_size,
        geo.head_dim,
    );
    let (num_rows, gs, sm_scale) = (c.num_rows, geo.group_size(), c.sm_scale);
    let nq = num_rows * gs;
    let entry_elems = geo.entry_elems();
    let pages = &kv.kv_indices[csr_range(kv.kv_indptr, s)];
    let last_pos = pages.len() - 1;
    let last_len = kv.kv_last_page_len[s] as usize; // validated
    let tokens_of = |pos: usize| if pos == last_pos { last_len } else { bs };
    let Scratch {
        scores,
        entries,
        qf,
        acc,
        sums,
        row,
    } = sc;

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
    let extra_kv = c.extra.map(|e| {
        let at = (s * h_kv + h) * d;
        (&e.k[at..at + d], &e.v[at..at + d])
    });
    let ncols = ntok + 1; // column `ntok` holds the extra key's score
    scores.clear();
    scores.resize(nq * ncols, 0.0);

    for r in 0..num_rows {
        for gi in 0..gs {
            let src = ((s * num_rows + r) * hq + h * gs + gi) * d;
            load(&mut qf[(r * gs + gi) * d..][..d], &c.q[src..src + d]);
        }
    }

    // Pass 1: scores.
    let mut col = 0;
    for &(_, pos) in entries.iter() {
        let e = pages[pos as usize] as usize * h_kv + h;
        for t in 0..tokens_of(pos as usize) {
            rows.load_k(e, e * entry_elems + t * d, row);
            for qi in 0..nq {
                scores[qi * ncols + col] = dot(&qf[qi * d..][..d], row) * sm_scale;
            }
            col += 1;
        }
    }
    if let Some((ek, _)) = extra_kv {
        load(row, ek);
        for qi in gs..nq {
            scores[qi * ncols + ntok] = dot(&qf[qi * d..][..d], row) * sm_scale;
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
    for &(_, pos) in entries.iter() {
        let e = pages[pos as usize] as usize * h_kv + h;
        for t in 0..tokens_of(pos as usize) {
            rows.load_v(e, e * entry_elems + t * d, row);
            for qi in 0..nq {
                axpy(&mut acc[qi * d..][..d], scores[qi * ncols + col], row);
            }
            col += 1;
        }
    }
    if let Some((_, ev)) = extra_kv {
        load(row, ev);
        for qi in gs..nq {
            axpy(&mut acc[qi * d..][..d], scores[qi * ncols + ntok], row);
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

/// `max` that propagates NaN (`f32::max` returns the other operand).
#[inline]
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn too_large(what: &str) -> OasisError {
    OasisError::Invalid(format!("{what}: scratch size overflows memory"))
}

#[inline]
fn load<T: KvElem>(dst: &mut [f32], src: &[T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// f32 dot product with 8 independent accumulators (vectorisable, fixed order).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8; // arbitrary: one AVX register of f32
    let split = a.len().min(b.len()) / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    for (x, y) in a[..split]
        .chunks_exact(LANES)
        .zip(b[..split].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[inline]
fn axpy(acc: &mut [f32], p: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += p * v;
    }
}

#[cfg(test)]
mod tests;
