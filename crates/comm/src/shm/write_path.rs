//! How a writer fills ring memory: cached stores or streaming stores, chosen by measuring both.
//!
//! A ring slot's lines were last read by the peer's core, which still holds copies of them. A
//! cached store must first take the line back from that core (a coherence round trip per line);
//! a streaming store (`copy::stream_nonoverlapping`) writes the line to memory without waiting,
//! and the reader then fetches it from memory. Which is faster depends on where the two cores
//! are, which a process cannot know and which can change while it runs (a VM's vCPUs move).
//! Between cores that share an L3 cached stores are the faster; between far cores (another die
//! or socket, or vCPUs the hypervisor placed apart) a cached copy is bounded by one coherence
//! round trip per line and streaming is several times faster (`examples/ring_write_paths.rs`
//! measures both on the machine at hand; figures on docs/src/performance.md).
//!
//! So each link times its large copies (≥ [`CHOOSE_FROM`] bytes; smaller ones are
//! latency-bound and stay cached, where a reader finds them soonest) and keeps, per path, an
//! estimate of the time per byte (see [`WritePathChooser::record`]). It uses the cheaper path and tries the other one every
//! [`PROBE_EVERY`]-th large copy, so it follows a change of placement within a few probes. Only
//! where the bytes travel changes, never which bytes: results are the same either way.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Copies shorter than this always use cached stores.
pub(super) const CHOOSE_FROM: usize = 16 * 1024;
/// One large copy in this many tries the path not currently preferred. A probe of the slow path
/// costs a few copies' time at worst, so probing 1 in 128 costs a few percent, while a link that
/// moves tens of large chunks per step (the benchmark MLP's exact sum) re-measures every few
/// steps and follows a change of placement quickly.
const PROBE_EVERY: u32 = 128;
/// Streaming must look this many times cheaper to the writer than cached stores before it is
/// used: a streamed line is read from memory, a cached one from the writer's cache, and the
/// reader's side of that is not in the writer's timing. Between near cores the two paths cost
/// the writer about the same and streaming costs the reader more, so it must win clearly; between
/// far cores it wins by far more than this margin.
const STREAM_MARGIN: u32 = 2;

/// Which stores fill the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WritePath {
    Cached,
    Streamed,
}

impl WritePath {
    fn index(self) -> usize {
        match self {
            WritePath::Cached => 0,
            WritePath::Streamed => 1,
        }
    }
    fn other(self) -> WritePath {
        match self {
            WritePath::Cached => WritePath::Streamed,
            WritePath::Streamed => WritePath::Cached,
        }
    }
}

/// Per outgoing link: the measured cost of each path. Atomics (relaxed) only so that the
/// transport stays `Sync`; one thread at a time sends on a link (the transport's busy guard).
#[derive(Default)]
pub(super) struct WritePathChooser {
    /// Per path, its last three samples in picoseconds per byte (0 = none yet), and where the
    /// next one goes.
    samples: [[AtomicU32; 3]; 2],
    next: [AtomicU32; 2],
    /// Large copies since the last probe.
    since_probe: AtomicU32,
}

impl WritePathChooser {
    /// The path for a copy of `n` bytes.
    pub fn pick(&self, n: usize) -> WritePath {
        if n < CHOOSE_FROM {
            return WritePath::Cached;
        }
        let [cached, streamed] = [WritePath::Cached, WritePath::Streamed].map(|p| self.cost(p));
        if cached == 0 {
            return WritePath::Cached;
        }
        if streamed == 0 {
            return WritePath::Streamed;
        }
        let best = if cached > STREAM_MARGIN * streamed {
            WritePath::Streamed
        } else {
            WritePath::Cached
        };
        let since = self.since_probe.load(Ordering::Relaxed) + 1;
        if since >= PROBE_EVERY {
            self.since_probe.store(0, Ordering::Relaxed);
            best.other()
        } else {
            self.since_probe.store(since, Ordering::Relaxed);
            best
        }
    }

    /// Folds in that a copy of `n` bytes on `path` took `took`.
    pub fn record(&self, path: WritePath, n: usize, took: Duration) {
        if n < CHOOSE_FROM {
            return;
        }
        let sample =
            (took.as_nanos().saturating_mul(1000) / n as u128).clamp(1, u32::MAX as u128) as u32;
        let samples = &self.samples[path.index()];
        if samples[0].load(Ordering::Relaxed) == 0 {
            // The first sample stands for all three until others arrive.
            for s in samples {
                s.store(sample, Ordering::Relaxed);
            }
            return;
        }
        let next = &self.next[path.index()];
        let at = next.load(Ordering::Relaxed) as usize % 3;
        samples[at].store(sample, Ordering::Relaxed);
        next.store((at as u32 + 1) % 3, Ordering::Relaxed);
    }

    /// A path's picoseconds per byte: the median of its last three samples, so that one copy
    /// the scheduler interrupted does not lock a path out, while a change of placement shows
    /// after two copies on the path in use and two probes of the other. 0 = not measured yet.
    fn cost(&self, path: WritePath) -> u32 {
        let [a, b, c] = [0, 1, 2].map(|i| self.samples[path.index()][i].load(Ordering::Relaxed));
        a.max(b).min(a.min(b).max(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 64 ns per ps/B: the conversions below are exact.
    const BIG: usize = 64_000;

    /// Runs `copies` large copies that take `cached` / `streamed` per byte; returns how many
    /// went each way.
    fn run(c: &WritePathChooser, copies: usize, cached_ps: u64, streamed_ps: u64) -> [usize; 2] {
        let mut counts = [0; 2];
        for _ in 0..copies {
            let path = c.pick(BIG);
            counts[path.index()] += 1;
            let ps = match path {
                WritePath::Cached => cached_ps,
                WritePath::Streamed => streamed_ps,
            };
            c.record(path, BIG, Duration::from_nanos(ps * BIG as u64 / 1000));
        }
        counts
    }

    #[test]
    fn small_copies_are_cached_and_not_measured() {
        let c = WritePathChooser::default();
        for _ in 0..1000 {
            assert_eq!(c.pick(CHOOSE_FROM - 1), WritePath::Cached);
            c.record(WritePath::Streamed, CHOOSE_FROM - 1, Duration::from_secs(1));
        }
        assert_eq!(c.cost(WritePath::Streamed), 0);
    }

    #[test]
    fn streaming_must_be_clearly_cheaper() {
        let c = WritePathChooser::default();
        // Streaming a little cheaper for the writer is not enough (the reader pays for it).
        let [cached, _] = run(&c, 1280, 60, 45);
        assert!(cached > 1200, "cached {cached}");
    }

    #[test]
    fn cost_is_the_median_of_the_last_three() {
        let c = WritePathChooser::default();
        let rec = |ps: u64| {
            c.record(
                WritePath::Cached,
                BIG,
                Duration::from_nanos(ps * BIG as u64 / 1000),
            )
        };
        rec(40);
        assert_eq!(c.cost(WritePath::Cached), 40);
        rec(5000);
        assert_eq!(c.cost(WritePath::Cached), 40);
        rec(400);
        assert_eq!(c.cost(WritePath::Cached), 400);
        rec(30);
        assert_eq!(c.cost(WritePath::Cached), 400);
        rec(35);
        assert_eq!(c.cost(WritePath::Cached), 35);
    }

    #[test]
    fn measures_both_then_keeps_the_cheaper_and_probes_the_other() {
        let c = WritePathChooser::default();
        // Far cores: streaming 9× cheaper.
        let [cached, streamed] = run(&c, 1280, 420, 47);
        assert_eq!(cached, 1 + 1279 / PROBE_EVERY as usize);
        assert_eq!(streamed, 1280 - cached);
        // Near cores: cached wins again after two probes.
        let [cached, streamed] = run(&c, 1280, 43, 57);
        assert!(cached > 1000, "cached {cached}, streamed {streamed}");
        // Far again: cached is left after two copies.
        let [cached, _] = run(&c, 1280, 420, 47);
        assert!(cached <= 2 + 10, "cached {cached}");
    }

    #[test]
    fn one_interrupted_copy_does_not_lock_a_path_out() {
        let c = WritePathChooser::default();
        run(&c, 300, 43, 57);
        // A cached copy is preempted for 5 ms.
        let path = c.pick(BIG);
        assert_eq!(path, WritePath::Cached);
        c.record(path, BIG, Duration::from_millis(5));
        let [cached, _] = run(&c, 2 * PROBE_EVERY as usize, 43, 57);
        assert!(cached > PROBE_EVERY as usize, "cached {cached}");
    }
}
