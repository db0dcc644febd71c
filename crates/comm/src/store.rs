//! The authenticated rendezvous store: a small key-value service through which ranks publish
//! their addresses and agree on a job. Served by the launcher, or by rank 0 when an external
//! launcher (Slurm, mpirun, torchrun) started the workers.
//!
//! Security model: every connection must pass the mutual HMAC handshake of `wire` with
//! context `"store|" ‖ job_id`, so only processes holding this job's secret can read or write, and
//! clients know they talk to their own job's store. Anything else (a stranger, garbage, a wrong
//! secret or job id, another protocol version) is refused: the connection is closed, counted in
//! [`StoreServer::refused_connections`] and logged in aggregate (at most one line per
//! [`StoreOptions::refusal_log_interval`], counts by reason, never the secret or a MAC).
//!
//! Limits (see `docs/src/security.md`): a connection that has not authenticated is *pending*; pending
//! connections are limited per source IP and in total ([`AdmissionLimits`]), and one over budget
//! waits in the lobby without a thread ([`LobbyLimits`]; why: `admission.rs`), or, with the lobby
//! off or its trigger not reached, is closed on the accept thread without reading a byte. An
//! admitted one has one deadline for its whole handshake, so trickling bytes does not keep it
//! alive. Authenticated connections have their own cap ([`StoreOptions::max_authenticated`]).
//! Clients retry refused or broken attempts with capped exponential backoff until their own
//! deadline (`wire::dial`).
//!
//! Requests after the handshake (integers little-endian):
//! `MAGIC` · version u16 · op u8 · key_len u32 · value_len u32 · key · value
//! answered by `MAGIC` · version u16 · status u8 · len u32 · payload.
//! Keys are at most [`MAX_KEY_BYTES`] and values at most [`MAX_VALUE_BYTES`], checked before
//! allocating, so garbage lengths cannot make the server allocate gigabytes.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::admission::{Admission, AdmissionLimits, Deadlined, LobbyLimits, Pending, RefusalLog};
use crate::auth::JobSecret;
use crate::error::{CommError, Result};
use crate::lobby::{Lobby, Outcome};
use crate::wire::{self, RefusalKind, Service, PREFIX_LEN};

/// Longest key the store accepts.
pub const MAX_KEY_BYTES: usize = 4 << 10;
/// Largest value the store accepts.
pub const MAX_VALUE_BYTES: usize = 16 << 20;

/// Limits of a [`StoreServer`]; `Default` is what the launcher uses.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Budgets and deadline for connections that have not authenticated yet.
    pub admission: AdmissionLimits,
    /// Authenticated connections beyond this are refused, so even key holders cannot exhaust
    /// threads.
    pub max_authenticated: usize,
    /// At most one refusal log line per this interval.
    pub refusal_log_interval: Duration,
    /// Where connections over a pending budget wait without a thread.
    pub lobby: LobbyLimits,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            admission: AdmissionLimits::default(),
            max_authenticated: 1024,
            refusal_log_interval: Duration::from_secs(5),
            lobby: LobbyLimits::default(),
        }
    }
}
/// How long a client waits for an answer beyond the time the request itself may take.
const ANSWER_GRACE: Duration = Duration::from_secs(30);
/// Longest wait a `get` may ask the server for (keeps `Instant` arithmetic finite).
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_TRY_GET: u8 = 3;
const OP_ADD: u8 = 4;

const ST_OK: u8 = 0;
const ST_VALUE: u8 = 1;
const ST_MISSING: u8 = 2;
const ST_ERROR: u8 = 3;

/// Connections accepted between two looks at the lobby, so that a flood of new ones cannot delay
/// the proofs already waiting there.
const ACCEPT_BATCH: usize = 64;

const REQUEST_HEADER_LEN: usize = PREFIX_LEN + 1 + 4 + 4;
const ANSWER_HEADER_LEN: usize = PREFIX_LEN + 1 + 4;

fn store_context(job_id: &str) -> Vec<u8> {
    [b"store|".as_slice(), job_id.as_bytes()].concat()
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

struct Shared {
    local: SocketAddr,
    secret: JobSecret,
    context: Vec<u8>,
    data: Mutex<HashMap<String, Vec<u8>>>,
    /// Signalled on every write and on shutdown; `get` waits on it.
    changed: Condvar,
    stop: AtomicBool,
    refused: AtomicU64,
    /// Clones of live connections, so shutdown can close them and wake their threads.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Budgets of connections still in their handshake.
    admission: Admission,
    /// Authenticated connections alive (counted apart from pending ones).
    authenticated: AtomicUsize,
    options: StoreOptions,
    log: Mutex<RefusalLog>,
    log_lines: AtomicU64,
    /// Connections waiting in the lobby (kept by the accept thread, counted here for tests).
    lobby_len: AtomicUsize,
}

/// Decrements `Shared::authenticated` when an authenticated connection ends, however it ends.
struct AuthGuard(Arc<Shared>);

impl Drop for AuthGuard {
    fn drop(&mut self) {
        self.0.authenticated.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    /// Count a refusal; `category` is what the aggregated log line counts, `detail` the example.
    fn refuse(&self, peer: SocketAddr, category: &str, detail: &str) {
        self.refused.fetch_add(1, Ordering::SeqCst);
        let line = lock(&self.log).record(Instant::now(), category, format!("{peer}: {detail}"));
        self.emit(line);
    }

    fn emit(&self, line: Option<String>) {
        if let Some(line) = line {
            self.log_lines.fetch_add(1, Ordering::SeqCst);
            eprintln!("lockstep store {}: {line}", self.local);
        }
    }
}

/// The store's server; serves on background threads until dropped or [`StoreServer::shutdown`].
pub struct StoreServer {
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Bind `addr` (port 0 picks an ephemeral port) and start serving with default limits.
    pub fn bind(addr: SocketAddr, secret: &JobSecret, job_id: &str) -> Result<StoreServer> {
        Self::bind_with(addr, secret, job_id, StoreOptions::default())
    }

    /// [`StoreServer::bind`] with explicit limits.
    pub fn bind_with(
        addr: SocketAddr,
        secret: &JobSecret,
        job_id: &str,
        options: StoreOptions,
    ) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| CommError::setup(format!("binding rendezvous store on {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| CommError::setup("reading the store's bound address", e))?;
        // Nonblocking + poll, so the accept loop notices shutdown without a wake-up connection.
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::setup("configuring the store's listener", e))?;
        let shared = Arc::new(Shared {
            local,
            secret: secret.clone(),
            context: store_context(job_id),
            data: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            admission: Admission::new(options.admission),
            authenticated: AtomicUsize::new(0),
            options,
            log: Mutex::new(RefusalLog::new(options.refusal_log_interval)),
            log_lines: AtomicU64::new(0),
            lobby_len: AtomicUsize::new(0),
        });
        let lobby = Lobby::new(options.lobby, secret, &shared.context, Service::Store);
        let s = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name("lockstep-store-accept".into())
            .spawn(move || accept_loop(listener, lobby, s))
            .map_err(|e| CommError::setup("starting the store's accept thread", e))?;
        Ok(StoreServer {
            shared,
            accept_thread: Some(accept_thread),
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }

    /// How many connections were refused (failed handshake, malformed request, overload).
    pub fn refused_connections(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// How many aggregated refusal lines were logged (at most one per log interval).
    pub fn refusal_log_lines(&self) -> u64 {
        self.shared.log_lines.load(Ordering::SeqCst)
    }

    /// Refusals since the start by reason (the categories of the aggregated log lines).
    pub fn refusals_by_reason(&self) -> std::collections::BTreeMap<String, u64> {
        lock(&self.shared.log).cumulative().clone()
    }

    /// Connections in their handshake now, on threads of their own (not counting the lobby).
    pub fn pending_handshakes(&self) -> usize {
        self.shared.admission.pending()
    }

    /// Connections waiting in the lobby now.
    pub fn lobby_handshakes(&self) -> usize {
        self.shared.lobby_len.load(Ordering::SeqCst)
    }

    /// Authenticated connections open now.
    pub fn authenticated_connections(&self) -> usize {
        self.shared.authenticated.load(Ordering::SeqCst)
    }

    /// Stop accepting, close every connection and wake waiting requests. Idempotent.
    pub fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _guard = lock(&self.shared.data);
            self.shared.changed.notify_all();
        }
        for conn in lock(&self.shared.conns).values() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
            let line = lock(&self.shared.log).flush(Instant::now());
            self.shared.emit(line);
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(listener: TcpListener, mut lobby: Lobby, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        // Proofs already waiting in the lobby are judged before anything new is accepted.
        for outcome in lobby.wait(listener.as_raw_fd(), Duration::from_millis(100)) {
            settle(outcome, &shared);
        }
        let line = lock(&shared.log).tick(Instant::now());
        shared.emit(line);
        // A newcomer held for a lobby place stops accepting (the flood's pace, see `lobby.rs`).
        for _ in 0..ACCEPT_BATCH {
            if !lobby.accepting() {
                break;
            }
            match listener.accept() {
                Ok((stream, peer)) => admit(stream, peer, &mut lobby, &shared),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Transient (EMFILE, ECONNABORTED, …): report, back off, keep serving.
                    eprintln!("lockstep store {}: accept failed: {e}", shared.local);
                    std::thread::sleep(Duration::from_millis(50));
                    break;
                }
            }
        }
        shared.lobby_len.store(lobby.len(), Ordering::SeqCst);
    }
}

/// A new connection: a place in the budgets and a thread for its handshake; over budget, the
/// lobby if that budget is stale (always, by default), else closed here, on the accept thread,
/// with nothing read.
fn admit(stream: TcpStream, peer: SocketAddr, lobby: &mut Lobby, shared: &Arc<Shared>) {
    let limits = lobby.limits();
    let now = Instant::now();
    match shared.admission.try_admit_at(peer.ip(), now, limits.after) {
        Ok(ticket) => {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name("lockstep-store-conn".into())
                .spawn(move || serve_connection(stream, peer, ticket, s));
            if spawned.is_err() {
                // The closure (and with it the ticket) was dropped, giving back the place.
                shared.refuse(peer, "no thread", "could not start a thread for it");
            }
        }
        Err(over) if over.stale && limits.total > 0 => {
            let until = now + shared.options.admission.handshake_deadline;
            for outcome in lobby.park(stream, peer, until) {
                settle(outcome, shared);
            }
        }
        Err(over) => {
            drop(stream);
            shared.refuse(peer, &over.category, &over.category);
        }
    }
}

/// What the lobby decided about a waiting connection.
fn settle(outcome: Outcome, shared: &Arc<Shared>) {
    match outcome {
        Outcome::Admitted(stream, peer) => {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name("lockstep-store-conn".into())
                .spawn(move || serve_authenticated(stream, peer, s));
            if spawned.is_err() {
                shared.refuse(peer, "no thread", "could not start a thread for it");
            }
        }
        Outcome::Refused {
            peer,
            category,
            detail,
        } => shared.refuse(peer, &category, &detail),
    }
}

/// Why a connection ends.
enum End {
    /// The client hung up between requests.
    Normal,
    /// The client broke the protocol; refuse (count and log).
    Refuse(String),
}

fn serve_connection(stream: TcpStream, peer: SocketAddr, ticket: Pending, shared: Arc<Shared>) {
    // One deadline for the whole handshake, however slowly its bytes arrive.
    let deadline = Instant::now() + shared.options.admission.handshake_deadline;
    let setup = stream
        .set_nonblocking(false)
        .and_then(|_| stream.set_nodelay(true));
    if let Err(e) = setup {
        shared.refuse(
            peer,
            RefusalKind::Other.label(),
            &format!("could not configure socket: {e}"),
        );
        return;
    }
    let mut d = Deadlined {
        stream: &stream,
        deadline,
    };
    if let Err(why) =
        wire::accept_handshake(&mut d, &shared.secret, &shared.context, Service::Store)
    {
        shared.refuse(peer, why.kind.label(), &why.reason);
        return;
    }
    drop(ticket);
    serve_authenticated(stream, peer, shared);
}

/// Serves the requests of a connection that passed the handshake, within the authenticated cap.
fn serve_authenticated(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    if shared.authenticated.fetch_add(1, Ordering::SeqCst) >= shared.options.max_authenticated {
        shared.authenticated.fetch_sub(1, Ordering::SeqCst);
        shared.refuse(
            peer,
            "authenticated connection cap reached",
            "authenticated connection cap reached",
        );
        return;
    }
    let _auth = AuthGuard(shared.clone());
    let shared = &*shared;
    let mut stream = stream;
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    match stream.try_clone() {
        Ok(clone) => {
            lock(&shared.conns).insert(id, clone);
        }
        Err(e) => {
            let detail = format!("could not register connection: {e}");
            shared.refuse(peer, "other errors", &detail);
            return;
        }
    }
    // Registered before this check, so a concurrent shutdown either sees us or we see it.
    if !shared.stop.load(Ordering::SeqCst) {
        // Authenticated clients may stay idle between requests for as long as they like.
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(Some(ANSWER_GRACE));
        if let End::Refuse(reason) = serve_requests(&mut stream, shared) {
            if !shared.stop.load(Ordering::SeqCst) {
                shared.refuse(peer, "malformed request", &reason);
            }
        }
    }
    lock(&shared.conns).remove(&id);
}

/// One decoded request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub op: u8,
    pub key: String,
    pub value: Vec<u8>,
}

/// Why a request could not be read.
#[derive(Debug)]
pub(crate) enum BadRequest {
    /// The connection failed or closed mid-request.
    Io(String),
    /// The bytes are not a valid request; the reason may be sent back to the client.
    Malformed(String),
}

/// The request's bytes on the wire (`MAGIC` · version · op · key_len · value_len · key · value).
pub(crate) fn encode_request(op: u8, key: &str, value: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(REQUEST_HEADER_LEN + key.len() + value.len());
    msg.extend_from_slice(&wire::prefix());
    msg.push(op);
    msg.extend_from_slice(&(key.len() as u32).to_le_bytes());
    msg.extend_from_slice(&(value.len() as u32).to_le_bytes());
    msg.extend_from_slice(key.as_bytes());
    msg.extend_from_slice(value);
    msg
}

/// Checks a request header: prefix, known op, lengths within the limits. Returns (op, key
/// length, value length).
pub(crate) fn parse_request_header(
    h: &[u8; REQUEST_HEADER_LEN],
) -> std::result::Result<(u8, usize, usize), String> {
    let pre: [u8; PREFIX_LEN] = h[..PREFIX_LEN].try_into().unwrap();
    wire::check_prefix(&pre).map_err(|r| format!("malformed request: {r}"))?;
    let op = h[PREFIX_LEN];
    let key_len =
        u32::from_le_bytes(h[PREFIX_LEN + 1..PREFIX_LEN + 5].try_into().unwrap()) as usize;
    let val_len = u32::from_le_bytes(h[PREFIX_LEN + 5..].try_into().unwrap()) as usize;
    if key_len > MAX_KEY_BYTES || val_len > MAX_VALUE_BYTES {
        return Err(format!(
            "request with {key_len}-byte key and {val_len}-byte value exceeds the limits \
             ({MAX_KEY_BYTES} / {MAX_VALUE_BYTES} bytes)"
        ));
    }
    if !matches!(op, OP_SET | OP_GET | OP_TRY_GET | OP_ADD) {
        return Err(format!("unknown request op {op}"));
    }
    if matches!(op, OP_GET | OP_ADD) && val_len != 8 {
        return Err(format!(
            "op {op} needs an 8-byte argument, got {val_len} bytes"
        ));
    }
    Ok((op, key_len, val_len))
}

/// Read one request; `Ok(None)` on a clean EOF before its first byte. Memory grows with the bytes
/// that actually arrive (never more than the checked lengths), not with what the header claims.
pub(crate) fn read_request<R: Read>(r: &mut R) -> std::result::Result<Option<Request>, BadRequest> {
    let mut h = [0u8; REQUEST_HEADER_LEN];
    match read_exact_or_eof(r, &mut h) {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(e) => return Err(BadRequest::Io(format!("I/O error reading request: {e}"))),
    }
    let (op, key_len, val_len) = parse_request_header(&h).map_err(BadRequest::Malformed)?;
    let key = read_bounded(r, key_len)
        .map_err(|e| BadRequest::Io(format!("I/O error reading request body: {e}")))?;
    let value = read_bounded(r, val_len)
        .map_err(|e| BadRequest::Io(format!("I/O error reading request body: {e}")))?;
    let key =
        String::from_utf8(key).map_err(|_| BadRequest::Malformed("key is not UTF-8".into()))?;
    Ok(Some(Request { op, key, value }))
}

/// Exactly `len` bytes, allocated as they arrive.
fn read_bounded<R: Read>(r: &mut R, len: usize) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::with_capacity(len.min(64 << 10));
    r.by_ref().take(len as u64).read_to_end(&mut v)?;
    if v.len() != len {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    Ok(v)
}

fn serve_requests(stream: &mut TcpStream, shared: &Shared) -> End {
    loop {
        let Request { op, key, value } = match read_request(stream) {
            Ok(Some(r)) => r,
            Ok(None) => return End::Normal,
            Err(BadRequest::Io(reason)) => return End::Refuse(reason),
            Err(BadRequest::Malformed(reason)) => {
                let _ = stream.write_all(&encode_answer(ST_ERROR, reason.as_bytes()));
                return End::Refuse(reason);
            }
        };
        let (status, payload) = match op {
            OP_SET => {
                lock(&shared.data).insert(key, value);
                shared.changed.notify_all();
                (ST_OK, Vec::new())
            }
            OP_TRY_GET => match lock(&shared.data).get(&key) {
                Some(v) => (ST_VALUE, v.clone()),
                None => (ST_MISSING, Vec::new()),
            },
            OP_GET => {
                // Length checked by `parse_request_header`.
                let ms: [u8; 8] = value.as_slice().try_into().unwrap();
                let wait = Duration::from_millis(u64::from_le_bytes(ms)).min(MAX_WAIT);
                wait_for_key(shared, &key, wait)
            }
            _ => {
                let d: [u8; 8] = value.as_slice().try_into().unwrap();
                add_counter(shared, key, i64::from_le_bytes(d))
            }
        };
        if shared.stop.load(Ordering::SeqCst) {
            return End::Normal;
        }
        if let Err(e) = stream.write_all(&encode_answer(status, &payload)) {
            return End::Refuse(format!("I/O error sending answer: {e}"));
        }
    }
}

/// `Ok(false)` on a clean EOF before the first byte.
fn read_exact_or_eof<R: Read>(stream: &mut R, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn wait_for_key(shared: &Shared, key: &str, wait: Duration) -> (u8, Vec<u8>) {
    let deadline = Instant::now() + wait;
    let mut data = lock(&shared.data);
    loop {
        if let Some(v) = data.get(key) {
            return (ST_VALUE, v.clone());
        }
        let now = Instant::now();
        if now >= deadline || shared.stop.load(Ordering::SeqCst) {
            return (ST_MISSING, Vec::new());
        }
        data = shared
            .changed
            .wait_timeout(data, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Counters are stored as decimal text (readable with `get`, like torch's store).
fn add_counter(shared: &Shared, key: String, delta: i64) -> (u8, Vec<u8>) {
    let mut data = lock(&shared.data);
    let current = match data.get(&key) {
        None => 0,
        Some(v) => match std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
        {
            Some(n) => n,
            None => {
                return (
                    ST_ERROR,
                    format!("value of '{key}' is not an integer counter").into_bytes(),
                )
            }
        },
    };
    let Some(new) = current.checked_add(delta) else {
        return (
            ST_ERROR,
            format!("counter '{key}' would overflow ({current} + {delta})").into_bytes(),
        );
    };
    data.insert(key, new.to_string().into_bytes());
    shared.changed.notify_all();
    (ST_VALUE, new.to_le_bytes().to_vec())
}

/// The answer's bytes on the wire (`MAGIC` · version · status · len · payload).
pub(crate) fn encode_answer(status: u8, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(ANSWER_HEADER_LEN + payload.len());
    msg.extend_from_slice(&wire::prefix());
    msg.push(status);
    msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    msg.extend_from_slice(payload);
    msg
}

/// Why an answer could not be read.
#[derive(Debug)]
pub(crate) enum BadAnswer {
    Io(std::io::Error),
    Malformed(String),
}

/// Read one answer: (status, payload). Unknown statuses and oversize lengths are refused before
/// the payload is read.
pub(crate) fn read_answer<R: Read>(r: &mut R) -> std::result::Result<(u8, Vec<u8>), BadAnswer> {
    let mut h = [0u8; ANSWER_HEADER_LEN];
    r.read_exact(&mut h).map_err(BadAnswer::Io)?;
    let pre: [u8; PREFIX_LEN] = h[..PREFIX_LEN].try_into().unwrap();
    wire::check_prefix(&pre).map_err(|r| BadAnswer::Malformed(format!("malformed answer: {r}")))?;
    let status = h[PREFIX_LEN];
    if !matches!(status, ST_OK | ST_VALUE | ST_MISSING | ST_ERROR) {
        return Err(BadAnswer::Malformed(format!(
            "unknown answer status {status}"
        )));
    }
    let len = u32::from_le_bytes(h[PREFIX_LEN + 1..].try_into().unwrap()) as usize;
    if len > MAX_VALUE_BYTES {
        return Err(BadAnswer::Malformed(format!(
            "answer of {len} bytes exceeds the {MAX_VALUE_BYTES}-byte limit"
        )));
    }
    let payload = read_bounded(r, len).map_err(BadAnswer::Io)?;
    Ok((status, payload))
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// One authenticated connection to a [`StoreServer`]. Calls block for at most their timeout (plus
/// a grace period for the answer to arrive); an I/O failure leaves the client unusable (the
/// request stream may be out of step), so later calls fail with the original reason.
pub struct StoreClient {
    stream: TcpStream,
    addr: SocketAddr,
    broken: Option<String>,
    /// Prepended to every key (see [`StoreClient::with_namespace`]).
    namespace: String,
    /// How long to wait for an answer beyond the time the request itself may take.
    answer_grace: Duration,
}

impl StoreClient {
    /// Connect and authenticate. Refused, reset or closed attempts (the server may start after its
    /// clients, or be refusing a flood from our address) are retried with capped exponential
    /// backoff until `timeout`; a failed authentication is final. The error names the store's
    /// address, how long we tried and the last reason.
    pub fn connect(
        addr: SocketAddr,
        secret: &JobSecret,
        job_id: &str,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let stream = wire::dial(
            addr,
            secret,
            &store_context(job_id),
            Service::Store,
            &format!("store at {addr}"),
            Instant::now() + timeout,
            None,
        )?;
        Ok(StoreClient {
            stream,
            addr,
            broken: None,
            namespace: String::new(),
            answer_grace: ANSWER_GRACE,
        })
    }

    /// Wait at most `grace` for an answer beyond the time a request may take (default 30 s).
    /// Why: a node agent must notice a dead store host within its heartbeat timeout, not after
    /// a grace meant for loaded servers.
    pub fn with_answer_grace(mut self, grace: Duration) -> StoreClient {
        self.answer_grace = grace;
        self
    }

    /// Every key this client names is read and written as `namespace ‖ key`. Why: a job that
    /// restarts its workers keeps one store for its whole life (the node agents coordinate through
    /// it), and each attempt's workers must meet only each other: their rendezvous keys live under
    /// the attempt's namespace (`g3/host/0`), so a late key of an earlier attempt is never read.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> StoreClient {
        self.namespace = namespace.into();
        self
    }

    /// Has the connection failed (the store's host gone, or the stream out of step)? Then every
    /// later request fails too; a request that merely timed out waiting for a key does not count.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// The store's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This host's IP on the route to the store: a good address to advertise to other ranks,
    /// since they reach the store the same way.
    pub fn local_ip(&self) -> Result<IpAddr> {
        self.stream
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| CommError::setup("reading the local address of the store connection", e))
    }

    /// Set `key` to `value` (overwriting), waking everyone waiting for it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        check_value("store set", value)?;
        self.request(OP_SET, key, value, Duration::ZERO)?;
        Ok(())
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = timeout.min(MAX_WAIT).as_millis() as u64;
        match self.request(OP_GET, key, &ms.to_le_bytes(), timeout.min(MAX_WAIT))? {
            Some(v) => Ok(v),
            None => Err(CommError::Rendezvous(format!(
                "timed out after {:.2}s waiting for key '{key}' in store at {}",
                timeout.as_secs_f64(),
                self.addr
            ))),
        }
    }

    /// The value of `key` if it is set now.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        self.request(OP_TRY_GET, key, &[], Duration::ZERO)
    }

    /// Atomically add `delta` to the integer counter `key` (absent = 0) and return the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let v = self
            .request(OP_ADD, key, &delta.to_le_bytes(), Duration::ZERO)?
            .ok_or_else(|| self.fail(format!("store answered add '{key}' without a value")))?;
        let b: [u8; 8] = v
            .as_slice()
            .try_into()
            .map_err(|_| self.fail(format!("store answered add '{key}' with {} bytes", v.len())))?;
        Ok(i64::from_le_bytes(b))
    }

    /// Wait until every key in `keys` is set; the timeout error lists the keys still missing.
    pub fn wait_all(&mut self, keys: &[String], timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let deadline = started + timeout;
        for (i, key) in keys.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.get(key, left) {
                Ok(_) => {}
                Err(CommError::Rendezvous(_)) if self.broken.is_none() => {
                    let mut missing = Vec::new();
                    for k in &keys[i..] {
                        if self.try_get(k)?.is_none() {
                            missing.push(format!("'{k}'"));
                        }
                    }
                    let more = missing.len().saturating_sub(10);
                    missing.truncate(10);
                    let tail = if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    };
                    return Err(CommError::Rendezvous(format!(
                        "timed out after {:.2}s waiting for keys [{}]{tail} in store at {}",
                        started.elapsed().as_secs_f64(),
                        missing.join(", "),
                        self.addr
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn fail(&mut self, reason: String) -> CommError {
        let msg = format!("store at {}: {reason}", self.addr);
        self.broken = Some(msg.clone());
        CommError::Rendezvous(msg)
    }

    /// Send one request, read its answer. `Ok(None)` = the key is missing.
    fn request(
        &mut self,
        op: u8,
        key: &str,
        value: &[u8],
        may_take: Duration,
    ) -> Result<Option<Vec<u8>>> {
        if let Some(b) = &self.broken {
            return Err(CommError::Rendezvous(format!(
                "client unusable after an earlier failure: {b}"
            )));
        }
        let key = &format!("{}{key}", self.namespace);
        if key.len() > MAX_KEY_BYTES {
            return Err(CommError::invalid(
                "store",
                format!(
                    "key of {} bytes exceeds the {MAX_KEY_BYTES}-byte limit",
                    key.len()
                ),
            ));
        }
        let msg = encode_request(op, key, value);
        let wait = may_take + self.answer_grace;
        if let Err(e) = self
            .stream
            .set_read_timeout(Some(wait))
            .and_then(|_| self.stream.set_write_timeout(Some(self.answer_grace)))
            .and_then(|_| self.stream.write_all(&msg))
        {
            return Err(self.fail(describe_io("sending request", &e)));
        }
        let (status, payload) = match read_answer(&mut self.stream) {
            Ok(a) => a,
            Err(BadAnswer::Io(e)) => {
                return Err(self.fail(describe_io(
                    &format!("waiting {:.1}s for its answer", wait.as_secs_f64()),
                    &e,
                )))
            }
            Err(BadAnswer::Malformed(r)) => return Err(self.fail(r)),
        };
        match status {
            ST_OK => Ok(Some(Vec::new())),
            ST_VALUE => Ok(Some(payload)),
            ST_MISSING => Ok(None),
            ST_ERROR => Err(CommError::Rendezvous(format!(
                "store at {} rejected the request for '{key}': {}",
                self.addr,
                String::from_utf8_lossy(&payload)
            ))),
            other => Err(self.fail(format!("unknown answer status {other}"))),
        }
    }
}

fn check_value(op: &'static str, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(CommError::invalid(
            op,
            format!(
                "value of {} bytes exceeds the {MAX_VALUE_BYTES}-byte limit",
                value.len()
            ),
        ));
    }
    Ok(())
}

fn describe_io(what: &str, e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            format!("connection closed while {what} (store stopped?)")
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!("no progress while {what}"),
        _ => format!("I/O error while {what}: {e}"),
    }
}

/// Fuzz harnesses for the request and answer decoders (see `fuzz_util`). Properties: no panic,
/// decoded keys and values within the limits, garbage refused, memory bounded by the bytes that
/// arrived rather than the lengths claimed, and valid encodings round-trip.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::fuzz_util::{config, mutated};
    use proptest::prelude::*;
    use std::io::Cursor;

    fn check_request(input: &[u8]) {
        let mut c = Cursor::new(input);
        // Decode requests until the input runs out or one is refused (a connection would end).
        for _ in 0..input.len() + 1 {
            match read_request(&mut c) {
                Ok(Some(r)) => {
                    assert!(r.key.len() <= MAX_KEY_BYTES && r.value.len() <= MAX_VALUE_BYTES);
                    assert!(matches!(r.op, OP_SET | OP_GET | OP_TRY_GET | OP_ADD));
                    // Never holds more than it was sent.
                    assert!(r.key.len() + r.value.len() <= input.len());
                    assert!(r.value.capacity() <= input.len().max(64 << 10));
                }
                Ok(None) | Err(_) => return,
            }
        }
    }

    fn check_answer(input: &[u8]) {
        if let Ok((status, payload)) = read_answer(&mut Cursor::new(input)) {
            assert!(matches!(status, ST_OK | ST_VALUE | ST_MISSING | ST_ERROR));
            assert!(payload.len() <= MAX_VALUE_BYTES && payload.len() <= input.len());
        }
    }

    fn op() -> impl Strategy<Value = u8> {
        prop::sample::select(vec![OP_SET, OP_GET, OP_TRY_GET, OP_ADD])
    }

    fn valid_request() -> impl Strategy<Value = (u8, String, Vec<u8>)> {
        (
            op(),
            "[a-z/0-9]{0,40}",
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(op, key, mut value)| {
                if matches!(op, OP_GET | OP_ADD) {
                    value.resize(8, 0);
                }
                (op, key, value)
            })
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn fuzz_request_random(input in prop::collection::vec(any::<u8>(), 0..256)) {
            check_request(&input);
        }

        #[test]
        fn fuzz_request_mutated(input in valid_request().prop_flat_map(|(op, k, v)| mutated(encode_request(op, &k, &v)))) {
            check_request(&input);
        }

        #[test]
        fn request_round_trips((op, key, value) in valid_request()) {
            let bytes = encode_request(op, &key, &value);
            let mut c = Cursor::new(&bytes[..]);
            let r = read_request(&mut c).unwrap().unwrap();
            prop_assert_eq!(r, Request { op, key, value });
            prop_assert!(read_request(&mut c).unwrap().is_none());
        }

        #[test]
        fn fuzz_answer_random(input in prop::collection::vec(any::<u8>(), 0..256)) {
            check_answer(&input);
        }

        #[test]
        fn fuzz_answer_mutated(input in (0u8..4, prop::collection::vec(any::<u8>(), 0..64)).prop_flat_map(|(st, p)| mutated(encode_answer(st, &p)))) {
            check_answer(&input);
        }

        #[test]
        fn answer_round_trips(status in 0u8..4, payload in prop::collection::vec(any::<u8>(), 0..256)) {
            let bytes = encode_answer(status, &payload);
            let (s, p) = read_answer(&mut Cursor::new(&bytes[..])).unwrap();
            prop_assert_eq!((s, p), (status, payload));
        }
    }

    /// A header that claims the largest value but sends ten bytes is refused without the server
    /// reserving 16 MiB for it; one that claims more than the limit is refused from its header.
    #[test]
    fn claimed_lengths_do_not_allocate() {
        let mut msg = encode_request(OP_SET, "k", &[0u8; 10]);
        msg[PREFIX_LEN + 5..REQUEST_HEADER_LEN]
            .copy_from_slice(&(MAX_VALUE_BYTES as u32).to_le_bytes());
        assert!(matches!(
            read_request(&mut Cursor::new(&msg[..])),
            Err(BadRequest::Io(_))
        ));
        msg[PREFIX_LEN + 5..REQUEST_HEADER_LEN]
            .copy_from_slice(&(MAX_VALUE_BYTES as u32 + 1).to_le_bytes());
        assert!(matches!(
            read_request(&mut Cursor::new(&msg[..])),
            Err(BadRequest::Malformed(_))
        ));
        let mut a = encode_answer(ST_VALUE, b"xy");
        a[PREFIX_LEN + 1..ANSWER_HEADER_LEN].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_answer(&mut Cursor::new(&a[..])),
            Err(BadAnswer::Malformed(_))
        ));
    }

    /// `get` and `add` without their 8-byte argument are refused at the header, before the
    /// server would index into the value.
    #[test]
    fn get_and_add_need_eight_bytes() {
        for op in [OP_GET, OP_ADD] {
            let msg = encode_request(op, "k", &[1, 2, 3]);
            assert!(matches!(
                read_request(&mut Cursor::new(&msg[..])),
                Err(BadRequest::Malformed(_))
            ));
        }
    }
}
