//! The lobby: connections over a pending-handshake budget that wait for their proof without a
//! thread of their own (why: `admission.rs`). The accepting thread owns it: it sends each newcomer
//! the hello at once, then in every round polls the listener and the waiting connections together,
//! checks the proofs that arrived before it accepts anything new, and drops connections that gave
//! a wrong answer, hung up, or outstayed their deadline. Everything here is non-blocking.

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
    until: Instant,
}

/// Connections waiting for their proof, oldest first.
pub(crate) struct Lobby {
    limits: LobbyLimits,
    secret: JobSecret,
    context: Vec<u8>,
    service: Service,
    waiting: VecDeque<Waiting>,
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
        }
    }

    pub fn limits(&self) -> LobbyLimits {
        self.limits
    }

    /// Connections waiting now.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Lets `stream` wait until `until` for its proof: sends the hello, pushing out the oldest
    /// waiter of its source (or of all) where the lobby is full. Returns those dropped.
    pub fn park(&mut self, stream: TcpStream, peer: SocketAddr, until: Instant) -> Vec<Outcome> {
        let mut dropped = self.make_room(peer.ip());
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

    /// The oldest waiter of `ip` if it has its share, else the oldest of all if the lobby is full.
    fn make_room(&mut self, ip: IpAddr) -> Vec<Outcome> {
        let mine = self.waiting.iter().filter(|w| w.peer.ip() == ip).count();
        let (index, category) = if mine >= self.limits.per_ip {
            let i = self.waiting.iter().position(|w| w.peer.ip() == ip);
            (i, format!("lobby of {ip} full"))
        } else if self.waiting.len() >= self.limits.total {
            (Some(0), "lobby full".to_string())
        } else {
            (None, String::new())
        };
        let Some(w) = index.and_then(|i| self.waiting.remove(i)) else {
            return Vec::new();
        };
        let detail = "pushed out of the lobby by a newer connection before it proved anything";
        vec![refused(w.peer, &category, detail.into())]
    }

    /// Polls `listener` and the waiters for up to `timeout`, then checks every proof that arrived
    /// and drops waiters past their deadline. The listener is left to the caller to accept from.
    pub fn wait(&mut self, listener: RawFd, timeout: Duration) -> Vec<Outcome> {
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener)
            .chain(self.waiting.iter().map(|w| w.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let now = Instant::now();
        let next_expiry = self.waiting.iter().map(|w| w.until).min();
        let timeout =
            next_expiry.map_or(timeout, |t| timeout.min(t.saturating_duration_since(now)));
        let ms = timeout.as_millis().clamp(0, 1000) as libc::c_int;
        // SAFETY: `fds` is a valid array of pollfds that outlives the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        let ready: Vec<bool> = fds[1..].iter().map(|p| p.revents != 0).collect();
        self.serve(&ready, Instant::now())
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
        let limits = LobbyLimits {
            after: Duration::ZERO,
            per_ip,
            total,
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
}
