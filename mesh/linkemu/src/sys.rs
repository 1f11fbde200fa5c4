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
            &timeout,
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
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(option, error = %io::Error::last_os_error(), "setsockopt failed");
        }
    }
}
