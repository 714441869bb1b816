//! Shared argument checks. Every kernel runs all of its checks before its first write, so these
//! helpers only read; they turn every bad size or table entry into an [`OasisError`].

use crate::error::{check_len, OasisError, Result};

/// Number of leading rows of a buffer shaped `[rows, row_shape...]`: `len` must be a whole
/// multiple of the row size. Used for pools whose row count is implied by the buffer.
pub(crate) fn leading_rows(what: &'static str, len: usize, row_shape: &[usize]) -> Result<usize> {
    let row = row_shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match row {
        Some(row) if row > 0 && len.is_multiple_of(row) => Ok(len / row),
        Some(0) if len == 0 => Ok(0),
        _ => Err(OasisError::Shape {
            what,
            expected: format!(
                "[n, {}] (a multiple of {} elements)",
                join(row_shape),
                fmt_opt(row)
            ),
            got: format!("{len} elements"),
        }),
    }
}

fn join(shape: &[usize]) -> String {
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn fmt_opt(x: Option<usize>) -> String {
    x.map_or_else(|| "overflowing".to_string(), |x| x.to_string())
}

/// The two tables of a selection plan, given by their lengths: `plan_slots` and `plan_blocks`,
/// both of `shape` `[num_seqs, num_kv_heads, fetch_cap]`.
pub(crate) fn plan_shape(plan_slots: usize, plan_blocks: usize, shape: [usize; 3]) -> Result<()> {
    check_len("plan_slots", plan_slots, &shape)?;
    check_len("plan_blocks", plan_blocks, &shape)
}

/// A table entry that must index `0..bound`.
#[inline]
pub(crate) fn index(what: &'static str, value: i32, bound: usize) -> Result<usize> {
    match usize::try_from(value) {
        Ok(i) if i < bound => Ok(i),
        _ => Err(OasisError::IndexOutOfRange {
            what,
            index: i64::from(value),
            bound,
        }),
    }
}

/// Check every entry of an index table against `0..bound` (negative entries included).
pub(crate) fn all_indices(what: &'static str, table: &[i32], bound: usize) -> Result<()> {
    for &v in table {
        index(what, v, bound)?;
    }
    Ok(())
}

/// A CSR `indptr` over `nnz` entries: at least one element, starts at 0, non-decreasing, ends at
/// `nnz`. Returns the number of rows (sequences), `indptr.len() - 1`.
pub(crate) fn csr(
    indptr_what: &'static str,
    indptr: &[i32],
    indices_what: &'static str,
    nnz: usize,
) -> Result<usize> {
    let Some((&last, _)) = indptr.split_last() else {
        return Err(OasisError::Shape {
            what: indptr_what,
            expected: "[num_seqs + 1] (at least 1 element)".to_string(),
            got: "0 elements".to_string(),
        });
    };
    if indptr[0] != 0 {
        return Err(OasisError::Invalid(format!(
            "{indptr_what}[0] must be 0, got {}",
            indptr[0]
        )));
    }
    for (s, w) in indptr.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(OasisError::Invalid(format!(
                "{indptr_what} must be non-decreasing: {indptr_what}[{}] = {} < {indptr_what}[{s}] = {}",
                s + 1,
                w[1],
                w[0]
            )));
        }
    }
    // `last >= 0` since indptr[0] == 0 and it never decreases.
    let last = last as usize;
    if last != nnz {
        return Err(OasisError::Shape {
            what: indices_what,
            expected: format!("[{last}] ({indptr_what}[-1])"),
            got: format!("{nnz} elements"),
        });
    }
    Ok(indptr.len() - 1)
}

/// The `[start, end)` range of row `s` of a CSR table already checked by [`csr`].
#[inline]
pub(crate) fn csr_range(indptr: &[i32], s: usize) -> std::ops::Range<usize> {
    // Both casts are of values checked non-negative by `csr`.
    indptr[s] as usize..indptr[s + 1] as usize
}

/// A length entry that must lie in `1..=max`.
pub(crate) fn length(what: &'static str, i: usize, value: i32, max: usize) -> Result<usize> {
    match usize::try_from(value) {
        Ok(n) if n >= 1 && n <= max => Ok(n),
        _ => Err(OasisError::Invalid(format!(
            "{what}[{i}] = {value}, expected 1..={max}"
        ))),
    }
}
