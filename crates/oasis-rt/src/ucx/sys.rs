//! The few `ucp_*` entry points the UCX transport uses, declared by hand and loaded from
//! `libucp.so.0` at run time.
//!
//! Every struct is `repr(C)` and laid out as in `ucp/api/ucp.h` of UCX 1.13 (Debian's
//! `libucx-dev`); the `const` assertions below pin the sizes and offsets that were read from
//! those headers, and `tests/ucx.rs` compiles a C program against the system headers (when they
//! are installed) and compares it field by field. Only fields named in a struct's `field_mask`
//! are read by UCX, so newer releases that append fields read these structs unchanged (the
//! functions used exist since UCX 1.10).
//!
//! `ucs_status_t` is a *packed* enum in C (`UCS_S_PACKED`): one signed byte, not an `int`.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::sync::OnceLock;

use libloading::Library;

/// `ucs_status_t`.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: NULL (done), a request, or an error status cast to a pointer.
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_listener_h = *mut c_void;
pub type ucp_conn_request_h = *mut c_void;
pub type ucp_config_t = c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
/// `UCS_ERR_LAST`: error statuses are `UCS_ERR_LAST < s < 0`.
pub const UCS_ERR_LAST: isize = -100;

/// `UCP_API_MAJOR/MINOR` of the headers the structs were copied from (`ucp_init_version`).
pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 13;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SINGLE`: only the progress thread calls into the worker
/// (`ucp_worker_signal` is documented safe from any thread regardless).
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;

pub const UCP_LISTENER_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 0;
pub const UCP_LISTENER_PARAM_FIELD_CONN_HANDLER: u64 = 1 << 2;
pub const UCP_LISTENER_ATTR_FIELD_SOCKADDR: u64 = 1 << 0;
pub const UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR: u64 = 1 << 0;

pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_EP_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 4;
pub const UCP_EP_PARAM_FIELD_FLAGS: u64 = 1 << 5;
pub const UCP_EP_PARAM_FIELD_CONN_REQUEST: u64 = 1 << 6;
pub const UCP_EP_PARAMS_FLAGS_CLIENT_SERVER: c_uint = 1 << 0;
/// `UCP_ERR_HANDLING_MODE_PEER`: failed peers are reported to the error handler.
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;

pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_RNDV: u32 = 1 << 2;
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
/// `UCP_AM_FLAG_WHOLE_MSG`: the handler sees whole messages only.
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;

pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;

pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;

/// `ucp_params_t`.
#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (`cpu_mask` is `ucs_cpu_set_t`, 128 bytes).
#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

pub type ucp_listener_conn_callback_t =
    unsafe extern "C" fn(conn_request: ucp_conn_request_h, arg: *mut c_void);

/// `ucp_listener_conn_handler_t`.
#[repr(C)]
pub struct ucp_listener_conn_handler_t {
    pub cb: Option<ucp_listener_conn_callback_t>,
    pub arg: *mut c_void,
}

/// `ucp_listener_params_t` (the deprecated `accept_handler` is never set).
#[repr(C)]
pub struct ucp_listener_params_t {
    pub field_mask: u64,
    pub sockaddr: ucs_sock_addr_t,
    pub accept_handler: [*mut c_void; 2],
    pub conn_handler: ucp_listener_conn_handler_t,
}

/// `struct sockaddr_storage`.
#[repr(C, align(8))]
pub struct sockaddr_storage {
    pub bytes: [u8; 128],
}

/// `ucp_listener_attr_t`.
#[repr(C)]
pub struct ucp_listener_attr_t {
    pub field_mask: u64,
    pub sockaddr: sockaddr_storage,
}

/// `ucp_conn_request_attr_t`.
#[repr(C)]
pub struct ucp_conn_request_attr_t {
    pub field_mask: u64,
    pub client_address: sockaddr_storage,
    pub client_id: u64,
}

pub type ucp_err_handler_cb_t =
    unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t);

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: Option<ucp_err_handler_cb_t>,
    pub arg: *mut c_void,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: ucp_conn_request_h,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

/// `ucp_send_nbx_callback_t`.
pub type ucp_send_nbx_callback_t =
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void);
/// `ucp_am_recv_data_nbx_callback_t`.
pub type ucp_am_recv_data_nbx_callback_t = unsafe extern "C" fn(
    request: *mut c_void,
    status: ucs_status_t,
    length: usize,
    user_data: *mut c_void,
);

/// `ucp_request_param_t` (`cb` is a union of callback pointers: one pointer wide).
#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
}

impl ucp_request_param_t {
    /// A parameter block naming only a completion callback, its user data and `flags`.
    pub fn with_callback(cb: *const c_void, user_data: *mut c_void, flags: u32) -> Self {
        ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_CALLBACK
                | UCP_OP_ATTR_FIELD_USER_DATA
                | UCP_OP_ATTR_FIELD_FLAGS,
            flags,
            request: std::ptr::null_mut(),
            cb,
            datatype: 0,
            user_data,
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// `struct ucp_am_recv_param`.
#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

/// `ucp_am_recv_callback_t`.
pub type ucp_am_recv_callback_t = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t;

/// `ucp_am_handler_param_t`.
#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: Option<ucp_am_recv_callback_t>,
    pub arg: *mut c_void,
}

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

// Sizes and offsets read from ucp.h (UCX 1.13, x86_64 and aarch64 Linux, LP64).
const _: () = {
    assert!(size_of::<ucs_status_t>() == 1);
    assert!(size_of::<ucp_params_t>() == 80 && offset_of!(ucp_params_t, name) == 72);
    assert!(size_of::<ucp_worker_params_t>() == 200);
    assert!(offset_of!(ucp_worker_params_t, cpu_mask) == 16);
    assert!(offset_of!(ucp_worker_params_t, events) == 144);
    assert!(offset_of!(ucp_worker_params_t, name) == 176);
    assert!(offset_of!(ucp_worker_params_t, client_id) == 192);
    assert!(size_of::<ucs_sock_addr_t>() == 16);
    assert!(size_of::<ucp_listener_params_t>() == 56);
    assert!(offset_of!(ucp_listener_params_t, conn_handler) == 40);
    assert!(size_of::<ucp_listener_attr_t>() == 136);
    assert!(size_of::<ucp_conn_request_attr_t>() == 144);
    assert!(offset_of!(ucp_conn_request_attr_t, client_id) == 136);
    assert!(size_of::<ucp_ep_params_t>() == 104);
    assert!(offset_of!(ucp_ep_params_t, err_mode) == 16);
    assert!(offset_of!(ucp_ep_params_t, err_handler) == 24);
    assert!(offset_of!(ucp_ep_params_t, flags) == 48);
    assert!(offset_of!(ucp_ep_params_t, sockaddr) == 56);
    assert!(offset_of!(ucp_ep_params_t, conn_request) == 72);
    assert!(offset_of!(ucp_ep_params_t, local_sockaddr) == 88);
    assert!(size_of::<ucp_request_param_t>() == 72);
    assert!(offset_of!(ucp_request_param_t, cb) == 16);
    assert!(offset_of!(ucp_request_param_t, user_data) == 32);
    assert!(offset_of!(ucp_request_param_t, memory_type) == 48);
    assert!(offset_of!(ucp_request_param_t, memh) == 64);
    assert!(size_of::<ucp_am_handler_param_t>() == 32);
    assert!(offset_of!(ucp_am_handler_param_t, cb) == 16);
    assert!(size_of::<ucp_am_recv_param_t>() == 16);
    assert!(size_of::<ucp_mem_map_params_t>() == 40);
    assert!(offset_of!(ucp_mem_map_params_t, memory_type) == 32);
};

/// `UCS_PTR_IS_ERR`.
pub fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// `UCS_PTR_RAW_STATUS` of an error pointer.
pub fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The loaded entry points. Field names are the C names.
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            /// Where it was loaded from and what it reported.
            pub version: (u32, u32, u32),
            _lib: Library,
        }

        impl Api {
            /// # Safety
            /// `lib` must be a UCX 1.x `libucp`: every symbol is given the signature above,
            /// copied from its `ucp.h`.
            unsafe fn load(lib: Library, name: &str) -> Result<Api, String> {
                let mut get_version: Option<unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint)> = None;
                if let Ok(f) = lib.get(b"ucp_get_version\0") {
                    get_version = Some(*f);
                }
                let get_version = get_version
                    .ok_or_else(|| format!("{name} has no ucp_get_version"))?;
                let (mut major, mut minor, mut release) = (0, 0, 0);
                get_version(&mut major, &mut minor, &mut release);
                Ok(Api {
                    $($name: *lib
                        .get(concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|e| format!(
                            "{name} (UCX {major}.{minor}.{release}) lacks {}: {e} (UCX >= 1.10 is needed)",
                            stringify!($name)
                        ))?,)*
                    version: (major, minor, release),
                    _lib: lib,
                })
            }
        }
    };
}

api! {
    ucp_init_version: fn(c_uint, c_uint, *const ucp_params_t, *const ucp_config_t, *mut ucp_context_h) -> ucs_status_t;
    ucp_cleanup: fn(ucp_context_h);
    ucp_worker_create: fn(ucp_context_h, *const ucp_worker_params_t, *mut ucp_worker_h) -> ucs_status_t;
    ucp_worker_destroy: fn(ucp_worker_h);
    ucp_worker_progress: fn(ucp_worker_h) -> c_uint;
    ucp_worker_get_efd: fn(ucp_worker_h, *mut c_int) -> ucs_status_t;
    ucp_worker_arm: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_signal: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_set_am_recv_handler: fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t;
    ucp_listener_create: fn(ucp_worker_h, *const ucp_listener_params_t, *mut ucp_listener_h) -> ucs_status_t;
    ucp_listener_destroy: fn(ucp_listener_h);
    ucp_listener_query: fn(ucp_listener_h, *mut ucp_listener_attr_t) -> ucs_status_t;
    ucp_listener_reject: fn(ucp_listener_h, ucp_conn_request_h) -> ucs_status_t;
    ucp_conn_request_query: fn(ucp_conn_request_h, *mut ucp_conn_request_attr_t) -> ucs_status_t;
    ucp_ep_create: fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t;
    ucp_ep_close_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_ep_flush_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_am_send_nbx: fn(ucp_ep_h, c_uint, *const c_void, usize, *const c_void, usize, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_am_recv_data_nbx: fn(ucp_worker_h, *mut c_void, *mut c_void, usize, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_am_data_release: fn(ucp_worker_h, *mut c_void);
    ucp_request_check_status: fn(*mut c_void) -> ucs_status_t;
    ucp_request_free: fn(*mut c_void);
    ucp_request_cancel: fn(ucp_worker_h, *mut c_void);
    ucp_mem_map: fn(ucp_context_h, *const ucp_mem_map_params_t, *mut *mut c_void) -> ucs_status_t;
    ucp_mem_unmap: fn(ucp_context_h, *mut c_void) -> ucs_status_t;
    ucp_rkey_pack: fn(ucp_context_h, *mut c_void, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(ucp_ep_h, *const c_void, *mut *mut c_void) -> ucs_status_t;
    ucp_rkey_destroy: fn(*mut c_void);
    ucp_get_nbx: fn(ucp_ep_h, *mut c_void, usize, u64, *mut c_void, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucs_status_string: fn(ucs_status_t) -> *const c_char;
}

impl Api {
    /// The text UCX gives a status.
    pub fn status_string(&self, s: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any value.
        unsafe {
            let p = (self.ucs_status_string)(s);
            if p.is_null() {
                return format!("status {s}");
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Library names tried in order (override with `OASIS_UCP_LIB`).
pub const LIBUCP_NAMES: [&str; 2] = ["libucp.so.0", "libucp.so"];

/// Load `libucp` once per process.
///
/// # Errors
/// A one-line reason (library absent, a symbol missing).
pub fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let names: Vec<String> = match std::env::var("OASIS_UCP_LIB") {
            Ok(p) => vec![p],
            Err(_) => LIBUCP_NAMES.iter().map(|s| s.to_string()).collect(),
        };
        let mut last = String::new();
        for name in &names {
            // SAFETY: loading libucp runs its initialisers, which only set up UCX's own
            // global state; `Api::load` gives each symbol its C signature from ucp.h.
            match unsafe { Library::new(name) } {
                Ok(lib) => return unsafe { Api::load(lib, name) },
                Err(e) => last = format!("{name}: {e}"),
            }
        }
        Err(format!(
            "cannot load libucp ({last}); install libucx0 (Debian: apt-get install libucx0) or set OASIS_UCP_LIB"
        ))
    })
    .as_ref()
    .map_err(Clone::clone)
}

macro_rules! size {
    ($t:ident) => {
        (
            concat!("sizeof(", stringify!($t), ")"),
            size_of::<$t>() as i64,
        )
    };
}
macro_rules! off {
    ($t:ident, $f:ident) => {
        (
            concat!("offsetof(", stringify!($t), ", ", stringify!($f), ")"),
            offset_of!($t, $f) as i64,
        )
    };
}
macro_rules! konst {
    ($($c:ident),*) => {
        [$((stringify!($c), $c as i64)),*]
    };
}

/// Every size, offset and constant this module copies from the headers, keyed by the C
/// expression that computes it (`tests/ucx.rs` compiles [`layout_c`] and compares).
pub fn layout() -> Vec<(&'static str, i64)> {
    let mut v = vec![
        size!(ucs_status_t),
        size!(ucp_params_t),
        off!(ucp_params_t, features),
        off!(ucp_params_t, mt_workers_shared),
        off!(ucp_params_t, name),
        size!(ucp_worker_params_t),
        off!(ucp_worker_params_t, thread_mode),
        off!(ucp_worker_params_t, cpu_mask),
        off!(ucp_worker_params_t, events),
        off!(ucp_worker_params_t, user_data),
        off!(ucp_worker_params_t, event_fd),
        off!(ucp_worker_params_t, flags),
        off!(ucp_worker_params_t, name),
        off!(ucp_worker_params_t, client_id),
        size!(ucs_sock_addr_t),
        off!(ucs_sock_addr_t, addrlen),
        size!(ucp_listener_params_t),
        off!(ucp_listener_params_t, sockaddr),
        off!(ucp_listener_params_t, accept_handler),
        off!(ucp_listener_params_t, conn_handler),
        size!(ucp_listener_conn_handler_t),
        size!(ucp_listener_attr_t),
        off!(ucp_listener_attr_t, sockaddr),
        size!(ucp_conn_request_attr_t),
        off!(ucp_conn_request_attr_t, client_address),
        off!(ucp_conn_request_attr_t, client_id),
        size!(ucp_err_handler_t),
        size!(ucp_ep_params_t),
        off!(ucp_ep_params_t, address),
        off!(ucp_ep_params_t, err_mode),
        off!(ucp_ep_params_t, err_handler),
        off!(ucp_ep_params_t, user_data),
        off!(ucp_ep_params_t, flags),
        off!(ucp_ep_params_t, sockaddr),
        off!(ucp_ep_params_t, conn_request),
        off!(ucp_ep_params_t, name),
        off!(ucp_ep_params_t, local_sockaddr),
        size!(ucp_request_param_t),
        off!(ucp_request_param_t, flags),
        off!(ucp_request_param_t, request),
        off!(ucp_request_param_t, cb),
        off!(ucp_request_param_t, datatype),
        off!(ucp_request_param_t, user_data),
        off!(ucp_request_param_t, reply_buffer),
        off!(ucp_request_param_t, memory_type),
        off!(ucp_request_param_t, recv_info),
        off!(ucp_request_param_t, memh),
        size!(ucp_am_recv_param_t),
        off!(ucp_am_recv_param_t, reply_ep),
        size!(ucp_am_handler_param_t),
        off!(ucp_am_handler_param_t, id),
        off!(ucp_am_handler_param_t, flags),
        off!(ucp_am_handler_param_t, cb),
        off!(ucp_am_handler_param_t, arg),
        size!(ucp_mem_map_params_t),
        off!(ucp_mem_map_params_t, length),
        off!(ucp_mem_map_params_t, flags),
        off!(ucp_mem_map_params_t, prot),
        off!(ucp_mem_map_params_t, memory_type),
    ];
    v.extend(konst!(
        UCS_OK,
        UCS_INPROGRESS,
        UCS_ERR_BUSY,
        UCS_ERR_LAST,
        UCP_API_MAJOR,
        UCP_API_MINOR,
        UCP_PARAM_FIELD_FEATURES,
        UCP_PARAM_FIELD_NAME,
        UCP_FEATURE_RMA,
        UCP_FEATURE_WAKEUP,
        UCP_FEATURE_AM,
        UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        UCS_THREAD_MODE_SINGLE,
        UCP_LISTENER_PARAM_FIELD_SOCK_ADDR,
        UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        UCP_LISTENER_ATTR_FIELD_SOCKADDR,
        UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR,
        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        UCP_EP_PARAM_FIELD_ERR_HANDLER,
        UCP_EP_PARAM_FIELD_SOCK_ADDR,
        UCP_EP_PARAM_FIELD_FLAGS,
        UCP_EP_PARAM_FIELD_CONN_REQUEST,
        UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        UCP_ERR_HANDLING_MODE_PEER,
        UCP_EP_CLOSE_FLAG_FORCE,
        UCP_OP_ATTR_FIELD_CALLBACK,
        UCP_OP_ATTR_FIELD_USER_DATA,
        UCP_OP_ATTR_FIELD_FLAGS,
        UCP_AM_SEND_FLAG_REPLY,
        UCP_AM_SEND_FLAG_RNDV,
        UCP_AM_RECV_ATTR_FIELD_REPLY_EP,
        UCP_AM_RECV_ATTR_FLAG_RNDV,
        UCP_AM_HANDLER_PARAM_FIELD_ID,
        UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        UCP_AM_HANDLER_PARAM_FIELD_CB,
        UCP_AM_HANDLER_PARAM_FIELD_ARG,
        UCP_AM_FLAG_WHOLE_MSG,
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS,
        UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        UCP_MEM_MAP_PARAM_FIELD_PROT,
        UCP_MEM_MAP_PROT_LOCAL_READ,
        UCP_MEM_MAP_PROT_LOCAL_WRITE,
        UCP_MEM_MAP_PROT_REMOTE_READ,
        AF_INET,
        AF_INET6
    ));
    v
}

/// A C program that prints, for every key of [`layout`], `key value` as the system headers
/// compute it.
pub fn layout_c() -> String {
    let mut c = String::from(
        "#include <ucp/api/ucp.h>\n#include <stdio.h>\n#include <stddef.h>\n#include <sys/socket.h>\nint main(void) {\n",
    );
    for (key, _) in layout() {
        c.push_str(&format!(
            "    printf(\"%s %lld\\n\", \"{key}\", (long long)({key}));\n"
        ));
    }
    c.push_str("    return 0;\n}\n");
    c
}
