//! MPI point-to-point transport (cargo feature `mpi`; rsmpi's `mpi-sys` bindings over the system
//! MPI, e.g. Open MPI 4.1).
//!
//! Ranks and world size come from MPI itself (`MPI_COMM_WORLD`), so a job started by `mpirun`
//! needs no rendezvous store. MPI is initialised with `MPI_THREAD_MULTIPLE` (lockstep's overlap
//! thread and the main thread may both be inside the transport); every operation here is
//! point-to-point on one private duplicate of the world communicator, which MPI allows from any
//! number of threads at once (only collectives would need a communicator per thread).
//!
//! Deadlines: an MPI call cannot be cancelled, so nothing here blocks inside MPI. Sends and
//! receives are `MPI_Isend` / `MPI_Irecv`, completed by polling `MPI_Test` (spin, then yield, then
//! short sleeps) until done or the deadline passes; then the error names the peer rank and the time
//! waited, pending receives are cancelled, and the transport remembers the failure so that
//! dropping it does not call `MPI_Finalize` (which could wait for the dead or hung peer): the
//! process exits, and mpirun ends the job.
//!
//! Tags: lockstep's 64-bit tags are mixed down to the bits `MPI_TAG_UB` allows (31 with Open MPI).
//! MPI matches messages by (source, tag) in order; the receiver checks the exact length, so a
//! message of another operation can only be taken for this one if both are in flight between the
//! same two ranks at once *and* their tags collide (probability 2⁻³¹ per such pair).

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi_sys as ffi;

use crate::error::{CommError, LinkFailure, TransportError};
use crate::transport::{Tag, Transport};

/// Largest piece one MPI message carries (MPI counts are `int`).
const MAX_PIECE: usize = 1 << 30;

/// The MPI world as a lockstep transport. One per process (MPI is initialised once).
pub struct MpiTransport {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    /// 2^k − 1 ≤ `MPI_TAG_UB`: tags are mixed down to these bits.
    tag_mask: u64,
    bytes_sent: AtomicU64,
    /// Set after any failure: dropping then skips `MPI_Finalize`.
    failed: AtomicBool,
}

/// Whether this process initialised MPI (it can be initialised only once).
static INITIALISED: Mutex<bool> = Mutex::new(false);

// SAFETY: the communicator handle is only passed to MPI point-to-point calls, which MPI allows
// from any thread once initialised with MPI_THREAD_MULTIPLE (checked in `init`).
unsafe impl Send for MpiTransport {}
unsafe impl Sync for MpiTransport {}

fn check(rc: c_int, what: &str) -> Result<(), CommError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError::setup(
            "MPI",
            format!("{what} returned error {rc}"),
        ))
    }
}

impl MpiTransport {
    /// Initialise MPI (thread level `MPI_THREAD_MULTIPLE`) and take the world.
    pub fn init() -> Result<Self, CommError> {
        let mut done = INITIALISED.lock().unwrap_or_else(|e| e.into_inner());
        if *done {
            return Err(CommError::setup(
                "MPI",
                "MPI was already initialised in this process",
            ));
        }
        let mut provided: c_int = 0;
        // SAFETY: MPI_Init_thread without argv (allowed since MPI-2), once per process.
        let (rc, multiple) = unsafe {
            (
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    ffi::RSMPI_THREAD_MULTIPLE,
                    &mut provided,
                ),
                ffi::RSMPI_THREAD_MULTIPLE,
            )
        };
        check(rc, "MPI_Init_thread")?;
        *done = true;
        if provided != multiple {
            return Err(CommError::setup(
                "MPI",
                format!(
                    "the MPI library provides thread level {provided}, lockstep needs \
                     MPI_THREAD_MULTIPLE ({multiple})"
                ),
            ));
        }
        // SAFETY: plain MPI calls on handles MPI gave us; out-parameters are initialised by MPI.
        unsafe {
            let mut comm: ffi::MPI_Comm = std::mem::zeroed();
            check(
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm),
                "MPI_Comm_dup",
            )?;
            check(
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            check(ffi::MPI_Comm_rank(comm, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(comm, &mut size), "MPI_Comm_size")?;
            let mut ub: *mut c_int = std::ptr::null_mut();
            let mut flag: c_int = 0;
            check(
                ffi::MPI_Comm_get_attr(
                    comm,
                    ffi::MPI_TAG_UB as c_int,
                    &mut ub as *mut *mut c_int as *mut c_void,
                    &mut flag,
                ),
                "MPI_Comm_get_attr(MPI_TAG_UB)",
            )?;
            // The standard guarantees at least 32767.
            let tag_ub = if flag != 0 && !ub.is_null() {
                (*ub).max(32767)
            } else {
                32767
            } as u64;
            let tag_mask = (1u64 << (63 - (tag_ub + 1).leading_zeros())) - 1;
            Ok(Self {
                comm,
                rank: rank as usize,
                world: size as usize,
                tag_mask,
                bytes_sent: AtomicU64::new(0),
                failed: AtomicBool::new(false),
            })
        }
    }

    /// `MPI_Get_library_version` up to the first comma (e.g. "Open MPI v4.1.4").
    pub fn library_version() -> String {
        let mut buf = vec![0u8; 8192];
        let mut len: c_int = 0;
        // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING (Open MPI: 256).
        unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr() as *mut _, &mut len) };
        buf.truncate(len.max(0) as usize);
        let v = String::from_utf8_lossy(&buf);
        v.split([',', '\n', '\0'])
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }

    /// The MPI tag of a lockstep tag: a 64-bit mix (splitmix64's finaliser) cut to the tag bits.
    fn mpi_tag(&self, tag: Tag) -> c_int {
        let mut x = tag;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        (x & self.tag_mask) as c_int
    }

    fn fail(&self, e: TransportError) -> TransportError {
        self.failed.store(true, Ordering::SeqCst);
        e
    }

    fn post_send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        reqs: &mut Vec<Pending>,
    ) -> Result<(), TransportError> {
        for piece in pieces(data.len()) {
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: `data` outlives the request: `complete` waits for it (or the transport is
            // marked failed and the process ends without touching MPI again).
            let rc = unsafe {
                ffi::MPI_Isend(
                    data.as_ptr().add(piece.0) as *const c_void,
                    piece.1 as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    self.mpi_tag(tag),
                    self.comm,
                    &mut req,
                )
            };
            if rc != 0 {
                return Err(self.fail(TransportError::send(
                    peer,
                    self.peer_addr(peer),
                    LinkFailure::Io(format!("MPI_Isend returned error {rc}")),
                )));
            }
            reqs.push(Pending {
                req,
                peer,
                recv_len: None,
                done: false,
            });
        }
        Ok(())
    }

    fn post_recv(
        &self,
        peer: usize,
        tag: Tag,
        buf: &mut [u8],
        reqs: &mut Vec<Pending>,
    ) -> Result<(), TransportError> {
        for piece in pieces(buf.len()) {
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: as in post_send; pending receives are cancelled before an early return.
            let rc = unsafe {
                ffi::MPI_Irecv(
                    buf.as_mut_ptr().add(piece.0) as *mut c_void,
                    piece.1 as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    self.mpi_tag(tag),
                    self.comm,
                    &mut req,
                )
            };
            if rc != 0 {
                return Err(self.fail(TransportError::recv(
                    peer,
                    self.peer_addr(peer),
                    LinkFailure::Io(format!("MPI_Irecv returned error {rc}")),
                )));
            }
            reqs.push(Pending {
                req,
                peer,
                recv_len: Some(piece.1),
                done: false,
            });
        }
        Ok(())
    }

    /// Poll every request until all are complete or `deadline` passes.
    fn complete(
        &self,
        reqs: &mut [Pending],
        started: Instant,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut polls: u64 = 0;
        loop {
            let mut all = true;
            let mut failed = None;
            for p in reqs.iter_mut().filter(|p| !p.done) {
                let mut flag: c_int = 0;
                // SAFETY: a request MPI gave us and a zeroed status for MPI to fill.
                let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
                let rc = unsafe { ffi::MPI_Test(&mut p.req, &mut flag, &mut status) };
                if rc != 0 {
                    failed = Some(p.error(
                        self,
                        LinkFailure::Protocol(format!(
                            "MPI_Test returned error {rc} (a message longer than expected, or a lost peer)"
                        )),
                    ));
                    break;
                }
                if flag == 0 {
                    all = false;
                    continue;
                }
                p.done = true;
                if let Some(want) = p.recv_len {
                    let mut count: c_int = 0;
                    // SAFETY: the status MPI_Test filled for this receive.
                    unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
                    if count as usize != want {
                        failed = Some(p.error(
                            self,
                            LinkFailure::Protocol(format!(
                                "expected {want} bytes, the peer sent {count}"
                            )),
                        ));
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                self.cancel_pending(reqs);
                return Err(self.fail(e));
            }
            if all {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                // Name a receive we are still waiting for if there is one (that peer is the one
                // that did not deliver), else the send.
                let waited = now.duration_since(started);
                let stuck = reqs
                    .iter()
                    .filter(|p| !p.done)
                    .min_by_key(|p| p.recv_len.is_none())
                    .expect("an incomplete request");
                let e = stuck.error(self, LinkFailure::Timeout(waited));
                self.cancel_pending(reqs);
                return Err(self.fail(e));
            }
            polls += 1;
            if polls < 2_000 {
                std::hint::spin_loop();
            } else if now.duration_since(started) < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Cancel the receives still pending (their buffers are about to be given back); sends cannot
    /// be cancelled reliably and are left to the process's end.
    fn cancel_pending(&self, reqs: &mut [Pending]) {
        for p in reqs.iter_mut().filter(|p| !p.done && p.recv_len.is_some()) {
            // SAFETY: cancelling and then completing our own receive request.
            unsafe {
                ffi::MPI_Cancel(&mut p.req);
                let mut status: ffi::MPI_Status = std::mem::zeroed();
                ffi::MPI_Wait(&mut p.req, &mut status);
            }
            p.done = true;
        }
    }
}

struct Pending {
    req: ffi::MPI_Request,
    peer: usize,
    /// Some(len) for a receive.
    recv_len: Option<usize>,
    done: bool,
}

impl Pending {
    fn error(&self, t: &MpiTransport, failure: LinkFailure) -> TransportError {
        if self.recv_len.is_some() {
            TransportError::recv(self.peer, t.peer_addr(self.peer), failure)
        } else {
            TransportError::send(self.peer, t.peer_addr(self.peer), failure)
        }
    }
}

/// (offset, len) pieces of at most MAX_PIECE bytes; one empty piece for an empty buffer.
fn pieces(len: usize) -> Vec<(usize, usize)> {
    if len == 0 {
        return vec![(0, 0)];
    }
    (0..len)
        .step_by(MAX_PIECE)
        .map(|o| (o, MAX_PIECE.min(len - o)))
        .collect()
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn peer_addr(&self, peer: usize) -> String {
        format!("mpi:world rank {peer}")
    }
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let started = Instant::now();
        let mut reqs = Vec::with_capacity(1);
        self.post_send(peer, tag, data, &mut reqs)?;
        self.complete(&mut reqs, started, deadline)?;
        self.bytes_sent
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        buf: &mut [u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let started = Instant::now();
        let mut reqs = Vec::with_capacity(1);
        self.post_recv(peer, tag, buf, &mut reqs)?;
        self.complete(&mut reqs, started, deadline)
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
        let started = Instant::now();
        let mut reqs = Vec::with_capacity(2);
        // Receive first, so the peer's eager send finds a posted buffer.
        if let Err(e) = self
            .post_recv(from, recv_tag, recv, &mut reqs)
            .and_then(|()| self.post_send(to, send_tag, send, &mut reqs))
        {
            self.cancel_pending(&mut reqs);
            return Err(e);
        }
        self.complete(&mut reqs, started, deadline)?;
        self.bytes_sent
            .fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        if self.failed.load(Ordering::SeqCst) {
            // Requests may still be pending on a dead or hung peer: MPI_Finalize could wait for
            // them forever. Leave MPI as it is; the process is about to exit with an error.
            return;
        }
        // SAFETY: our own communicator, no request pending (every operation completed); MPI was
        // initialised by `init` and is finalised once, here.
        unsafe {
            ffi::MPI_Comm_free(&mut self.comm);
            ffi::MPI_Finalize();
        }
    }
}
