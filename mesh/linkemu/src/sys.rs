//! The few system calls std does not wrap: a nanosecond-precision wait on several sockets, the
//! thread's timer slack, and socket buffer sizes.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// Asks the kernel to wake this thread within about a microsecond of its timers instead of the
/// default 50 µs slack. Best effort.
pub(crate) fn tighten_timer_slack() {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: PR_SET_TIMERSLACK takes one integer argument and touches no memory.
        let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
        if rc != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "could not tighten timer slack");
        }
    }
}

/// Blocks until one of `fds` is readable (or has an error pending) or `timeout` passes.
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Duration) -> io::Result<()> {
    let mut pollfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let rc = poll(&mut pollfds, timeout);
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn poll(pollfds: &mut [libc::pollfd], timeout: Duration) -> libc::c_int {
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `pollfds` is a valid, exclusively borrowed array of `len` pollfd structs and
    // `timeout` lives across the call; no signal mask is passed.
    unsafe {
        libc::ppoll(
            pollfds.as_mut_ptr(),
            pollfds.len() as libc::nfds_t,
            &raw const timeout,
            std::ptr::null(),
        )
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
fn poll(pollfds: &mut [libc::pollfd], timeout: Duration) -> libc::c_int {
    // Millisecond resolution, rounded down: the caller spins the rest.
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: as above, with a plain millisecond timeout.
    unsafe { libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, ms) }
}

/// Raises a socket's send and receive buffers so bursts at emulated line rate are not dropped by
/// the kernel before the link model sees them. Best effort: the kernel caps the values.
pub(crate) fn enlarge_buffers(socket: &impl AsRawFd, bytes: usize) {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: the fd is a live socket owned by the caller; the option value is a c_int
        // whose size is passed alongside it.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&raw const value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(option, error = %io::Error::last_os_error(), "setsockopt failed");
        }
    }
}

/// Asks the kernel to stamp each received datagram with its arrival time (`SO_TIMESTAMPNS`), read
/// back by [`recv_stamped`]. Best effort: without it datagrams count as arriving when read, and
/// so do those of the first moments, since Linux enables stamping globally from a work item.
pub(crate) fn stamp_arrivals(socket: &impl AsRawFd) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let on: libc::c_int = 1;
        // SAFETY: as in `enlarge_buffers`: a live socket and a c_int option of the stated size.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_TIMESTAMPNS,
                (&raw const on).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "SO_TIMESTAMPNS failed");
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = socket;
}

/// One datagram read by [`recv_stamped`].
pub(crate) struct Received {
    pub len: usize,
    /// The sender, when the socket is not connected.
    pub from: Option<std::net::SocketAddr>,
    /// When the kernel received it, as time since the Unix epoch (`CLOCK_REALTIME`).
    pub stamp: Option<Duration>,
}

/// `recvfrom` that also returns the kernel's arrival stamp, so a relay thread that was descheduled
/// for a while still feeds its link model the true arrival times.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) fn recv_stamped(socket: &impl AsRawFd, buf: &mut [u8]) -> io::Result<Received> {
    // Every pointer in `msg` refers to a local that outlives the `recvmsg` call, with its true
    // length; the kernel writes at most those lengths. The cmsg walk uses libc's macros over the
    // control length the kernel reported, and the payload is read unaligned.
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // u64s keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 16];
    // SAFETY: all-zero is a valid msghdr (null pointers, zero lengths), filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&raw mut addr).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` points only at the locals above, which outlive the call (see the top comment).
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut stamp = None;
    // SAFETY: `msg` is the header the kernel just filled; the macro reads its control fields.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-NULL cmsghdr inside `control`, as CMSG_FIRSTHDR/CMSG_NXTHDR return them.
        let header = unsafe { &*cmsg };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_TIMESTAMPNS {
            // SAFETY: an SCM_TIMESTAMPNS message carries a timespec; read unaligned from `control`.
            let ts: libc::timespec =
                unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast()) };
            if let (Ok(secs), Ok(nanos)) = (u64::try_from(ts.tv_sec), u32::try_from(ts.tv_nsec)) {
                stamp = Some(Duration::new(secs, nanos));
            }
        }
        // SAFETY: `cmsg` is a header of `msg`'s control buffer; the macro stops at its end.
        cmsg = unsafe { libc::CMSG_NXTHDR(&raw const msg, cmsg) };
    }
    Ok(Received {
        len: n as usize,
        from: socket_addr(&addr, msg.msg_namelen),
        stamp,
    })
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn socket_addr(
    addr: &libc::sockaddr_storage,
    len: libc::socklen_t,
) -> Option<std::net::SocketAddr> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
    let len = len as usize;
    match libc::c_int::from(addr.ss_family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for.
            let a =
                unsafe { &*(addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(
                SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                )
                .into(),
            )
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let a =
                unsafe { &*(addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(
                SocketAddrV6::new(
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                    u32::from_be(a.sin6_flowinfo),
                    a.sin6_scope_id,
                )
                .into(),
            )
        }
        _ => None,
    }
}

/// Without kernel stamps: a plain `recv_from` on the (non-blocking) socket.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) fn recv_stamped(socket: &std::net::UdpSocket, buf: &mut [u8]) -> io::Result<Received> {
    let (len, from) = socket.recv_from(buf)?;
    Ok(Received {
        len,
        from: Some(from),
        stamp: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::time::{SystemTime, UNIX_EPOCH};

    fn stamped_round(local: &str) {
        let rx = UdpSocket::bind(local).expect("bind rx");
        rx.set_nonblocking(true).expect("nonblocking");
        stamp_arrivals(&rx);
        // Linux turns receive stamping on system-wide from a work item, a moment later; until
        // then datagrams are stamped when read.
        std::thread::sleep(Duration::from_millis(50));
        let tx = UdpSocket::bind(local).expect("bind tx");
        let mut buf = [0u8; 64];
        assert_eq!(
            recv_stamped(&rx, &mut buf).err().map(|e| e.kind()),
            Some(io::ErrorKind::WouldBlock)
        );
        tx.send_to(b"hello", rx.local_addr().expect("addr"))
            .expect("send");
        std::thread::sleep(Duration::from_millis(30));
        let got = recv_stamped(&rx, &mut buf).expect("recv");
        assert_eq!(&buf[..got.len], b"hello");
        assert_eq!(got.from, Some(tx.local_addr().expect("addr")));
        if cfg!(any(target_os = "linux", target_os = "android")) {
            let stamp = got.stamp.expect("kernel stamp");
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("after 1970");
            let age = wall.saturating_sub(stamp);
            assert!(
                age >= Duration::from_millis(25) && age < Duration::from_secs(5),
                "{age:?}"
            );
        }
    }

    #[test]
    fn stamped_receive_v4() {
        stamped_round("127.0.0.1:0");
    }

    #[test]
    fn stamped_receive_v6() {
        // Some CI sandboxes have no IPv6 loopback.
        if UdpSocket::bind("[::1]:0").is_ok() {
            stamped_round("[::1]:0");
        }
    }
}
