//! The lobby: connections over a pending-handshake budget that wait for their proof without a
//! thread of their own (why: `admission.rs`). The accepting thread owns it: it sends each newcomer
//! the hello at once, then in every round polls the listener and the waiting connections together,
//! checks the proofs that arrived before it accepts anything new, and drops connections that gave
//! a wrong answer, hung up, or outstayed their deadline. Everything here is non-blocking.
//!
//! A newcomer pushes a waiter out only once that waiter has had [`LobbyLimits::min_wait`] to
//! answer; until then the newcomer is *held* (no hello yet) and the accepting thread accepts
//! nothing more ([`Lobby::accepting`]), leaving new connections in the kernel's queue. The place a
//! real client gets is therefore a span of time, not a count of the flood's newcomers, which a
//! fast flood used up before the client's thread ran.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::admission::LobbyLimits;
use crate::auth::{random_nonce, JobSecret, NONCE_LEN};
use crate::wire::{self, Service, PREFIX_LEN, PROOF_LEN};

/// What became of a waiting connection.
pub(crate) enum Outcome {
    /// It proved it holds the secret and was sent the verdict; blocking again, ready to be served.
    Admitted(TcpStream, SocketAddr),
    /// Dropped: `category` for the aggregated log, `detail` as its example.
    Refused {
        peer: SocketAddr,
        category: String,
        detail: String,
    },
}

struct Waiting {
    stream: TcpStream,
    peer: SocketAddr,
    nonce_a: [u8; NONCE_LEN],
    proof: [u8; PROOF_LEN],
    got: usize,
    /// When it was parked (it may be pushed out from `since + min_wait` on).
    since: Instant,
    until: Instant,
}

/// A newcomer waiting for a place (no hello sent yet).
struct Held {
    stream: TcpStream,
    peer: SocketAddr,
    until: Instant,
}

/// Connections waiting for their proof, oldest first.
pub(crate) struct Lobby {
    limits: LobbyLimits,
    secret: JobSecret,
    context: Vec<u8>,
    service: Service,
    waiting: VecDeque<Waiting>,
    held: Option<Held>,
}

impl Lobby {
    pub fn new(limits: LobbyLimits, secret: &JobSecret, context: &[u8], service: Service) -> Lobby {
        // Each waiter holds a descriptor; leave most of them to everything else.
        let total = limits.total.min(descriptor_limit() / 4);
        Lobby {
            limits: LobbyLimits {
                total,
                per_ip: limits.per_ip.min(total),
                ..limits
            },
            secret: secret.clone(),
            context: context.to_vec(),
            service,
            waiting: VecDeque::new(),
            held: None,
        }
    }

    pub fn limits(&self) -> LobbyLimits {
        self.limits
    }

    /// Connections waiting now.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether the accepting thread may accept: not while a newcomer is held.
    pub fn accepting(&self) -> bool {
        self.held.is_none()
    }

    /// Lets `stream` wait until `until` for its proof: sends the hello, pushing out the oldest
    /// waiter of its source (or of all) where the lobby is full. Returns those dropped. If that
    /// waiter has not had `min_wait` yet, `stream` is held instead (see [`Lobby::accepting`]).
    pub fn park(&mut self, stream: TcpStream, peer: SocketAddr, until: Instant) -> Vec<Outcome> {
        if self.held.is_some() {
            // The caller stopped accepting; a second newcomer cannot wait too.
            return vec![refused(
                peer,
                "lobby full",
                "a newcomer already waits for a place".into(),
            )];
        }
        let now = Instant::now();
        let victim = self.victim(peer.ip());
        if victim
            .as_ref()
            .is_some_and(|(i, _)| now < self.protected_until(*i))
        {
            self.held = Some(Held {
                stream,
                peer,
                until,
            });
            return Vec::new();
        }
        let mut dropped: Vec<Outcome> = victim
            .and_then(|(i, category)| self.push_out(i, &category))
            .into_iter()
            .collect();
        let nonce_a = random_nonce();
        let hello = wire::hello_message(self.service, &nonce_a);
        // A fresh socket's send buffer takes the whole hello at once; if not, it is not worth more.
        let sent = stream
            .set_nonblocking(true)
            .and_then(|_| stream.set_nodelay(true))
            .and_then(|_| (&stream).write(&hello));
        match sent {
            Ok(n) if n == hello.len() => self.waiting.push_back(Waiting {
                stream,
                peer,
                nonce_a,
                proof: [0; PROOF_LEN],
                got: 0,
                since: now,
                until,
            }),
            Ok(_) => dropped.push(refused(
                peer,
                "other errors",
                "hello not sent at once".into(),
            )),
            Err(e) => dropped.push(refused_io(peer, "sending hello", &e)),
        }
        dropped
    }

    /// When the waiter at `index` may be pushed out.
    fn protected_until(&self, index: usize) -> Instant {
        self.waiting[index].since + self.limits.min_wait
    }

    /// Parks the held newcomer if its place is free now (or drops it past its deadline).
    fn place_held(&mut self, now: Instant) -> Vec<Outcome> {
        let Some(h) = self.held.take() else {
            return Vec::new();
        };
        if now >= h.until {
            let detail = "timed out waiting for a place in the lobby".into();
            return vec![refused(h.peer, "handshake deadline passed", detail)];
        }
        self.park(h.stream, h.peer, h.until)
    }

    /// How long the held newcomer still waits for its place (`None`: none is held).
    fn held_wait(&self, now: Instant) -> Option<Duration> {
        let h = self.held.as_ref()?;
        let ready = match self.victim(h.peer.ip()) {
            Some((i, _)) => self.protected_until(i).min(h.until),
            None => now,
        };
        Some(ready.saturating_duration_since(now))
    }

    /// The waiter a newcomer from `ip` would push out, and the log category: the oldest of `ip`
    /// if it has its share, else the oldest of all if the lobby is full; `None` if there is room.
    fn victim(&self, ip: IpAddr) -> Option<(usize, String)> {
        let mine = self.waiting.iter().filter(|w| w.peer.ip() == ip).count();
        if mine >= self.limits.per_ip {
            let i = self.waiting.iter().position(|w| w.peer.ip() == ip)?;
            Some((i, format!("lobby of {ip} full")))
        } else if !self.waiting.is_empty() && self.waiting.len() >= self.limits.total {
            Some((0, "lobby full".to_string()))
        } else {
            None
        }
    }

    /// Pushes out the waiter at `index` ([`Lobby::victim`]'s), counted under `category`.
    fn push_out(&mut self, index: usize, category: &str) -> Option<Outcome> {
        let w = self.waiting.remove(index)?;
        let detail = "pushed out of the lobby by a newer connection before it proved anything";
        Some(refused(w.peer, category, detail.into()))
    }

    /// Polls `listener` (not while a newcomer is held) and the waiters for up to `timeout`, then
    /// checks every proof that arrived, drops waiters past their deadline and gives the held
    /// newcomer its place if it is free now. The listener is left to the caller to accept from.
    pub fn wait(&mut self, listener: RawFd, timeout: Duration) -> Vec<Outcome> {
        let now = Instant::now();
        let held_wait = self.held_wait(now);
        // poll(2) skips negative descriptors.
        let listener = if held_wait.is_some() { -1 } else { listener };
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener)
            .chain(self.waiting.iter().map(|w| w.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let next_expiry = self.waiting.iter().map(|w| w.until).min();
        let timeout = next_expiry
            .map_or(timeout, |t| timeout.min(t.saturating_duration_since(now)))
            .min(held_wait.unwrap_or(Duration::MAX));
        // Rounded up, so a wait of less than a millisecond does not spin.
        let ms = timeout.as_micros().div_ceil(1000).clamp(0, 1000) as libc::c_int;
        // SAFETY: `fds` is a valid array of pollfds that outlives the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        let ready: Vec<bool> = fds[1..].iter().map(|p| p.revents != 0).collect();
        let now = Instant::now();
        let mut outcomes = self.serve(&ready, now);
        outcomes.extend(self.place_held(now));
        outcomes
    }

    /// Reads from the waiters marked `ready` (in lobby order); settles those done or expired.
    fn serve(&mut self, ready: &[bool], now: Instant) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        let waiting = std::mem::take(&mut self.waiting);
        for (i, mut w) in waiting.into_iter().enumerate() {
            let step = if ready.get(i).copied().unwrap_or(false) {
                self.step(&mut w)
            } else {
                Step::Wait
            };
            match step {
                Step::Wait if now >= w.until => outcomes.push(refused(
                    w.peer,
                    "handshake deadline passed",
                    "timed out while reading proof (waiting in the lobby)".into(),
                )),
                Step::Wait => kept.push_back(w),
                Step::Complete => outcomes.push(self.conclude(w)),
                Step::Done(outcome) => outcomes.push(outcome),
            }
        }
        self.waiting = kept;
        outcomes
    }

    /// Reads what arrived of `w`'s proof and judges it once it is complete (the prefix as soon as
    /// it is there, so garbage is dropped after six bytes).
    fn step(&self, w: &mut Waiting) -> Step {
        loop {
            match (&w.stream).read(&mut w.proof[w.got..]) {
                Ok(0) => {
                    let e = std::io::Error::from(ErrorKind::UnexpectedEof);
                    return Step::Done(refused_io(w.peer, "reading proof", &e));
                }
                Ok(n) => {
                    let had = w.got;
                    w.got += n;
                    if had < PREFIX_LEN && w.got >= PREFIX_LEN {
                        let pre: [u8; PREFIX_LEN] = w.proof[..PREFIX_LEN].try_into().unwrap();
                        if let Err(r) = wire::judge_proof_prefix(&pre) {
                            return Step::Done(self.refuse(w, r));
                        }
                    }
                    if w.got == PROOF_LEN {
                        return Step::Complete;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Step::Done(refused_io(w.peer, "reading proof", &e)),
            }
        }
    }

    /// Judges a complete proof; a good one is answered and handed back blocking.
    fn conclude(&self, mut w: Waiting) -> Outcome {
        let judged = wire::judge_proof(
            &w.proof,
            &w.nonce_a,
            &self.secret,
            &self.context,
            self.service,
        );
        let verdict = match judged {
            Ok(v) => v,
            Err(r) => return self.refuse(&mut w, r),
        };
        // An empty send buffer (the client waits for this before sending more) takes it at once.
        match (&w.stream).write(&verdict) {
            Ok(n) if n == verdict.len() => {}
            Ok(_) => {
                return refused(
                    w.peer,
                    wire::RefusalKind::Other.label(),
                    "verdict not sent at once".into(),
                )
            }
            Err(e) => return refused_io(w.peer, "sending verdict", &e),
        }
        match w.stream.set_nonblocking(false) {
            Ok(()) => Outcome::Admitted(w.stream, w.peer),
            Err(e) => refused_io(w.peer, "handing over", &e),
        }
    }

    fn refuse(&self, w: &mut Waiting, r: wire::Refusal) -> Outcome {
        let why = r.answer(&mut &w.stream);
        refused(w.peer, why.kind.label(), why.reason)
    }
}

enum Step {
    /// Nothing (more) to read yet.
    Wait,
    /// The whole proof is there, its prefix good: to be judged.
    Complete,
    /// Settled: hung up, broke, or sent garbage.
    Done(Outcome),
}

fn refused(peer: SocketAddr, category: &str, detail: String) -> Outcome {
    Outcome::Refused {
        peer,
        category: category.to_string(),
        detail,
    }
}

fn refused_io(peer: SocketAddr, what: &str, e: &std::io::Error) -> Outcome {
    let why = wire::io_reason(what, e);
    refused(peer, why.kind.label(), why.reason)
}

/// The soft limit on open descriptors (1024 if it cannot be read).
fn descriptor_limit() -> usize {
    // SAFETY: rlimit is plain data; getrlimit fills it.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid resource and out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::connect_handshake;
    use std::net::TcpListener;

    fn secret() -> JobSecret {
        JobSecret::from_hex(&"ab".repeat(32)).unwrap()
    }

    /// A listener, and a function that connects to it and returns the accepted end.
    fn pair() -> (TcpListener, impl Fn() -> (TcpStream, TcpStream, SocketAddr)) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let l2 = l.try_clone().unwrap();
        (l, move || {
            let c = TcpStream::connect(addr).unwrap();
            let (s, peer) = l2.accept().unwrap();
            (c, s, peer)
        })
    }

    fn lobby(per_ip: usize, total: usize) -> Lobby {
        paced_lobby(per_ip, total, Duration::ZERO)
    }

    fn paced_lobby(per_ip: usize, total: usize, min_wait: Duration) -> Lobby {
        let limits = LobbyLimits {
            after: Duration::ZERO,
            per_ip,
            total,
            min_wait,
        };
        Lobby::new(limits, &secret(), b"store|job", Service::Store)
    }

    fn categories(outcomes: &[Outcome]) -> Vec<String> {
        outcomes
            .iter()
            .map(|o| match o {
                Outcome::Admitted(_, p) => format!("admitted {p}"),
                Outcome::Refused { category, .. } => category.clone(),
            })
            .collect()
    }

    /// Waits (bounded) until the lobby has settled `n` connections.
    fn settle(l: &mut Lobby, fd: RawFd, n: usize) -> Vec<Outcome> {
        let until = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < n && Instant::now() < until {
            got.extend(l.wait(fd, Duration::from_millis(20)));
        }
        got
    }

    #[test]
    fn a_newcomer_pushes_out_the_oldest_waiter_of_its_source_and_a_real_client_gets_through() {
        let (listener, connect) = pair();
        let fd = listener.as_raw_fd();
        let mut l = lobby(2, 8);
        let far = Instant::now() + Duration::from_secs(60);
        let (_c1, s1, p1) = connect();
        let (_c2, s2, _) = connect();
        let (_c3, s3, _) = connect();
        assert!(l.park(s1, p1, far).is_empty());
        assert!(l.park(s2, p1, far).is_empty());
        let pushed = l.park(s3, p1, far);
        assert_eq!(categories(&pushed), ["lobby of 127.0.0.1 full"]);
        assert!(matches!(&pushed[0], Outcome::Refused { peer, .. } if *peer == p1));
        assert_eq!(l.len(), 2);

        // A real client, parked after the silent ones (pushing out the oldest again), proves
        // itself within a round trip and is handed back.
        let (mut c, s, p) = connect();
        let client = std::thread::spawn(move || {
            connect_handshake(&mut c, &secret(), b"store|job", Service::Store, "store").is_ok()
        });
        assert_eq!(categories(&l.park(s, p, far)), ["lobby of 127.0.0.1 full"]);
        let got = settle(&mut l, fd, 1);
        assert_eq!(categories(&got), [format!("admitted {p}")]);
        assert!(client.join().unwrap(), "the client saw a good verdict");
        assert_eq!(l.len(), 1, "the silent one still waits");
    }

    #[test]
    fn garbage_wrong_proofs_hang_ups_and_overstayers_are_dropped() {
        let (listener, connect) = pair();
        let fd = listener.as_raw_fd();
        let mut l = lobby(8, 8);
        let far = Instant::now() + Duration::from_secs(60);
        let (mut garbage, s, p) = connect();
        l.park(s, p, far);
        garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!(categories(&settle(&mut l, fd, 1)), ["not a lockstep peer"]);

        let (mut wrong, s, p) = connect();
        l.park(s, p, far);
        let client = std::thread::spawn(move || {
            let other = JobSecret::from_hex(&"cd".repeat(32)).unwrap();
            connect_handshake(&mut wrong, &other, b"store|job", Service::Store, "store").is_err()
        });
        assert_eq!(categories(&settle(&mut l, fd, 1)), ["bad MAC"]);
        assert!(client.join().unwrap(), "a wrong secret is told so");

        let (hang_up, s, p) = connect();
        l.park(s, p, far);
        drop(hang_up);
        assert_eq!(
            categories(&settle(&mut l, fd, 1)),
            ["closed during handshake"]
        );

        let (_silent, s, p) = connect();
        l.park(s, p, Instant::now() + Duration::from_millis(50));
        assert_eq!(
            categories(&settle(&mut l, fd, 1)),
            ["handshake deadline passed"]
        );
        assert_eq!(l.len(), 0);
    }

    /// A waiter younger than `min_wait` is not pushed out: the newcomer is held, accepting stops,
    /// and the newcomer gets its place (pushing out the oldest) only once that one has waited
    /// `min_wait`; a held newcomer past its deadline is dropped.
    #[test]
    fn a_newcomer_is_held_until_the_oldest_waiter_has_had_its_minimum_wait() {
        let (listener, connect) = pair();
        let fd = listener.as_raw_fd();
        let min_wait = Duration::from_millis(300);
        let mut l = paced_lobby(2, 8, min_wait);
        let far = Instant::now() + Duration::from_secs(60);
        let (_c1, s1, p1) = connect();
        let (_c2, s2, _) = connect();
        let (_c3, s3, _) = connect();
        let parked = Instant::now();
        assert!(l.park(s1, p1, far).is_empty());
        assert!(l.park(s2, p1, far).is_empty());
        assert!(l.park(s3, p1, far).is_empty(), "held, nobody pushed out");
        assert!(!l.accepting());
        assert_eq!(l.len(), 2);
        let got = settle(&mut l, fd, 1);
        assert!(
            parked.elapsed() >= min_wait,
            "pushed out after {:?}",
            parked.elapsed()
        );
        assert_eq!(categories(&got), ["lobby of 127.0.0.1 full"]);
        assert!(l.accepting());
        assert_eq!(l.len(), 2);

        let mut l = paced_lobby(1, 8, Duration::from_secs(60));
        let (_c4, s4, p4) = connect();
        let (_c5, s5, _) = connect();
        assert!(l.park(s4, p4, far).is_empty());
        assert!(l
            .park(s5, p4, Instant::now() + Duration::from_millis(50))
            .is_empty());
        assert!(!l.accepting());
        let got = settle(&mut l, fd, 1);
        assert_eq!(categories(&got), ["handshake deadline passed"]);
        assert!(l.accepting());
        assert_eq!(l.len(), 1, "the waiter keeps its place");
    }
}
