//! File descriptors for the flood tests.

/// Soft RLIMIT_NOFILE up to the hard limit (at most 16,384): a flood holds many sockets on each
/// end.
pub fn raise_fd_limit() {
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max.min(16384);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}
