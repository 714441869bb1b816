//! Sockets and poll for the progress thread, declared by hand (Linux): `poll(2)` on the worker's
//! event fd, socket addresses to and from UCX's.

use std::ffi::c_int;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::sys;

#[repr(C)]
pub(super) struct PollFd {
    pub(super) fd: c_int,
    pub(super) events: i16,
    pub(super) revents: i16,
}

pub(super) const POLLIN: i16 = 1;

extern "C" {
    pub(super) fn poll(fds: *mut PollFd, nfds: u64, timeout: c_int) -> c_int;
}

/// A `struct sockaddr_in` (16 bytes) or `sockaddr_in6` (28 bytes) built from a [`SocketAddr`]:
/// family in host order, port in network order, then the address.
#[repr(C, align(4))]
pub(super) struct RawSockaddr {
    pub(super) bytes: [u8; 28],
    pub(super) len: u32,
}

impl RawSockaddr {
    pub(super) fn new(addr: SocketAddr) -> RawSockaddr {
        let mut bytes = [0u8; 28];
        bytes[2..4].copy_from_slice(&addr.port().to_be_bytes());
        let len = match addr {
            SocketAddr::V4(a) => {
                bytes[..2].copy_from_slice(&sys::AF_INET.to_ne_bytes());
                bytes[4..8].copy_from_slice(&a.ip().octets());
                16
            }
            SocketAddr::V6(a) => {
                bytes[..2].copy_from_slice(&sys::AF_INET6.to_ne_bytes());
                bytes[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
                bytes[8..24].copy_from_slice(&a.ip().octets());
                bytes[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
                28
            }
        };
        RawSockaddr { bytes, len }
    }

    pub(super) fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        sys::ucs_sock_addr_t {
            addr: self.bytes.as_ptr().cast(),
            addrlen: self.len,
        }
    }
}

pub(super) fn parse_sockaddr(s: &sys::sockaddr_storage) -> Option<SocketAddr> {
    let b = &s.bytes;
    let family = u16::from_ne_bytes([b[0], b[1]]);
    let port = u16::from_be_bytes([b[2], b[3]]);
    match family {
        sys::AF_INET => Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(b[4], b[5], b[6], b[7])),
            port,
        )),
        sys::AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[8..24]);
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a)), port))
        }
        _ => None,
    }
}
