//! The progress thread's connections: connect (and its completion), listen and accept, close,
//! reap and endpoint close. Methods of [`State`](super::State), on the progress thread only.

use super::*;

impl State {
    pub(super) fn connect(&mut self, addr: SocketAddr, reply: oneshot::Sender<Result<ConnParts>>) {
        let raw = RawSockaddr::new(addr);
        let mut params = self.ep_params();
        params.field_mask |= sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR;
        params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        params.sockaddr = raw.as_ucs();
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: params and the sockaddr outlive the call (UCX copies the address).
        let s = unsafe { (self.api.ucp_ep_create)(self.worker, &params, &mut ep) };
        if s != sys::UCS_OK {
            let _ = reply.send(Err(unreachable(addr, &self.api.status_string(s))));
            return;
        }
        let parts = self.add_conn(ep, addr.to_string());
        let id = parts.id;
        // The flush completes once the endpoint is connected (or fails when it cannot be).
        let ctx = Box::into_raw(Box::new(FlushCtx {
            inbox: self.inbox,
            conn: id,
        }));
        let param =
            sys::ucp_request_param_t::with_callback(on_flushed as *const c_void, ctx.cast(), 0);
        // SAFETY: a live endpoint; `ctx` is freed by the callback, or below when there is none.
        let r = unsafe { (self.api.ucp_ep_flush_nbx)(ep, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            // SAFETY: no callback will run: the context is still ours.
            drop(unsafe { Box::from_raw(ctx) });
            let status = if r.is_null() {
                sys::UCS_OK
            } else {
                sys::ptr_status(r)
            };
            self.finish_connect(reply, parts, addr, status);
        } else if let Some(c) = self.conns.get_mut(&id) {
            c.connecting = Some((reply, parts, addr));
        }
    }

    pub(super) fn finish_connect(
        &mut self,
        reply: oneshot::Sender<Result<ConnParts>>,
        parts: ConnParts,
        addr: SocketAddr,
        status: sys::ucs_status_t,
    ) {
        let id = parts.id;
        let broken = self.conns.get(&id).is_none_or(|c| c.broken);
        if status != sys::UCS_OK || broken {
            let why = if status != sys::UCS_OK {
                self.api.status_string(status)
            } else {
                "connection failed".into()
            };
            let _ = reply.send(Err(unreachable(addr, &why)));
            self.close(id);
        } else if reply.send(Ok(parts)).is_err() {
            // The caller gave up (connect timeout).
            self.close(id);
        }
    }

    pub(super) fn listen(&mut self, addr: SocketAddr) -> Result<ListenParts> {
        let id = self.new_id();
        let raw = RawSockaddr::new(addr);
        let arg = Box::into_raw(Box::new(ListenerArg {
            inbox: self.inbox,
            id,
        }));
        let params = sys::ucp_listener_params_t {
            field_mask: sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            sockaddr: raw.as_ucs(),
            accept_handler: [std::ptr::null_mut(); 2],
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(on_conn_request),
                arg: arg.cast(),
            },
        };
        let mut handle: sys::ucp_listener_h = std::ptr::null_mut();
        // SAFETY: params outlive the call; `arg` lives until the listener is destroyed.
        let s = unsafe { (self.api.ucp_listener_create)(self.worker, &params, &mut handle) };
        if s != sys::UCS_OK {
            // SAFETY: no listener holds it.
            drop(unsafe { Box::from_raw(arg) });
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!("ucx listen on {addr}: {}", self.api.status_string(s)),
            )));
        }
        // SAFETY: attr is plain data; a live listener.
        let mut attr: sys::ucp_listener_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        let bound = match unsafe { (self.api.ucp_listener_query)(handle, &mut attr) } {
            sys::UCS_OK => parse_sockaddr(&attr.sockaddr).unwrap_or(addr),
            _ => addr,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        self.listeners.insert(
            id,
            ListenerState {
                handle,
                arg,
                accepted: tx,
            },
        );
        Ok(ListenParts {
            id,
            addr: bound,
            accepted: rx,
        })
    }

    pub(super) fn close_listener(&mut self, id: u64) {
        if let Some(l) = self.listeners.remove(&id) {
            // SAFETY: a live listener; its conn handler cannot run after destroy, so the
            // argument can go.
            unsafe {
                (self.api.ucp_listener_destroy)(l.handle);
                drop(Box::from_raw(l.arg));
            }
        }
    }

    pub(super) fn accept(&mut self, listener: u64, request: usize) {
        let request = request as sys::ucp_conn_request_h;
        let Some(l) = self.listeners.get(&listener) else {
            return;
        };
        let lh = l.handle;
        // SAFETY: attr is plain data; the request is live until an ep is created or it is
        // rejected.
        let mut attr: sys::ucp_conn_request_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
        let peer = match unsafe { (self.api.ucp_conn_request_query)(request, &mut attr) } {
            sys::UCS_OK => parse_sockaddr(&attr.client_address)
                .map_or_else(|| "?".to_string(), |a| a.to_string()),
            _ => "?".to_string(),
        };
        let mut params = self.ep_params();
        params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST;
        params.conn_request = request;
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: a pending connection request of a live listener.
        let s = unsafe { (self.api.ucp_ep_create)(self.worker, &params, &mut ep) };
        if s != sys::UCS_OK {
            warn!(%peer, error = %self.api.status_string(s), "ucx accept failed");
            // SAFETY: the request was not consumed.
            unsafe { (self.api.ucp_listener_reject)(lh, request) };
            return;
        }
        let parts = self.add_conn(ep, peer);
        let id = parts.id;
        let delivered = self
            .listeners
            .get(&listener)
            .is_some_and(|l| l.accepted.send(parts).is_ok());
        if !delivered {
            self.close(id);
        }
    }

    pub(super) fn close(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.closing {
            return;
        }
        c.closing = true;
        c.broken = true;
        let ep = c.ep;
        let rndv: Vec<usize> = c.rndv.drain().map(|(_, (d, _))| d).collect();
        let reqs: Vec<usize> = c.reqs.iter().copied().collect();
        if let Some((reply, _, addr)) = c.connecting.take() {
            let _ = reply.send(Err(unreachable(addr, "connection closed")));
        }
        let _ = c.incoming.send(Incoming::Closed(None));
        // No more arrivals for it.
        self.by_ep.remove(&(ep as usize));
        for d in rndv {
            // SAFETY: unreleased descriptors of this connection.
            unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
        }
        for r in reqs {
            // SAFETY: requests in `reqs` are outstanding: their callbacks have not run (a
            // completion is removed from `reqs` before any command or close runs).
            unsafe { (self.api.ucp_request_cancel)(self.worker, r as *mut c_void) };
        }
        self.reap(id);
    }

    /// Close the endpoint of a closing connection once nothing is outstanding on it.
    pub(super) fn reap(&mut self, id: ConnId) {
        let ready = self
            .conns
            .get(&id)
            .is_some_and(|c| c.closing && c.reqs.is_empty());
        if !ready {
            return;
        }
        if let Some(c) = self.conns.remove(&id) {
            for (_, h) in c.rkeys {
                // SAFETY: unpacked on this endpoint, no get outstanding (`reqs` is empty);
                // destroyed before the endpoint, as UCX requires.
                unsafe { (self.api.ucp_rkey_destroy)(h as *mut c_void) };
            }
            self.close_ep(c.ep, c.failed);
        }
    }

    pub(super) fn close_ep(&mut self, ep: sys::ucp_ep_h, force: bool) {
        let flags = if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        let mut param = sys::ucp_request_param_t::with_callback(
            on_closed as *const c_void,
            self.inbox.cast(),
            0,
        );
        param.flags = flags;
        self.inbox().closing += 1;
        // SAFETY: a live endpoint, closed once (it left the maps above).
        let r = unsafe { (self.api.ucp_ep_close_nbx)(ep, &param) };
        if r.is_null() || sys::ptr_is_err(r) {
            self.inbox().closing -= 1;
        }
    }
}
