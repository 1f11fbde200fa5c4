//! Which paths count as loopback (and so get loopback datagrams and the loopback bulk controller), and
//! `GLEAM_LOOPBACK_PATH=lan`, which makes loopback stand for a LAN (the benchmarks' link emulator).
//! One test in its own binary: it sets an environment variable.

use std::net::SocketAddr;

use gleam_auth::tls::{PathKind, path_kind};

#[test]
fn loopback_is_loopback_unless_it_stands_for_a_lan() {
    let addr = |s: &str| s.parse::<SocketAddr>().expect("an address");
    for local in [
        "127.0.0.1:4433",
        "127.0.0.2:4433",
        "[::1]:4433",
        "[::ffff:127.0.0.1]:4433",
    ] {
        assert_eq!(path_kind(addr(local)), PathKind::Loopback, "{local}");
    }
    for lan in ["192.168.1.20:4433", "[fe80::1]:4433", "10.0.0.2:4433"] {
        assert_eq!(path_kind(addr(lan)), PathKind::Lan, "{lan}");
    }
    // SAFETY: the only test of this binary, so no other thread reads the environment meanwhile.
    unsafe { std::env::set_var("GLEAM_LOOPBACK_PATH", "lan") };
    assert_eq!(path_kind(addr("127.0.0.2:4433")), PathKind::Lan);
}
