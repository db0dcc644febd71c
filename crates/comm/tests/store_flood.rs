//! The rendezvous store under a slow-handshake flood (issue 10): strangers that trickle their
//! handshake a byte at a time must not lock out a real rank. Loopback only: the flood comes from
//! 127.0.0.2 (all of 127.0.0.0/8 is loopback on Linux) or from 127.0.0.1 itself. Every loop is
//! bounded and the flood threads stop on a flag, so the tests end by themselves.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lockstep_comm::admission::{AdmissionLimits, LobbyLimits};
use lockstep_comm::auth::JobSecret;
use lockstep_comm::store::{StoreClient, StoreOptions, StoreServer};

#[path = "common/fd_limit.rs"]
mod fd_limit;
use fd_limit::raise_fd_limit;

/// Hang guard for condition polling; never an assertion about speed.
const GUARD: Duration = Duration::from_secs(60);

/// A TCP connection to `to` from source address `from` (bound before connecting).
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let SocketAddr::V4(to) = to else {
        panic!("IPv4 only")
    };
    // SAFETY: a fresh socket, closed by TcpStream's Drop (or right here on error).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let src = sin(from, 0);
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let dst = sin(*to.ip(), to.port());
        if libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        stream.set_write_timeout(Some(Duration::from_secs(1)))?;
        Ok(stream)
    }
}

/// The bytes a slow stranger trickles: a valid prefix (so the server keeps reading) then zeros.
fn trickle_byte(i: usize) -> u8 {
    const START: [u8; 6] = [b'L', b'K', b'S', b'T', 1, 0];
    START.get(i).copied().unwrap_or(0)
}

struct Flood {
    stop: Arc<AtomicBool>,
    /// Trickle rounds completed so far.
    rounds: Arc<AtomicUsize>,
    thread: Option<JoinHandle<FloodStats>>,
}

#[derive(Debug, Default)]
struct FloodStats {
    connects: usize,
    connect_errors: usize,
    rounds: usize,
}

impl Flood {
    /// `n` connections from `from`, each sending one more handshake byte every `every`; a
    /// connection the server closed is reopened if `reconnect` (a persistent attacker). Stops on
    /// its flag or after `max_rounds` rounds.
    fn start(
        from: Ipv4Addr,
        to: SocketAddr,
        n: usize,
        every: Duration,
        reconnect: bool,
        max_rounds: usize,
    ) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let rounds = Arc::new(AtomicUsize::new(0));
        let done_rounds = rounds.clone();
        let thread = std::thread::spawn(move || {
            let mut stats = FloodStats::default();
            let mut conns: Vec<Option<(TcpStream, usize)>> = Vec::with_capacity(n);
            for _ in 0..n {
                stats.connects += 1;
                match connect_from(from, to) {
                    Ok(s) => conns.push(Some((s, 0))),
                    Err(_) => {
                        stats.connect_errors += 1;
                        conns.push(None);
                    }
                }
            }
            while !flag.load(Ordering::SeqCst) && stats.rounds < max_rounds {
                stats.rounds += 1;
                for c in conns.iter_mut() {
                    if flag.load(Ordering::SeqCst) {
                        break;
                    }
                    let alive = match c {
                        Some((s, sent)) => {
                            let ok = s.write(&[trickle_byte(*sent)]).is_ok();
                            *sent += 1;
                            ok
                        }
                        None => false,
                    };
                    if !alive {
                        *c = None;
                        if reconnect {
                            stats.connects += 1;
                            match connect_from(from, to) {
                                Ok(s) => *c = Some((s, 0)),
                                Err(_) => stats.connect_errors += 1,
                            }
                        }
                    }
                }
                done_rounds.fetch_add(1, Ordering::SeqCst);
                // Sleep in slices so `stop` ends the flood promptly.
                let until = Instant::now() + every;
                while Instant::now() < until && !flag.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            stats
        });
        Flood {
            stop,
            rounds,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> FloodStats {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + GUARD;
    while !cond() {
        assert!(Instant::now() < until, "hang guard: never saw {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Slow strangers from 127.0.0.2 trickling a byte every 2 s and reconnecting when closed, 1,100
/// more than the source's handshake budget and lobby places hold together (with the lobby's
/// 1,024 places, a flood of 1,100 alone would mostly wait in the lobby instead of being
/// refused); a real rank from 127.0.0.1 connects, authenticates, sets and gets within its
/// normal deadline.
#[test]
fn store_serves_a_real_rank_during_a_slow_flood_beyond_its_source_limits() {
    raise_fd_limit();
    let secret = JobSecret::generate().unwrap();
    let mut srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret, "job-f").unwrap();
    let addr = srv.local_addr();
    let per_ip = AdmissionLimits::default().max_pending_per_ip;
    let held = per_ip + LobbyLimits::default().per_ip;
    let started = Instant::now();
    let flood = Flood::start(
        Ipv4Addr::new(127, 0, 0, 2),
        addr,
        held + 1100,
        Duration::from_secs(2),
        true,
        30,
    );
    // The flood holds its whole per-source budget, the rest is being refused, and it has been
    // trickling (and reconnecting what was closed) for two rounds.
    wait_until("the flood fill its budget and be refused", || {
        srv.pending_handshakes() == per_ip
            && srv.refused_connections() >= 1000
            && flood.rounds.load(Ordering::SeqCst) >= 2
    });

    // A real rank, with the deadline a worker normally uses.
    let mut c = StoreClient::connect(addr, &secret, "job-f", Duration::from_secs(30)).unwrap();
    assert_eq!(c.local_ip().unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    for i in 0..20 {
        c.set(&format!("k{i}"), format!("v{i}").as_bytes()).unwrap();
    }
    for i in 0..20 {
        assert_eq!(
            c.get(&format!("k{i}"), Duration::from_secs(10)).unwrap(),
            format!("v{i}").into_bytes()
        );
    }
    assert_eq!(c.add("counter", 5).unwrap(), 5);
    // A second rank can join too while the flood goes on.
    let mut d = StoreClient::connect(addr, &secret, "job-f", Duration::from_secs(30)).unwrap();
    assert_eq!(d.get("k3", Duration::from_secs(10)).unwrap(), b"v3");
    assert_eq!(srv.authenticated_connections(), 2);
    assert!(srv.pending_handshakes() <= per_ip);

    let stats = flood.finish();
    let refused = srv.refused_connections();
    let by_reason = srv.refusals_by_reason();
    srv.shutdown();
    let elapsed = started.elapsed();
    assert!(refused >= 1000, "refused {refused}; flood {stats:?}");
    // Refused for the source's budget, or — once a handshake held that budget past the lobby's
    // wait — for its lobby being full (the lobby admits provers without a thread; see lobby.rs).
    let over_budget: u64 = [
        "handshake budget of 127.0.0.2 exhausted",
        "lobby of 127.0.0.2 full",
    ]
    .iter()
    .map(|k| by_reason.get(*k).copied().unwrap_or(0))
    .sum();
    assert!(over_budget >= 1000, "{by_reason:?}");
    // Aggregated: one line per 5 s interval (plus the one flushed at shutdown), not one each.
    let lines = srv.refusal_log_lines();
    let bound = elapsed.as_secs() / 5 + 2;
    assert!(
        lines >= 1 && lines <= bound,
        "{lines} log lines for {refused} refusals in {elapsed:?} (bound {bound})"
    );
}

/// With the lobby turned off, a flood from the rank's own address fills the per-source budget,
/// so the rank is refused at first; it keeps retrying with backoff and gets in once the flood's handshakes reach their
/// whole-handshake deadline (they trickle a byte every 100 ms, so a per-read deadline would never
/// fire).
#[test]
fn a_refused_rank_retries_until_the_flood_hits_its_handshake_deadline() {
    raise_fd_limit();
    let secret = JobSecret::generate().unwrap();
    let opts = StoreOptions {
        admission: AdmissionLimits {
            handshake_deadline: Duration::from_secs(2),
            max_pending_per_ip: 16,
            max_pending: 64,
        },
        // Without the lobby, which would let the rank in at once: the budget alone is tested.
        lobby: LobbyLimits {
            total: 0,
            ..LobbyLimits::default()
        },
        ..StoreOptions::default()
    };
    let mut srv =
        StoreServer::bind_with("127.0.0.1:0".parse().unwrap(), &secret, "job-s", opts).unwrap();
    let addr = srv.local_addr();
    let flood = Flood::start(
        Ipv4Addr::LOCALHOST,
        addr,
        48,
        Duration::from_millis(100),
        false,
        600,
    );
    wait_until("the flood fill the per-source budget", || {
        srv.pending_handshakes() == 16 && srv.refused_connections() >= 32
    });
    let budget = "handshake budget of 127.0.0.1 exhausted";
    let before = srv.refusals_by_reason().get(budget).copied().unwrap_or(0);

    let mut c = StoreClient::connect(addr, &secret, "job-s", Duration::from_secs(30)).unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", Duration::from_secs(5)).unwrap(), b"v");

    let by_reason = srv.refusals_by_reason();
    let stats = flood.finish();
    assert!(stats.rounds >= 1, "{stats:?}");
    srv.shutdown();
    let after = by_reason.get(budget).copied().unwrap_or(0);
    assert!(
        after > before,
        "the rank was never refused ({before} → {after}): {by_reason:?}"
    );
    assert!(
        by_reason
            .get("handshake deadline passed")
            .copied()
            .unwrap_or(0)
            >= 1,
        "no flood handshake reached its deadline: {by_reason:?}"
    );
}

/// When the budget never frees up (and the lobby is off), connecting fails at the caller's deadline and says where,
/// how long, how many attempts and the last reason.
#[test]
fn a_rank_that_never_gets_in_names_the_store_the_time_and_the_last_reason() {
    let secret = JobSecret::generate().unwrap();
    let opts = StoreOptions {
        admission: AdmissionLimits {
            handshake_deadline: Duration::from_secs(60),
            max_pending_per_ip: 1,
            max_pending: 64,
        },
        // Without the lobby, which would let the rank in at once: nothing frees the budget.
        lobby: LobbyLimits {
            total: 0,
            ..LobbyLimits::default()
        },
        ..StoreOptions::default()
    };
    let srv =
        StoreServer::bind_with("127.0.0.1:0".parse().unwrap(), &secret, "job-n", opts).unwrap();
    let addr = srv.local_addr();
    let _silent = TcpStream::connect(addr).unwrap();
    wait_until("the silent connection be pending", || {
        srv.pending_handshakes() == 1
    });
    let e = StoreClient::connect(addr, &secret, "job-n", Duration::from_millis(500))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!("could not reach store at {addr}")),
        "{e}"
    );
    assert!(e.contains("gave up after"), "{e}");
    assert!(e.contains("attempts; last: "), "{e}");
    assert!(e.contains("connection closed while reading hello"), "{e}");
}

/// More real ranks on one host than its per-source budget, all connecting at once: the ones
/// over budget are refused, retry with backoff and all get in.
#[test]
fn more_ranks_than_the_per_source_budget_all_get_in() {
    raise_fd_limit();
    let secret = JobSecret::generate().unwrap();
    let opts = StoreOptions {
        admission: AdmissionLimits {
            max_pending_per_ip: 4,
            ..AdmissionLimits::default()
        },
        ..StoreOptions::default()
    };
    let srv =
        StoreServer::bind_with("127.0.0.1:0".parse().unwrap(), &secret, "job-m", opts).unwrap();
    let addr = srv.local_addr();
    let n = 48;
    let barrier = std::sync::Barrier::new(n);
    std::thread::scope(|sc| {
        for rank in 0..n {
            let (secret, barrier) = (&secret, &barrier);
            sc.spawn(move || {
                barrier.wait();
                let mut c =
                    StoreClient::connect(addr, secret, "job-m", Duration::from_secs(60)).unwrap();
                c.add("arrived", 1).unwrap();
                c.set(&format!("r{rank}"), b"x").unwrap();
            });
        }
    });
    let mut c = StoreClient::connect(addr, &secret, "job-m", Duration::from_secs(60)).unwrap();
    assert_eq!(c.add("arrived", 0).unwrap(), n as i64);
}
