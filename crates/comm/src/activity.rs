//! Process-wide liveness of the calling code, for hang detection outside collectives.
//!
//! Why: a worker stuck outside any collective (in data loading, say) is only noticed by its peers
//! when their next collective times out, and then they all blame whoever they waited for. Its
//! own launcher can do better if it knows two things: when the worker's code last made progress
//! ([`touch`], called by the training loops at step and micro-batch boundaries), and whether it
//! is now inside a communication operation ([`waiting`], held by every `Communicator`
//! operation), which has its own deadline. A worker that is not waiting and has not moved for the
//! launcher's stall timeout is hung, and is named as such.
//!
//! Invariant: this module knows nothing of training; it is two atomics.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static WAITING: AtomicU32 = AtomicU32::new(0);
/// Milliseconds since [`epoch`] of the last sign of progress.
static LAST_MS: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// The calling code made progress now.
pub fn touch() {
    let ms = epoch().elapsed().as_millis() as u64;
    LAST_MS.fetch_max(ms, Ordering::Relaxed);
}

/// Held while a communication operation runs (it has its own deadline); progress is recorded
/// when it starts and when it ends.
pub struct Waiting(());

/// Mark the caller as waiting in a communication operation until the guard drops.
pub fn waiting() -> Waiting {
    touch();
    WAITING.fetch_add(1, Ordering::SeqCst);
    Waiting(())
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::SeqCst);
        touch();
    }
}

/// Is some thread waiting in a communication operation, and how long since the last progress.
pub fn snapshot() -> (bool, Duration) {
    let now = epoch().elapsed().as_millis() as u64;
    let last = LAST_MS.load(Ordering::Relaxed);
    (
        WAITING.load(Ordering::SeqCst) > 0,
        Duration::from_millis(now.saturating_sub(last)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_grows_until_touched_and_waiting_is_counted() {
        touch();
        std::thread::sleep(Duration::from_millis(30));
        let (w, idle) = snapshot();
        assert!(!w);
        assert!(idle >= Duration::from_millis(30), "{idle:?}");
        {
            let _g = waiting();
            let (w, idle) = snapshot();
            assert!(w);
            assert!(idle < Duration::from_millis(30), "{idle:?}");
        }
        assert!(!snapshot().0);
    }
}
