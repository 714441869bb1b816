//! [`Runtime::check_invariants`]: every table against the pools (tests and debug builds).

use super::*;

impl Runtime {
    /// Check every invariant of the tables against the pools (tests and debug builds).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let mut owner_gpu = HashMap::new();
        let mut owner_host = HashMap::new();
        let mut owner_row = HashMap::new();
        let (mut res_gpu, mut res_host, mut res_rows) = (0, 0, 0);
        let bad = |m: String| Err(OasisError::Invalid(m));
        for t in self.reqs.values() {
            res_gpu += t.reservation.gpu_pages;
            res_host += t.reservation.host_blocks;
            res_rows += t.reservation.host_rows;
            for r in t.all_rows() {
                if self.rows.is_free(r) || owner_row.insert(r, t.id).is_some() {
                    return bad(format!(
                        "host row {r} of request {} is free or shared",
                        t.id
                    ));
                }
            }
            if t.host_rows.len() != t.host_blocks.len() {
                return bad(format!(
                    "request {} has {} host rows for {} host blocks",
                    t.id,
                    t.host_rows.len(),
                    t.host_blocks.len()
                ));
            }
            if let Some(c) = &t.cache {
                c.check_invariants()?;
                let filler = c.rows()[0];
                for (l, &r) in t.host_rows.iter().enumerate().take(t.written_from) {
                    if c.row_of(l).unwrap_or(filler) != r {
                        return bad(format!(
                            "request {}: block {l}'s host row {r} is not its cache row",
                            t.id
                        ));
                    }
                }
                if c.cached().any(|(l, _)| l >= t.written_from) {
                    return bad(format!("request {}: a written block is cached", t.id));
                }
                if c.capacity() == 0 {
                    return bad(format!("request {}: an empty row cache", t.id));
                }
            } else if t.written_from != 0 {
                return bad(format!("request {}: written_from without a cache", t.id));
            }
            if t.host_rows_held() > t.reservation.host_rows {
                return bad(format!("request {} holds more rows than reserved", t.id));
            }
            for p in t.all_pages() {
                if self.gpu.is_free(p) || owner_gpu.insert(p, t.id).is_some() {
                    return bad(format!("page {p} of request {} is free or shared", t.id));
                }
            }
            for &h in &t.host_blocks {
                if self.host.is_free(h) || owner_host.insert(h, t.id).is_some() {
                    return bad(format!(
                        "host block {h} of request {} is free or shared",
                        t.id
                    ));
                }
            }
            if t.gpu_pages_held() > t.reservation.gpu_pages
                || t.host_blocks.len() > t.reservation.host_blocks
            {
                return bad(format!("request {} holds more than its reservation", t.id));
            }
            let b = self.cfg.block_size;
            if t.sparse {
                if !t.pages.is_empty()
                    || t.slot_pages.len() != self.cfg.top_k_blocks
                    || t.local_page.is_none()
                    || t.host_blocks.len() < t.kv_len.div_ceil(b)
                {
                    return bad(format!("sparse request {} has malformed tables", t.id));
                }
            } else if t.pages.len() < t.kv_len.div_ceil(b)
                || !t.slot_pages.is_empty()
                || !t.host_blocks.is_empty()
            {
                return bad(format!("dense request {} has malformed tables", t.id));
            }
        }
        if owner_gpu.len() + self.gpu.num_free() != self.gpu.num_blocks()
            || owner_host.len() + self.host.num_free() != self.host.num_blocks()
            || owner_row.len() + self.rows.num_free() != self.rows.num_blocks()
        {
            return bad("a block is neither free nor held (leak)".into());
        }
        if (res_gpu, res_host, res_rows)
            != (self.reserved_gpu, self.reserved_host, self.reserved_rows)
        {
            return bad("the reservation totals drifted".into());
        }
        if self.free_slots.len() + self.reqs.len() != self.cfg.max_num_seqs {
            return bad("an accumulator slot leaked".into());
        }
        Ok(())
    }
}
