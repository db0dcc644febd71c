//! Gradient parts that every rank of a one-host group maps: the exact sum reads its peers'
//! values where they lie instead of receiving copies of them through the rings.
//!
//! Why: through the rings, each rank of 2 writes its `i64` sums for the peer's half into a ring
//! and reads the peer's out of one (`2 × 8 × P/2` bytes copied per rank), then the same again for
//! the finished `f32` halves. Here each rank's micro-batch gradients live in its **window**, a
//! memory-backed file in the shared-memory transport's directory that every rank of the group
//! maps, next to a *sum area* of `P` values, and
//! [`crate::exact::ExactReducer::reduce_shared`] runs:
//!
//! 1. `all_reduce(max)` of the per-bucket exponents, as every exact sum does. It is also the
//!    barrier after which every rank's parts are complete and visible: a rank sends its exponents
//!    only after writing its parts, and a message's arrival orders everything its sender wrote
//!    before it (the rings publish with release stores and read with acquire loads).
//! 2. Rank `r` sums chunk `r` (`collectives::chunk_range`) of every part of every rank, reading
//!    the peers' parts from their windows, into chunk `r` of its sum area (one fused pass per
//!    bucket, no `i64` vector). Bytes copied: none.
//! 3. A barrier: every chunk is finished.
//! 4. Every rank copies the peers' chunks from their sum areas into its own: `(n−1)/n · 4P`
//!    bytes, the all-gather's bytes copied once instead of twice. Its sum area then holds the
//!    whole sum ([`SharedParts::sum`]).
//!
//! No barrier after step 4: a rank overwrites its chunk of its sum area only after the next
//! exponent `all_reduce`, which no rank enters before it has finished copying; the rest of its
//! sum area nobody else reads; and it overwrites its parts only in the next step's backward,
//! after step 3, when no rank reads them any more. Against the rings this saves every copy of
//! the `i64` sums and one of the two copies of the finished values.
//!
//! **Far cores.** Reading a peer's lines leaves copies in this core's caches, and the peer's next
//! write to them must wait until they are invalidated: cheap between cores that share an L3,
//! slow between far ones, where the peer's next backward (which writes its parts) stalls on every
//! line this rank read. Where two processes' cores sit is not known to them and can change while
//! they run (a VM's vCPUs move). So every [`MEASURE_EVERY`] reductions each pair of ranks times a
//! short ping-pong through their windows, and a rank evicts the lines it read from a peer that is
//! far (round trip above [`FAR_ROUND_TRIP`]) right after reading them (`copy::evict`). Near
//! peers' lines are kept: there the eviction costs more than the stall it avoids.
//!
//! Same bits as the other forms of the exact sum: each value's `i64` sum is exact in any order
//! and converted back by the same function, whichever rank forms it.
//!
//! Setup ([`SharedParts::establish`], collective): each rank creates its window under a name
//! with a fresh random nonce and its own pid and start time
//! (`lockstep-{job}-parts-{rank}-{nonce}.{pid}.{start}`, 0600, never through a symlink, locked
//! by its creator for as long as it lives, memory reserved up front so a full tmpfs is found here
//! and not by a SIGBUS later), the ranks all-gather their nonces, part counts, lengths, whether
//! the window exists and its creator, map each other's windows (read-only, only files of our own
//! user) and check the header, then agree that everyone mapped everything, and each rank removes
//! its window's name: nothing is left in the directory once setup returns, and the mappings live
//! until the `SharedParts` is dropped. A crash inside setup can leave one window file; its name
//! (nonce-unique) never collides with a later job's, and the next transport set up in that
//! directory removes it once its creator is provably dead (`shm::reclaim_leaked`). When some rank
//! cannot set up its window (a tmpfs too small for the gradients, a name held by another user),
//! every rank learns it in the same collective and the exact sum goes through the rings.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::shm::Creator;

const MAGIC: u64 = u64::from_le_bytes(*b"LSPARTS1");
/// Header bytes before the first part: line 0 holds magic, nonce and the parts this step; line 1
/// the ping-pong word (its own line, so a measurement does not disturb the rest).
const HEADER: usize = 128;
/// Words per rank in the setup's all-gather: nonce, parts, length, created, creator pid and
/// start time.
const INFO: usize = 6;
/// Reductions between two measurements of how far each peer's core is.
pub const MEASURE_EVERY: u64 = 64;
/// A peer whose round trip through the ping words takes longer than this is far: its lines are
/// evicted after reading. A trip moves two cache lines (each rank writes only its own window),
/// each changing hands twice: between cores that share an L3 that is on the order of 100 ns,
/// between far cores several hundred; this bound lies between the two.
pub const FAR_ROUND_TRIP: Duration = Duration::from_nanos(300);
/// Round trips per measurement: `BATCHES` batches of `TRIPS` (the fastest batch counts).
const TRIPS: usize = 16;
const BATCHES: usize = 3;
/// A measurement whose peer does not answer within this (an oversubscribed host) is dropped.
const PING_PATIENCE: Duration = Duration::from_millis(2);

/// A part of the current reduction and whether its rank is far.
pub(crate) type PartOf<'a> = (&'a [f32], bool);

/// What [`SharedParts::establish`] gave, the same on every rank.
pub enum Sharing {
    Shared(SharedParts),
    /// The transport has no shared memory, or the group is one rank.
    NoSharedMemory,
    /// Shared memory exists but a window could not be set up (why).
    Unavailable(String),
}

/// This rank's window (writable) and its peers' (read-only), in group-rank order.
pub struct SharedParts {
    windows: Vec<Window>,
    me: usize,
    /// Values per part.
    len: usize,
    /// Parts each group rank's window holds.
    slots: Vec<usize>,
    /// Per group rank: whether its core was far at the last measurement.
    far: Vec<bool>,
    /// Reductions so far (measurements happen at multiples of `MEASURE_EVERY`).
    reductions: u64,
}

struct Window {
    base: *mut u8,
    bytes: usize,
    /// Our own window's name, until it is removed.
    name: Option<PathBuf>,
    /// Our own window's file, held open for its lock (which tells a reclaimer we are alive).
    _file: Option<File>,
}

// SAFETY: the mappings stay valid until Drop; writes go only to our own window through `&mut
// self`, and peers' windows are read only between the synchronisations described above.
unsafe impl Send for SharedParts {}
unsafe impl Sync for SharedParts {}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: base/bytes come from a successful mmap; nothing borrows it past `self`.
        unsafe { libc::munmap(self.base.cast(), self.bytes) };
        if let Some(name) = self.name.take() {
            let _ = std::fs::remove_file(name);
        }
    }
}

/// Bytes of one part in a window: rounded up to whole cache lines.
fn part_stride(len: usize) -> usize {
    (len * 4).div_ceil(64) * 64
}

/// Header, `slots` parts and the sum area; `None` when it overflows (such a window cannot be
/// created anyway).
fn window_bytes(slots: usize, len: usize) -> Option<usize> {
    let stride = len.checked_mul(4)?.div_ceil(64).checked_mul(64)?;
    slots
        .checked_add(1)?
        .checked_mul(stride)?
        .checked_add(HEADER)
}

/// The window's name: unique by its nonce, and naming its creator so that a leaked one can be
/// reclaimed once the creator is provably dead.
fn window_path(
    dir: &Path,
    job_id: &str,
    global_rank: usize,
    nonce: u64,
    creator: Creator,
) -> PathBuf {
    dir.join(format!(
        "lockstep-{job_id}-parts-{global_rank}-{nonce:016x}.{}.{}",
        creator.pid,
        creator.start.unwrap_or(0)
    ))
}

/// Opens `path` (not through a symlink, only a file of our own user) and maps its `bytes` (which
/// must be its size).
fn open_and_map(path: &Path, bytes: usize, writable: bool) -> Result<*mut u8, CommError> {
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            crate::shm::taken_by_other(path)
                .unwrap_or_else(|| CommError::setup(format!("open {}", path.display()), e))
        })?;
    let meta = file
        .metadata()
        .map_err(|e| CommError::setup(format!("stat {}", path.display()), e))?;
    if let Some(taken) = crate::shm::owned_by_other(path, meta.uid(), crate::shm::my_uid()) {
        return Err(taken);
    }
    let size = meta.len();
    if size != bytes as u64 {
        return Err(CommError::Rendezvous(format!(
            "{} holds {size} bytes, its rank announced {bytes}",
            path.display()
        )));
    }
    crate::shm::map(&file, bytes, path, writable)
}

/// Creates our window file, locked, with its memory reserved and its header written. A name
/// held by another user is [`CommError::NameTaken`].
fn create(path: &Path, bytes: usize, nonce: u64) -> Result<Window, CommError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            crate::shm::taken_by_other(path)
                .unwrap_or_else(|| CommError::setup(format!("create {}", path.display()), e))
        })?;
    // The window owns the name from here on: any failure below removes it.
    let mut window = Window {
        base: std::ptr::null_mut(),
        bytes: 0,
        name: Some(path.to_path_buf()),
        _file: None,
    };
    crate::shm::lock_for_life(&file)
        .map_err(|e| CommError::setup(format!("lock {}", path.display()), e))?;
    file.set_len(bytes as u64)
        .map_err(|e| CommError::setup(format!("size {} to {bytes} bytes", path.display()), e))?;
    crate::shm::reserve(&file, bytes).map_err(|why| {
        CommError::setup(
            format!("reserve {bytes} bytes for {}", path.display()),
            format!(
                "{why}: the exact sum's shared gradient windows need their micro-batch \
                 gradients' bytes in {}; enlarge it (e.g. docker --shm-size)",
                path.parent()
                    .map_or("?".into(), |d| d.display().to_string())
            ),
        )
    })?;
    window.base = crate::shm::map(&file, bytes, path, true)?;
    window.bytes = bytes;
    window._file = Some(file);
    let words = window.header();
    words[1].store(nonce, Ordering::Relaxed);
    words[0].store(MAGIC, Ordering::Release);
    Ok(window)
}

impl Window {
    /// Header words: magic, nonce, parts this step.
    fn header(&self) -> &[AtomicU64; 3] {
        // SAFETY: the mapping is page aligned and at least HEADER bytes; atomics of plain memory.
        unsafe { &*(self.base as *const [AtomicU64; 3]) }
    }

    /// The ping-pong word (its own cache line).
    fn ping(&self) -> &AtomicU64 {
        // SAFETY: as above; offset 64 is inside the header and 8-aligned.
        unsafe { &*(self.base.add(64) as *const AtomicU64) }
    }
}

impl SharedParts {
    /// Collective over `comm`: every rank creates a window of `slots` parts of `len` values (plus
    /// a sum area of `len` values) and maps everyone's. Every rank gets the same kind of
    /// answer: [`Sharing::NoSharedMemory`] when the group's transport has no shared memory or the
    /// group is one rank, [`Sharing::Unavailable`] when some rank could not create or map a
    /// window (a full tmpfs, say; the exact sum then goes through the rings). Every rank must
    /// pass the same `len`; `slots` may differ.
    pub fn establish(
        comm: &mut Communicator,
        slots: usize,
        len: usize,
    ) -> Result<Sharing, CommError> {
        let n = comm.size();
        let Some(shared) = comm.shared_memory().filter(|_| n > 1) else {
            return Ok(Sharing::NoSharedMemory);
        };
        let me = comm.rank();
        let nonce = crate::shm::random_nonce()?;
        let creator = Creator::me();
        let path = window_path(
            &shared.dir,
            &shared.job_id,
            comm.global_rank_of(me),
            nonce,
            creator,
        );
        let mut own = match window_bytes(slots, len) {
            Some(bytes) => create(&path, bytes, nonce),
            None => Err(CommError::invalid(
                "shared gradient parts",
                format!("{slots} parts of {len} values overflow a window"),
            )),
        };

        // [nonce, slots, len, created, pid, start] per rank; i64 carries the u64s bit for bit.
        let mut info = vec![0i64; INFO * n];
        info[INFO * me..INFO * (me + 1)].copy_from_slice(&[
            nonce as i64,
            slots as i64,
            len as i64,
            own.is_ok() as i64,
            creator.pid as i64,
            creator.start.unwrap_or(0) as i64,
        ]);
        comm.all_gather_chunks(&mut info)?;
        let info: Vec<[u64; INFO]> = info
            .chunks(INFO)
            .map(|c| std::array::from_fn(|k| c[k] as u64))
            .collect();
        if let Some(r) = info.iter().position(|i| i[2] != len as u64) {
            return Err(CommError::invalid(
                "shared gradient parts",
                format!(
                    "rank {r} shares parts of {} values, rank {me} of {len}",
                    info[r][2]
                ),
            ));
        }
        if let Some(r) = info.iter().position(|i| i[3] == 0) {
            let why = match &own {
                Err(e) if r == me => e.to_string(),
                _ => "see that rank's log".into(),
            };
            return Ok(Sharing::Unavailable(format!(
                "rank {r} could not create its window: {why}"
            )));
        }

        let mut windows = Vec::with_capacity(n);
        let mut failed = None;
        for (r, &[nonce_r, slots_r, _, _, pid_r, start_r]) in info.iter().enumerate() {
            if r == me {
                windows.push(std::mem::replace(
                    &mut own,
                    Err(CommError::Broken(String::new())),
                )?);
                continue;
            }
            let creator_r = Creator {
                pid: pid_r as u32,
                start: Some(start_r).filter(|&s| s != 0),
            };
            let path = window_path(
                &shared.dir,
                &shared.job_id,
                comm.global_rank_of(r),
                nonce_r,
                creator_r,
            );
            let bytes = window_bytes(slots_r as usize, len).expect("created, so it fits");
            match open_and_map(&path, bytes, false) {
                Ok(base) => {
                    let window = Window {
                        base,
                        bytes,
                        name: None,
                        _file: None,
                    };
                    let h = window.header();
                    if h[0].load(Ordering::Acquire) != MAGIC
                        || h[1].load(Ordering::Relaxed) != nonce_r
                    {
                        return Err(CommError::Rendezvous(format!(
                            "{} is not rank {r}'s window (magic or nonce differ)",
                            path.display()
                        )));
                    }
                    windows.push(window);
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        // Every rank has mapped every window, or someone could not: agreed here, after which
        // the names can go.
        let mut mapped = [failed.is_none() as i32];
        comm.all_reduce(&mut mapped, crate::element::ReduceOp::Min)?;
        if mapped[0] == 0 {
            return Ok(Sharing::Unavailable(format!(
                "a rank could not map its peers' windows{}",
                failed.map_or(String::new(), |e| format!(" ({e})"))
            )));
        }
        if let Some(name) = windows[me].name.take() {
            std::fs::remove_file(&name)
                .map_err(|e| CommError::setup(format!("remove {}", name.display()), e))?;
        }
        Ok(Sharing::Shared(SharedParts {
            slots: info.iter().map(|i| i[1] as usize).collect(),
            windows,
            me,
            len,
            far: vec![false; n],
            reductions: 0,
        }))
    }

    /// Values per part.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many parts this rank's window holds.
    pub fn slots(&self) -> usize {
        self.slots[self.me]
    }

    /// This rank's part `slot`, to be written.
    pub fn part_mut(&mut self, slot: usize) -> &mut [f32] {
        assert!(slot < self.slots(), "part {slot} of {}", self.slots());
        let w = &self.windows[self.me];
        // SAFETY: in bounds of our writable mapping (window_bytes), 64-aligned; `&mut self`
        // makes it the only reference into our window.
        unsafe {
            std::slice::from_raw_parts_mut(
                w.base.add(HEADER + slot * part_stride(self.len)).cast(),
                self.len,
            )
        }
    }

    /// Rank `rank`'s part `slot` (this rank's included). Crate-only: a peer's part may only be
    /// read between the synchronisations of a reduction.
    pub(crate) fn part(&self, rank: usize, slot: usize) -> &[f32] {
        assert!(slot < self.slots[rank], "rank {rank}'s part {slot}");
        let w = &self.windows[rank];
        // SAFETY: in bounds of that mapping; peers write their parts only outside the reduction
        // (see the module doc).
        unsafe {
            std::slice::from_raw_parts(
                w.base.add(HEADER + slot * part_stride(self.len)).cast(),
                self.len,
            )
        }
    }

    /// This rank's part `slot`.
    pub fn own_part(&self, slot: usize) -> &[f32] {
        self.part(self.me, slot)
    }

    /// This rank's parts `0..count`, all readable at once.
    pub fn own_parts(&self, count: usize) -> Vec<&[f32]> {
        (0..count).map(|k| self.part(self.me, k)).collect()
    }

    /// Announces how many of its parts this rank holds in the coming reduction.
    pub(crate) fn set_parts_now(&self, count: usize) {
        assert!(
            count <= self.slots(),
            "{count} parts, window of {}",
            self.slots()
        );
        self.windows[self.me].header()[2].store(count as u64, Ordering::Relaxed);
    }

    /// Every rank's parts of the current reduction (read after the first synchronisation), in
    /// rank order, each with whether its rank is far; and `range` of this rank's sum area:
    /// disjoint memory.
    pub(crate) fn parts_and_sum(
        &mut self,
        range: Range<usize>,
    ) -> Result<(Vec<PartOf<'_>>, &mut [f32]), CommError> {
        assert!(range.end <= self.len);
        let at = self.sum_offset(self.me) + 4 * range.start;
        // SAFETY: in bounds of our writable mapping (the sum area is `len` values), disjoint
        // from every part; `&mut self` makes it the only mutable reference into our window.
        let sum = unsafe {
            std::slice::from_raw_parts_mut(self.windows[self.me].base.add(at).cast(), range.len())
        };
        let mut all = Vec::new();
        for (r, w) in self.windows.iter().enumerate() {
            let count = w.header()[2].load(Ordering::Relaxed);
            if count > self.slots[r] as u64 {
                return Err(CommError::Rendezvous(format!(
                    "rank {r} announced {count} parts in a window of {}",
                    self.slots[r]
                )));
            }
            all.extend((0..count as usize).map(|k| (self.part(r, k), self.far[r])));
        }
        Ok((all, sum))
    }

    fn sum_offset(&self, rank: usize) -> usize {
        HEADER + self.slots[rank] * part_stride(self.len)
    }

    /// Copies `range` of `rank`'s sum area into this rank's (read after the barrier that
    /// follows its writing), then evicts what was read if that rank is far.
    pub(crate) fn copy_sum_from(&mut self, rank: usize, range: Range<usize>) {
        assert!(rank != self.me && range.end <= self.len);
        let n = range.len();
        // SAFETY: both in bounds of their mappings (sum areas of `len` values); different
        // windows, so disjoint; ours is only written through `&mut self`.
        let (src, dst) = unsafe {
            let src = self.windows[rank]
                .base
                .add(self.sum_offset(rank) + 4 * range.start);
            let dst = self.windows[self.me]
                .base
                .add(self.sum_offset(self.me) + 4 * range.start);
            (
                std::slice::from_raw_parts(src.cast::<f32>(), n),
                std::slice::from_raw_parts_mut(dst.cast::<f32>(), n),
            )
        };
        dst.copy_from_slice(src);
        if self.far[rank] {
            crate::copy::evict(bytemuck::cast_slice(src));
        }
    }

    /// The whole sum after a reduction ([`crate::exact::ExactReducer::reduce_shared`]).
    pub fn sum(&self) -> &[f32] {
        // SAFETY: in bounds of our mapping; written only through `&mut self`.
        unsafe {
            std::slice::from_raw_parts(
                self.windows[self.me]
                    .base
                    .add(self.sum_offset(self.me))
                    .cast(),
                self.len,
            )
        }
    }

    /// Counts a reduction; every [`MEASURE_EVERY`] of them (the first included) returns true:
    /// time to [`SharedParts::measure_distances`]. The same on every rank.
    pub(crate) fn due_for_measuring(&mut self) -> bool {
        self.reductions += 1;
        (self.reductions - 1).is_multiple_of(MEASURE_EVERY)
    }

    /// Collective, called by every rank right after a barrier: each pair of ranks times a
    /// cache-line ping-pong through their windows' ping words (pairs in the rounds of a
    /// round-robin tournament, so each rank has one partner at a time) and records whether the
    /// partner is far. A partner that does not answer in time (an oversubscribed host) keeps its
    /// earlier verdict.
    pub(crate) fn measure_distances(&mut self) {
        let n = self.windows.len();
        let m = n + n % 2; // with a bye when n is odd
        for round in 0..m - 1 {
            let partner = round_robin_partner(self.me, round, m);
            if partner >= n {
                continue;
            }
            // Unique, increasing values per (measurement, round), so a late word from an earlier
            // ping-pong is never taken for an answer.
            let base = ((self.reductions / MEASURE_EVERY) * m as u64 + round as u64)
                * (2 * (BATCHES * TRIPS) as u64 + 2)
                + 1;
            if let Some(rt) = self.ping_pong(partner, base) {
                self.far[partner] = rt > FAR_ROUND_TRIP;
            }
        }
    }

    /// `BATCHES` × `TRIPS` round trips with `partner` (the lower rank serves); the time per trip
    /// of the fastest batch (one clock reading per batch: reading the clock per trip would cost
    /// as much as a near trip), or `None` when the partner stopped answering.
    fn ping_pong(&self, partner: usize, base: u64) -> Option<Duration> {
        let mine = self.windows[self.me].ping();
        let theirs = self.windows[partner].ping();
        let serve = self.me < partner;
        let wait_for = |word: &AtomicU64, value: u64| {
            let since = Instant::now();
            let mut spins = 0u32;
            while word.load(Ordering::Acquire) < value {
                std::hint::spin_loop();
                spins += 1;
                if spins.is_multiple_of(1024) && since.elapsed() > PING_PATIENCE {
                    return false;
                }
            }
            true
        };
        let mut best = Duration::MAX;
        let mut value = base;
        for _ in 0..BATCHES {
            let started = Instant::now();
            for _ in 0..TRIPS {
                let (ask, answer) = (value, value + 1);
                value += 2;
                if serve {
                    mine.store(ask, Ordering::Release);
                    if !wait_for(theirs, answer) {
                        return None;
                    }
                } else {
                    if !wait_for(theirs, ask) {
                        return None;
                    }
                    mine.store(answer, Ordering::Release);
                }
            }
            best = best.min(started.elapsed() / TRIPS as u32);
        }
        Some(best)
    }

    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    pub(crate) fn size(&self) -> usize {
        self.windows.len()
    }
}

/// Rank `i`'s partner in round `round` of a round-robin tournament of `m` (even) players: rank
/// `m − 1` stays put, the others rotate (the circle method). Symmetric: the partner's partner is
/// `i`. A partner `≥` the real number of ranks is a bye.
fn round_robin_partner(i: usize, round: usize, m: usize) -> usize {
    let k = m - 1;
    if i == k {
        return round;
    }
    let p = (2 * round + k - i) % k;
    if p == i {
        k
    } else {
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_meets_exactly_once() {
        for n in 2..=9 {
            let m = n + n % 2;
            let mut met = vec![vec![0; m]; m];
            for round in 0..m - 1 {
                for (i, row) in met.iter_mut().enumerate() {
                    let p = round_robin_partner(i, round, m);
                    assert_ne!(p, i, "n={n} round={round}");
                    assert_eq!(round_robin_partner(p, round, m), i, "n={n} round={round}");
                    row[p] += 1;
                }
            }
            for (i, row) in met.iter().enumerate() {
                for (j, &c) in row.iter().enumerate() {
                    assert_eq!(c, usize::from(i != j), "n={n}: {i} met {j} {c} times");
                }
            }
        }
    }
}
