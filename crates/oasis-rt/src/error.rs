//! One error enum for the crate, and the numeric codes that cross the wire.
//!
//! Local errors carry structured fields; an error the daemon sends back arrives as
//! [`Error::Remote`] with its [`ErrorCode`]. [`Error::code`] maps both to the same code, so a
//! caller tests `err.code() == ErrorCode::Busy` whichever side raised it.

use std::fmt;
use std::io;
use std::time::Duration;

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure of the protocol, the staging pool, the transports, the daemon and the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- frames ----
    /// The length prefix (or an encoded message) passes the frame size limit.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge { len: u64, max: u64 },
    /// The frame ends before a field it declares.
    #[error("truncated frame: {field} needs {needed} bytes, {available} left")]
    Truncated {
        field: &'static str,
        needed: u64,
        available: u64,
    },
    /// Header version (or the Hello's) is not the one this build speaks.
    #[error("unsupported protocol version {got} (this build speaks {expected})")]
    BadVersion { got: u16, expected: u16 },
    /// Unknown message kind byte.
    #[error("unknown message kind {0:#04x}")]
    UnknownKind(u8),
    /// A numeric field outside its bound (`value` must be `< limit`, or `<= limit` for sizes).
    #[error("{field} = {value} out of range (limit {limit})")]
    OutOfRange {
        field: &'static str,
        value: u64,
        limit: u64,
    },
    /// A field that is in range but malformed (bad UTF-8, nonzero reserved bits, ...).
    #[error("invalid {field}: {reason}")]
    Invalid {
        field: &'static str,
        reason: &'static str,
    },
    /// Bytes left after the message's last field.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(u64),
    /// The peer answered with a message of the wrong kind or sequence number.
    #[error("unexpected reply: expected {expected}, got {got}")]
    UnexpectedReply { expected: &'static str, got: String },

    // ---- staging pool ----
    /// The staging could never fit: its request alone would pass the whole budget.
    /// `requested`: the request's accounted bytes had the staging been stored.
    #[error("a request of {requested} bytes can never fit the staging budget of {budget} bytes")]
    OutOfMemory { requested: u64, budget: u64 },
    /// The budget is full of live data (which is never evicted): retry after releases.
    #[error("staging pool busy: {requested} bytes requested, {free} free after eviction")]
    Busy { requested: u64, free: u64 },
    /// No staged request with this id (never staged, released, or evicted after its lease).
    #[error("unknown request {0}")]
    UnknownRequest(u64),
    /// A block (or summary row) that was asked for was never staged.
    #[error("request {request}: block {block} of layer {layer} is not staged")]
    MissingBlock {
        request: u64,
        layer: u16,
        block: u32,
    },
    /// A request was staged again with a different geometry.
    #[error("request {request}: geometry differs from the staged one")]
    GeometryMismatch { request: u64 },
    /// A block read back is not the one staged (its length or its bytes): a daemon or
    /// transport fault, caught by `oasis-rt bench`'s check.
    #[error("request {request}: block {block} of layer {layer} read back wrong: {reason}")]
    ReadMismatch {
        request: u64,
        layer: u16,
        block: u32,
        reason: String,
    },

    // ---- connections ----
    /// Missing or wrong token (or a first frame that is not Hello).
    #[error("unauthorized: missing or wrong token")]
    Unauthorized,
    /// An operation passed its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// The peer closed the connection (or an earlier failure broke it).
    #[error("connection closed")]
    Closed,
    /// The daemon cannot be reached.
    #[error("cannot connect to {addr}: {source}")]
    Unreachable {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// An error the daemon answered with.
    #[error("daemon error ({code}): {message}")]
    Remote { code: ErrorCode, message: String },
    /// Bad configuration or command line.
    #[error("{0}")]
    Config(String),
    /// A transport that this build or this machine does not have.
    #[error("{0}")]
    Unavailable(String),
    /// Any other I/O failure.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// The wire code of this error (the one the daemon sends, or the one it sent).
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::FrameTooLarge { .. } => ErrorCode::TooLarge,
            Error::Truncated { .. }
            | Error::UnknownKind(_)
            | Error::Invalid { .. }
            | Error::TrailingBytes(_)
            | Error::UnexpectedReply { .. } => ErrorCode::BadFrame,
            Error::OutOfRange { .. } => ErrorCode::BadRequest,
            Error::BadVersion { .. } => ErrorCode::BadVersion,
            Error::OutOfMemory { .. } => ErrorCode::OutOfMemory,
            Error::Busy { .. } => ErrorCode::Busy,
            Error::UnknownRequest(_) => ErrorCode::UnknownRequest,
            Error::MissingBlock { .. } => ErrorCode::MissingBlock,
            Error::GeometryMismatch { .. } => ErrorCode::GeometryMismatch,
            Error::Unauthorized => ErrorCode::Unauthorized,
            Error::Remote { code, .. } => *code,
            Error::Timeout { .. }
            | Error::Closed
            | Error::Unreachable { .. }
            | Error::Config(_)
            | Error::Unavailable(_)
            | Error::ReadMismatch { .. }
            | Error::Io(_) => ErrorCode::Internal,
        }
    }

    /// True when the connection cannot carry another call after this error (the daemon closes
    /// it after a bad frame or a refused handshake; a timeout leaves a reply in flight).
    pub fn breaks_connection(&self) -> bool {
        match self {
            Error::Remote { code, .. } => matches!(
                code,
                ErrorCode::BadFrame
                    | ErrorCode::BadVersion
                    | ErrorCode::Unauthorized
                    | ErrorCode::ShuttingDown
            ),
            Error::OutOfMemory { .. }
            | Error::Busy { .. }
            | Error::UnknownRequest(_)
            | Error::MissingBlock { .. }
            | Error::GeometryMismatch { .. }
            | Error::ReadMismatch { .. }
            | Error::OutOfRange { .. }
            | Error::Config(_)
            | Error::Unavailable(_) => false,
            _ => true,
        }
    }
}

/// The numeric error codes of `Error` frames (u16 on the wire). Codes this build does not know
/// decode as [`ErrorCode::Unknown`], which keeps the number (a newer daemon may add codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Malformed frame: the daemon closes the connection after sending it.
    BadFrame,
    BadVersion,
    Unauthorized,
    OutOfMemory,
    Busy,
    UnknownRequest,
    MissingBlock,
    GeometryMismatch,
    /// A frame (or the reply it asks for) passes the frame size limit.
    TooLarge,
    /// A field out of range for the request's geometry.
    BadRequest,
    Internal,
    ShuttingDown,
    Unknown(u16),
}

impl ErrorCode {
    /// Every known code, for metrics.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::BadFrame,
        ErrorCode::BadVersion,
        ErrorCode::Unauthorized,
        ErrorCode::OutOfMemory,
        ErrorCode::Busy,
        ErrorCode::UnknownRequest,
        ErrorCode::MissingBlock,
        ErrorCode::GeometryMismatch,
        ErrorCode::TooLarge,
        ErrorCode::BadRequest,
        ErrorCode::Internal,
        ErrorCode::ShuttingDown,
    ];

    /// From the wire.
    pub fn from_u16(v: u16) -> ErrorCode {
        ErrorCode::ALL
            .iter()
            .copied()
            .find(|c| c.as_u16() == v)
            .unwrap_or(ErrorCode::Unknown(v))
    }

    /// To the wire.
    pub fn as_u16(self) -> u16 {
        match self {
            ErrorCode::BadFrame => 1,
            ErrorCode::BadVersion => 2,
            ErrorCode::Unauthorized => 3,
            ErrorCode::OutOfMemory => 4,
            ErrorCode::Busy => 5,
            ErrorCode::UnknownRequest => 6,
            ErrorCode::MissingBlock => 7,
            ErrorCode::GeometryMismatch => 8,
            ErrorCode::TooLarge => 9,
            ErrorCode::BadRequest => 10,
            ErrorCode::Internal => 11,
            ErrorCode::ShuttingDown => 12,
            ErrorCode::Unknown(v) => v,
        }
    }

    /// Lowercase name, used in messages and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::BadVersion => "bad_version",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::OutOfMemory => "out_of_memory",
            ErrorCode::Busy => "busy",
            ErrorCode::UnknownRequest => "unknown_request",
            ErrorCode::MissingBlock => "missing_block",
            ErrorCode::GeometryMismatch => "geometry_mismatch",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Internal => "internal",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Unknown(_) => "unknown",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::Unknown(v) => write!(f, "unknown code {v}"),
            c => f.write_str(c.name()),
        }
    }
}
