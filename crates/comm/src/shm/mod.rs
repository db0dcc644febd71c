//! Shared-memory transport for ranks on the same host.
//!
//! # Design
//!
//! **Segments.** Every rank owns one file, `{dir}/lockstep-{job_id}-{rank}`, holding one
//! single-producer/single-consumer byte ring per *writer* rank (the rank itself included, for
//! messages to self), i.e. all of its inbound rings, plus a header with a doorbell futex. The reader
//! creates the rings, so the owner pid in the header is the reader's; each writer records its pid
//! and a random nonce in its slot when it claims it. One file per rank rather than per pair because
//! a thread in `send_recv` waits for two things at once (space in the ring to `to`, data in the ring
//! from `from`) and a futex can only watch one word: with per-rank files every rank has a single
//! doorbell that all its peers can reach (a reader maps the writer's segment anyway, to write to
//! it), and both events ring it. See `segment.rs` for the byte layout, `ring.rs` for the ring and
//! the framing, `wait.rs` for how a blocked call waits, `write_path.rs` for how a writer fills a
//! ring.
//!
//! **Why a named file in tmpfs and not memfd.** A memfd has no name; handing it to unrelated
//! processes needs a Unix socket (SCM_RIGHTS) or `/proc/<pid>/fd/<n>`, which Yama ptrace
//! restrictions can forbid. A 0600 file in `/dev/shm` is found by name with no extra channel, is
//! memory backed like a memfd, and stops existing as a name as soon as setup completes.
//!
//! **Setup** ([`ShmTransport::establish`]). Each rank (1) creates its segment under a temporary
//! name, initialises the header, takes an OFD lock on it and `rename`s it to the public name, which
//! atomically replaces any stale file of a crashed earlier job with the same id; (2) polls until it
//! has opened every peer's segment, checked magic, version, world, ring size and file size, checked
//! that the owner is alive (its lock is held; a file whose owner has exited is stale and will be
//! replaced, so we keep waiting) and claimed its writer slot; (3) once all slots of its own segment
//! are claimed, sets `ready` and unlinks the name. A writer that finds the name now points to a
//! different file than the one it claimed (it attached to a stale file just before the owner
//! replaced it) drops it and attaches again. Nothing is left in `dir` once all ranks returned
//! from `establish` or dropped their transport; a crash leaves at most the crashed rank's file, which
//! the next job with the same id replaces, and which any later transport set up in `dir` removes
//! once its owner is provably dead ([`reclaim_leaked`], run at the start of `establish` for every
//! job but its own; see `reclaim.rs`).
//!
//! **Other users.** `dir` is normally `/dev/shm`, shared by every local user (sticky, world
//! writable). A file of another user at a name this job needs can be neither replaced nor opened
//! usefully, so `establish` stops at once with [`CommError::NameTaken`] (path, the owner's uid and
//! name), which [`CommError::is_permanent`] marks as not curable by a restart. Names built from the
//! job id alone can be guessed by whoever learns the id (it shows in `dir` as soon as one rank's
//! file exists); [`ShmTransport::establish_keyed`] adds a tag derived from the job's secret to
//! every name, so no one without the secret can take one first. Segments are never opened through
//! a symlink.
//!
//! **Transfers.** `send`, `recv` and `send_recv` are non-blocking steps driven by one loop
//! (`drive`): write what fits, read what is there, repeat; so mirror-image `send_recv` calls of any
//! size cannot deadlock, and a plain `send` bigger than the free space streams as the reader drains.
//! Payload is copied once from the caller's slice into the ring and once out into the caller's
//! buffer. Large copies into the ring use cached or streaming stores, whichever each link measures
//! cheaper for where the two cores sit (`write_path.rs`).
//!
//! **Failures.** While stuck, a call checks the peer's `closed` flag (set by its Drop) and, each
//! sleep slice, whether the peer process still exists (its OFD lock, released by the kernel when the
//! process dies even before it is reaped; plus `kill(pid, 0)`): either gives `LinkFailure::Closed`
//! after draining what the peer published, and the address says which (`…; rank 1 closed its
//! transport` or `…; the process of rank 1 (pid N) has exited`). The deadline gives
//! `LinkFailure::Timeout`. A call that fails part-way through a message poisons that direction of
//! the link (the stream is no longer framed), so later calls fail with a protocol error instead of
//! misreading bytes. Ranks whose settings disagree (world, ring size) fail at once on both sides:
//! the rank that notices flags the other's segment.
//!
//! **Usage notes.** One transport per `(job_id, rank)` at a time: a second concurrent stream (e.g.
//! background gradient all-reduce) establishes its own transport under a derived job id such as
//! `{job_id}-grad`. Each rank reserves `world × ring_bytes` in `dir` up front (so a full tmpfs is
//! an error at setup, not a SIGBUS later); `dir` should be tmpfs, a disk-backed directory works
//! but is slow.

mod owner;
mod reclaim;
mod ring;
mod segment;
mod wait;
mod write_path;

use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::auth::JobSecret;
use crate::error::{CommError, LinkFailure, Result, TransportError};
use crate::transport::{SharedMemory, Tag, Transport};
pub(crate) use owner::{my_uid, owned_by_other, taken_by_other, Creator};
pub use reclaim::{reclaim_leaked, ReclaimReport};
use ring::{Incoming, Outgoing, Ring};
pub(crate) use segment::{lock_for_life, map, reserve};
use segment::{segment_path, Attach, Expect, Segment};
use wait::{Backoff, Phase};
use write_path::WritePathChooser;

/// Default ring size per directed pair: small enough that a ring stays in the L2/L3 caches (and
/// that `world²` rings fit a small /dev/shm), large enough that the writer rarely waits for the
/// reader (1 MiB: larger rings gained nothing measurable, a quarter of it was measurably slower).
pub const DEFAULT_RING_BYTES: usize = 1 << 20;
/// Largest world this transport accepts (every rank maps `world × world` rings).
pub const MAX_WORLD: usize = 256;
const MIN_RING_BYTES: usize = 4096;
const MAX_RING_BYTES: usize = 1 << 30;
const MAX_JOB_ID_LEN: usize = 64;

#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Ring size per directed pair; a power of two between 4 KiB and 1 GiB. Must be equal on all ranks.
    pub ring_bytes: usize,
    /// Directory of the segment files; should be memory backed (tmpfs). All ranks must agree.
    pub dir: PathBuf,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: DEFAULT_RING_BYTES,
            dir: PathBuf::from("/dev/shm"),
        }
    }
}

/// Process-local state of the two directions of the link to one peer.
#[derive(Default)]
struct LinkState {
    /// A thread is currently sending to / receiving from this peer (misuse detection).
    out_busy: AtomicBool,
    in_busy: AtomicBool,
    /// Frames completed so far on each direction (the next frame's sequence number).
    out_seq: AtomicU64,
    in_seq: AtomicU64,
    /// A transfer failed part-way; the byte stream is no longer framed.
    out_poisoned: AtomicBool,
    in_poisoned: AtomicBool,
    /// Cached or streaming stores into the ring we write to this peer.
    write_path: WritePathChooser,
}

/// A transport over shared memory; see the module documentation.
pub struct ShmTransport {
    rank: usize,
    world: usize,
    /// `segs[r]`: rank r's segment (its inbound rings); `segs[rank]` is ours.
    segs: Vec<Segment>,
    links: Vec<LinkState>,
    ring_bytes: usize,
    bytes_sent: AtomicU64,
    /// The segments' directory and job id (also where `shared_parts` creates its windows).
    shared: SharedMemory,
}

fn validate_job_id(job_id: &str) -> Result<()> {
    if job_id.is_empty() || job_id.len() > MAX_JOB_ID_LEN {
        return Err(CommError::invalid(
            "shm establish",
            format!(
                "job id must have 1 to {MAX_JOB_ID_LEN} characters, got {}",
                job_id.len()
            ),
        ));
    }
    if let Some(c) = job_id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(CommError::invalid(
            "shm establish",
            format!("job id {job_id:?} contains {c:?}; only [A-Za-z0-9_-] are allowed"),
        ));
    }
    Ok(())
}

/// Reclaims what dead jobs leaked in `dir` before this job adds its own files, sparing the files
/// of `job_id` (which `establish` replaces itself); one line on stderr when something was removed.
fn reclaim_for(dir: &std::path::Path, job_id: &str) {
    let r = reclaim::reclaim(dir, Some(job_id));
    if !r.removed.is_empty() {
        eprintln!(
            "lockstep shm: removed {} file(s), {} bytes, that dead jobs left in {}",
            r.removed.len(),
            r.bytes,
            dir.display()
        );
    }
}

pub(crate) fn random_nonce() -> Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| CommError::setup("shm establish: random nonce", e))?;
    Ok(u64::from_le_bytes(b) | 1) // never 0, which marks an unclaimed slot
}

impl ShmTransport {
    /// Connect rank `rank` of `world` to all other ranks of job `job_id` on this host. All ranks
    /// call this with the same `job_id` and options; it returns once every rank has mapped every
    /// ring it needs (and the segment names are gone), or fails after `timeout` naming what is
    /// missing. The segment names follow from the job id alone: where another local user could
    /// learn it, prefer [`ShmTransport::establish_keyed`].
    pub fn establish(
        rank: usize,
        world: usize,
        job_id: &str,
        timeout: Duration,
        opts: &ShmOptions,
    ) -> Result<ShmTransport> {
        Self::establish_with(rank, world, job_id, timeout, opts, None)
    }

    /// [`ShmTransport::establish`] with segment names that also depend on `key` (the job's
    /// secret, which every rank holds): no one without it can guess a name and create it first.
    /// All ranks must pass the same key.
    pub fn establish_keyed(
        rank: usize,
        world: usize,
        job_id: &str,
        timeout: Duration,
        opts: &ShmOptions,
        key: &JobSecret,
    ) -> Result<ShmTransport> {
        Self::establish_with(rank, world, job_id, timeout, opts, Some(key))
    }

    fn establish_with(
        rank: usize,
        world: usize,
        job_id: &str,
        timeout: Duration,
        opts: &ShmOptions,
        key: Option<&JobSecret>,
    ) -> Result<ShmTransport> {
        check_settings(rank, world, job_id, opts)?;
        let ring_bytes = opts.ring_bytes;
        let started = Instant::now();
        let deadline = started + timeout;
        let nonce = random_nonce()?;
        reclaim_for(&opts.dir, job_id);

        let own_path = segment_path(&opts.dir, job_id, rank, key);
        let mut own = Segment::create(&opts.dir, own_path, rank, world, ring_bytes, nonce)?;
        let mut peers: Vec<Option<Segment>> = (0..world).map(|_| None).collect();
        let mut peer_ready = vec![false; world];
        peer_ready[rank] = true;
        let mut own_ready = false;
        let mut pause = Duration::from_micros(50);
        loop {
            let mut waiting: Vec<String> = Vec::new();
            if !own_ready {
                match own_segment_ready(&mut own, rank, world, ring_bytes)? {
                    None => own_ready = true,
                    Some(why) => waiting.push(why),
                }
            }
            for q in 0..world {
                if peer_ready[q] {
                    continue;
                }
                let expect = Expect {
                    owner: q,
                    world,
                    ring_bytes,
                    my_rank: rank,
                    my_nonce: nonce,
                };
                let path = segment_path(&opts.dir, job_id, q, key);
                match peer_progress(&mut peers[q], &path, &expect)? {
                    None => peer_ready[q] = true,
                    Some(why) => waiting.push(why),
                }
            }
            if waiting.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous(format!(
                    "shm: rank {rank} of {world} (job {job_id}, dir {}) gave up after {:.2}s: {}",
                    opts.dir.display(),
                    started.elapsed().as_secs_f64(),
                    waiting.join("; ")
                )));
            }
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(2));
        }
        let mut own = Some(own);
        let segs: Vec<Segment> = peers
            .into_iter()
            .enumerate()
            .map(|(q, s)| {
                if q == rank {
                    own.take().expect("own segment")
                } else {
                    s.expect("attached")
                }
            })
            .collect();
        Ok(ShmTransport {
            rank,
            world,
            segs,
            links: (0..world).map(|_| LinkState::default()).collect(),
            ring_bytes,
            bytes_sent: AtomicU64::new(0),
            shared: SharedMemory {
                dir: opts.dir.clone(),
                job_id: job_id.to_string(),
            },
        })
    }

    /// Ring size per directed pair.
    pub fn ring_bytes(&self) -> usize {
        self.ring_bytes
    }

    /// The ring from `writer` to `reader` (it lives in the reader's segment).
    fn ring(&self, writer: usize, reader: usize) -> Ring {
        let seg = &self.segs[reader];
        // SAFETY: the segment stays mapped for the transport's lifetime and its rings are
        // `ring_bytes` long, a power of two ≥ 4 KiB.
        unsafe { Ring::new(seg.slot(writer), seg.ring(writer), self.ring_bytes) }
    }

    /// Error-message address of the ring `writer -> reader`.
    fn link_addr(&self, writer: usize, reader: usize) -> String {
        format!(
            "shm:{} ring {writer}->{reader}",
            self.segs[reader].path.display()
        )
    }

    fn bad_peer(&self, peer: usize, sending: bool) -> Option<TransportError> {
        if peer < self.world {
            return None;
        }
        let f = LinkFailure::Protocol(format!("rank {peer} is outside world of {}", self.world));
        let addr = format!("shm:<no rank {peer}>");
        Some(if sending {
            TransportError::send(peer, addr, f)
        } else {
            TransportError::recv(peer, addr, f)
        })
    }

    /// Tell `peer` it may be able to progress, if it sleeps. The fence pairs with the one in
    /// `drive` after a sleeper registers: either we see its registration or it sees our update.
    fn ring_bell(&self, peer: usize) {
        fence(Ordering::SeqCst);
        let h = self.segs[peer].header();
        if h.sleepers.load(Ordering::Relaxed) != 0 {
            h.bell.fetch_add(1, Ordering::Release);
            wait::futex_wake_all(&h.bell);
        }
    }

    /// Cheap check: did `peer` close its transport?
    fn peer_closed(&self, peer: usize) -> Option<String> {
        (peer != self.rank && self.segs[peer].header().closed.load(Ordering::Acquire) != 0)
            .then(|| format!("rank {peer} closed its transport"))
    }

    /// Syscall check: is `peer`'s process gone (lock released or pid nonexistent)?
    fn peer_gone(&self, peer: usize) -> Option<String> {
        if peer == self.rank {
            return None;
        }
        if let Some(closed) = self.peer_closed(peer) {
            return Some(closed); // the more precise reason, when it applies
        }
        let seg = &self.segs[peer];
        let pid = seg.header().owner_pid;
        (segment::pid_gone(pid) || !seg.owner_holds_lock())
            .then(|| format!("the process of rank {peer} (pid {pid}) has exited"))
    }

    fn drive(
        &self,
        mut out: Option<Outgoing<'_>>,
        mut inc: Option<Incoming<'_>>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let started = Instant::now();
        let me = self.segs[self.rank].header();
        let mut backoff = Backoff::new();
        // Registered as a sleeper on our bell, which had this value just before.
        let mut asleep: Option<u32> = None;
        // A peer looked closed/gone; we re-step once to drain what it published before that.
        let mut suspect: Option<(usize, bool, String)> = None;
        let mut protocol_error = false;
        // Liveness was just checked (after a wake-up); no need to repeat it before sleeping again.
        let mut liveness_fresh = false;

        let result = loop {
            let mut progressed = false;
            if let Some(o) = out.as_mut().filter(|o| !o.finished()) {
                if o.step() {
                    progressed = true;
                    self.ring_bell(o.peer);
                }
            }
            if let Some(i) = inc.as_mut().filter(|i| !i.finished()) {
                match i.step() {
                    Ok(true) => {
                        progressed = true;
                        self.ring_bell(i.peer);
                    }
                    Ok(false) => {}
                    Err(detail) => {
                        protocol_error = true;
                        let addr = self.link_addr(i.peer, self.rank);
                        break Err(TransportError::recv(
                            i.peer,
                            addr,
                            LinkFailure::Protocol(detail),
                        ));
                    }
                }
            }
            let out_open = out.as_ref().is_some_and(|o| !o.finished());
            let in_open = inc.as_ref().is_some_and(|i| !i.finished());
            if !out_open && !in_open {
                break Ok(());
            }
            if progressed {
                if asleep.take().is_some() {
                    me.sleepers.fetch_sub(1, Ordering::SeqCst);
                }
                backoff.reset();
                suspect = None;
                liveness_fresh = false;
                if Instant::now() >= deadline {
                    break Err(self.timeout_error(&out, &inc, started));
                }
                continue;
            }

            // Stuck: nothing to write into, nothing to read.
            if let Some((peer, sending, why)) = suspect.take() {
                break Err(self.closed_error(peer, sending, why));
            }
            // Open directions whose peer is someone else: (peer, sending?).
            let watched = [
                out.as_ref().filter(|_| out_open).map(|o| (o.peer, true)),
                inc.as_ref().filter(|_| in_open).map(|i| (i.peer, false)),
            ];
            suspect = watched
                .iter()
                .flatten()
                .find_map(|&(p, s)| self.peer_closed(p).map(|w| (p, s, w)));
            if suspect.is_some() {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(self.timeout_error(&out, &inc, started));
            }
            if let Some(seen) = asleep.take() {
                wait::futex_wait(&me.bell, seen, wait::SLEEP_SLICE.min(deadline - now));
                me.sleepers.fetch_sub(1, Ordering::SeqCst);
                suspect = watched
                    .iter()
                    .flatten()
                    .find_map(|&(p, s)| self.peer_gone(p).map(|w| (p, s, w)));
                liveness_fresh = true;
                continue;
            }
            match backoff.next() {
                Phase::Spin => wait::spin(),
                Phase::Yield => wait::yield_now(),
                Phase::Sleep => {
                    if !std::mem::take(&mut liveness_fresh) {
                        suspect = watched
                            .iter()
                            .flatten()
                            .find_map(|&(p, s)| self.peer_gone(p).map(|w| (p, s, w)));
                        if suspect.is_some() {
                            continue;
                        }
                    }
                    // Announce ourselves, then step once more before sleeping (see `ring_bell`).
                    let seen = me.bell.load(Ordering::Acquire);
                    me.sleepers.fetch_add(1, Ordering::SeqCst);
                    fence(Ordering::SeqCst);
                    asleep = Some(seen);
                }
            }
        };
        if asleep.is_some() {
            me.sleepers.fetch_sub(1, Ordering::SeqCst);
        }

        match &result {
            Ok(()) => {
                if let Some(o) = &out {
                    self.links[o.peer].out_seq.fetch_add(1, Ordering::Relaxed);
                    self.bytes_sent
                        .fetch_add(o.payload_len() as u64, Ordering::Relaxed);
                }
                if let Some(i) = &inc {
                    self.links[i.peer].in_seq.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(_) => {
                if let Some(o) = out.as_ref().filter(|o| o.partial()) {
                    self.links[o.peer]
                        .out_poisoned
                        .store(true, Ordering::Relaxed);
                }
                if let Some(i) = inc.as_ref().filter(|i| i.partial() || protocol_error) {
                    self.links[i.peer]
                        .in_poisoned
                        .store(true, Ordering::Relaxed);
                }
            }
        }
        result
    }

    fn timeout_error(
        &self,
        out: &Option<Outgoing<'_>>,
        inc: &Option<Incoming<'_>>,
        started: Instant,
    ) -> TransportError {
        let waited = LinkFailure::Timeout(started.elapsed());
        // Blame the direction we are waiting on; when receiving is done, the reader of our data.
        match (inc.as_ref().filter(|i| !i.finished()), out) {
            (Some(i), _) => TransportError::recv(i.peer, self.link_addr(i.peer, self.rank), waited),
            (None, Some(o)) => {
                TransportError::send(o.peer, self.link_addr(self.rank, o.peer), waited)
            }
            (None, None) => unreachable!("timeout without a transfer"),
        }
    }

    fn closed_error(&self, peer: usize, sending: bool, why: String) -> TransportError {
        if sending {
            TransportError::send(
                peer,
                format!("{}; {why}", self.link_addr(self.rank, peer)),
                LinkFailure::Closed,
            )
        } else {
            TransportError::recv(
                peer,
                format!("{}; {why}", self.link_addr(peer, self.rank)),
                LinkFailure::Closed,
            )
        }
    }

    /// Claim the sending direction to `to`: checks range, poison, concurrent use, closed peer.
    fn begin_send(&self, to: usize) -> Result<BusyGuard<'_>, TransportError> {
        if let Some(e) = self.bad_peer(to, true) {
            return Err(e);
        }
        let link = &self.links[to];
        let fail = |f: LinkFailure| TransportError::send(to, self.link_addr(self.rank, to), f);
        if link.out_busy.swap(true, Ordering::Acquire) {
            return Err(fail(LinkFailure::Protocol(format!(
                "another thread is already sending to rank {to} on this transport (use one transport per concurrent stream)"
            ))));
        }
        let guard = BusyGuard(&link.out_busy);
        if link.out_poisoned.load(Ordering::Relaxed) {
            return Err(fail(LinkFailure::Protocol(
                "an earlier send to this rank failed part-way through a message; the link is unusable".into(),
            )));
        }
        if let Some(why) = self.peer_closed(to) {
            return Err(self.closed_error(to, true, why));
        }
        Ok(guard)
    }

    /// Claim the receiving direction from `from`.
    fn begin_recv(&self, from: usize) -> Result<BusyGuard<'_>, TransportError> {
        if let Some(e) = self.bad_peer(from, false) {
            return Err(e);
        }
        let link = &self.links[from];
        let fail = |f: LinkFailure| TransportError::recv(from, self.link_addr(from, self.rank), f);
        if link.in_busy.swap(true, Ordering::Acquire) {
            return Err(fail(LinkFailure::Protocol(format!(
                "another thread is already receiving from rank {from} on this transport (use one transport per concurrent stream)"
            ))));
        }
        let guard = BusyGuard(&link.in_busy);
        if link.in_poisoned.load(Ordering::Relaxed) {
            return Err(fail(LinkFailure::Protocol(
                "an earlier receive from this rank failed part-way through a message; the link is unusable".into(),
            )));
        }
        Ok(guard)
    }

    fn outgoing<'a>(&'a self, to: usize, tag: Tag, data: &'a [u8]) -> Outgoing<'a> {
        let link = &self.links[to];
        let seq = link.out_seq.load(Ordering::Relaxed);
        Outgoing::new(
            to,
            self.ring(self.rank, to),
            &link.write_path,
            tag,
            data,
            seq,
        )
    }

    fn incoming<'a>(&self, from: usize, tag: Tag, buf: &'a mut [u8]) -> Incoming<'a> {
        let seq = self.links[from].in_seq.load(Ordering::Relaxed);
        Incoming::new(from, self.ring(from, self.rank), tag, buf, seq)
    }
}

struct BusyGuard<'a>(&'a AtomicBool);
impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Refuses settings no segment can be made with: `world`, `rank`, the ring size, a directory that
/// is not one.
fn check_settings(rank: usize, world: usize, job_id: &str, opts: &ShmOptions) -> Result<()> {
    validate_job_id(job_id)?;
    if world == 0 || world > MAX_WORLD || rank >= world {
        return Err(CommError::invalid(
            "shm establish",
            format!("rank {rank} of world {world}: need 1 ≤ world ≤ {MAX_WORLD} and rank < world"),
        ));
    }
    let ring_bytes = opts.ring_bytes;
    if !ring_bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes) {
        return Err(CommError::invalid(
            "shm establish",
            format!("ring_bytes {ring_bytes} must be a power of two between {MIN_RING_BYTES} and {MAX_RING_BYTES}"),
        ));
    }
    if segment::layout(world, ring_bytes).is_none_or(|(_, len)| len > isize::MAX as usize) {
        return Err(CommError::invalid(
            "shm establish",
            format!("world {world} × ring_bytes {ring_bytes} is too large to map"),
        ));
    }
    if !opts.dir.is_dir() {
        return Err(CommError::setup(
            "shm establish",
            format!(
                "segment directory {} does not exist or is not a directory",
                opts.dir.display()
            ),
        ));
    }
    Ok(())
}

/// Whether every rank has attached to `own` (the segment rank `rank` owns): then it is marked
/// ready and its name removed (`None`); else what is missing. A rank that rejected the segment's
/// settings ends the setup.
fn own_segment_ready(
    own: &mut Segment,
    rank: usize,
    world: usize,
    ring_bytes: usize,
) -> Result<Option<String>> {
    let h = own.header();
    let rejected_by = h.rejected_by.load(Ordering::Acquire);
    if rejected_by != 0 {
        return Err(CommError::Rendezvous(format!(
            "ranks disagree: rank {} found {} (rank {rank} of {world}, {ring_bytes} B rings) \
             incompatible with its own settings; see its error",
            rejected_by - 1,
            own.path.display()
        )));
    }
    let missing: Vec<usize> = (0..world)
        .filter(|&w| own.slot(w).writer_nonce.load(Ordering::Acquire) == 0)
        .collect();
    if !missing.is_empty() {
        return Ok(Some(format!(
            "rank(s) {missing:?} have not attached to {}",
            own.path.display()
        )));
    }
    // Set `ready` before unlinking: a writer that sees the name gone must be able to tell "done"
    // from "replaced".
    h.ready.store(1, Ordering::Release);
    own.unlink_name();
    Ok(None)
}

/// One attempt to attach to rank `expect.owner`'s segment at `path` (into `peer`) or, once
/// attached, to see it ready: `None` when it is, else what is awaited.
fn peer_progress(
    peer: &mut Option<Segment>,
    path: &Path,
    expect: &Expect,
) -> Result<Option<String>> {
    let q = expect.owner;
    let Some(seg) = peer else {
        return Ok(Some(match Segment::attach(path, expect)? {
            Attach::Attached(seg) => {
                *peer = Some(seg);
                format!("rank {q} just attached")
            }
            Attach::NotYet(why) => why,
        }));
    };
    // Attached: done once the owner saw all its writers; if meanwhile the name was replaced, we
    // attached to a stale file and must start over.
    if seg.header().ready.load(Ordering::Acquire) == 1 {
        return Ok(None);
    }
    let why = if !seg.name_points_here() && seg.header().ready.load(Ordering::Acquire) != 1 {
        let why = format!(
            "{} was replaced after we attached; re-attaching",
            seg.path.display()
        );
        *peer = None;
        why
    } else if !seg.owner_holds_lock() {
        format!(
            "rank {q} (pid {}) exited during setup, leaving {}",
            seg.header().owner_pid,
            seg.path.display()
        )
    } else {
        format!(
            "rank {q} has not seen all its writers attach to {}",
            seg.path.display()
        )
    };
    Ok(Some(why))
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.segs[self.rank]
            .header()
            .closed
            .store(1, Ordering::SeqCst);
        // Wake peers sleeping on their own doorbells so they notice promptly.
        for (q, seg) in self
            .segs
            .iter()
            .enumerate()
            .filter(|&(q, _)| q != self.rank)
        {
            let _ = q;
            let h = seg.header();
            h.bell.fetch_add(1, Ordering::Release);
            wait::futex_wake_all(&h.bell);
        }
        // Segments unmap (and close, releasing our lock) as the Vec drops.
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn peer_addr(&self, peer: usize) -> String {
        match self.segs.get(peer) {
            Some(seg) => format!("shm:{}", seg.path.display()),
            None => format!("shm:<no rank {peer}>"),
        }
    }
    fn name(&self) -> &'static str {
        "shm"
    }

    fn send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let _g = self.begin_send(peer)?;
        self.drive(Some(self.outgoing(peer, tag, data)), None, deadline)
    }

    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        buf: &mut [u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let _g = self.begin_recv(peer)?;
        self.drive(None, Some(self.incoming(peer, tag, buf)), deadline)
    }

    fn send_recv_tagged(
        &self,
        to: usize,
        send: &[u8],
        send_tag: Tag,
        from: usize,
        recv: &mut [u8],
        recv_tag: Tag,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let _gs = self.begin_send(to)?;
        let _gr = self.begin_recv(from)?;
        self.drive(
            Some(self.outgoing(to, send_tag, send)),
            Some(self.incoming(from, recv_tag, recv)),
            deadline,
        )
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn shared_memory(&self) -> Option<SharedMemory> {
        Some(self.shared.clone())
    }
}
