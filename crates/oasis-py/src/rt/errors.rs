//! `oasis_rt::Error` to the `oasiskv.errors` classes, with a hint that says how to fix the call.

use super::*;

/// The error's Python class (in `oasiskv.errors`) and how to fix the call.
pub(crate) fn class_and_hint(e: &RtError, addr: &str) -> (&'static str, String) {
    let code = e.code();
    let remote = matches!(e, RtError::Remote { .. });
    match e {
        RtError::Unavailable(_) => (
            "ConfigError",
            "or connect over TCP instead (oasis-rt://HOST:PORT, the daemon on --transport tcp)"
                .into(),
        ),
        RtError::Config(_) => (
            "ConfigError",
            "pass the daemon's --listen address, e.g. 'oasis-rt://127.0.0.1:7470' (TCP) or \
             'oasis-rt+ucx://127.0.0.1:7470' (UCX)"
                .into(),
        ),
        RtError::Unreachable { .. } => {
            let (listen, flag) = match addr.strip_prefix(UCX_SCHEME) {
                Some(a) => (a, " --transport ucx"),
                None => (addr, ""),
            };
            (
                "RemoteUnavailableError",
                format!(
                    "start the daemon (`oasis-rt serve --listen {listen}{flag}`) or check the \
                     address"
                ),
            )
        }
        RtError::Closed | RtError::Truncated { .. } | RtError::Io(_) => (
            "RemoteUnavailableError",
            "the daemon closed the connection (it exited or was killed, or an earlier error \
             dropped it); make a new RtClient once the daemon is back"
                .into(),
        ),
        RtError::Timeout { .. } => (
            "RemoteTimeoutError",
            "the daemon did not answer in time; check that it is alive, or raise timeout_s. \
             This client is closed now: make a new one"
                .into(),
        ),
        _ => match code {
            ErrorCode::Unauthorized => (
                "RemoteAuthError",
                "pass the daemon's shared token (token=..., the contents of its --token-file)"
                    .into(),
            ),
            ErrorCode::Busy => (
                "RemoteBusyError",
                "the daemon's staging memory is full of live requests; release finished \
                 requests, retry later, or raise its --memory"
                    .into(),
            ),
            ErrorCode::OutOfMemory => (
                "RemoteBusyError",
                "this staging alone passes the daemon's --memory; raise it".into(),
            ),
            ErrorCode::UnknownRequest | ErrorCode::MissingBlock => (
                "RemoteNotFoundError",
                "the request was never staged, was released, or was evicted after its lease; \
                 stage it again"
                    .into(),
            ),
            ErrorCode::ShuttingDown => (
                "RemoteUnavailableError",
                "the daemon is shutting down; make a new RtClient once it is back".into(),
            ),
            ErrorCode::TooLarge => (
                "InvalidArgumentError",
                "ask for fewer layers or keys per call (the reply passes the frame limit)".into(),
            ),
            ErrorCode::GeometryMismatch => (
                "InvalidArgumentError",
                "stage every part of a request with the same geometry".into(),
            ),
            ErrorCode::BadVersion => (
                "RemoteError",
                "the daemon speaks another protocol version; use matching oasiskv and oasis-rt \
                 builds"
                    .into(),
            ),
            ErrorCode::BadRequest if !remote => (
                "InvalidArgumentError",
                "fix the argument named above".into(),
            ),
            ErrorCode::BadFrame if !remote => (
                "InvalidArgumentError",
                "fix the argument named above".into(),
            ),
            _ => (
                "RemoteError",
                "see the daemon's log for the request's details".into(),
            ),
        },
    }
}

/// `oasis_rt::Error` -> its `oasiskv.errors` class, with `.code` set to the protocol's name.
/// `dropped`: the error cost the connection (said in the message unless the class says it).
pub(crate) fn rt_err(py: Python<'_>, e: RtError, addr: &str, dropped: bool) -> PyErr {
    let (class, mut hint) = class_and_hint(&e, addr);
    if dropped && !matches!(class, "RemoteUnavailableError" | "RemoteTimeoutError") {
        hint.push_str("; the connection is closed now: make a new RtClient");
    }
    let err = py_err(py, class, format!("oasis-rt {addr}: {e}; {hint}"));
    // The protocol's code name; transport failures on this side (all `internal` on the wire)
    // get their own. Best effort: the attribute only adds detail to the class.
    let code = match &e {
        RtError::Unreachable { .. } => "unreachable",
        RtError::Unavailable(_) => "ucx_unavailable",
        RtError::Config(_) => "bad_address",
        RtError::Closed | RtError::Truncated { .. } | RtError::Io(_) => "closed",
        RtError::Timeout { .. } => "timeout",
        _ => e.code().name(),
    };
    let _ = err.value(py).setattr("code", code);
    err
}

pub(super) fn internal(py: Python<'_>, what: &str) -> PyErr {
    py_err(
        py,
        "OasisError",
        format!("internal error in RtClient.{what}; please report it"),
    )
}

pub(crate) fn bad_arg(py: Python<'_>, msg: String) -> PyErr {
    py_err(py, "InvalidArgumentError", msg)
}
