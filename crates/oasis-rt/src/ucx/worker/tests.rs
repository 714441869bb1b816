//! The tests of the progress thread's plain parts (socket addresses, constants).

use super::*;

#[test]
fn sockaddrs_round_trip() {
    for a in ["127.0.0.1:7470", "[::1]:9", "10.1.2.3:0"] {
        let addr: SocketAddr = a.parse().unwrap();
        let raw = RawSockaddr::new(addr);
        let mut s = sys::sockaddr_storage { bytes: [0; 128] };
        let n = raw.len as usize;
        s.bytes[..n].copy_from_slice(&raw.bytes[..n]);
        assert_eq!(parse_sockaddr(&s), Some(addr), "{a}");
    }
}
