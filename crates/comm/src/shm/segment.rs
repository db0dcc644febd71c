//! One rank's shared-memory segment: the file, its layout, how it is created, found and checked.
//!
//! Layout (all offsets from the start of the mapping; 128-byte spacing keeps words written by
//! different processes off each other's cache lines, including the adjacent-line prefetcher's pair):
//!
//! ```text
//!      0  SegHeader   identity (magic, version, world, owner rank/pid/nonce, ring size, data offset),
//!                     then `ready`/`closed` flags, then the owner's doorbell (futex word + sleepers)
//!    512  SlotHeader × world    slot w = ring written by rank w: writer claim, head, tail
//!   data  ring × world          `ring_bytes` each, page aligned
//! ```
//!
//! Identity fields are written before the file gets its public name (create under a temporary name,
//! then `rename`), so anyone who can open the public name sees a fully initialised header; they
//! include the owner's start time, so that a later job can prove a leaked file's owner dead even
//! after its pid was reused (`reclaim.rs`). The owner
//! holds an open-file-description lock (`F_OFD_SETLK`) on the file for as long as its segment is
//! mapped; the kernel drops it when the owner's last descriptor closes, i.e. at process exit even
//! while the process is still an unreaped zombie. Peers test it with `F_OFD_GETLK`: this is how a
//! stale file from a crashed job, and a peer killed with SIGKILL, are recognised without trusting a
//! pid that may have been reused.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::owner::{my_uid, owned_by_other, taken_by_other, Creator};
use crate::auth::JobSecret;
use crate::error::CommError;

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"LCKSTSHM");
pub(super) const VERSION: u32 = 1;
const SLOTS_OFFSET: usize = 512;
const PAGE: usize = 4096;

/// Per-segment header, owned by the segment's rank (the reader of every ring in it).
#[repr(C)]
pub(super) struct SegHeader {
    pub magic: u64,
    pub version: u32,
    pub world: u32,
    pub owner_rank: u32,
    pub owner_pid: u32,
    pub ring_bytes: u64,
    pub owner_nonce: u64,
    pub data_offset: u64,
    /// The owner's start time (`/proc/<pid>/stat`), 0 if unknown; with `owner_pid` it tells the
    /// owner from a later process that got the same pid.
    pub owner_start: u64,
    _pad0: [u8; 128 - 56],
    /// Set by the owner once every writer has claimed its slot (the name is unlinked right after).
    pub ready: AtomicU32,
    /// Set by the owner when its transport is dropped.
    pub closed: AtomicU32,
    /// 1 + rank of a writer that found this segment incompatible with its own settings, so that
    /// the owner fails at once too instead of waiting for its timeout.
    pub rejected_by: AtomicU32,
    _pad1: [u8; 128 - 12],
    /// The owner's doorbell: bumped (then FUTEX_WAKE) by anyone who made progress possible for it.
    pub bell: AtomicU32,
    /// How many of the owner's threads are (about to be) asleep on `bell`; wakers skip the syscall at 0.
    pub sleepers: AtomicU32,
    _pad2: [u8; 128 - 8],
}

/// Per-ring header: ring `w` of segment `r` carries bytes from rank `w` to rank `r`.
#[repr(C)]
pub(super) struct SlotHeader {
    /// Nonce of the writer transport that claimed this slot (0 = unclaimed).
    pub writer_nonce: AtomicU64,
    pub writer_pid: AtomicU32,
    _pad0: [u8; 128 - 12],
    /// Bytes ever written (only the writer stores it).
    pub head: AtomicU64,
    _pad1: [u8; 128 - 8],
    /// Bytes ever read (only the reader stores it).
    pub tail: AtomicU64,
    _pad2: [u8; 128 - 8],
}

const _: () = assert!(std::mem::size_of::<SegHeader>() == 384);
const _: () = assert!(std::mem::size_of::<SegHeader>() <= SLOTS_OFFSET);
const _: () = assert!(std::mem::size_of::<SlotHeader>() == 384);

/// Byte offset of the first ring, and total file size, for a segment of `world` rings.
pub(super) fn layout(world: usize, ring_bytes: usize) -> Option<(usize, usize)> {
    let slots_end =
        SLOTS_OFFSET.checked_add(world.checked_mul(std::mem::size_of::<SlotHeader>())?)?;
    let data = slots_end.checked_add(PAGE - 1)? / PAGE * PAGE;
    let total = data.checked_add(world.checked_mul(ring_bytes)?)?;
    Some((data, total))
}

/// Public name of rank `rank`'s segment: `lockstep-{job_id}-{rank}`, followed with a key by
/// `-{tag}`, 16 hex digits of `HMAC(key, job id, rank)`: a user without the key can neither guess
/// a segment's name before it exists nor derive one rank's name from another's, so cannot take
/// it first.
pub(super) fn segment_path(
    dir: &Path,
    job_id: &str,
    rank: usize,
    key: Option<&JobSecret>,
) -> PathBuf {
    match key {
        None => dir.join(format!("lockstep-{job_id}-{rank}")),
        Some(key) => {
            let mac = key.mac(&[
                b"lockstep-shm-name-v1|",
                job_id.as_bytes(),
                b"|",
                &(rank as u64).to_le_bytes(),
            ]);
            dir.join(format!(
                "lockstep-{job_id}-{rank}-{}",
                hex::encode(&mac[..8])
            ))
        }
    }
}

/// The private name a segment is prepared under before it is renamed to `public`:
/// `.{public}.{pid}.{start}.{nonce}.tmp`, so that a leaked one names its creator.
fn tmp_path(public: &Path, me: Creator, nonce: u64) -> PathBuf {
    let name = public
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    public.with_file_name(format!(
        ".{name}.{}.{}.{nonce:016x}.tmp",
        me.pid,
        me.start.unwrap_or(0)
    ))
}

/// What a writer expects of the segment it opens.
pub(super) struct Expect {
    pub owner: usize,
    pub world: usize,
    pub ring_bytes: usize,
    pub my_rank: usize,
    pub my_nonce: u64,
}

/// Result of one attempt to open a peer's segment.
pub(super) enum Attach {
    Attached(Segment),
    /// Not usable yet; the string says why (for the timeout message).
    NotYet(String),
}

/// A mapped segment. Dropping it unmaps it; the owner's copy also removes the public name if it
/// still refers to this file (establish normally unlinked it already).
pub(super) struct Segment {
    file: File,
    base: *mut u8,
    len: usize,
    pub path: PathBuf,
    data_offset: usize,
    ring_bytes: usize,
    dev_ino: (u64, u64),
    /// We created it and its public name has not been removed yet.
    owns_name: bool,
}

// SAFETY: the mapping is shared memory accessed only through atomics (headers) or through ring
// regions whose exclusive use is arbitrated by the head/tail protocol; the pointers stay valid
// until Drop.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn os_err(context: impl Into<String>, e: io::Error) -> CommError {
    CommError::setup(context, e)
}

/// Maps `len` bytes of `file` shared, read-write or read-only (also `shared_parts`' windows).
pub(crate) fn map(
    file: &File,
    len: usize,
    path: &Path,
    writable: bool,
) -> Result<*mut u8, CommError> {
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: plain FFI call; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_err(
            format!("mmap {} ({len} bytes)", path.display()),
            io::Error::last_os_error(),
        ));
    }
    Ok(p.cast())
}

/// Reserves the first `len` bytes of `file` (`posix_fallocate`), so that a tmpfs too small for
/// them is an error now instead of a SIGBUS on first touch; a file system that cannot preallocate
/// is accepted (best effort). Also used for `shared_parts`' windows.
pub(crate) fn reserve(file: &File, len: usize) -> io::Result<()> {
    // SAFETY: FFI with a valid fd.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } {
        0 | libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        err => Err(io::Error::from_raw_os_error(err)),
    }
}

fn whole_file_lock(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
}

fn dev_ino(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

impl Segment {
    /// Create this rank's segment at `path` (in `dir`): initialise it under a private temporary
    /// name, lock it, then atomically `rename` it over the public name. The rename also replaces
    /// any stale file a crashed earlier job with the same id left there, so such a file can never
    /// wedge a new job; a file of another user there cannot be replaced (sticky directory) and is
    /// [`CommError::NameTaken`].
    pub fn create(
        dir: &Path,
        path: PathBuf,
        rank: usize,
        world: usize,
        ring_bytes: usize,
        nonce: u64,
    ) -> Result<Segment, CommError> {
        let (data_offset, len) = layout(world, ring_bytes).ok_or_else(|| {
            CommError::setup(
                "shm",
                format!("segment for world {world} × {ring_bytes} B overflows"),
            )
        })?;
        let me = Creator::me();
        let pid = me.pid;
        let tmp = tmp_path(&path, me, nonce);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| os_err(format!("create {}", tmp.display()), e))?;
        // From here on, remove the temporary name if anything fails.
        let cleanup = TmpGuard(&tmp);
        lock_for_life(&file).map_err(|e| os_err(format!("lock {}", tmp.display()), e))?;
        file.set_len(len as u64)
            .map_err(|e| os_err(format!("size {} to {len} bytes", tmp.display()), e))?;
        // Reserve the memory now: a tmpfs that runs out of space later (Docker's default /dev/shm is
        // 64 MiB) would kill us with SIGBUS on first touch of a ring page instead of an error.
        reserve(&file, len).map_err(|why| {
            CommError::setup(
                format!("reserve {len} bytes for {}", tmp.display()),
                format!(
                    "{why}: every rank needs world × ring_bytes = {world} × {ring_bytes} bytes \
                     in {}; enlarge it (e.g. docker --shm-size) or use smaller rings",
                    dir.display()
                ),
            )
        })?;
        let meta = file
            .metadata()
            .map_err(|e| os_err(format!("stat {}", tmp.display()), e))?;
        let base = map(&file, len, &tmp, true)?;
        let mut seg = Segment {
            file,
            base,
            len,
            path: path.clone(),
            data_offset,
            ring_bytes,
            dev_ino: dev_ino(&meta),
            owns_name: false,
        };
        // SAFETY: fresh zero-filled private file of `len` bytes; nobody else can have it mapped yet.
        unsafe {
            let h = seg.base as *mut SegHeader;
            std::ptr::addr_of_mut!((*h).magic).write(MAGIC);
            std::ptr::addr_of_mut!((*h).version).write(VERSION);
            std::ptr::addr_of_mut!((*h).world).write(world as u32);
            std::ptr::addr_of_mut!((*h).owner_rank).write(rank as u32);
            std::ptr::addr_of_mut!((*h).owner_pid).write(pid);
            std::ptr::addr_of_mut!((*h).ring_bytes).write(ring_bytes as u64);
            std::ptr::addr_of_mut!((*h).owner_nonce).write(nonce);
            std::ptr::addr_of_mut!((*h).data_offset).write(data_offset as u64);
            std::ptr::addr_of_mut!((*h).owner_start).write(me.start.unwrap_or(0));
        }
        // Our own slot (messages to ourselves) is claimed by us.
        seg.slot(rank).writer_nonce.store(nonce, Ordering::Relaxed);
        seg.slot(rank).writer_pid.store(pid, Ordering::Relaxed);
        std::fs::rename(&tmp, &path).map_err(|e| {
            taken_by_other(&path).unwrap_or_else(|| {
                os_err(format!("rename {} to {}", tmp.display(), path.display()), e)
            })
        })?;
        std::mem::forget(cleanup);
        seg.owns_name = true;
        Ok(seg)
    }

    /// One attempt to open and claim our writer slot in `path` (the segment of rank `expect.owner`).
    /// Files that may still be replaced by the real owner (missing, foreign, stale, from an older
    /// version) are `NotYet`; a live owner whose job disagrees with ours is a hard error, and so
    /// is a file of another user, which the owner can never replace ([`CommError::NameTaken`]).
    /// Symlinks are not followed.
    pub fn attach(path: &Path, expect: &Expect) -> Result<Attach, CommError> {
        let owner = expect.owner;
        if let Some(taken) = taken_by_other(path) {
            return Err(taken);
        }
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Attach::NotYet(format!(
                    "{} does not exist yet (rank {owner} not started?)",
                    path.display()
                )))
            }
            Err(e) => {
                return Ok(Attach::NotYet(format!(
                    "cannot open {}: {e}",
                    path.display()
                )))
            }
        };
        let meta = file
            .metadata()
            .map_err(|e| os_err(format!("stat {}", path.display()), e))?;
        // Checked again on what was opened: the name may have been taken since the look above.
        if let Some(taken) = owned_by_other(path, meta.uid(), my_uid()) {
            return Err(taken);
        }
        let size = meta.len() as usize;
        if size < SLOTS_OFFSET {
            return Ok(Attach::NotYet(format!(
                "{} is not a lockstep segment ({size} bytes; foreign or stale file, waiting for rank {owner} to replace it)",
                path.display()
            )));
        }
        let base = map(&file, size, path, true)?;
        let mut seg = Segment {
            file,
            base,
            len: size,
            path: path.to_path_buf(),
            data_offset: 0,
            ring_bytes: 0,
            dev_ino: dev_ino(&meta),
            owns_name: false,
        };
        let h = seg.header();
        if h.magic != MAGIC || h.version != VERSION {
            return Ok(Attach::NotYet(format!(
                "{} has magic {:#018x} version {} (want {MAGIC:#018x} version {VERSION}): foreign or stale file, \
                 waiting for rank {owner} to replace it",
                path.display(),
                h.magic,
                h.version
            )));
        }
        if !seg.owner_holds_lock() {
            return Ok(Attach::NotYet(format!(
                "{} was left by pid {} which has exited (stale file of an earlier job with this id?); \
                 waiting for rank {owner} to replace it",
                path.display(),
                h.owner_pid
            )));
        }
        let (want_data, want_len) =
            layout(expect.world, expect.ring_bytes).expect("validated by establish");
        if h.owner_rank as usize != owner
            || h.world as usize != expect.world
            || h.ring_bytes as usize != expect.ring_bytes
            || h.data_offset as usize != want_data
            || size != want_len
        {
            h.rejected_by
                .store(expect.my_rank as u32 + 1, Ordering::Release);
            return Err(CommError::Rendezvous(format!(
                "ranks disagree: {} (pid {}) was created as rank {} of {} with {} B rings and {size} bytes, \
                 but rank {} expects rank {owner} of {} with {} B rings and {want_len} bytes",
                path.display(),
                h.owner_pid,
                h.owner_rank,
                h.world,
                h.ring_bytes,
                expect.my_rank,
                expect.world,
                expect.ring_bytes
            )));
        }
        seg.data_offset = want_data;
        seg.ring_bytes = expect.ring_bytes;
        let slot = seg.slot(expect.my_rank);
        match slot.writer_nonce.compare_exchange(0, expect.my_nonce, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => slot.writer_pid.store(std::process::id(), Ordering::Release),
            Err(n) if n == expect.my_nonce => {}
            Err(_) => {
                return Err(CommError::Rendezvous(format!(
                    "rank {}'s slot in {} (rank {owner}, pid {}) is already claimed by pid {}: two processes \
                     started as rank {}, or a process of an earlier job with the same id is still running",
                    expect.my_rank,
                    path.display(),
                    seg.header().owner_pid,
                    slot.writer_pid.load(Ordering::Acquire),
                    expect.my_rank
                )))
            }
        }
        Ok(Attach::Attached(seg))
    }

    pub fn header(&self) -> &SegHeader {
        // SAFETY: the mapping is at least SLOTS_OFFSET bytes and page aligned.
        unsafe { &*(self.base as *const SegHeader) }
    }

    pub fn slot(&self, writer: usize) -> &SlotHeader {
        let off = SLOTS_OFFSET + writer * std::mem::size_of::<SlotHeader>();
        assert!(off + std::mem::size_of::<SlotHeader>() <= self.len);
        // SAFETY: in bounds (checked) and 128-byte aligned.
        unsafe { &*(self.base.add(off) as *const SlotHeader) }
    }

    /// Start of the ring written by `writer`.
    pub fn ring(&self, writer: usize) -> *mut u8 {
        let off = self.data_offset + writer * self.ring_bytes;
        assert!(self.data_offset > 0 && off + self.ring_bytes <= self.len);
        // SAFETY: in bounds (checked).
        unsafe { self.base.add(off) }
    }

    /// Whether the owning process still holds its lock on the file (false once it has exited).
    pub fn owner_holds_lock(&self) -> bool {
        is_locked(&self.file)
    }

    /// Whether the public name still refers to this very file (not removed, not replaced).
    pub fn name_points_here(&self) -> bool {
        std::fs::metadata(&self.path)
            .map(|m| dev_ino(&m) == self.dev_ino)
            .unwrap_or(false)
    }

    /// Remove the public name if it still refers to this file (owner only). The check-then-unlink
    /// window is harmless: only a new job reusing our job id while we are still alive could race it.
    pub fn unlink_name(&mut self) {
        if self.owns_name {
            if self.name_points_here() {
                let _ = std::fs::remove_file(&self.path);
            }
            self.owns_name = false;
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink_name();
        // SAFETY: base/len come from a successful mmap and nothing borrows the mapping any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
        // `file` closes afterwards, which releases the owner's lock.
    }
}

/// Whether anyone holds a lock on `file` (a segment's or window's creator does while it uses it;
/// the kernel drops it when the process dies). If the query itself fails we cannot tell: locked.
pub(crate) fn is_locked(file: &File) -> bool {
    let mut fl = whole_file_lock(libc::F_WRLCK);
    // SAFETY: FFI with a valid fd and a valid flock.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    rc != 0 || fl.l_type != libc::F_UNLCK as libc::c_short
}

/// Takes the creator's lock on `file` (see [`is_locked`]); released when its last descriptor
/// closes, at the latest when the process dies.
pub(crate) fn lock_for_life(file: &File) -> io::Result<()> {
    let fl = whole_file_lock(libc::F_WRLCK);
    // SAFETY: FFI with a valid fd and a valid flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The creator recorded in a segment file's header, if the file has this layout's magic and
/// version (read with `pread`, not mapped: the file may be anything).
pub(super) fn creator_of(file: &File) -> Option<Creator> {
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; std::mem::size_of::<SegHeader>()];
    file.read_exact_at(&mut h, 0).ok()?;
    let u64_at = |off: usize| u64::from_ne_bytes(h[off..off + 8].try_into().unwrap());
    let u32_at = |off: usize| u32::from_ne_bytes(h[off..off + 4].try_into().unwrap());
    if u64_at(std::mem::offset_of!(SegHeader, magic)) != MAGIC
        || u32_at(std::mem::offset_of!(SegHeader, version)) != VERSION
    {
        return None;
    }
    let start = u64_at(std::mem::offset_of!(SegHeader, owner_start));
    Some(Creator {
        pid: u32_at(std::mem::offset_of!(SegHeader, owner_pid)),
        start: (start != 0).then_some(start),
    })
}

struct TmpGuard<'a>(&'a Path);
impl Drop for TmpGuard<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Is `pid` certainly gone? (`kill(pid, 0)` fails with ESRCH.) A zombie still counts as present,
/// which is why the lock test above is the primary check.
pub(super) fn pid_gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence/permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}
