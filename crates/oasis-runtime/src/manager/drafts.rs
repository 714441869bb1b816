//! Appends and speculative drafts of [`Runtime`]: whether a request may take one more token, the
//! drafts a speculative plan entered, and their commit (accepted) or rollback.

use super::*;

impl Runtime {
    /// Whether request `id`'s draft may take position `kv_len`, after the token its last plan
    /// stored (speculative decoding: [`Runtime::plan_speculative`] reserves a tentative slot
    /// there only then; the step computed the draft's K/V in row 1). False when
    /// * the request is past the sparse threshold (it must turn sparse first: its reservation
    ///   does not cover more dense pages);
    /// * it is sparse and the token would complete its local block: this step's selection did
    ///   not see that block as a candidate, so the next step would attend to neither it (the
    ///   local page moves on) nor, unless it is selected, its slot;
    /// * the block it lands in would pass the reservation.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request.
    pub fn can_append(&self, id: u64) -> Result<bool> {
        let b = self.cfg.block_size;
        if self.wants_sparse(id)? {
            return Ok(false);
        }
        let t = self.get(id)?;
        let blk = t.kv_len / b;
        Ok(if t.sparse {
            t.kv_len % b != b - 1
                && (blk < t.host_blocks.len() || t.host_blocks.len() < t.reservation.host_blocks)
        } else {
            blk < t.pages.len() || t.pages.len() < t.reservation.gpu_pages
        })
    }

    /// The requests whose drafts hold a tentative slot ([`Runtime::plan_speculative`]), batch
    /// order.
    pub fn pending_drafts(&self) -> Vec<u64> {
        self.drafts.iter().map(|d| d.id).collect()
    }

    /// Resolve the tentative slots of the last [`Runtime::plan_speculative`]: the drafts of
    /// `accepted` are stored (the step wrote their K/V into the slot): their mapping update is
    /// queued (applied by the next plan) and `kv_len` advances, so those tables moved by two
    /// tokens in the step. Every other slot is given back (the block entered for it freed), so a
    /// rejected draft leaves nothing: the next token lands where it would have.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an id listed twice or without a tentative slot. Nothing changes
    /// then.
    pub fn commit_drafts(&mut self, accepted: &[u64]) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(accepted.len());
        for &id in accepted {
            if !seen.insert(id) {
                return Err(OasisError::Invalid(format!(
                    "request {id} listed twice among the accepted drafts"
                )));
            }
            if !self.drafts.iter().any(|d| d.id == id) {
                return Err(OasisError::Invalid(format!(
                    "request {id} holds no tentative draft slot (plan_speculative reserves them; \
                     pending_drafts lists them)"
                )));
            }
        }
        for d in std::mem::take(&mut self.drafts) {
            let t = self.reqs.get_mut(&d.id).expect("release drops its drafts");
            if seen.contains(&d.id) {
                t.kv_len += 1;
                if let Some((page, value)) = d.map {
                    self.queue_map(page, value);
                }
            } else if let Some(block) = d.entered {
                // The block entered for the draft is the table's last one (with its row).
                if t.sparse {
                    debug_assert_eq!(t.host_rows.last().copied(), d.entered_row);
                    self.pop_host_block(d.id, block)?;
                } else {
                    debug_assert_eq!(t.pages.last(), Some(&block));
                    t.pages.pop();
                    self.gpu.free(&[block])?;
                }
            }
        }
        Ok(())
    }
}
