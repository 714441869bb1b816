//! The progress thread's life: creating the UCX context and worker (with the active-message
//! handler), the loop (drain commands, `ucp_worker_progress` until idle, handle the callbacks'
//! events, sleep on the event fd), and shutdown. Methods of [`State`](super::State), on the
//! progress thread only.

use std::time::Instant;

use super::sockets::{poll, PollFd, POLLIN};
use super::*;

impl State {
    /// # Safety
    /// Call on the thread that will run [`State::run`].
    pub(super) unsafe fn init(api: &'static Api, max_eager: usize) -> Result<State> {
        let mut context: sys::ucp_context_h = std::ptr::null_mut();
        let mut params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME,
            features: sys::UCP_FEATURE_AM | sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: std::ptr::null_mut(),
            request_cleanup: std::ptr::null_mut(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: c"oasis-rt".as_ptr(),
        };
        let mut s = (api.ucp_init_version)(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            std::ptr::null(),
            &mut context,
        );
        if s != sys::UCS_OK {
            // Without wakeup support the thread polls instead.
            params.features &= !sys::UCP_FEATURE_WAKEUP;
            s = (api.ucp_init_version)(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                std::ptr::null(),
                &mut context,
            );
        }
        if s != sys::UCS_OK {
            return Err(status_error(api, "init", s));
        }
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
        wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let s = (api.ucp_worker_create)(context, &wp, &mut worker);
        if s != sys::UCS_OK {
            (api.ucp_cleanup)(context);
            return Err(status_error(api, "worker create", s));
        }
        let mut efd: c_int = -1;
        let efd = if params.features & sys::UCP_FEATURE_WAKEUP != 0
            && (api.ucp_worker_get_efd)(worker, &mut efd) == sys::UCS_OK
        {
            Some(efd)
        } else {
            None
        };
        let inbox = Box::into_raw(Box::new(Inbox {
            api,
            events: Vec::new(),
            max_eager,
            closing: 0,
        }));
        let handler = sys::ucp_am_handler_param_t {
            field_mask: sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_am),
            arg: inbox.cast(),
        };
        let s = (api.ucp_worker_set_am_recv_handler)(worker, &handler);
        if s != sys::UCS_OK {
            (api.ucp_worker_destroy)(worker);
            (api.ucp_cleanup)(context);
            drop(Box::from_raw(inbox));
            return Err(status_error(api, "am handler", s));
        }
        Ok(State {
            api,
            context,
            worker,
            efd,
            inbox,
            conns: HashMap::new(),
            by_ep: HashMap::new(),
            listeners: HashMap::new(),
            regions: HashMap::new(),
            next_id: 1,
        })
    }

    pub(super) fn run(mut self, rx: std_mpsc::Receiver<Cmd>, submit: &Submit) {
        'outer: loop {
            let mut busy = false;
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(std_mpsc::TryRecvError::Disconnected) => break 'outer,
                    Ok(cmd) => {
                        busy = true;
                        self.command(cmd);
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                }
            }
            // SAFETY: the worker is ours; callbacks only touch the inbox.
            while unsafe { (self.api.ucp_worker_progress)(self.worker) } != 0 {
                busy = true;
            }
            busy |= self.events();
            if busy {
                continue;
            }
            self.idle();
        }
        // Stop taking commands before the worker goes.
        *submit.tx.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.shutdown();
    }

    fn idle(&mut self) {
        let Some(fd) = self.efd else {
            std::thread::sleep(Duration::from_micros(50));
            return;
        };
        // SAFETY: our worker; arm returns BUSY when events (or a ucp_worker_signal) are pending.
        let s = unsafe { (self.api.ucp_worker_arm)(self.worker) };
        if s == sys::UCS_ERR_BUSY {
            return;
        }
        if s != sys::UCS_OK {
            std::thread::sleep(Duration::from_micros(50));
            return;
        }
        let mut pfd = PollFd {
            fd,
            events: POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; poll has this signature in every libc.
        unsafe { poll(&mut pfd, 1, IDLE_POLL.as_millis() as c_int) };
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Connect { addr, reply } => self.connect(addr, reply),
            Cmd::Listen { addr, reply } => {
                let _ = reply.send(self.listen(addr));
            }
            Cmd::CloseListener(id) => self.close_listener(id),
            Cmd::Send { conn, frame, reply } => self.send(conn, frame, reply),
            Cmd::Pull { conn, desc, reply } => self.pull(conn, desc, reply),
            Cmd::Discard { conn, desc } => {
                if let Some((d, _)) = self.conns.get_mut(&conn).and_then(|c| c.rndv.remove(&desc)) {
                    // SAFETY: a descriptor UCX gave us and nobody released yet.
                    unsafe { (self.api.ucp_am_data_release)(self.worker, d as *mut c_void) };
                }
            }
            Cmd::Close(id) => self.close(id),
            Cmd::MemMap { data, reply } => {
                if let Err(Ok(parts)) = reply.send(self.mem_map(data)) {
                    // The caller gave up (timeout): nobody would unmap it.
                    self.mem_unmap(parts.id);
                }
            }
            Cmd::MemUnmap(id) => self.mem_unmap(id),
            Cmd::Get {
                conn,
                rkey,
                addr,
                len,
                reply,
            } => self.get(conn, &rkey, addr, len, reply),
            Cmd::Gets { conn, items } => {
                for it in items {
                    self.get(conn, &it.rkey, it.addr, it.len, it.reply);
                }
            }
            Cmd::Shutdown => {}
        }
    }

    /// Handle what the callbacks reported. True if there was anything.
    fn events(&mut self) -> bool {
        let mut events = std::mem::take(&mut self.inbox().events);
        let any = !events.is_empty();
        // Completions first: a request they name is freed and must leave `reqs` before any
        // close below could cancel it.
        let mut reaped = Vec::new();
        events.retain(|e| match e {
            Event::Done { conn, request } => {
                if let Some(c) = self.conns.get_mut(conn) {
                    c.reqs.remove(request);
                    reaped.push(*conn);
                }
                false
            }
            _ => true,
        });
        for id in reaped {
            self.reap(id);
        }
        for e in events {
            match e {
                Event::Done { .. } => {}
                Event::ConnRequest { listener, request } => self.accept(listener, request),
                Event::EpError { ep, status } => {
                    let Some(&id) = self.by_ep.get(&ep) else {
                        continue;
                    };
                    let why = self.api.status_string(status);
                    debug!(conn = id, error = %why, "ucx endpoint failed");
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.broken = true;
                        c.failed = true;
                        let _ = c.incoming.send(Incoming::Closed(None));
                    }
                }
                Event::Flushed { conn, status } => {
                    let Some(pending) = self.conns.get_mut(&conn).and_then(|c| c.connecting.take())
                    else {
                        continue;
                    };
                    let (reply, parts, addr) = pending;
                    self.finish_connect(reply, parts, addr, status);
                }
                Event::Am { ep, data } => self.arrived(ep, data),
            }
        }
        any
    }

    fn shutdown(mut self) {
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id);
        }
        let lids: Vec<u64> = self.listeners.keys().copied().collect();
        for id in lids {
            self.close_listener(id);
        }
        let start = Instant::now();
        while (self.inbox().closing > 0 || !self.conns.is_empty())
            && start.elapsed() < SHUTDOWN_WAIT
        {
            // SAFETY: our worker.
            unsafe { (self.api.ucp_worker_progress)(self.worker) };
            self.events();
        }
        if !self.conns.is_empty() {
            warn!(
                left = self.conns.len(),
                "ucx requests still outstanding at shutdown"
            );
        }
        let regions: Vec<u64> = self.regions.keys().copied().collect();
        for id in regions {
            self.mem_unmap(id);
        }
        // SAFETY: every endpoint and listener is closed; nothing uses the worker after this.
        unsafe {
            (self.api.ucp_worker_destroy)(self.worker);
            (self.api.ucp_cleanup)(self.context);
            drop(Box::from_raw(self.inbox));
        }
    }
}
