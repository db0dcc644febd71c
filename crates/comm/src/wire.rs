//! Bytes on the wire shared by the rendezvous store ([`crate::store`]) and the TCP transport
//! ([`crate::tcp`]): the magic, the protocol version and the authenticated connection handshake.
//!
//! Every message of both protocols starts with `MAGIC` and `PROTOCOL_VERSION`, so a stranger (an
//! HTTP probe, a port scanner, an older lockstep build) is recognised from its first six bytes and
//! refused before anything is allocated on its behalf.
//!
//! Handshake (the HMAC challenge-response of [`crate::auth`], mutual):
//!
//! | dir | message  | bytes                                                             |
//! |-----|----------|-------------------------------------------------------------------|
//! | A→C | hello    | `MAGIC` · version u16 · service u8 · `nonce_a` (32)                |
//! | C→A | proof    | `MAGIC` · version u16 · service u8 · `nonce_c` (32) · MAC (32)     |
//! | A→C | verdict  | `MAGIC` · version u16 · status u8 · acceptor MAC (32, zero if refused) |
//!
//! (A = acceptor, C = connector; integers little-endian.) The `service` byte says which of the two
//! protocols the port speaks, so pointing a store client at a data port gives a clear error rather
//! than "wrong secret". MACs bind the job id and the service through `context`.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::admission::Deadlined;

use crate::auth::{acceptor_proof, connector_proof, random_nonce, JobSecret, MAC_LEN, NONCE_LEN};
use crate::error::CommError;

/// First bytes of every lockstep message ("LKST").
pub const MAGIC: [u8; 4] = *b"LKST";
/// Bumped whenever a message layout changes; peers must agree exactly.
pub const PROTOCOL_VERSION: u16 = 1;

/// `MAGIC` + version.
pub const PREFIX_LEN: usize = 6;
const HELLO_LEN: usize = PREFIX_LEN + 1 + NONCE_LEN;
/// Bytes of the connector's proof, which the acceptor reads after its hello.
pub(crate) const PROOF_LEN: usize = PREFIX_LEN + 1 + NONCE_LEN + MAC_LEN;
const VERDICT_LEN: usize = PREFIX_LEN + 1 + MAC_LEN;

const VERDICT_OK: u8 = 0;
const VERDICT_BAD_AUTH: u8 = 1;
const VERDICT_BAD_VERSION: u8 = 2;
const VERDICT_WRONG_SERVICE: u8 = 3;

/// Which protocol a port speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Store = 1,
    Data = 2,
}

impl Service {
    fn describe(code: u8) -> String {
        match code {
            1 => "a lockstep rendezvous store".into(),
            2 => "a lockstep TCP data port".into(),
            other => format!("an unknown lockstep service ({other})"),
        }
    }
}

/// Why a handshake was refused, decided where the failure happens (never read back out of its
/// words): the refusal log counts refusals by this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// The proof's MAC did not verify: a wrong secret or job id.
    BadMac,
    /// The handshake's deadline passed before it completed.
    DeadlinePassed,
    /// The first bytes were not lockstep's magic (an HTTP probe, a port scanner).
    NotLockstep,
    /// A lockstep peer of another protocol version.
    OtherVersion,
    /// A lockstep peer that wanted the other service (a store client at a data port).
    WrongService,
    /// The remote closed or reset the connection mid-handshake.
    Closed,
    /// Anything else (an I/O error, a socket that could not be configured).
    Other,
}

impl RefusalKind {
    /// The category in the aggregated refusal log line.
    pub fn label(self) -> &'static str {
        match self {
            RefusalKind::BadMac => "bad MAC",
            RefusalKind::DeadlinePassed => "handshake deadline passed",
            RefusalKind::NotLockstep => "not a lockstep peer",
            RefusalKind::OtherVersion => "other protocol version",
            RefusalKind::WrongService => "wrong service",
            RefusalKind::Closed => "closed during handshake",
            RefusalKind::Other => "other errors",
        }
    }

    /// The kind of an I/O failure, by its `ErrorKind`.
    pub(crate) fn of_io(e: &std::io::Error) -> RefusalKind {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => RefusalKind::DeadlinePassed,
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => RefusalKind::Closed,
            _ => RefusalKind::Other,
        }
    }
}

/// A refused (or failed) handshake or malformed prefix: its kind and the reason in words a user
/// can act on (no secret material).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub kind: RefusalKind,
    pub reason: String,
}

impl Rejected {
    pub fn new(kind: RefusalKind, reason: impl Into<String>) -> Rejected {
        Rejected {
            kind,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// `MAGIC` followed by the version, as every message begins.
pub fn prefix() -> [u8; PREFIX_LEN] {
    let mut p = [0u8; PREFIX_LEN];
    p[..4].copy_from_slice(&MAGIC);
    p[4..].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    p
}

/// Checks a received `MAGIC` + version prefix; the error says what was wrong in words a user can
/// act on (and never echoes more than the four magic bytes).
pub fn check_prefix(p: &[u8; PREFIX_LEN]) -> Result<(), Rejected> {
    if p[..4] != MAGIC {
        return Err(Rejected::new(
            RefusalKind::NotLockstep,
            format!(
                "bad magic {:#010x} (not a lockstep peer?)",
                u32::from_be_bytes([p[0], p[1], p[2], p[3]])
            ),
        ));
    }
    let version = u16::from_le_bytes([p[4], p[5]]);
    if version != PROTOCOL_VERSION {
        return Err(Rejected::new(
            RefusalKind::OtherVersion,
            format!("protocol version {version} but this build speaks {PROTOCOL_VERSION}"),
        ));
    }
    Ok(())
}

/// The acceptor's side. On `Err` the connection must be dropped; the reason names what the remote
/// got wrong and contains no secret material.
pub fn accept_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &JobSecret,
    context: &[u8],
    service: Service,
) -> Result<(), Rejected> {
    let nonce_a = random_nonce();
    stream
        .write_all(&hello_message(service, &nonce_a))
        .map_err(|e| io_reason("sending hello", &e))?;

    // Read the prefix on its own first, so garbage is refused after six bytes instead of
    // waiting for a full proof that will never come.
    let mut proof = [0u8; PROOF_LEN];
    stream
        .read_exact(&mut proof[..PREFIX_LEN])
        .map_err(|e| io_reason("reading proof", &e))?;
    let pre: [u8; PREFIX_LEN] = proof[..PREFIX_LEN].try_into().unwrap();
    judge_proof_prefix(&pre).map_err(|r| r.answer(stream))?;
    stream
        .read_exact(&mut proof[PREFIX_LEN..])
        .map_err(|e| io_reason("reading proof", &e))?;
    let verdict =
        judge_proof(&proof, &nonce_a, secret, context, service).map_err(|r| r.answer(stream))?;
    stream
        .write_all(&verdict)
        .map_err(|e| io_reason("sending verdict", &e))
}

/// The acceptor's first message: prefix, `service`, `nonce_a`.
pub(crate) fn hello_message(service: Service, nonce_a: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut hello = [0u8; HELLO_LEN];
    hello[..PREFIX_LEN].copy_from_slice(&prefix());
    hello[PREFIX_LEN] = service as u8;
    hello[PREFIX_LEN + 1..].copy_from_slice(nonce_a);
    hello
}

/// Why the acceptor refuses a proof (for its log) and the verdict to send back first, where the
/// remote deserves one (a lockstep peer of another version or service, a wrong MAC).
#[derive(Debug)]
pub(crate) struct Refusal {
    pub why: Rejected,
    pub verdict: Option<[u8; VERDICT_LEN]>,
}

impl Refusal {
    /// Sends the verdict, if any (best effort: the connection is dropped next), and gives the
    /// reason.
    pub fn answer<S: Write>(self, stream: &mut S) -> Rejected {
        if let Some(v) = self.verdict {
            let _ = stream.write_all(&v);
        }
        self.why
    }
}

fn verdict_message(status: u8, mac: &[u8; MAC_LEN]) -> [u8; VERDICT_LEN] {
    let mut v = [0u8; VERDICT_LEN];
    v[..PREFIX_LEN].copy_from_slice(&prefix());
    v[PREFIX_LEN] = status;
    v[PREFIX_LEN + 1..].copy_from_slice(mac);
    v
}

/// Judges the first `PREFIX_LEN` bytes of a proof, so that garbage is refused before the rest.
pub(crate) fn judge_proof_prefix(pre: &[u8; PREFIX_LEN]) -> Result<(), Refusal> {
    check_prefix(pre).map_err(|why| Refusal {
        why,
        // A lockstep peer of another version is told why before the hang-up.
        verdict: (pre[..4] == MAGIC).then(|| verdict_message(VERDICT_BAD_VERSION, &[0; MAC_LEN])),
    })
}

/// Judges a whole proof (its prefix already passed) against our `nonce_a`; on success, the verdict
/// to send, carrying the acceptor's own proof.
pub(crate) fn judge_proof(
    proof: &[u8; PROOF_LEN],
    nonce_a: &[u8; NONCE_LEN],
    secret: &JobSecret,
    context: &[u8],
    service: Service,
) -> Result<[u8; VERDICT_LEN], Refusal> {
    if proof[PREFIX_LEN] != service as u8 {
        return Err(Refusal {
            why: Rejected::new(
                RefusalKind::WrongService,
                format!(
                    "peer expected {} but this is {}",
                    Service::describe(proof[PREFIX_LEN]),
                    Service::describe(service as u8)
                ),
            ),
            verdict: Some(verdict_message(VERDICT_WRONG_SERVICE, &[0; MAC_LEN])),
        });
    }
    let nonce_c = &proof[PREFIX_LEN + 1..PREFIX_LEN + 1 + NONCE_LEN];
    let mac = &proof[PREFIX_LEN + 1 + NONCE_LEN..];
    if !secret.verify(&[b"lockstep-auth-v1|c|", context, nonce_a, nonce_c], mac) {
        return Err(Refusal {
            why: Rejected::new(
                RefusalKind::BadMac,
                "authentication failed (wrong secret or job id)",
            ),
            verdict: Some(verdict_message(VERDICT_BAD_AUTH, &[0; MAC_LEN])),
        });
    }
    let answer = acceptor_proof(secret, context, nonce_a, nonce_c);
    Ok(verdict_message(VERDICT_OK, &answer))
}

pub(crate) fn io_reason(what: &str, e: &std::io::Error) -> Rejected {
    let reason = match e.kind() {
        ErrorKind::UnexpectedEof => format!("connection closed while {what}"),
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!("timed out while {what}"),
        _ => format!("I/O error while {what}: {e}"),
    };
    Rejected::new(RefusalKind::of_io(e), reason)
}

/// Why the connector's side of a handshake failed.
#[derive(Debug)]
pub enum ConnectFailure {
    /// The connection broke or stalled before a verdict (an acceptor over its budget closes new
    /// connections at once): worth another attempt while the caller's deadline allows.
    Transient(CommError),
    /// The acceptor answered and the answer is final (wrong secret, version, service, impostor).
    Final(CommError),
}

/// The connector's side. `remote` describes the other end for messages, e.g.
/// "store at 127.0.0.1:29500" or "rank 2 (10.0.0.3:40312)". The failure says whether it is worth
/// retrying.
pub fn connect_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &JobSecret,
    context: &[u8],
    service: Service,
    remote: &str,
) -> Result<(), ConnectFailure> {
    let io = |what: &str, e: std::io::Error| {
        ConnectFailure::Transient(CommError::Rendezvous(format!(
            "{remote}: {}",
            io_reason(what, &e)
        )))
    };
    let fin = |e: CommError| ConnectFailure::Final(e);
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| io("reading hello", e))?;
    let pre: [u8; PREFIX_LEN] = hello[..PREFIX_LEN].try_into().unwrap();
    check_prefix(&pre).map_err(|r| fin(CommError::Rendezvous(format!("{remote}: {r}"))))?;
    if hello[PREFIX_LEN] != service as u8 {
        return Err(fin(CommError::Rendezvous(format!(
            "{remote} is {}, not {}",
            Service::describe(hello[PREFIX_LEN]),
            Service::describe(service as u8)
        ))));
    }
    let nonce_a = &hello[PREFIX_LEN + 1..];
    let nonce_c = random_nonce();
    let mut proof = [0u8; PROOF_LEN];
    proof[..PREFIX_LEN].copy_from_slice(&prefix());
    proof[PREFIX_LEN] = service as u8;
    proof[PREFIX_LEN + 1..PREFIX_LEN + 1 + NONCE_LEN].copy_from_slice(&nonce_c);
    proof[PREFIX_LEN + 1 + NONCE_LEN..]
        .copy_from_slice(&connector_proof(secret, context, nonce_a, &nonce_c));
    stream
        .write_all(&proof)
        .map_err(|e| io("sending proof", e))?;

    let mut verdict = [0u8; VERDICT_LEN];
    stream
        .read_exact(&mut verdict)
        .map_err(|e| io("reading verdict", e))?;
    let pre: [u8; PREFIX_LEN] = verdict[..PREFIX_LEN].try_into().unwrap();
    check_prefix(&pre).map_err(|r| fin(CommError::Rendezvous(format!("{remote}: {r}"))))?;
    match verdict[PREFIX_LEN] {
        VERDICT_OK => {}
        VERDICT_BAD_AUTH => {
            return Err(fin(CommError::Auth(format!(
                "{remote} refused authentication: wrong secret or job id"
            ))))
        }
        VERDICT_BAD_VERSION => {
            return Err(fin(CommError::Rendezvous(format!(
                "{remote} refused this build's protocol version {PROTOCOL_VERSION}"
            ))))
        }
        VERDICT_WRONG_SERVICE => {
            return Err(fin(CommError::Rendezvous(format!(
                "{remote} is not {}",
                Service::describe(service as u8)
            ))))
        }
        other => {
            return Err(fin(CommError::Rendezvous(format!(
                "{remote} answered the handshake with unknown status {other}"
            ))))
        }
    }
    // Constant-time comparison; the same bytes as `acceptor_proof(secret, context, nonce_a, nonce_c)`.
    if !secret.verify(
        &[b"lockstep-auth-v1|a|", context, &nonce_c, nonce_a],
        &verdict[PREFIX_LEN + 1..],
    ) {
        return Err(fin(CommError::Auth(format!(
            "{remote} failed to prove it knows the job secret (another job's service, or an impostor)"
        ))));
    }
    Ok(())
}

/// First pause between connection attempts; doubled after each failure up to [`BACKOFF_CAP`].
pub const BACKOFF_START: Duration = Duration::from_millis(10);
/// Longest pause between connection attempts.
pub const BACKOFF_CAP: Duration = Duration::from_secs(1);
/// How long the first attempt waits for the TCP connection itself; doubled after each attempt
/// that ran out of it. Why not the whole deadline: a SYN that a listener's full queue dropped is
/// retransmitted by the kernel only after 1 s, then 3 s and 7 s in all, while a fresh attempt
/// sends a fresh SYN at once; a far server whose round trip is longer gets its longer wait after
/// a few attempts.
pub const CONNECT_ATTEMPT_START: Duration = Duration::from_millis(250);

/// Connect to `addr` and pass the handshake, retrying refused, reset, closed or stalled attempts
/// with capped exponential backoff (jittered, so clients refused together do not return together)
/// until `deadline`. A final answer (wrong secret, version or service) is not retried. The error
/// names `remote`, how long we tried, how many attempts and the last reason.
pub fn dial(
    addr: SocketAddr,
    secret: &JobSecret,
    context: &[u8],
    service: Service,
    remote: &str,
    deadline: Instant,
    abort: Option<&AtomicBool>,
) -> Result<TcpStream, CommError> {
    let started = Instant::now();
    let mut backoff = BACKOFF_START;
    let mut connect_wait = CONNECT_ATTEMPT_START;
    let mut attempts = 0u32;
    let last = loop {
        attempts += 1;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let reason = match TcpStream::connect_timeout(&addr, left.min(connect_wait)) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let mut d = Deadlined {
                    stream: &s,
                    deadline: deadline.max(Instant::now() + Duration::from_millis(100)),
                };
                match connect_handshake(&mut d, secret, context, service, remote) {
                    Ok(()) => {
                        // The caller sets its own timeouts; clear the handshake's leftovers.
                        let _ = s.set_read_timeout(None).and(s.set_write_timeout(None));
                        return Ok(s);
                    }
                    Err(ConnectFailure::Final(e)) => return Err(e),
                    Err(ConnectFailure::Transient(e)) => e.to_string(),
                }
            }
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                connect_wait *= 2;
                e.to_string()
            }
            Err(e) if retryable_connect(&e) => e.to_string(),
            Err(e) => break e.to_string(),
        };
        // Jitter in [backoff/2, backoff): cheap randomness from the clock is enough here.
        let nanos = Instant::now().duration_since(started).subsec_nanos() as u64;
        let half = backoff.as_nanos() as u64 / 2;
        let pause = Duration::from_nanos(half + nanos % half.max(1));
        if abort.is_some_and(|a| a.load(Ordering::SeqCst)) {
            return Err(CommError::Rendezvous("aborted".into()));
        }
        if Instant::now() + pause >= deadline {
            break reason;
        }
        std::thread::sleep(pause);
        backoff = (backoff * 2).min(BACKOFF_CAP);
    };
    Err(CommError::Rendezvous(format!(
        "could not reach {remote}: gave up after {:.1}s and {attempts} attempt{}; last: {last}",
        started.elapsed().as_secs_f64(),
        if attempts == 1 { "" } else { "s" }
    )))
}

fn retryable_connect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::TimedOut
            | ErrorKind::WouldBlock
            | ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_checks_name_the_problem() {
        assert!(check_prefix(&prefix()).is_ok());
        let e = check_prefix(b"GET / ").unwrap_err();
        assert_eq!(e.reason, "bad magic 0x47455420 (not a lockstep peer?)");
        assert_eq!(e.kind, RefusalKind::NotLockstep);
        let mut old = prefix();
        old[4..].copy_from_slice(&0u16.to_le_bytes());
        let e = check_prefix(&old).unwrap_err();
        assert_eq!(e.reason, "protocol version 0 but this build speaks 1");
        assert_eq!(e.kind, RefusalKind::OtherVersion);
    }
}

/// Fuzz harnesses for both sides of the handshake (see `fuzz_util`). Properties: no panic on any
/// input, garbage is refused with an error, nothing longer than one protocol message is written
/// back, and a real pair of peers still agrees.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::fuzz_util::{config, mutated, Scripted};
    use proptest::prelude::*;
    use std::os::unix::net::UnixStream;

    fn secret() -> JobSecret {
        JobSecret::from_hex(&"ab".repeat(32)).unwrap()
    }

    /// A hello and a verdict as an acceptor would send them (the verdict's MAC is wrong, as any
    /// attacker's would be).
    fn acceptor_script() -> Vec<u8> {
        let mut v = prefix().to_vec();
        v.push(Service::Store as u8);
        v.extend_from_slice(&[7u8; NONCE_LEN]);
        v.extend_from_slice(&prefix());
        v.push(VERDICT_OK);
        v.extend_from_slice(&[9u8; MAC_LEN]);
        v
    }

    fn connector_script() -> Vec<u8> {
        let mut v = prefix().to_vec();
        v.push(Service::Store as u8);
        v.extend_from_slice(&[7u8; NONCE_LEN]);
        v.extend_from_slice(&[9u8; MAC_LEN]);
        v
    }

    fn check_accept(input: Vec<u8>) {
        let mut s = Scripted::new(input);
        let r = accept_handshake(&mut s, &secret(), b"store|job", Service::Store);
        // Nobody without the secret and our fresh nonce can produce a valid proof.
        assert!(r.is_err());
        assert!(s.output.len() <= HELLO_LEN + VERDICT_LEN);
    }

    fn check_connect(input: Vec<u8>) {
        let mut s = Scripted::new(input);
        let r = connect_handshake(&mut s, &secret(), b"store|job", Service::Store, "store");
        assert!(r.is_err());
        assert!(s.output.len() <= PROOF_LEN);
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn fuzz_accept_handshake_random(input in prop::collection::vec(any::<u8>(), 0..200)) {
            check_accept(input);
        }

        #[test]
        fn fuzz_accept_handshake_mutated(input in mutated(connector_script())) {
            check_accept(input);
        }

        #[test]
        fn fuzz_connect_handshake_random(input in prop::collection::vec(any::<u8>(), 0..200)) {
            check_connect(input);
        }

        #[test]
        fn fuzz_connect_handshake_mutated(input in mutated(acceptor_script())) {
            check_connect(input);
        }

        #[test]
        fn fuzz_prefix(p in any::<[u8; PREFIX_LEN]>()) {
            let ok = check_prefix(&p).is_ok();
            prop_assert_eq!(ok, p == prefix());
        }
    }

    proptest! {
        #![proptest_config(config(32))]

        /// Valid peers over a real socket pair agree; different secrets or contexts never do.
        #[test]
        fn handshake_round_trips(same_secret in any::<bool>(), ctx in "[a-z]{0,12}") {
            let (mut a, mut c) = UnixStream::pair().unwrap();
            let other = if same_secret { secret() } else { JobSecret::from_hex(&"cd".repeat(32)).unwrap() };
            let ctx2 = ctx.clone();
            let t = std::thread::spawn(move || accept_handshake(&mut a, &secret(), ctx2.as_bytes(), Service::Data));
            let r = connect_handshake(&mut c, &other, ctx.as_bytes(), Service::Data, "peer");
            let acc = t.join().unwrap();
            prop_assert_eq!(r.is_ok(), same_secret);
            prop_assert_eq!(acc.is_ok(), same_secret);
            if !same_secret {
                prop_assert!(matches!(r, Err(ConnectFailure::Final(CommError::Auth(_)))));
            }
        }
    }

    /// A connection closed before the hello is worth retrying (an acceptor over its budget does
    /// exactly that); a wrong service is not.
    #[test]
    fn closed_before_hello_is_transient_wrong_service_is_final() {
        let mut s = Scripted::new(Vec::new());
        let r = connect_handshake(&mut s, &secret(), b"c", Service::Store, "store");
        assert!(matches!(r, Err(ConnectFailure::Transient(_))));
        let mut hello = acceptor_script();
        hello[PREFIX_LEN] = Service::Data as u8;
        let mut s = Scripted::new(hello);
        let r = connect_handshake(&mut s, &secret(), b"c", Service::Store, "store");
        assert!(matches!(r, Err(ConnectFailure::Final(_))));
    }
}
