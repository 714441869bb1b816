//! The progress thread's data path: frames sent and pulled (rendezvous), registered regions
//! and RMA gets, arrived active messages. Methods of [`State`](super::State), on the progress
//! thread only.

use super::*;

impl State {
    pub(super) fn send(
        &mut self,
        conn: ConnId,
        frame: Vec<u8>,
        reply: oneshot::Sender<Result<()>>,
    ) {
        let Some(c) = self.conns.get(&conn).filter(|c| !c.broken) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let ep = c.ep;
        let mut flags = sys::UCP_AM_SEND_FLAG_REPLY;
        if frame.len() >= RNDV_FRAME_BYTES {
            flags |= sys::UCP_AM_SEND_FLAG_RNDV;
        }
        let (ptr, len) = (frame.as_ptr(), frame.len());
        let ctx = Box::into_raw(Box::new(SendCtx {
            inbox: self.inbox,
            conn,
            _frame: frame,
            reply,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_sent as *const c_void, ctx.cast(), flags);
        // SAFETY: the frame's heap buffer lives in `ctx` until the send completes (the Vec is
        // moved, its buffer is not); a live endpoint.
        let r = unsafe {
            (self.api.ucp_am_send_nbx)(ep, AM_ID, std::ptr::null(), 0, ptr.cast(), len, &param)
        };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: completed (or failed) at once: no callback, the context is ours.
            let ctx = unsafe { Box::from_raw(ctx) };
            let result = if r.is_null() {
                Ok(())
            } else {
                Err(send_error(self.api, sys::ptr_status(r)))
            };
            let _ = ctx.reply.send(result);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    pub(super) fn pull(&mut self, conn: ConnId, desc: u64, reply: oneshot::Sender<Result<Bytes>>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let Some((d, len)) = c.rndv.remove(&desc) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        if c.broken {
            // SAFETY: an unreleased descriptor.
            unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
            let _ = reply.send(Err(Error::Closed));
            return;
        }
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        let ptr = buf.as_mut_ptr();
        let ctx = Box::into_raw(Box::new(PullCtx {
            api: self.api,
            inbox: self.inbox,
            conn,
            buf,
            len,
            reply,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_pulled as *const c_void, ctx.cast(), 0);
        // SAFETY: `buf` has `len` bytes of capacity and lives in `ctx` until completion; the
        // descriptor is unreleased.
        let r = unsafe {
            (self.api.ucp_am_recv_data_nbx)(self.worker, d as *mut c_void, ptr.cast(), len, &param)
        };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run.
            let ctx = unsafe { Box::from_raw(ctx) };
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            ctx.finish(status, len);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    pub(super) fn mem_map(&mut self, data: Bytes) -> Result<RegionParts> {
        if data.is_empty() {
            return Err(Error::Invalid {
                field: "region",
                reason: "is empty",
            });
        }
        // Peers may read it; nobody may write it remotely.
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            address: data.as_ptr() as *mut c_void,
            length: data.len(),
            flags: 0,
            prot: sys::UCP_MEM_MAP_PROT_LOCAL_READ
                | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
                | sys::UCP_MEM_MAP_PROT_REMOTE_READ,
            memory_type: 0,
        };
        let mut memh: *mut c_void = std::ptr::null_mut();
        // SAFETY: `data` (`length` bytes at `address`) stays alive and unmoved while mapped: the
        // region keeps it until ucp_mem_unmap.
        let s = unsafe { (self.api.ucp_mem_map)(self.context, &params, &mut memh) };
        if s != sys::UCS_OK {
            return Err(status_error(self.api, "mem map", s));
        }
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: a live memory handle of our context.
        let s = unsafe { (self.api.ucp_rkey_pack)(self.context, memh, &mut buf, &mut size) };
        if s != sys::UCS_OK || buf.is_null() {
            // SAFETY: mapped above, unmapped once.
            unsafe { (self.api.ucp_mem_unmap)(self.context, memh) };
            return Err(status_error(self.api, "rkey pack", s));
        }
        // SAFETY: UCX packed `size` bytes at `buf`, released right after the copy.
        let rkey = unsafe {
            let v = std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec();
            (self.api.ucp_rkey_buffer_release)(buf);
            v
        };
        let id = self.new_id();
        let base = data.as_ptr() as u64;
        self.regions.insert(id, (memh as usize, data));
        Ok(RegionParts { id, base, rkey })
    }

    pub(super) fn mem_unmap(&mut self, id: u64) {
        if let Some((memh, data)) = self.regions.remove(&id) {
            // SAFETY: a handle mapped by `mem_map`, unmapped once; the buffer goes after it.
            unsafe { (self.api.ucp_mem_unmap)(self.context, memh as *mut c_void) };
            drop(data);
        }
    }

    pub(super) fn get(
        &mut self,
        conn: ConnId,
        rkey: &Bytes,
        addr: u64,
        len: usize,
        reply: oneshot::Sender<Result<Bytes>>,
    ) {
        let api = self.api;
        let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.broken) else {
            let _ = reply.send(Err(Error::Closed));
            return;
        };
        let handle = match c.rkeys.get(rkey) {
            Some(&h) => h,
            None => {
                if c.rkeys.len() >= MAX_RKEYS_PER_CONN {
                    if !c.reqs.is_empty() {
                        // A get in flight may use any of them: none can go now.
                        let _ = reply.send(Err(Error::OutOfRange {
                            field: "distinct rkeys of one connection",
                            value: c.rkeys.len() as u64 + 1,
                            limit: MAX_RKEYS_PER_CONN as u64,
                        }));
                        return;
                    }
                    for (_, h) in c.rkeys.drain() {
                        // SAFETY: unpacked on this endpoint, destroyed once, and nothing is
                        // outstanding on the endpoint (`reqs` is empty).
                        unsafe { (api.ucp_rkey_destroy)(h as *mut c_void) };
                    }
                }
                let mut h: *mut c_void = std::ptr::null_mut();
                // SAFETY: a live endpoint; UCX parses `rkey.len()` bytes (bounded by the tokio
                // side) that the authenticated peer packed.
                let s = unsafe { (api.ucp_ep_rkey_unpack)(c.ep, rkey.as_ptr().cast(), &mut h) };
                if s != sys::UCS_OK {
                    let _ = reply.send(Err(Error::Invalid {
                        field: "rkey",
                        reason: "ucx cannot unpack it",
                    }));
                    return;
                }
                c.rkeys.insert(rkey.clone(), h as usize);
                h as usize
            }
        };
        let ep = c.ep;
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        let ptr = buf.as_mut_ptr();
        let ctx = Box::into_raw(Box::new(GetCtx {
            api,
            inbox: self.inbox,
            conn,
            buf,
            len,
            reply,
        }));
        let param = sys::ucp_request_param_t::with_callback(on_got as *const c_void, ctx.cast(), 0);
        // SAFETY: `buf` has `len` bytes of capacity and lives in `ctx` until completion; the
        // rkey was unpacked on this endpoint and lives until the endpoint closes.
        let r =
            unsafe { (api.ucp_get_nbx)(ep, ptr.cast(), len, addr, handle as *mut c_void, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run.
            let ctx = unsafe { Box::from_raw(ctx) };
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            ctx.finish(status);
        } else if let Some(c) = self.conns.get_mut(&conn) {
            c.reqs.insert(r as usize);
        }
    }

    pub(super) fn arrived(&mut self, ep: usize, data: AmData) {
        let release = |api: &Api, worker, data: &AmData| {
            if let AmData::Rndv { desc, .. } = data {
                // SAFETY: an unreleased descriptor that nobody will pull.
                unsafe { (api.ucp_am_data_release)(worker, *desc as *mut c_void) };
            }
        };
        let Some(&id) = self.by_ep.get(&ep) else {
            // No reply endpoint, or a connection closed meanwhile.
            release(self.api, self.worker, &data);
            return;
        };
        let next = self.new_id();
        let Some(c) = self.conns.get_mut(&id) else {
            release(self.api, self.worker, &data);
            return;
        };
        if c.broken {
            release(self.api, self.worker, &data);
            return;
        }
        if c.queued.load(Ordering::Acquire) >= MAX_QUEUED_FRAMES {
            release(self.api, self.worker, &data);
            warn!(
                conn = id,
                "peer sent {MAX_QUEUED_FRAMES} frames without reading replies, disconnecting"
            );
            c.broken = true;
            let _ = c.incoming.send(Incoming::Closed(Some(format!(
                "peer queued more than {MAX_QUEUED_FRAMES} frames"
            ))));
            return;
        }
        let item = match data {
            AmData::Eager(b) => Incoming::Eager(b),
            AmData::Oversized(len) => Incoming::Oversized(len),
            AmData::Rndv { desc, len } => {
                c.rndv.insert(next, (desc, len));
                Incoming::Rndv { desc: next, len }
            }
        };
        c.queued.fetch_add(1, Ordering::AcqRel);
        let _ = c.incoming.send(item);
    }
}
