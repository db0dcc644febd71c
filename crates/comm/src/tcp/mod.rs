//! TCP transport: one authenticated, full-duplex TCP connection per pair of ranks.
//!
//! Establishment ([`TcpTransport::establish`]):
//! 1. bind a listener on an ephemeral port of `bind_ip`; publish `"{prefix}/{rank}" = "ip:port"`
//!    in the rendezvous store (`ip` = `advertise_ip`, else the bound IP, else this host's IP on the
//!    route to the store);
//! 2. dial every lower rank (its address from the store) while accepting from every higher rank;
//! 3. on each connection: the mutual HMAC handshake of `wire` with context
//!    `"tcp|" ‖ job_id`, then the connector states `(rank, world)` and the acceptor answers with
//!    its own and a verdict. A stranger, garbage, another job or an unexpected rank is refused
//!    (logged with the remote address, counted in the establishment error if we time out) and the
//!    listener keeps accepting; the listener closes once the mesh is complete.
//!
//! Data frames (integers little-endian), 24-byte header then payload:
//! `MAGIC` · version u16 · reserved u16 · tag u64 · len u64 · payload.
//! The receiver states tag and length; any difference is a `Protocol` failure naming both.
//!
//! I/O: sockets are nonblocking with `TCP_NODELAY`; header and payload leave in one `sendmsg`
//! (gather), and arrive through `readv` straight into the caller's buffer (no staging copy).
//! `send_recv` drives both directions from one `poll(2)` loop, so a ring step where every rank
//! sends a large buffer to its neighbour cannot deadlock on full socket buffers, and no thread is
//! spawned per call. Every wait is bounded by the caller's deadline.
//!
//! Wakeups: before sleeping for a frame, the receive low-water mark (`SO_RCVLOWAT`) is raised to
//! the bytes still missing (the header's rest until it has arrived and been checked, then the
//! payload's rest, capped at [`TcpOptions::recv_low_water`]), so a 512 KiB segment costs one or
//! two wakeups instead of one per 64 KiB loopback packet. On 2 ranks over loopback the transport
//! is CPU-bound (both cores ~95% busy at 64 MiB): the kernel's two copies per byte (into and out
//! of socket buffers) take over half the cycles, the TCP stack a quarter, so more connections per
//! peer, larger buffers or `MSG_ZEROCOPY` (copied anyway on delivery to a local socket) would not
//! help there; saving wakeups does.
//!
//! A failure in the middle of a frame leaves that direction of the link out of step; it is then
//! poisoned, and later calls on it report the original failure instead of misreading bytes.
//!
//! Files: `mesh` builds the connections, `frame` moves one frame incrementally, this file holds
//! the options, the transport and its poll loop.

pub(crate) mod frame;
pub(crate) mod mesh;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::JobSecret;
use crate::error::{CommError, LinkFailure, Result, TransportError};
use crate::store::StoreClient;
use crate::transport::{Tag, Transport};
use frame::{poll_ms, RecvOp, SendOp};
use mesh::{data_context, Mesh};

/// Settings of [`TcpTransport::establish`].
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// IP to listen on. `0.0.0.0` (the default) accepts peers on any interface; connections are
    /// authenticated either way.
    pub bind_ip: IpAddr,
    /// IP other ranks should dial. Default: `bind_ip` if it is specific, else this host's IP on
    /// the route to the store.
    pub advertise_ip: Option<IpAddr>,
    /// Deadline for the whole mesh (waiting for peers' addresses, connecting, handshakes).
    pub connect_timeout: Duration,
    /// `SO_SNDBUF`/`SO_RCVBUF` for data sockets (the kernel doubles it and caps it at
    /// `net.core.{w,r}mem_max`); 0 leaves the kernel's autotuning in charge. Default 4 MiB: on
    /// loopback it moved 1 MiB ring steps clearly faster than autotuning, and it covers the
    /// bandwidth-delay product of a 10 Gb/s link up to a few milliseconds of round trip.
    pub socket_buffer_bytes: usize,
    /// Test-only: one-way delay added before each message is sent (emulates a WAN link where
    /// netem is unavailable).
    pub emulated_latency: Option<Duration>,
    /// Store key namespace: addresses are published as `"{store_prefix}/{rank}"`. Give each
    /// transport built over the same store its own prefix (e.g. a second stream of operations).
    pub store_prefix: String,
    /// Receive low-water mark (`SO_RCVLOWAT`) while a call waits for a frame: it sleeps until
    /// `min(bytes still to come, recv_low_water)` have arrived instead of waking for every
    /// 64 KiB loopback packet. Default 1 MiB: fewer wakeups and larger reads raise large
    /// all-reduces' bandwidth on loopback. 0 disables it; it is also off when
    /// `socket_buffer_bytes` is 0, where raising the mark would let the kernel clamp the window.
    pub recv_low_water: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            bind_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            advertise_ip: None,
            connect_timeout: Duration::from_secs(60),
            socket_buffer_bytes: 4 << 20,
            emulated_latency: None,
            store_prefix: "tcp".into(),
            recv_low_water: 1 << 20,
        }
    }
}

/// One direction of a link. `poisoned` holds why the stream is out of step, if it is.
struct Half {
    poisoned: Option<String>,
    /// `SO_RCVLOWAT` last set on the socket (receive half only; 0 = the kernel's default of 1).
    lowat: usize,
}

struct Link {
    stream: TcpStream,
    addr: String,
    send: Mutex<Half>,
    recv: Mutex<Half>,
}

/// A rank's authenticated TCP links to every other rank of the job.
pub struct TcpTransport {
    rank: usize,
    world: usize,
    /// `links[peer]`; `None` at our own rank.
    links: Vec<Option<Link>>,
    bytes_sent: AtomicU64,
    latency: Option<Duration>,
    /// [`TcpOptions::recv_low_water`], 0 when off.
    low_water: usize,
}

impl TcpTransport {
    /// Build the full mesh for `rank` of `world` through `store`. Every rank of the job must call
    /// this with the same `world`, `job_id`, secret and `opts.store_prefix`.
    pub fn establish(
        store: &mut StoreClient,
        rank: usize,
        world: usize,
        secret: &JobSecret,
        job_id: &str,
        opts: &TcpOptions,
    ) -> Result<TcpTransport> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid(
                "tcp establish",
                format!("rank {rank} is outside world of {world}"),
            ));
        }
        if world > u32::MAX as usize {
            return Err(CommError::invalid(
                "tcp establish",
                format!("world of {world} is too large"),
            ));
        }
        let started = Instant::now();
        let deadline = started + opts.connect_timeout;
        let listener = TcpListener::bind((opts.bind_ip, 0)).map_err(|e| {
            CommError::setup(
                format!("rank {rank}: binding TCP listener on {}", opts.bind_ip),
                e,
            )
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::setup(format!("rank {rank}: reading listener address"), e))?
            .port();
        let ip = match opts.advertise_ip {
            Some(ip) => ip,
            None if !opts.bind_ip.is_unspecified() => opts.bind_ip,
            None => store.local_ip()?,
        };
        let advertised = SocketAddr::new(ip, port);
        store.set(
            &format!("{}/{rank}", opts.store_prefix),
            advertised.to_string().as_bytes(),
        )?;

        let mesh = Mesh {
            rank,
            world,
            secret,
            context: data_context(job_id),
            deadline,
            started,
        };
        let streams = mesh.build(store, listener, &opts.store_prefix)?;

        let mut links = Vec::with_capacity(world);
        for (peer, entry) in streams.into_iter().enumerate() {
            let Some((stream, addr)) = entry else {
                links.push(None);
                continue;
            };
            configure_data_socket(&stream, opts.socket_buffer_bytes).map_err(|e| {
                CommError::setup(
                    format!("rank {rank}: configuring link to rank {peer} ({addr})"),
                    e,
                )
            })?;
            links.push(Some(Link {
                stream,
                addr,
                send: Mutex::new(Half {
                    poisoned: None,
                    lowat: 0,
                }),
                recv: Mutex::new(Half {
                    poisoned: None,
                    lowat: 0,
                }),
            }));
        }
        Ok(TcpTransport {
            rank,
            world,
            links,
            bytes_sent: AtomicU64::new(0),
            latency: opts.emulated_latency,
            low_water: if opts.socket_buffer_bytes > 0 {
                opts.recv_low_water
            } else {
                0
            },
        })
    }

    fn link(&self, peer: usize, as_recv: bool) -> Result<&Link, TransportError> {
        let err = |why: String| {
            let f = LinkFailure::Protocol(why);
            if as_recv {
                TransportError::recv(peer, self.peer_addr(peer), f)
            } else {
                TransportError::send(peer, self.peer_addr(peer), f)
            }
        };
        if peer >= self.world {
            return Err(err(format!(
                "rank {peer} is outside world of {}",
                self.world
            )));
        }
        self.links[peer].as_ref().ok_or_else(|| {
            err(format!(
                "rank {peer} is this rank; a TCP transport has no link to itself"
            ))
        })
    }

    fn emulate_latency(&self, deadline: Instant) {
        if let Some(d) = self.latency {
            let now = Instant::now();
            delay_until((now + d).min(deadline.max(now)));
        }
    }
}

/// Waits until `until` to within a few microseconds, as a link's delay would: a plain sleep
/// overshoots by the timer slack (50 µs by default) plus the wake-up latency of a busy machine,
/// and a step of a hundred messages then meets several milliseconds of delay that no link has.
/// So this thread's timer slack is set to 1 ns, and the sleep stops short of `until` by
/// [`SPIN_MARGIN`], which is passed yielding the core.
fn delay_until(until: Instant) {
    thread_local!(static PRECISE_TIMERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    PRECISE_TIMERS.with(|set| {
        if !set.replace(true) {
            // SAFETY: PR_SET_TIMERSLACK takes an unsigned long by value and touches no memory.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        }
    });
    let left = until.saturating_duration_since(Instant::now());
    if left > SPIN_MARGIN {
        std::thread::sleep(left - SPIN_MARGIN);
    }
    while Instant::now() < until {
        std::thread::yield_now();
    }
}

/// How much of an emulated delay is passed yielding rather than asleep: about one wake-up.
const SPIN_MARGIN: Duration = Duration::from_micros(60);

fn configure_data_socket(stream: &TcpStream, buffer: usize) -> std::io::Result<()> {
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    stream.set_nodelay(true)?;
    if buffer > 0 {
        let v = buffer.min(i32::MAX as usize) as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: valid fd, pointer to a c_int of the stated size.
            let r = unsafe {
                libc::setsockopt(
                    stream.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    stream.set_nonblocking(true)
}

impl TcpTransport {
    /// Drive an optional send and an optional receive to completion from one poll loop. On any
    /// failure, a direction left in the middle of a frame is poisoned.
    fn drive(
        &self,
        mut send: Option<(usize, &Link, &mut Half, SendOp<'_>)>,
        mut recv: Option<(usize, &Link, &mut Half, RecvOp<'_>)>,
        deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        if let Some((peer, link, half, _)) = &send {
            if let Some(why) = &half.poisoned {
                return Err(TransportError::send(
                    *peer,
                    link.addr.clone(),
                    unusable(why),
                ));
            }
        }
        if let Some((peer, link, half, _)) = &recv {
            if let Some(why) = &half.poisoned {
                return Err(TransportError::recv(
                    *peer,
                    link.addr.clone(),
                    unusable(why),
                ));
            }
        }
        let started = Instant::now();
        let result = loop {
            if let Some((peer, link, _, op)) = send.as_mut() {
                if let Err(f) = op.step(link.stream.as_raw_fd()) {
                    break Err((false, TransportError::send(*peer, link.addr.clone(), f)));
                }
            }
            if let Some((peer, link, _, op)) = recv.as_mut() {
                if let Err(f) = op.step(link.stream.as_raw_fd()) {
                    break Err((true, TransportError::recv(*peer, link.addr.clone(), f)));
                }
            }
            let send_fd = send
                .as_ref()
                .filter(|s| !s.3.finished())
                .map(|s| s.1.stream.as_raw_fd());
            let recv_fd = recv
                .as_ref()
                .filter(|r| !r.3.finished())
                .map(|r| r.1.stream.as_raw_fd());
            if send_fd.is_none() && recv_fd.is_none() {
                break Ok(());
            }
            if Instant::now() >= deadline {
                let waited = LinkFailure::Timeout(started.elapsed());
                // Blame the peer we wait for if there is one: its silence is the likelier cause.
                break Err(match (&recv, &send) {
                    (Some((peer, link, _, _)), _) if recv_fd.is_some() => {
                        (true, TransportError::recv(*peer, link.addr.clone(), waited))
                    }
                    (_, Some((peer, link, _, _))) => (
                        false,
                        TransportError::send(*peer, link.addr.clone(), waited),
                    ),
                    _ => unreachable!("something is pending"),
                });
            }
            if let (Some((_, _, half, op)), Some(fd)) = (recv.as_mut(), recv_fd) {
                let want = op.wake_bytes().min(self.low_water);
                if want != half.lowat {
                    set_rcvlowat(fd, want);
                    half.lowat = want;
                }
            }
            let mut fds = [libc::pollfd {
                fd: -1,
                events: 0,
                revents: 0,
            }; 2];
            let mut n = 0;
            if let Some(fd) = send_fd {
                fds[0] = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                n = 1;
            }
            if let Some(fd) = recv_fd {
                if n == 1 && fds[0].fd == fd {
                    fds[0].events |= libc::POLLIN;
                } else {
                    fds[n] = libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    n += 1;
                }
            }
            // SAFETY: `n` valid pollfds that outlive the call. EINTR just loops.
            unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, poll_ms(deadline)) };
        };
        if let Err((recv_failed, e)) = &result {
            // A frame cut short leaves its direction out of step; so does any failure other than
            // a timeout before the first byte (closed, I/O error, protocol violation).
            let why = e.failure.to_string();
            let fatal = !matches!(e.failure, LinkFailure::Timeout(_));
            if let Some((_, _, half, op)) = send.as_mut() {
                if op.cut_short() {
                    half.poisoned = Some(why.clone());
                }
            }
            if let Some((_, _, half, op)) = recv.as_mut() {
                if op.cut_short() || (fatal && *recv_failed) {
                    half.poisoned = Some(why);
                }
            }
        }
        result.map_err(|(_, e)| e)
    }
}

/// Set `SO_RCVLOWAT` (at least 1; the kernel caps it at half the receive buffer and still wakes
/// a reader early when the window is about to close, on EOF and on errors, so a frame shorter than
/// the mark is never stranded). A failure only costs wakeups, so it is ignored.
fn set_rcvlowat(fd: libc::c_int, bytes: usize) {
    let v = bytes.clamp(1, i32::MAX as usize) as libc::c_int;
    // SAFETY: valid fd, pointer to a c_int of the stated size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

fn unusable(why: &str) -> LinkFailure {
    LinkFailure::Protocol(format!("link unusable after an earlier failure: {why}"))
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn peer_addr(&self, peer: usize) -> String {
        match self.links.get(peer) {
            Some(Some(l)) => l.addr.clone(),
            Some(None) => "self".into(),
            None => "no such rank".into(),
        }
    }
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let link = self.link(peer, false)?;
        let mut half = link.send.lock().unwrap_or_else(|e| e.into_inner());
        self.emulate_latency(deadline);
        let op = SendOp::new(tag, data);
        self.drive(Some((peer, link, &mut half, op)), None, deadline)?;
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
        let link = self.link(peer, true)?;
        let mut half = link.recv.lock().unwrap_or_else(|e| e.into_inner());
        let op = RecvOp::new(tag, buf);
        self.drive(None, Some((peer, link, &mut half, op)), deadline)
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
        let out = self.link(to, false)?;
        let inc = self.link(from, true)?;
        // Always the send half first: no two threads can then wait on each other's locks.
        let mut out_half = out.send.lock().unwrap_or_else(|e| e.into_inner());
        let mut in_half = inc.recv.lock().unwrap_or_else(|e| e.into_inner());
        self.emulate_latency(deadline);
        let sop = SendOp::new(send_tag, send);
        let rop = RecvOp::new(recv_tag, recv);
        self.drive(
            Some((to, out, &mut out_half, sop)),
            Some((from, inc, &mut in_half, rop)),
            deadline,
        )?;
        self.bytes_sent
            .fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod delay_tests {
    use super::*;

    #[test]
    fn an_emulated_delay_never_ends_early_and_a_past_deadline_returns_at_once() {
        for us in [0, 30, 200, 700] {
            let start = Instant::now();
            delay_until(start + Duration::from_micros(us));
            assert!(
                start.elapsed() >= Duration::from_micros(us),
                "{us} µs ended early"
            );
        }
        let past = Instant::now() - Duration::from_millis(5);
        let start = Instant::now();
        delay_until(past);
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
