//! Admission control for the ports that strangers can reach (the rendezvous store and the TCP data
//! listeners while a mesh forms), and aggregated logging of what they refuse.
//!
//! Steps for each accepted TCP connection:
//! 1. [`Admission::try_admit`] counts it as *pending* (not yet authenticated) against a per-source
//!    IP budget and a global budget. Over either budget it is refused at once: the socket is
//!    closed on the accept thread, no thread is started and nothing is read from it.
//! 2. An admitted connection runs the HMAC handshake under one deadline for the whole handshake
//!    ([`Deadlined`]), not per read, so trickling one byte every few seconds does not keep it alive.
//! 3. When the handshake ends (either way) its [`Pending`] ticket is dropped and the budgets are
//!    given back; authenticated connections are counted separately by their owner (the store caps
//!    them on its own).
//!
//! Refusals are logged in aggregate by [`RefusalLog`]: at most one line per interval, counts by
//! reason, so a flood of thousands of connections writes a handful of lines.
//!
//! **Strangers on a real client's own address.** The budgets alone cannot tell a rank from a
//! stranger on the same IP: when a budget place frees up, it goes to whichever connection arrives
//! next, and a stranger that reconnects without pause always arrives before a real client pausing
//! between retries, so it could keep that client out for as long as it liked. Hence the *lobby*
//! ([`LobbyLimits`], `lobby.rs`): a connection over a budget is not refused but waits in the lobby,
//! without a thread: it is sent the hello at once and its proof is checked on the accepting thread
//! as it arrives, before any new connection is accepted. A real client passes in one round trip;
//! the lobby's places are bounded per source and in total, a newcomer pushes out the oldest waiter
//! of its source once that one has had [`LobbyLimits::min_wait`] to answer, and until then
//! nothing more is accepted, which paces a flood to its lobby share per `min_wait`.
//!
//! [`LobbyLimits::after`] can keep the lobby closed until a budget looks flooded: held for that
//! long by the same pending handshake (a real one takes a round trip), or refusing without a
//! pause for a second (a stranger whose connections churn so fast that none stays pending long).
//! Its default is zero, the lobby always open: with a trigger, a flood that stalled in the kernel's
//! SYN retransmissions paused its refusals often enough to restart the count, and a real client on
//! its address was refused for 2–6 s on the AMD EPYC.

use std::collections::{BTreeMap, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Budgets for not-yet-authenticated connections.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    /// Longest a whole handshake may take, from accept to the last byte of the verdict.
    pub handshake_deadline: Duration,
    /// Pending handshakes allowed from one source IP.
    pub max_pending_per_ip: usize,
    /// Pending handshakes allowed in total.
    pub max_pending: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            handshake_deadline: Duration::from_secs(10),
            max_pending_per_ip: 32,
            max_pending: 256,
        }
    }
}

/// Where connections over a pending budget wait without a thread (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct LobbyLimits {
    /// How long a budget must have been held by one pending handshake before connections over it
    /// wait in the lobby instead of being refused at once (a budget that has refused without a
    /// pause for a second, or for this long if shorter, counts as held too). Zero by default: the
    /// lobby is always open (why: the module documentation).
    pub after: Duration,
    /// Waiting connections from one source IP; a new one pushes out that source's oldest once
    /// that one has waited [`LobbyLimits::min_wait`]: 1024 by default.
    pub per_ip: usize,
    /// Waiting connections in total (at most a quarter of the process's descriptor limit); a new
    /// one pushes out the oldest. 0 turns the lobby off.
    pub total: usize,
    /// How long a waiter keeps its place before a newcomer may push it out. Until then the
    /// newcomer is held and nothing more is accepted, so a flood from one source enters the lobby
    /// at most `per_ip` times per `min_wait`, and a real client parked among it has this long to
    /// answer however fast the flood reconnects: 50 ms by default (a loopback flood otherwise
    /// pushed 8 waiters out within 0.2 ms, faster than a client's thread is scheduled).
    pub min_wait: Duration,
}

impl Default for LobbyLimits {
    fn default() -> Self {
        Self {
            after: Duration::ZERO,
            per_ip: 1024,
            total: 4096,
            min_wait: Duration::from_millis(50),
        }
    }
}

/// Why a connection got no place in the budgets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    /// The log category, e.g. "handshake budget of 10.0.0.9 exhausted".
    pub category: String,
    /// The budget that refused it has been held by one pending handshake for at least the age
    /// asked about: the connection may wait in the lobby.
    pub stale: bool,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
    /// Pending handshakes by (admission time, ticket number): the oldest first.
    since: BTreeMap<(Instant, u64), IpAddr>,
    next: u64,
    /// Per budget (a source, or `None`: the global one), since when it has refused without a
    /// pause longer than [`REFUSAL_PAUSE`], and when it last refused.
    refusing: HashMap<Option<IpAddr>, (Instant, Instant)>,
}

/// A budget that refused nothing for this long is no longer under a flood.
const REFUSAL_PAUSE: Duration = Duration::from_millis(500);
/// A budget that has refused without such a pause for this long is under a flood (or at most the
/// stale age asked about, if that is shorter).
const REFUSING_FOR: Duration = Duration::from_secs(1);

impl Counts {
    /// Whether the oldest pending handshake (of `ip`, or of anyone) was admitted by `cutoff`.
    fn oldest_before(&self, ip: Option<IpAddr>, cutoff: Instant) -> bool {
        self.since
            .iter()
            .take_while(|((t, _), _)| *t <= cutoff)
            .any(|(_, &from)| ip.is_none_or(|ip| ip == from))
    }

    /// Records a refusal by budget `of` at `now`; returns since when it has been refusing.
    fn refused(&mut self, of: Option<IpAddr>, now: Instant) -> Instant {
        // Forget budgets that stopped refusing long ago (a flood from many sources).
        if self.refusing.len() > 4096 {
            self.refusing
                .retain(|_, s| now.saturating_duration_since(s.1) <= REFUSAL_PAUSE);
        }
        let streak = self.refusing.entry(of).or_insert((now, now));
        if now.saturating_duration_since(streak.1) > REFUSAL_PAUSE {
            streak.0 = now;
        }
        streak.1 = now;
        streak.0
    }
}

/// Counts pending handshakes per source and in total; cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct Admission {
    limits: AdmissionLimits,
    counts: Arc<Mutex<Counts>>,
}

/// A pending handshake's place in the budgets; dropping it gives the place back.
pub struct Pending {
    ip: IpAddr,
    key: (Instant, u64),
    counts: Arc<Mutex<Counts>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({})", self.ip)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut c = lock(&self.counts);
        c.since.remove(&self.key);
        c.total -= 1;
        if let Some(n) = c.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_ip.remove(&self.ip);
            }
        }
    }
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits,
            counts: Arc::default(),
        }
    }

    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// A place in the budgets for one handshake from `ip`, or the reason (a log category) why not.
    pub fn try_admit(&self, ip: IpAddr) -> Result<Pending, String> {
        self.try_admit_at(ip, Instant::now(), Duration::MAX)
            .map_err(|o| o.category)
    }

    /// [`Admission::try_admit`] at `now`, saying whether the refusing budget has been held by one
    /// pending handshake for at least `stale_after`.
    pub fn try_admit_at(
        &self,
        ip: IpAddr,
        now: Instant,
        stale_after: Duration,
    ) -> Result<Pending, OverBudget> {
        let mut c = lock(&self.counts);
        let cutoff = now.checked_sub(stale_after);
        let flooded = now.checked_sub(stale_after.min(REFUSING_FOR));
        // Stale: one pending handshake has held the budget since the cutoff, or the budget has
        // refused without pause for [`REFUSING_FOR`] (a stranger whose own connections churn so
        // fast that none stays pending long, but which takes every place that frees up).
        let stale = |c: &mut Counts, of: Option<IpAddr>| {
            // With no age asked for (the lobby always open, the default), every refusal is stale:
            // no streak needs keeping.
            if stale_after.is_zero() {
                return true;
            }
            let refusing_since = c.refused(of, now);
            flooded.is_some_and(|t| refusing_since <= t)
                || cutoff.is_some_and(|t| c.oldest_before(of, t))
        };
        let mine = c.per_ip.get(&ip).copied().unwrap_or(0);
        if mine >= self.limits.max_pending_per_ip {
            return Err(OverBudget {
                category: format!("handshake budget of {ip} exhausted"),
                stale: stale(&mut c, Some(ip)),
            });
        }
        if c.total >= self.limits.max_pending {
            return Err(OverBudget {
                category: "global handshake budget exhausted".into(),
                stale: stale(&mut c, None),
            });
        }
        c.total += 1;
        *c.per_ip.entry(ip).or_insert(0) += 1;
        let key = (now, c.next);
        c.next += 1;
        c.since.insert(key, ip);
        Ok(Pending {
            ip,
            key,
            counts: self.counts.clone(),
        })
    }

    /// Handshakes pending now (all sources).
    pub fn pending(&self) -> usize {
        lock(&self.counts).total
    }
}

/// A socket whose every read and write is bounded by one shared deadline: the timeout of each
/// operation is the time left, so the whole exchange ends by `deadline` however the bytes trickle.
pub struct Deadlined<'a> {
    pub stream: &'a TcpStream,
    pub deadline: Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "handshake deadline passed",
            ))
        } else {
            Ok(left)
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        (&mut &*self.stream).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Distinct reasons kept per interval; more are folded into "other reasons" so that a flood from
/// many addresses cannot grow the table.
const MAX_REASONS: usize = 16;

/// Aggregates refusals into at most one log line per interval. Pure over the `now` it is given,
/// so it is tested without sleeping.
pub struct RefusalLog {
    interval: Duration,
    window_start: Option<Instant>,
    counts: BTreeMap<String, u64>,
    total: u64,
    last: Option<String>,
    /// Since the start, by category (folded like `counts`): for tests and diagnostics.
    cumulative: BTreeMap<String, u64>,
}

fn bump(map: &mut BTreeMap<String, u64>, category: &str, limit: usize) {
    if let Some(n) = map.get_mut(category) {
        *n += 1;
    } else if map.len() < limit {
        map.insert(category.to_string(), 1);
    } else {
        *map.entry("other reasons".into()).or_insert(0) += 1;
    }
}

impl RefusalLog {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            window_start: None,
            counts: BTreeMap::new(),
            total: 0,
            last: None,
            cumulative: BTreeMap::new(),
        }
    }

    /// Count one refusal. `category` is aggregated (no addresses of individual connections, so
    /// the table stays small); `detail` (peer address and reason) is kept as the interval's example.
    /// Returns a line to log if the interval is over.
    pub fn record(&mut self, now: Instant, category: &str, detail: String) -> Option<String> {
        self.window_start.get_or_insert(now);
        self.total += 1;
        bump(&mut self.counts, category, MAX_REASONS);
        bump(&mut self.cumulative, category, 4 * MAX_REASONS);
        self.last = Some(detail);
        self.tick(now)
    }

    /// Refusals since the start by category.
    pub fn cumulative(&self) -> &BTreeMap<String, u64> {
        &self.cumulative
    }

    /// The line for the finished interval, if one is due (called periodically and on refusals).
    pub fn tick(&mut self, now: Instant) -> Option<String> {
        let start = self.window_start?;
        if now.duration_since(start) < self.interval {
            return None;
        }
        self.flush(now)
    }

    /// The line for whatever was counted so far, due or not (at shutdown).
    pub fn flush(&mut self, now: Instant) -> Option<String> {
        let start = self.window_start.take()?;
        let mut parts: Vec<(String, u64)> = std::mem::take(&mut self.counts).into_iter().collect();
        parts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let reasons: Vec<String> = parts.iter().map(|(r, n)| format!("{n} {r}")).collect();
        let total = std::mem::take(&mut self.total);
        let last = self.last.take().unwrap_or_default();
        let plural = if total == 1 { "" } else { "s" };
        Some(format!(
            "refused {total} connection{plural} in the last {:.1}s ({}); last: {last}",
            now.duration_since(start).as_secs_f64(),
            reasons.join(", ")
        ))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_per_source_and_global_and_given_back() {
        let a = Admission::new(AdmissionLimits {
            handshake_deadline: Duration::from_secs(1),
            max_pending_per_ip: 2,
            max_pending: 3,
        });
        let ip1: IpAddr = "127.0.0.2".parse().unwrap();
        let ip2: IpAddr = "127.0.0.3".parse().unwrap();
        let t1 = a.try_admit(ip1).unwrap();
        let _t2 = a.try_admit(ip1).unwrap();
        assert_eq!(
            a.try_admit(ip1).err().unwrap(),
            "handshake budget of 127.0.0.2 exhausted"
        );
        let _t3 = a.try_admit(ip2).unwrap();
        assert_eq!(
            a.try_admit(ip2).err().unwrap(),
            "global handshake budget exhausted"
        );
        drop(t1);
        assert_eq!(a.pending(), 2);
        let _t4 = a.try_admit(ip1).unwrap();
    }

    /// With no age asked for (the default lobby, always open) every refusal is stale at once, and
    /// no refusal streak is kept for it.
    #[test]
    fn with_no_age_asked_every_refusal_is_stale_and_no_streak_is_kept() {
        let a = Admission::new(AdmissionLimits {
            handshake_deadline: Duration::from_secs(10),
            max_pending_per_ip: 1,
            max_pending: 8,
        });
        let ip: IpAddr = "127.0.0.2".parse().unwrap();
        let t0 = Instant::now();
        let _held = a.try_admit_at(ip, t0, Duration::ZERO).unwrap();
        for ms in [0, 1, 700] {
            let at = t0 + Duration::from_millis(ms);
            assert!(a.try_admit_at(ip, at, Duration::ZERO).unwrap_err().stale);
        }
        assert!(lock(&a.counts).refusing.is_empty());
    }

    /// A stranger whose connections churn (none stays pending long) but which takes every place
    /// that frees up: the budget refuses without pause, and after [`REFUSING_FOR`] of that its
    /// refusals are stale too; a pause of more than [`REFUSAL_PAUSE`] starts the count again.
    #[test]
    fn a_budget_refusing_without_pause_is_stale_even_when_its_handshakes_are_young() {
        let a = Admission::new(AdmissionLimits {
            handshake_deadline: Duration::from_secs(10),
            max_pending_per_ip: 1,
            max_pending: 8,
        });
        let ip: IpAddr = "127.0.0.2".parse().unwrap();
        let (t0, after) = (Instant::now(), Duration::from_secs(2));
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut held = Some(a.try_admit_at(ip, t0, after).unwrap());
        let mut stale_at = None;
        for step in 1..=14u64 {
            // Every 100 ms: the held handshake ends, the stranger takes the place at once and
            // the next connection is refused.
            drop(held.take());
            held = Some(a.try_admit_at(ip, ms(step * 100), after).unwrap());
            let over = a.try_admit_at(ip, ms(step * 100 + 1), after).unwrap_err();
            if over.stale && stale_at.is_none() {
                stale_at = Some(step * 100 + 1);
            }
        }
        // Refusing since 101 ms: stale from 1101 ms on, long before any handshake is 2 s old.
        assert_eq!(stale_at, Some(1101));
        // After a pause of 600 ms without refusals, the count starts again.
        drop(held);
        let _next = a.try_admit_at(ip, ms(2000), after).unwrap();
        assert!(!a.try_admit_at(ip, ms(2001), after).unwrap_err().stale);
    }

    #[test]
    fn an_over_budget_refusal_says_whether_the_budget_is_held_by_an_old_handshake() {
        let a = Admission::new(AdmissionLimits {
            handshake_deadline: Duration::from_secs(10),
            max_pending_per_ip: 1,
            max_pending: 2,
        });
        let (ip1, ip2, ip3): (IpAddr, IpAddr, IpAddr) = (
            "127.0.0.2".parse().unwrap(),
            "127.0.0.3".parse().unwrap(),
            "127.0.0.4".parse().unwrap(),
        );
        let t0 = Instant::now();
        let after = Duration::from_secs(2);
        let old = a.try_admit_at(ip1, t0, after).unwrap();
        let young = t0 + Duration::from_secs(1);
        let over = a.try_admit_at(ip1, young, after).unwrap_err();
        assert_eq!(over.category, "handshake budget of 127.0.0.2 exhausted");
        assert!(!over.stale, "held for 1 s only");
        assert!(a.try_admit_at(ip1, t0 + after, after).unwrap_err().stale);
        // The global budget: stale as soon as any of its handshakes is old.
        let _new = a.try_admit_at(ip2, young, after).unwrap();
        let over = a.try_admit_at(ip3, young, after).unwrap_err();
        assert_eq!(over.category, "global handshake budget exhausted");
        assert!(!over.stale);
        assert!(a.try_admit_at(ip3, t0 + after, after).unwrap_err().stale);
        // Another source's old handshake does not make ip2's own budget stale.
        drop(old);
        let _ip1 = a.try_admit_at(ip1, t0 + after, after).unwrap();
        let over = a.try_admit_at(ip2, t0 + after + Duration::from_millis(500), after);
        assert!(!over.unwrap_err().stale);
    }

    #[test]
    fn refusals_are_logged_once_per_interval_with_counts() {
        let mut log = RefusalLog::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let mut lines = Vec::new();
        for i in 0..1000u64 {
            let now = t0 + Duration::from_millis(i * 12); // 12 s of refusals
            let cat = if i % 50 == 0 {
                "bad MAC"
            } else {
                "handshake budget of 127.0.0.2 exhausted"
            };
            lines.extend(log.record(now, cat, format!("127.0.0.2:{i}: x")));
        }
        lines.extend(log.flush(t0 + Duration::from_secs(12)));
        assert_eq!(lines.len(), 3, "{lines:#?}");
        let total: u64 = lines
            .iter()
            .map(|l| l.split(' ').nth(1).unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, 1000);
        assert!(lines[0].contains("handshake budget of 127.0.0.2 exhausted"));
        assert!(lines[0].contains("bad MAC"));
        assert!(log.flush(t0 + Duration::from_secs(20)).is_none());
    }

    #[test]
    fn many_reasons_fold_into_other() {
        let mut log = RefusalLog::new(Duration::from_secs(5));
        let t0 = Instant::now();
        for i in 0..100 {
            log.record(
                t0,
                &format!("budget of 10.0.0.{i} exhausted"),
                String::new(),
            );
        }
        let line = log.flush(t0).unwrap();
        assert!(line.contains("84 other reasons"), "{line}");
    }
}
