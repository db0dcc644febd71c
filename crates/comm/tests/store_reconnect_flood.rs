//! The rendezvous store, and a rank's TCP data listener, against a stranger on the job's own
//! address that reconnects without pause (issue "Nothing lost, nothing clobbered, nothing
//! crashes", finding 3): whatever the stranger sends — nothing, garbage, a wrong proof — a real
//! client with the secret connecting from the same address (127.0.0.1) must get in (and set/get a
//! key, or form its link) well within its deadline. Before the lobby, the silent flood kept the
//! store's client out for 27.8 s of its 30 s. Loopback only; every flood stops on a flag, so the
//! tests end by themselves.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lockstep_comm::admission::LobbyLimits;
use lockstep_comm::auth::JobSecret;
use lockstep_comm::store::{StoreClient, StoreOptions, StoreServer};
use lockstep_comm::tcp::{TcpOptions, TcpTransport};
use lockstep_comm::Transport;

#[path = "common/fd_limit.rs"]
mod fd_limit;
use fd_limit::raise_fd_limit;

/// What the real client must achieve it in; its own connect deadline is longer, so a failure
/// here is a slow admission, not a give-up.
const WITHIN: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug)]
enum Attack {
    /// Connect and hang up at once.
    HangUp,
    /// Connect, send bytes that are not a lockstep proof, hang up.
    Garbage,
    /// Read the hello and answer it with a well-formed proof under the wrong secret.
    WrongSecret,
    /// Connect and say nothing; keep the newest `held` such connections open (closing the oldest)
    /// and open the next one at once, whether or not the server closed the earlier ones.
    Silent { held: usize },
}

/// One flood at a time in this binary: the tests measure a real client against *a* stranger, and
/// the test harness would otherwise run all of them at once — on 2 cores, seven flooding threads
/// and seven servers' accept loops leave a client thread unscheduled for longer than a lobby
/// place lasts, which is a measure of the harness, not of admission.
static ONE_FLOOD_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Flood {
    stop: Arc<AtomicBool>,
    connects: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
    /// Held until the flood has stopped (fields drop after `Drop::drop`).
    _alone: MutexGuard<'static, ()>,
}

impl Flood {
    fn start(to: SocketAddr, attack: Attack) -> Flood {
        let alone = ONE_FLOOD_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let stop = Arc::new(AtomicBool::new(false));
        let connects = Arc::new(AtomicUsize::new(0));
        let (flag, count) = (stop.clone(), connects.clone());
        let thread = std::thread::spawn(move || {
            let mut held: std::collections::VecDeque<TcpStream> = Default::default();
            while !flag.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(to) else {
                    continue;
                };
                count.fetch_add(1, Ordering::Relaxed);
                match attack {
                    Attack::HangUp => {}
                    Attack::Garbage => {
                        let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
                    }
                    Attack::WrongSecret => wrong_proof(&mut s),
                    Attack::Silent { held: n } => {
                        held.push_back(s);
                        while held.len() > n {
                            held.pop_front();
                        }
                    }
                }
            }
        });
        Flood {
            stop,
            connects,
            thread: Some(thread),
            _alone: alone,
        }
    }

    fn connects(&self) -> usize {
        self.connects.load(Ordering::Relaxed)
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

/// Reads the hello (prefix, service, 32-byte nonce) and answers with a proof of the right shape
/// whose MAC is made up.
fn wrong_proof(s: &mut TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut hello = [0u8; 6 + 1 + 32];
    if s.read_exact(&mut hello).is_err() {
        return;
    }
    let mut proof = [7u8; 6 + 1 + 32 + 32];
    proof[..7].copy_from_slice(&hello[..7]);
    let _ = s.write_all(&proof);
    let mut verdict = [0u8; 6 + 1 + 32];
    let _ = s.read_exact(&mut verdict);
}

/// When the real client starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Once the flood has run for a while.
    Warm,
    /// As soon as the flood holds a pending handshake: its connections are all young (the worst
    /// case when the lobby waited for a stale budget; it no longer does by default).
    Cold,
    /// Once the flood has filled the lobby (and keeps pushing its own waiters out).
    LobbyFull,
}

/// Runs `attack` from 127.0.0.1 against a fresh store and times a real client from 127.0.0.1:
/// connect, set, get.
fn real_client_gets_in_during(attack: Attack, start: Start) -> StoreServer {
    real_client_gets_in_with(attack, start, StoreOptions::default())
}

fn real_client_gets_in_with(attack: Attack, start: Start, opts: StoreOptions) -> StoreServer {
    raise_fd_limit();
    let secret = JobSecret::generate().unwrap();
    let srv =
        StoreServer::bind_with("127.0.0.1:0".parse().unwrap(), &secret, "job-r", opts).unwrap();
    let addr = srv.local_addr();
    let flood = Flood::start(addr, attack);
    let warming = Instant::now();
    let ready = || match start {
        Start::Warm => flood.connects() >= 2_000 || warming.elapsed() >= Duration::from_secs(3),
        Start::Cold => srv.pending_handshakes() > 0,
        Start::LobbyFull => srv.lobby_handshakes() == opts.lobby.per_ip,
    };
    while !ready() {
        assert!(warming.elapsed() < Duration::from_secs(60), "hang guard");
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    let mut c = StoreClient::connect(addr, &secret, "job-r", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{attack:?}: {e}"));
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", WITHIN).unwrap(), b"v");
    let took = started.elapsed();
    let connects = flood.connects();
    drop(flood);
    assert!(
        took < WITHIN,
        "{attack:?}: the real client took {took:?} ({connects} flood connections, \
         refusals {:?})",
        srv.refusals_by_reason()
    );
    eprintln!(
        "{attack:?}: real client in after {took:?}; {connects} flood connections; {:?}",
        srv.refusals_by_reason()
    );
    srv
}

#[test]
fn a_real_client_gets_in_while_a_stranger_reconnects_and_hangs_up() {
    real_client_gets_in_during(Attack::HangUp, Start::Warm);
}

#[test]
fn a_real_client_gets_in_while_a_stranger_reconnects_with_garbage() {
    real_client_gets_in_during(Attack::Garbage, Start::Warm);
}

#[test]
fn a_real_client_gets_in_while_a_stranger_reconnects_with_wrong_proofs() {
    real_client_gets_in_during(Attack::WrongSecret, Start::Warm);
}

#[test]
fn a_real_client_gets_in_while_a_stranger_holds_silent_connections_and_reconnects() {
    real_client_gets_in_during(Attack::Silent { held: 4_000 }, Start::Warm);
}

#[test]
fn a_real_client_gets_in_when_a_silent_flood_has_just_filled_the_budget() {
    real_client_gets_in_during(Attack::Silent { held: 4_000 }, Start::Cold);
}

/// With a lobby of 8 places the flood keeps pushing its own waiters out; the real client, which
/// answers within a round trip, still gets through.
#[test]
fn a_real_client_gets_through_a_small_lobby_the_flood_keeps_full() {
    let opts = StoreOptions {
        lobby: LobbyLimits {
            per_ip: 8,
            total: 8,
            ..LobbyLimits::default()
        },
        ..StoreOptions::default()
    };
    let srv = real_client_gets_in_with(Attack::Silent { held: 4_000 }, Start::LobbyFull, opts);
    let pushed = srv
        .refusals_by_reason()
        .get("lobby of 127.0.0.1 full")
        .copied();
    assert!(pushed.unwrap_or(0) > 0, "{:?}", srv.refusals_by_reason());
}

/// The same silent flood against rank 0's data listener while the mesh forms: rank 1, dialing
/// from the same address, still gets its link.
#[test]
fn a_rank_gets_its_link_while_a_stranger_floods_the_data_listener() {
    raise_fd_limit();
    let secret = JobSecret::generate().unwrap();
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret, "job-m").unwrap();
    let store = srv.local_addr();
    let opts = TcpOptions {
        bind_ip: "127.0.0.1".parse().unwrap(),
        connect_timeout: Duration::from_secs(30),
        ..TcpOptions::default()
    };
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            let mut c = StoreClient::connect(store, &secret, "job-m", WITHIN).unwrap();
            TcpTransport::establish(&mut c, 0, 2, &secret, "job-m", &opts).unwrap()
        });
        let mut c = StoreClient::connect(store, &secret, "job-m", WITHIN).unwrap();
        let data: SocketAddr = String::from_utf8(c.get("tcp/0", WITHIN).unwrap())
            .unwrap()
            .parse()
            .unwrap();
        let flood = Flood::start(data, Attack::Silent { held: 4_000 });
        // After 3 s of flood: the steady state (the flood's first moments are tested above).
        std::thread::sleep(Duration::from_secs(3));
        let started = Instant::now();
        let rank1 = TcpTransport::establish(&mut c, 1, 2, &secret, "job-m", &opts).unwrap();
        let took = started.elapsed();
        let connects = flood.connects();
        drop(flood);
        let rank0 = rank0.join().unwrap();
        assert!(
            took < WITHIN,
            "rank 1 took {took:?} to join ({connects} flood connections)"
        );
        let deadline = Instant::now() + WITHIN;
        let mut buf = [0u8; 3];
        std::thread::scope(|s| {
            s.spawn(|| rank0.send(1, 5, b"abc", deadline).unwrap());
            rank1.recv(0, 5, &mut buf, deadline).unwrap();
        });
        assert_eq!(&buf, b"abc");
    });
}
