//! The UCX callbacks and the per-request contexts they take back (send, pull, get, flush). All
//! run on the progress thread inside UCX calls (`ucp_worker_progress`, `ucp_ep_close_nbx`,
//! `ucp_listener_destroy`); they free their request, answer its reply and record what happened
//! in the [`Inbox`](super::Inbox), which the thread handles after the call returns.

use super::*;

pub(super) struct SendCtx {
    pub(super) inbox: *mut Inbox,
    pub(super) conn: ConnId,
    pub(super) _frame: Vec<u8>,
    pub(super) reply: oneshot::Sender<Result<()>>,
}

pub(super) struct PullCtx {
    pub(super) api: &'static Api,
    pub(super) inbox: *mut Inbox,
    pub(super) conn: ConnId,
    pub(super) buf: Vec<u8>,
    pub(super) len: usize,
    pub(super) reply: oneshot::Sender<Result<Bytes>>,
}

impl PullCtx {
    pub(super) fn finish(mut self, status: sys::ucs_status_t, got: usize) {
        let result = if status == sys::UCS_OK && got == self.len {
            // SAFETY: UCX wrote `got` bytes into the buffer's capacity.
            unsafe { self.buf.set_len(got) };
            Ok(Bytes::from(self.buf))
        } else if status == sys::UCS_OK {
            Err(Error::Truncated {
                field: "frame",
                needed: self.len as u64,
                available: got as u64,
            })
        } else {
            debug!(error = %self.api.status_string(status), "ucx rendezvous receive failed");
            Err(Error::Closed)
        };
        let _ = self.reply.send(result);
    }
}

pub(super) struct GetCtx {
    pub(super) api: &'static Api,
    pub(super) inbox: *mut Inbox,
    pub(super) conn: ConnId,
    pub(super) buf: Vec<u8>,
    pub(super) len: usize,
    pub(super) reply: oneshot::Sender<Result<Bytes>>,
}

impl GetCtx {
    pub(super) fn finish(mut self, status: sys::ucs_status_t) {
        let result = if status == sys::UCS_OK {
            // SAFETY: a completed get wrote all `len` bytes into the buffer's capacity.
            unsafe { self.buf.set_len(self.len) };
            Ok(Bytes::from(self.buf))
        } else {
            debug!(error = %self.api.status_string(status), "ucx get failed");
            Err(Error::Io(std::io::Error::other(format!(
                "ucx get: {}",
                self.api.status_string(status)
            ))))
        };
        let _ = self.reply.send(result);
    }
}

pub(super) unsafe extern "C" fn on_got(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<GetCtx>());
    (ctx.api.ucp_request_free)(request);
    (*ctx.inbox).events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    ctx.finish(status);
}

pub(super) struct FlushCtx {
    pub(super) inbox: *mut Inbox,
    pub(super) conn: ConnId,
}

pub(super) unsafe extern "C" fn on_sent(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<SendCtx>());
    let inbox = &mut *ctx.inbox;
    let result = if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(send_error(inbox.api, status))
    };
    (inbox.api.ucp_request_free)(request);
    inbox.events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    let _ = ctx.reply.send(result);
}

pub(super) unsafe extern "C" fn on_pulled(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<PullCtx>());
    (ctx.api.ucp_request_free)(request);
    (*ctx.inbox).events.push(Event::Done {
        conn: ctx.conn,
        request: request as usize,
    });
    ctx.finish(status, length);
}

pub(super) unsafe extern "C" fn on_flushed(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let ctx = Box::from_raw(user.cast::<FlushCtx>());
    let inbox = &mut *ctx.inbox;
    (inbox.api.ucp_request_free)(request);
    inbox.events.push(Event::Flushed {
        conn: ctx.conn,
        status,
    });
}

pub(super) unsafe extern "C" fn on_closed(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    user: *mut c_void,
) {
    let inbox = &mut *user.cast::<Inbox>();
    inbox.closing = inbox.closing.saturating_sub(1);
    (inbox.api.ucp_request_free)(request);
}

pub(super) unsafe extern "C" fn on_ep_error(
    arg: *mut c_void,
    ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    let inbox = &mut *arg.cast::<Inbox>();
    inbox.events.push(Event::EpError {
        ep: ep as usize,
        status,
    });
}

pub(super) unsafe extern "C" fn on_conn_request(
    request: sys::ucp_conn_request_h,
    arg: *mut c_void,
) {
    let arg = &*arg.cast::<ListenerArg>();
    (*arg.inbox).events.push(Event::ConnRequest {
        listener: arg.id,
        request: request as usize,
    });
}

pub(super) unsafe extern "C" fn on_am(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let inbox = &mut *arg.cast::<Inbox>();
    let param = &*param;
    let ep = if param.recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 {
        param.reply_ep as usize
    } else {
        0
    };
    if param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        // Keep the descriptor: the reader decides (after the size check) to pull or drop it.
        inbox.events.push(Event::Am {
            ep,
            data: AmData::Rndv {
                desc: data as usize,
                len: length,
            },
        });
        return sys::UCS_INPROGRESS;
    }
    let data = if length > inbox.max_eager {
        AmData::Oversized(length)
    } else if length == 0 || data.is_null() {
        AmData::Eager(Bytes::new())
    } else {
        AmData::Eager(Bytes::copy_from_slice(std::slice::from_raw_parts(
            data.cast::<u8>(),
            length,
        )))
    };
    inbox.events.push(Event::Am { ep, data });
    sys::UCS_OK
}
