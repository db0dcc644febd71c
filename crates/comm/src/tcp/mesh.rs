//! Building the full mesh of authenticated connections (steps 1-3 of the [`super`] docs).
//!
//! Rank `r` dials ranks `0..r` on one thread while its caller's thread accepts ranks `r+1..n`;
//! each accepted connection is authenticated on a thread of its own, so a silent stranger never
//! delays the real peers. Strangers are bounded as at the store ([`crate::admission`]): pending
//! handshakes are limited per source IP and in total (over budget: waiting in the lobby, checked
//! on the accepting thread without a thread of its own, so that a stranger reconnecting from a
//! peer's own address cannot keep the peer out; with the lobby full, closed there), each has one deadline for its whole handshake and identity message, and
//! refusals are logged in aggregate. Dialers retry refused or broken attempts with capped
//! exponential backoff until the establishment deadline ([`wire::dial`]).
//!
//! After the handshake (integers little-endian): connector → acceptor
//! `MAGIC` · version u16 · rank u32 · world u32; acceptor → connector the same with its own rank
//! and world, plus a verdict byte (0 = admitted, 1 = rejected; the reason is logged there).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::admission::{Admission, AdmissionLimits, Deadlined, LobbyLimits, Pending, RefusalLog};
use crate::auth::JobSecret;
use crate::error::{CommError, Result};
use crate::lobby::{Lobby, Outcome};
use crate::store::StoreClient;
use crate::wire::{self, RefusalKind, Rejected, Service, PREFIX_LEN};

/// Identity message: prefix · rank u32 · world u32; the acceptor's answer adds a verdict byte.
const HELLO_LEN: usize = PREFIX_LEN + 8;
/// At most one refusal log line per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(5);
/// Connections accepted between two looks at the lobby (as at the store).
const ACCEPT_BATCH: usize = 64;

pub(super) fn data_context(job_id: &str) -> Vec<u8> {
    [b"tcp|".as_slice(), job_id.as_bytes()].concat()
}

pub(super) struct Mesh<'a> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) secret: &'a JobSecret,
    pub(super) context: Vec<u8>,
    pub(super) deadline: Instant,
    pub(super) started: Instant,
}

enum Event {
    /// The dialer connected to a lower rank.
    Dialed(usize, TcpStream, String),
    DialFailed(CommError),
    /// An authenticated connection claims to be `rank` of `world`.
    Claim {
        stream: TcpStream,
        from: SocketAddr,
        rank: u32,
        world: u32,
    },
    Refused {
        from: SocketAddr,
        reason: String,
        /// The refusal log's category.
        category: String,
    },
}

/// What [`Mesh::build`] has so far: a link per peer, and what it refused.
struct Progress {
    streams: Vec<Option<(TcpStream, String)>>,
    /// Links to peers, dialed or accepted.
    have: usize,
    /// Links the dialer made (to lower ranks).
    dialed: usize,
    last_refusal: Option<String>,
    log: RefusalLog,
}

impl Mesh<'_> {
    /// Returns `streams[peer] = (stream, peer address)` for every peer.
    pub(super) fn build(
        &self,
        store: &mut StoreClient,
        listener: TcpListener,
        prefix: &str,
    ) -> Result<Vec<Option<(TcpStream, String)>>> {
        let mut progress = Progress {
            streams: (0..self.world).map(|_| None).collect(),
            have: 0,
            dialed: 0,
            last_refusal: None,
            log: RefusalLog::new(REFUSAL_LOG_INTERVAL),
        };
        listener.set_nonblocking(true).map_err(|e| {
            CommError::setup(format!("rank {}: configuring listener", self.rank), e)
        })?;
        let abort = AtomicBool::new(false);
        let (tx, rx) = mpsc::channel::<Event>();
        let this = self;
        let result = std::thread::scope(|scope| {
            let dial_tx = tx.clone();
            let abort_ref = &abort;
            scope.spawn(move || {
                for peer in 0..this.rank {
                    match this.dial(store, prefix, peer, abort_ref) {
                        Ok((s, addr)) => {
                            let _ = dial_tx.send(Event::Dialed(peer, s, addr));
                        }
                        Err(e) => {
                            let _ = dial_tx.send(Event::DialFailed(e));
                            return;
                        }
                    }
                }
            });
            let outcome = self.gather_links(&mut progress, &listener, &tx, &rx);
            abort.store(true, Ordering::SeqCst);
            self.emit(progress.log.flush(Instant::now()));
            outcome
        });
        result.map(|()| progress.streams)
    }

    /// Accepts higher ranks and takes the dialer's links to lower ones until every peer has a
    /// link, or the deadline has passed.
    fn gather_links(
        &self,
        progress: &mut Progress,
        listener: &TcpListener,
        tx: &mpsc::Sender<Event>,
        rx: &mpsc::Receiver<Event>,
    ) -> Result<()> {
        let need = self.world - 1;
        let admission = Admission::new(AdmissionLimits::default());
        let mut lobby = Lobby::new(
            LobbyLimits::default(),
            self.secret,
            &self.context,
            Service::Data,
        );
        while progress.have < need {
            // Accept what is pending, a batch at a time; each handshake runs on its own thread so
            // a silent stranger cannot hold up the real peers.
            if self.rank + 1 < self.world {
                self.accept_batch(progress, listener, &admission, &mut lobby, tx);
            }
            while let Ok(ev) = rx.try_recv() {
                self.take_event(progress, ev)?;
            }
            self.emit(progress.log.tick(Instant::now()));
            if progress.have == need {
                break;
            }
            let now = Instant::now();
            if now >= self.deadline {
                return Err(self.timed_out(progress, rx, now));
            }
            // Proofs waiting in the lobby are judged before anything new is accepted.
            let wait = (self.deadline - now).min(Duration::from_millis(10));
            for o in lobby.wait(listener.as_raw_fd(), wait.max(Duration::from_millis(1))) {
                self.lobby_outcome(o, tx);
            }
        }
        Ok(())
    }

    /// Accepts up to [`ACCEPT_BATCH`] pending connections, each handed to a handshake thread (or
    /// refused, or held in the lobby).
    fn accept_batch(
        &self,
        progress: &mut Progress,
        listener: &TcpListener,
        admission: &Admission,
        lobby: &mut Lobby,
        tx: &mpsc::Sender<Event>,
    ) {
        // A newcomer held for a lobby place stops accepting (the flood's pace, see `lobby.rs`).
        for _ in 0..ACCEPT_BATCH {
            if !lobby.accepting() {
                break;
            }
            match listener.accept() {
                Ok((s, from)) => match self.admit_new(s, from, admission, lobby, tx) {
                    // Over budget: closed there, nothing read, no thread.
                    Err(category) => self.emit(progress.log.record(
                        Instant::now(),
                        &category,
                        format!("{from}: {category}"),
                    )),
                    Ok(dropped) => {
                        for o in dropped {
                            self.lobby_outcome(o, tx);
                        }
                    }
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    eprintln!("lockstep tcp rank {}: accept failed: {e}", self.rank);
                    break;
                }
            }
        }
    }

    /// Records one event of the dialer or a handshake thread; a failed dial ends the build.
    fn take_event(&self, progress: &mut Progress, ev: Event) -> Result<()> {
        match ev {
            Event::Dialed(peer, s, addr) => {
                progress.streams[peer] = Some((s, addr));
                progress.have += 1;
                progress.dialed += 1;
            }
            Event::DialFailed(e) => return Err(e),
            Event::Refused {
                from,
                reason,
                category,
            } => {
                let detail = format!("{from}: {reason}");
                self.emit(
                    progress
                        .log
                        .record(Instant::now(), &category, detail.clone()),
                );
                progress.last_refusal = Some(detail);
            }
            Event::Claim {
                stream,
                from,
                rank,
                world,
            } => match self.admit(stream, from, rank, world, &progress.streams) {
                Ok((peer, s)) => {
                    progress.streams[peer] = Some((s, from.to_string()));
                    progress.have += 1;
                }
                Err(reason) => {
                    // Authenticated peers that disagree: rare and worth a line each.
                    eprintln!(
                        "lockstep tcp rank {}: refused connection from {from}: {reason}",
                        self.rank
                    );
                    progress.last_refusal = Some(format!("{from}: {reason}"));
                }
            },
        }
        Ok(())
    }

    /// The error for a mesh not complete at the deadline: naming the peers without a link.
    fn timed_out(
        &self,
        progress: &Progress,
        rx: &mpsc::Receiver<Event>,
        now: Instant,
    ) -> CommError {
        // The dialer shares our deadline and, if it is what failed, says more precisely why (e.g.
        // which address never got published): prefer that.
        let grace = now + Duration::from_secs(1);
        let mut dialed = progress.dialed;
        while dialed < self.rank {
            match rx.recv_timeout(grace.saturating_duration_since(Instant::now())) {
                Ok(Event::DialFailed(e)) => return e,
                Ok(Event::Dialed(..)) => dialed += 1,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let missing: Vec<String> = (0..self.world)
            .filter(|&p| p != self.rank && progress.streams[p].is_none())
            .map(|p| p.to_string())
            .collect();
        let refusal = progress
            .last_refusal
            .as_ref()
            .map(|r| format!("; last refused connection: {r}"))
            .unwrap_or_default();
        CommError::Rendezvous(format!(
            "rank {}: timed out after {:.2}s building the TCP mesh of {} ranks; \
             no link yet to rank(s) [{}]{refusal}",
            self.rank,
            (now - self.started).as_secs_f64(),
            self.world,
            missing.join(", ")
        ))
    }

    /// Prints a refusal log line, if there is one.
    fn emit(&self, line: Option<String>) {
        if let Some(line) = line {
            eprintln!("lockstep tcp rank {}: {line}", self.rank);
        }
    }

    /// Connect to `peer` (a lower rank) and prove who we are.
    fn dial(
        &self,
        store: &mut StoreClient,
        prefix: &str,
        peer: usize,
        abort: &AtomicBool,
    ) -> Result<(TcpStream, String)> {
        let key = format!("{prefix}/{peer}");
        // Wait in slices so an aborted establishment does not linger until the deadline.
        let value = loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if abort.load(Ordering::SeqCst) {
                return Err(CommError::Rendezvous("aborted".into()));
            }
            match store.try_get(&key)? {
                Some(v) => break v,
                None if left.is_zero() => {
                    return Err(CommError::Rendezvous(format!(
                        "rank {}: timed out after {:.2}s waiting for rank {peer} to publish its address ('{key}' in store at {})",
                        self.rank,
                        self.started.elapsed().as_secs_f64(),
                        store.server_addr()
                    )))
                }
                None => {
                    let _ = store.get(&key, left.min(Duration::from_millis(500)));
                }
            }
        };
        let text = String::from_utf8_lossy(&value).into_owned();
        let addr: SocketAddr = text.parse().map_err(|_| {
            CommError::Rendezvous(format!(
                "rank {peer} published '{text}' under '{key}', which is not an ip:port"
            ))
        })?;
        let remote = format!("rank {peer} ({addr})");
        // Refused: a listener not yet up, or one refusing a flood from our address; closed or
        // reset: over its handshake budget. Retried with backoff until our deadline.
        let mut stream = wire::dial(
            addr,
            self.secret,
            &self.context,
            Service::Data,
            &remote,
            self.deadline,
            Some(abort),
        )
        .map_err(|e| match e {
            CommError::Rendezvous(m) if m != "aborted" => {
                CommError::Rendezvous(format!("rank {}: {m}", self.rank))
            }
            other => other,
        })?;
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        stream
            .set_read_timeout(Some(left))
            .and_then(|_| stream.set_write_timeout(Some(left)))
            .map_err(|e| CommError::setup(format!("configuring connection to {remote}"), e))?;
        let io = |e: std::io::Error| {
            CommError::Rendezvous(format!("{remote}: I/O error exchanging ranks: {e}"))
        };
        stream
            .write_all(&hello(self.rank as u32, self.world as u32))
            .map_err(io)?;
        let mut answer = [0u8; HELLO_LEN + 1];
        stream.read_exact(&mut answer).map_err(io)?;
        let (their_rank, their_world) = parse_hello(&answer[..HELLO_LEN])
            .map_err(|r| CommError::Rendezvous(format!("{remote}: {r}")))?;
        if their_rank as usize != peer || their_world as usize != self.world {
            return Err(CommError::Rendezvous(format!(
                "rank {}: dialed {remote} but it is rank {their_rank} of world {their_world} \
                 (expected rank {peer} of world {}; stale address in the store, or mismatched launch?)",
                self.rank, self.world
            )));
        }
        if answer[HELLO_LEN] != 0 {
            return Err(CommError::Rendezvous(format!(
                "{remote} rejected this process as rank {} of world {} (see that rank's log)",
                self.rank, self.world
            )));
        }
        Ok((stream, addr.to_string()))
    }

    /// A new connection: a place in the budgets and a thread for its handshake; over budget, the
    /// lobby if that budget is stale (always, by default; giving what the lobby dropped to make room), else closed
    /// here with nothing read (giving the refusal's category).
    fn admit_new(
        &self,
        s: TcpStream,
        from: SocketAddr,
        admission: &Admission,
        lobby: &mut Lobby,
        tx: &mpsc::Sender<Event>,
    ) -> std::result::Result<Vec<Outcome>, String> {
        let limits = lobby.limits();
        match admission.try_admit_at(from.ip(), Instant::now(), limits.after) {
            Ok(ticket) => {
                self.spawn_acceptor(s, from, Some(ticket), true, tx.clone());
                Ok(Vec::new())
            }
            Err(over) if over.stale && limits.total > 0 => {
                Ok(lobby.park(s, from, self.handshake_deadline()))
            }
            Err(over) => Err(over.category),
        }
    }

    /// What the lobby decided: a proven connection goes on to its identity message on a thread of
    /// its own (which reports as usual); a dropped one is reported as a refusal.
    fn lobby_outcome(&self, o: Outcome, tx: &mpsc::Sender<Event>) {
        match o {
            Outcome::Admitted(s, from) => self.spawn_acceptor(s, from, None, false, tx.clone()),
            Outcome::Refused {
                peer,
                category,
                detail,
            } => {
                let _ = tx.send(Event::Refused {
                    from: peer,
                    reason: detail,
                    category,
                });
            }
        }
    }

    /// When a handshake accepted now must be over: the standard deadline, but never past the
    /// mesh's own (and at least 100 ms).
    fn handshake_deadline(&self) -> Instant {
        Instant::now()
            + self
                .deadline
                .saturating_duration_since(Instant::now())
                .clamp(
                    Duration::from_millis(100),
                    AdmissionLimits::default().handshake_deadline,
                )
    }

    /// Authenticate an accepted connection (unless the lobby did already: `handshake` false) and
    /// read its claimed identity, on a separate thread, all under one deadline; `ticket` holds its
    /// place in the pending budgets until then.
    fn spawn_acceptor(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        ticket: Option<Pending>,
        handshake: bool,
        tx: mpsc::Sender<Event>,
    ) {
        let secret = self.secret.clone();
        let context = self.context.clone();
        let deadline = self.handshake_deadline();
        let spawned = std::thread::Builder::new()
            .name("lockstep-tcp-accept".into())
            .spawn(move || {
                let ev = (|| {
                    stream
                        .set_nonblocking(false)
                        .and_then(|_| stream.set_nodelay(true))
                        .map_err(|e| {
                            Rejected::new(
                                RefusalKind::Other,
                                format!("could not configure socket: {e}"),
                            )
                        })?;
                    let mut d = Deadlined {
                        stream: &stream,
                        deadline,
                    };
                    if handshake {
                        wire::accept_handshake(&mut d, &secret, &context, Service::Data)?;
                    }
                    let mut h = [0u8; HELLO_LEN];
                    d.read_exact(&mut h).map_err(|e| {
                        Rejected::new(
                            RefusalKind::of_io(&e),
                            format!("no rank/world after the handshake: {e}"),
                        )
                    })?;
                    let (rank, world) = parse_hello(&h)
                        .map_err(|reason| Rejected::new(RefusalKind::Other, reason))?;
                    Ok(Event::Claim {
                        stream,
                        from,
                        rank,
                        world,
                    })
                })();
                drop(ticket);
                let _ = tx.send(ev.unwrap_or_else(|why: Rejected| Event::Refused {
                    from,
                    reason: why.reason,
                    category: why.kind.label().to_string(),
                }));
            });
        if spawned.is_err() {
            eprintln!(
                "lockstep tcp rank {}: could not start a thread for connection from {from}",
                self.rank
            );
        }
    }

    /// Check an authenticated peer's claimed identity and answer it.
    fn admit(
        &self,
        mut stream: TcpStream,
        from: SocketAddr,
        rank: u32,
        world: u32,
        streams: &[Option<(TcpStream, String)>],
    ) -> std::result::Result<(usize, TcpStream), String> {
        let (r, w) = (rank as usize, world as usize);
        let problem = if w != self.world {
            Some(format!(
                "peer says world size {w} but this rank has {}",
                self.world
            ))
        } else if r <= self.rank || r >= self.world {
            Some(format!(
                "peer claims rank {r}, but rank {} accepts only ranks {}..{}",
                self.rank,
                self.rank + 1,
                self.world
            ))
        } else if streams[r].is_some() {
            Some(format!("rank {r} is already connected"))
        } else {
            None
        };
        let mut answer = [0u8; HELLO_LEN + 1];
        answer[..HELLO_LEN].copy_from_slice(&hello(self.rank as u32, self.world as u32));
        answer[HELLO_LEN] = problem.is_some() as u8;
        let sent = stream.write_all(&answer);
        if let Some(p) = problem {
            return Err(p);
        }
        sent.map_err(|e| format!("I/O error answering rank {r} at {from}: {e}"))?;
        Ok((r, stream))
    }
}

pub(crate) fn hello(rank: u32, world: u32) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..PREFIX_LEN].copy_from_slice(&wire::prefix());
    h[PREFIX_LEN..PREFIX_LEN + 4].copy_from_slice(&rank.to_le_bytes());
    h[PREFIX_LEN + 4..].copy_from_slice(&world.to_le_bytes());
    h
}

/// Decodes an identity message. Takes any slice: a short one is refused rather than panicking
/// (every caller passes a full array, but the fuzz harness feeds it anything).
pub(crate) fn parse_hello(h: &[u8]) -> std::result::Result<(u32, u32), String> {
    if h.len() != HELLO_LEN {
        return Err(format!(
            "identity message of {} bytes, expected {HELLO_LEN}",
            h.len()
        ));
    }
    let pre: [u8; PREFIX_LEN] = h[..PREFIX_LEN].try_into().unwrap();
    wire::check_prefix(&pre).map_err(|r| r.reason)?;
    let rank = u32::from_le_bytes(h[PREFIX_LEN..PREFIX_LEN + 4].try_into().unwrap());
    let world = u32::from_le_bytes(h[PREFIX_LEN + 4..PREFIX_LEN + 8].try_into().unwrap());
    Ok((rank, world))
}

/// Fuzz harness for the identity message (see `fuzz_util`): any slice, no panic; only a message
/// with the right prefix and length decodes; valid ones round-trip.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::fuzz_util::{config, mutated};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn fuzz_mesh_hello(input in prop::collection::vec(any::<u8>(), 0..32)) {
            if let Ok((r, w)) = parse_hello(&input) {
                prop_assert_eq!(&hello(r, w)[..], &input[..]);
            }
        }

        #[test]
        fn fuzz_mesh_hello_mutated(input in (any::<u32>(), any::<u32>()).prop_flat_map(|(r, w)| mutated(hello(r, w).to_vec()))) {
            if let Ok((r, w)) = parse_hello(&input) {
                prop_assert_eq!(&hello(r, w)[..], &input[..]);
            }
        }

        #[test]
        fn mesh_hello_round_trips(r in any::<u32>(), w in any::<u32>()) {
            prop_assert_eq!(parse_hello(&hello(r, w)).unwrap(), (r, w));
        }
    }

    /// Regression: short slices used to index out of bounds (every caller passed a full array).
    #[test]
    fn short_identity_messages_are_refused() {
        for n in 0..HELLO_LEN {
            assert!(parse_hello(&hello(1, 2)[..n]).is_err());
        }
    }
}
