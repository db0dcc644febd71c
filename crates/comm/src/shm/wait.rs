//! How a blocked transfer waits: spin, then yield, then sleep on a futex in bounded slices.
//!
//! Spinning gives the lowest latency when the peer runs on another core, but with up to 8 ranks on
//! 2 cores a spinning rank steals the CPU from the very peer it waits for, so spinning stops after
//! a few microseconds; `sched_yield` then lets other ranks run; after that we sleep on our doorbell
//! futex, which every peer rings (only when we announced ourselves as a sleeper) after publishing
//! data for us or freeing space in a ring we write. Sleeps are bounded so that we re-check the
//! deadline and whether the peer process still exists.

use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

/// Spin this long after the last progress before yielding.
const SPIN_FOR: Duration = Duration::from_micros(5);
/// Yield until this long after the last progress, then sleep.
const YIELD_UNTIL: Duration = Duration::from_micros(100);
/// Longest single futex sleep: bounds how late we notice a dead peer or a passed deadline.
pub(super) const SLEEP_SLICE: Duration = Duration::from_millis(20);

pub(super) enum Phase {
    Spin,
    Yield,
    Sleep,
}

/// Tracks how long a transfer has been stuck.
pub(super) struct Backoff {
    stuck_since: Option<Instant>,
}

impl Backoff {
    pub fn new() -> Self {
        Backoff { stuck_since: None }
    }
    pub fn reset(&mut self) {
        self.stuck_since = None;
    }
    /// What to do after an iteration that made no progress.
    pub fn next(&mut self) -> Phase {
        let now = Instant::now();
        let since = *self.stuck_since.get_or_insert(now);
        let stuck = now - since;
        if stuck < SPIN_FOR {
            Phase::Spin
        } else if stuck < YIELD_UNTIL {
            Phase::Yield
        } else {
            Phase::Sleep
        }
    }
}

pub(super) fn spin() {
    for _ in 0..16 {
        std::hint::spin_loop();
    }
}

pub(super) fn yield_now() {
    // SAFETY: no preconditions.
    unsafe { libc::sched_yield() };
}

/// Sleep until `word != expected`, a wake-up, or `timeout`. Non-private futex because the waker
/// may be another process. Spurious returns (EAGAIN, EINTR, timeout) are fine: callers re-check.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 that lives in a shared mapping; `ts` outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wake every thread sleeping on `word` (in any process).
pub(super) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in a shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
