//! Fault injection with real processes: a worker SIGKILLed (or SIGSTOPped) in the middle of
//! training.
//!
//! The promise under test: a dead or silent peer is a named error within the collective timeout,
//! never a hang. Workers started torchrun-style (each its own process, no launcher) must exit
//! non-zero within `dist.timeout_secs` + a margin, naming the lost rank, its address and the
//! operation that failed, over both transports; under the launcher, the job must fail naming the
//! killed worker (the root cause, not a survivor that failed because of it) and its signal.
//!
//! Every process is watched: a deadline kills all of them and fails the test with their stderr,
//! and a guard kills them if the test panics, so a hang never outlives the test.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
/// `dist.timeout_secs` of the runs: how long a collective may wait for a peer.
const TIMEOUT_SECS: u64 = 3;
/// From the kill to the survivors' exit: the collective timeout plus time to notice, report and
/// exit on a loaded 2-core machine.
const EXIT_BOUND: Duration = Duration::from_secs(TIMEOUT_SECS + 5);
/// Start-up (rendezvous, data, model) until training reports progress.
const START_BOUND: Duration = Duration::from_secs(60);
/// Operation names a `CommError::Op` can carry.
const OPS: [&str; 7] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "send",
    "recv",
];

/// A watched process: its stderr is collected line by line as it arrives.
struct Proc {
    name: String,
    child: Child,
    stderr: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
    exit: Option<(ExitStatus, Instant)>,
}

impl Proc {
    fn spawn(name: String, mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Proc {
            name,
            child,
            stderr,
            reader: Some(reader),
            exit: None,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Record the exit if it happened; true once exited.
    fn poll(&mut self) -> bool {
        if self.exit.is_none() {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.exit = Some((st, Instant::now()));
                // The pipe closes with the process; take the last lines.
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
            }
        }
        self.exit.is_some()
    }
}

/// The processes of one test. Dropping it kills whatever still runs.
struct Job(Vec<Proc>);

impl Job {
    fn report(&self) -> String {
        self.0
            .iter()
            .map(|p| {
                format!(
                    "--- {} (pid {}, exit {:?}) stderr:\n{}",
                    p.name,
                    p.pid(),
                    p.exit.map(|e| e.0),
                    tail(&p.stderr(), 30)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Kill everything and fail the test with every process's stderr.
    fn fail(&mut self, why: &str) -> ! {
        self.kill_all();
        panic!("{why}\n{}", self.report());
    }

    fn kill_all(&mut self) {
        for p in &mut self.0 {
            if !p.poll() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }

    /// Wait until process `i` has written a line containing `needle` to stderr. Fails if any
    /// process exits first or the deadline passes.
    fn wait_for_line(&mut self, i: usize, needle: &str, bound: Duration) {
        let until = Instant::now() + bound;
        loop {
            if self.0[i].stderr().contains(needle) {
                return;
            }
            if let Some(p) = self.0.iter_mut().position(|p| p.poll()) {
                let name = self.0[p].name.clone();
                self.fail(&format!("{name} exited before {needle:?} appeared"));
            }
            if Instant::now() > until {
                self.fail(&format!("no {needle:?} within {bound:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until every process in `which` has exited, at most until `until`; on a hang, kill all
    /// and fail.
    fn wait_exits(&mut self, which: &[usize], until: Instant, what: &str) {
        loop {
            let mut all = true;
            for &i in which {
                all &= self.0[i].poll();
            }
            if all {
                return;
            }
            if Instant::now() > until {
                self.fail(&format!("HANG: {what}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

fn sigkill(pid: i32) {
    // SAFETY: plain syscall on a pid of a process we started (or our own child's child, still
    // unreaped by its parent, so the pid cannot have been reused).
    let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, SIGKILL): {}",
        std::io::Error::last_os_error()
    );
}

/// A fresh 64-hex-digit secret per job, so concurrent jobs never share one (nor a derived shm job id).
fn fresh_secret(salt: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mix = salt.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!(
        "{:016x}{:016x}{:016x}{:016x}",
        nanos,
        std::process::id(),
        mix,
        nanos ^ mix
    )
}

fn lockstep(out: &Path, sets: &[String]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["train", "--out", out.to_str().unwrap()]);
    for s in sets {
        c.args(["--set", s]);
    }
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "LOCKSTEP_RANK",
        "LOCKSTEP_SECRET",
        "TORCHELASTIC_RUN_ID",
    ] {
        c.env_remove(k);
    }
    c
}

/// A run long enough never to finish during the test; peers give up after `TIMEOUT_SECS`.
fn long_run(transport: Option<&str>) -> Vec<String> {
    let mut v = vec![
        "train.steps=100000".to_string(),
        format!("dist.timeout_secs={TIMEOUT_SECS}"),
    ];
    if let Some(t) = transport {
        v.push(format!("dist.transport={t}"));
    }
    v
}

/// The `lockstep: error: …` line of a worker's stderr.
fn error_line(stderr: &str) -> Option<&str> {
    stderr.lines().find(|l| l.contains("lockstep: error:"))
}

const WORLD: usize = 3;
/// The rank the fault is injected into: a middle rank, so both survivors are its ring neighbours.
const VICTIM: usize = 1;

/// Start `WORLD` torchrun-style workers (each its own process, rank 0 serving the store) on a long
/// run over `transport`, and wait until training is under way.
fn start_torchrun_job(transport: &str, tmp: &Path) -> Job {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = fresh_secret(transport);
    let mut job = Job((0..WORLD)
        .map(|r| {
            let mut c = lockstep(tmp, &long_run(Some(transport)));
            c.env("RANK", r.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("LOCKSTEP_SECRET", &secret)
                .env("RAYON_NUM_THREADS", "1");
            Proc::spawn(format!("{transport} rank {r}"), c)
        })
        .collect());
    // Rank 0 reports progress every 10 steps; by then every rank has run collectives.
    job.wait_for_line(0, "step 10/100000", START_BOUND);
    for (r, p) in job.0.iter().enumerate() {
        assert!(
            p.stderr().contains(&format!("rank {r} of {WORLD}")),
            "{}: not started as a torchrun-style worker:\n{}",
            p.name,
            p.stderr()
        );
    }
    job
}

/// Rank 1 is SIGKILLed once training is under way. Both survivors must fail within the bound, and
/// say which rank was lost during which operation.
fn killed_peer_is_named_by_survivors(transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mut job = start_torchrun_job(transport, tmp.path());
    sigkill(job.0[VICTIM].pid());
    let killed_at = Instant::now();
    job.wait_exits(
        &[0, 1, 2],
        killed_at + EXIT_BOUND,
        &format!("a survivor of the killed rank {VICTIM} did not exit within {EXIT_BOUND:?}"),
    );

    let mut report = Vec::new();
    for i in [0, 2] {
        let p = &job.0[i];
        let (status, at) = p.exit.unwrap();
        let err = p.stderr();
        let line = error_line(&err).unwrap_or_default().to_string();
        report.push(format!(
            "{}: {status} after {:.2}s: {line}",
            p.name,
            (at - killed_at).as_secs_f64()
        ));
        assert!(!status.success(), "{} exited 0:\n{}", p.name, job.report());
        assert!(
            !line.is_empty(),
            "{}: no error line:\n{}",
            p.name,
            job.report()
        );
        assert!(
            line.contains(&format!("rank {VICTIM} (")),
            "{}: the error does not name the killed rank {VICTIM} with its address:\n{line}\n{}",
            p.name,
            job.report()
        );
        assert!(
            OPS.iter().any(|op| line.contains(&format!("{op}: "))),
            "{}: the error does not name the operation:\n{line}",
            p.name
        );
    }
    let (victim_status, _) = job.0[VICTIM].exit.unwrap();
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(victim_status.signal(), Some(libc::SIGKILL));
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn killed_worker_is_named_by_the_survivors_over_shm() {
    killed_peer_is_named_by_survivors("shm");
}

#[test]
fn killed_worker_is_named_by_the_survivors_over_tcp() {
    killed_peer_is_named_by_survivors("tcp");
}

/// Rank 1 is SIGSTOPped: alive, links open, but silent. Nobody can see it die, so only the
/// collective timeout ends the wait.
fn stopped_peer_times_out(transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mut job = start_torchrun_job(transport, tmp.path());
    let pid = job.0[VICTIM].pid();
    // SAFETY: plain syscall on a child we started and have not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped_at = Instant::now();
    job.wait_exits(
        &[0, 2],
        stopped_at + EXIT_BOUND,
        &format!("a survivor of the stopped rank {VICTIM} did not exit within {EXIT_BOUND:?}"),
    );
    let timeout = Duration::from_secs(TIMEOUT_SECS);
    let mut report = Vec::new();
    for i in [0, 2] {
        let p = &job.0[i];
        let (status, at) = p.exit.unwrap();
        let waited = at - stopped_at;
        let line = error_line(&p.stderr()).unwrap_or_default().to_string();
        report.push(format!(
            "{}: {status} after {:.2}s: {line}",
            p.name,
            waited.as_secs_f64()
        ));
        assert!(!status.success(), "{} exited 0:\n{}", p.name, job.report());
        // The operation in flight may have started a little before the stop, never much.
        assert!(
            waited + Duration::from_millis(500) >= timeout,
            "{} gave up after {waited:?}, before the {timeout:?} timeout could pass:\n{line}",
            p.name
        );
        // The waited time is read as a number: a loaded machine may print 3.01 or 3.40.
        let waited_reported = waited_seconds(&line);
        assert!(
            waited_reported.is_some_and(|w| w >= TIMEOUT_SECS as f64 - 0.05
                && w < EXIT_BOUND.as_secs_f64())
                && line.contains(&format!("s waiting for rank {VICTIM} (")),
            "{}: the error does not say it timed out waiting for the stopped rank {VICTIM}:\n{line}\n{}",
            p.name,
            job.report()
        );
        assert!(
            OPS.iter().any(|op| line.contains(&format!("{op}: "))),
            "{}: the error does not name the operation:\n{line}",
            p.name
        );
    }
    assert!(
        !job.0[VICTIM].poll(),
        "the stopped rank must still be there (stopped, not dead)"
    );
    eprintln!("{}", report.join("\n"));
}

#[test]
fn stopped_worker_times_out_over_shm() {
    stopped_peer_times_out("shm");
}

#[test]
fn stopped_worker_times_out_over_tcp() {
    stopped_peer_times_out("tcp");
}

/// The seconds in "timed out after 3.02s waiting for …".
fn waited_seconds(line: &str) -> Option<f64> {
    let rest = &line[line.find("timed out after ")? + "timed out after ".len()..];
    rest[..rest.find('s')?].parse().ok()
}

/// `/proc/<pid>/stat`: (parent pid, state letter). `None` if the process is gone.
fn proc_stat(pid: i32) -> Option<(i32, char)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: parse after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Worker children of `parent`, as (rank, pid), from `/proc`.
fn worker_children(parent: i32) -> Vec<(usize, i32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if proc_stat(pid).map(|s| s.0) != Some(parent) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !cmdline.split(|&b| b == 0).any(|a| a == b"worker") {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"LOCKSTEP_RANK="))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
        if let Some(rank) = rank {
            found.push((rank, pid));
        }
    }
    found.sort();
    found
}

#[test]
fn launcher_fails_the_job_naming_the_killed_worker_and_its_signal() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = lockstep(tmp.path(), &long_run(None));
    // No restarts: this test is about how the failure is reported (recovery.rs covers restarts).
    c.args(["--nproc", "3", "--max-restarts", "0"]);
    let mut job = Job(vec![Proc::spawn("launcher".into(), c)]);
    // Not a terminal: the launcher writes its progress bar as plain lines.
    job.wait_for_line(0, "step 10/100000", START_BOUND);
    let workers = worker_children(job.0[0].pid());
    assert_eq!(
        workers.iter().map(|w| w.0).collect::<Vec<_>>(),
        vec![0, 1, 2],
        "worker children of the launcher: {workers:?}"
    );

    sigkill(workers[VICTIM].1);
    let killed_at = Instant::now();
    job.wait_exits(
        &[0],
        killed_at + EXIT_BOUND,
        &format!(
            "the launcher did not exit within {EXIT_BOUND:?} of worker rank {VICTIM} being killed"
        ),
    );
    let (status, at) = job.0[0].exit.unwrap();
    let err = job.0[0].stderr();
    assert!(!status.success(), "launcher exited 0:\n{err}");
    // The launcher's own verdict (worker lines it relays carry a "[rank N] " prefix).
    let verdict = err
        .lines()
        .find(|l| l.starts_with("lockstep: error:"))
        .unwrap_or_default();
    assert!(
        verdict.contains(&format!("worker rank {VICTIM} failed: killed by signal 9")),
        "the launcher must name the killed worker, not a survivor that failed after it, and its signal:\n{verdict}\n---\n{}",
        tail(&err, 30)
    );
    // The launcher took the other workers down with it.
    for (rank, pid) in workers {
        if let Some((_, state)) = proc_stat(pid) {
            assert!(
                state == 'Z' || state == 'X',
                "worker rank {rank} (pid {pid}) still running (state {state}) after the launcher exited"
            );
        }
    }
    eprintln!(
        "launcher: {status} after {:.2}s: {verdict}",
        (at - killed_at).as_secs_f64()
    );
}

/// Exit status of a worker whose launcher is gone (crates/cli/src/orphan.rs).
const EXIT_ORPHANED: i32 = 4;

#[test]
fn workers_of_a_killed_launcher_exit_cleanly_with_a_message_not_a_panic() {
    // Orphans are re-parented to the nearest subreaper: make it this test process, so their
    // exit statuses can be collected with waitpid.
    // SAFETY: plain prctl on this process.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut c = lockstep(tmp.path(), &long_run(None));
    c.args(["--nproc", "2", "--max-restarts", "0"]);
    let mut job = Job(vec![Proc::spawn("launcher".into(), c)]);
    job.wait_for_line(0, "step 10/100000", START_BOUND);
    let workers = worker_children(job.0[0].pid());
    assert_eq!(workers.len(), 2, "worker children: {workers:?}");
    sigkill(job.0[0].pid());
    let deadline = Instant::now() + EXIT_BOUND;
    for (rank, pid) in workers {
        let mut status = 0;
        loop {
            // SAFETY: waitpid on a process re-parented to us.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "orphaned worker rank {rank} (pid {pid}) still running {EXIT_BOUND:?} after its \
                 launcher was killed"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == EXIT_ORPHANED,
            "orphaned worker rank {rank} must exit with status {EXIT_ORPHANED} (not a panic's \
             101 or a signal); wait status {status:#x}"
        );
    }
}
