//! Shared-memory names against other processes (issue "Nothing lost, nothing clobbered, nothing
//! crashes", findings 1 and 2): files that killed jobs leaked are reclaimed, and only those —
//! never a live job's, another user's, or what a symlink points to —; a name another user took
//! first is a typed, permanent error naming the path and the owner; keyed names cannot be taken
//! first. Leaks come from real child processes (the test binary re-executed, running only
//! `child_process`), killed with SIGKILL. The tests with another user need root (to create the
//! squatter's file and run the victim as a third uid); without it they say so and pass.

#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_comm::auth::JobSecret;
use lockstep_comm::shared_parts::SharedParts;
use lockstep_comm::shm::{reclaim_leaked, ShmOptions, ShmTransport};
use lockstep_comm::{CommError, Communicator};

const CHILD_ENV: &str = "LOCKSTEP_SHM_HYGIENE_CHILD";
const RING: usize = 64 * 1024;
/// Hang guard for waiting on a child; never an assertion about speed.
const GUARD: Duration = Duration::from_secs(60);
/// The squatter's and the victim's uids when the test runs as root.
const SQUATTER_UID: u32 = 65534;
const VICTIM_UID: u32 = 65533;

fn opts(dir: &Path) -> ShmOptions {
    ShmOptions {
        ring_bytes: RING,
        dir: dir.to_path_buf(),
    }
}

fn spawn_child(mode: &str, dir: &Path, job: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "child_process",
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ])
    .env(CHILD_ENV, format!("{mode}|{}|{job}", dir.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    c
}

/// Not a test: the child process of the tests below (does nothing unless started by them).
#[test]
#[ignore = "helper process, started by other tests"]
fn child_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '|');
    let (mode, dir, job) = (
        parts.next().unwrap(),
        PathBuf::from(parts.next().unwrap()),
        parts.next().unwrap(),
    );
    let long = Duration::from_secs(600);
    match mode {
        // Rank 1 of 2 waiting for a rank 0 that never comes: its segment stays until it is killed.
        "segment" => {
            let _ = ShmTransport::establish(1, 2, job, long, &opts(&dir));
        }
        // Two ranks (threads); rank 0 sets up its gradient window, rank 1 never does: the window
        // stays until the process is killed.
        "window" => {
            let mut comms = pair(&dir, job, long);
            let mut rank0 = comms.remove(0);
            let _keep = comms;
            let _ = SharedParts::establish(&mut rank0, 1, 1 << 16);
        }
        // As another user: set up rank 0 of 2 (plain or keyed names) and print what happened.
        "victim" | "victim-keyed" => {
            let key = JobSecret::from_hex(&"ab".repeat(32)).unwrap();
            let t = Duration::from_secs(2);
            let r = if mode == "victim" {
                ShmTransport::establish(0, 1, job, t, &opts(&dir))
            } else {
                ShmTransport::establish_keyed(0, 1, job, t, &opts(&dir), &key)
            };
            match r {
                Ok(_) => println!("\nRESULT:OK"),
                Err(e) => println!("\nRESULT:ERR permanent={} {e}", e.is_permanent()),
            }
        }
        "victim-attach" => {
            match ShmTransport::establish(0, 2, job, Duration::from_secs(2), &opts(&dir)) {
                Ok(_) => println!("\nRESULT:OK"),
                Err(e) => println!("\nRESULT:ERR permanent={} {e}", e.is_permanent()),
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Both ranks of a shared-memory group of two in this process.
fn pair(dir: &Path, job: &str, timeout: Duration) -> Vec<Communicator> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                sc.spawn(move || {
                    let t = ShmTransport::establish(r, 2, job, timeout, &opts(dir)).unwrap();
                    Communicator::new(Arc::new(t), timeout)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Waits until a file whose name starts with `prefix` appears in `dir`; returns its name.
fn wait_for_file(dir: &Path, prefix: &str) -> String {
    let until = Instant::now() + GUARD;
    loop {
        if let Some(f) = files(dir).into_iter().find(|f| f.starts_with(prefix)) {
            return f;
        }
        assert!(
            Instant::now() < until,
            "hang guard: {prefix}* never appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Children that each leave a file: `(mode, job, prefix of the file)`. All run at once and are
/// killed with SIGKILL (not reaped) once every file is there: a child set up after another was
/// killed would reclaim its leak already.
fn leak(dir: &Path, what: &[(&str, &str, &str)]) -> Vec<(Child, String)> {
    let children: Vec<Child> = what
        .iter()
        .map(|(mode, job, _)| spawn_child(mode, dir, job).spawn().unwrap())
        .collect();
    let names: Vec<String> = what.iter().map(|w| wait_for_file(dir, w.2)).collect();
    children
        .into_iter()
        .zip(names)
        .map(|(mut c, n)| {
            c.kill().unwrap();
            (c, n)
        })
        .collect()
}

/// A pid that certainly belonged to a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn leaked_files_of_dead_processes_are_reclaimed_and_nothing_else() {
    let s = Scratch::new();
    let dir = &s.dir;
    // What must stay: a live job's segment and window (this process, mid-setup) …
    let live_dir = dir.clone();
    let live = std::thread::spawn(move || {
        ShmTransport::establish(0, 2, "live-l", Duration::from_secs(5), &opts(&live_dir)).err()
    });
    let live_segment = wait_for_file(dir, "lockstep-live-l-0");
    let mut comms = pair(dir, "live-w", Duration::from_secs(5));
    let mut rank0 = comms.remove(0);
    let live_window = std::thread::spawn(move || {
        let _ = SharedParts::establish(&mut rank0, 1, 1 << 16);
    });
    let live_window_name = wait_for_file(dir, "lockstep-live-w-parts-");
    // Leaks of killed processes: a segment (its killer does not reap it yet: a zombie still has
    // its pid) and a gradient window.
    let mut leaks = leak(
        dir,
        &[
            ("segment", "dead-a", "lockstep-dead-a-1"),
            ("window", "dead-b", "lockstep-dead-b-parts-"),
        ],
    );
    let (mut zombie, segment) = leaks.remove(0);
    let (mut child, window) = leaks.remove(0);
    child.wait().unwrap();
    assert!(window.contains('.'), "window names its creator: {window}");
    // A segment left under its private name by a process that has exited (the real window for
    // this is a few instructions long, so the file is made here with a real dead pid).
    let tmp = format!(
        ".lockstep-dead-c-0.{}.12345.00000000000000ab.tmp",
        dead_pid()
    );
    std::fs::write(dir.join(&tmp), vec![0u8; 4096]).unwrap();
    // … a symlink with a leak's name, pointing at a file that must not be touched …
    let victim = dir.join("victim");
    std::fs::copy(dir.join(&segment), &victim).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("lockstep-link-0")).unwrap();
    let link_tmp = format!(".lockstep-link-1.{}.1.00000000000000ab.tmp", dead_pid());
    std::os::unix::fs::symlink(&victim, dir.join(&link_tmp)).unwrap();
    // … another user's leak (root only can make one) and a file that is not lockstep's.
    let foreign = dir.join("lockstep-foreign-0");
    std::fs::copy(dir.join(&segment), &foreign).unwrap();
    if is_root() {
        std::os::unix::fs::chown(&foreign, Some(SQUATTER_UID), Some(SQUATTER_UID)).unwrap();
    }
    std::fs::write(dir.join("unrelated"), b"x").unwrap();

    let report = reclaim_leaked(dir);
    zombie.wait().unwrap();

    let mut removed: Vec<String> = report
        .removed
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    removed.sort();
    let mut want = vec![segment.clone(), window.clone(), tmp.clone()];
    want.sort();
    if !is_root() {
        // Then the "foreign" copy is ours, and as leaked as the segment it copies.
        want.push("lockstep-foreign-0".into());
        want.sort();
    }
    assert_eq!(removed, want, "{report:?}");
    assert!(report.bytes >= 3 * 4096, "{report:?}");
    assert!(report.errors.is_empty(), "{report:?}");
    assert_eq!(report.alive, 2, "the live segment and window: {report:?}");
    let left = files(dir);
    for stays in [
        &live_segment,
        &live_window_name,
        "victim",
        "lockstep-link-0",
        &link_tmp,
        "unrelated",
    ] {
        assert!(
            left.iter().any(|f| f == stays),
            "{stays} was removed: {left:?}"
        );
    }
    if is_root() {
        assert!(foreign.exists(), "another user's file was removed");
    }
    assert_eq!(
        std::fs::read(&victim).unwrap().len(),
        std::fs::metadata(&victim).unwrap().len() as usize
    );
    // The live setups go on to their own timeouts, untouched.
    assert!(live.join().unwrap().is_some());
    live_window.join().unwrap();
    drop(comms);
}

#[test]
fn a_new_transport_reclaims_other_jobs_leaks_but_keeps_its_own_jobs_files() {
    let s = Scratch::new();
    let dir = &s.dir;
    let own_prefix = format!("lockstep-{}-1", s.job);
    let leaks = leak(
        dir,
        &[
            ("segment", "old-job", "lockstep-old-job-1"),
            ("segment", &s.job, &own_prefix),
        ],
    );
    let names: Vec<String> = leaks
        .into_iter()
        .map(|(mut c, n)| {
            c.wait().unwrap();
            n
        })
        .collect();
    let (other, own) = (&names[0], names[1].clone());
    // One rank of its own: set up at once, and on its way it removed the other job's leak. Its
    // own job's stale file is left for its own rank 1 to replace (see tests/shm.rs).
    let t = ShmTransport::establish(0, 1, &s.job, Duration::from_secs(5), &opts(dir)).unwrap();
    assert_eq!(files(dir), vec![own], "{other} should be gone");
    drop(t);
}

/// A sticky, world-writable directory like /dev/shm, for the squatter and the victim.
fn sticky_dir(s: &Scratch) -> PathBuf {
    let dir = s.dir.join("sticky");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&s.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    dir
}

/// The squatter's file at `name`: owned by SQUATTER_UID, mode 0600, empty.
fn squat(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, b"").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&path, Some(SQUATTER_UID), Some(SQUATTER_UID)).unwrap();
    path
}

/// Runs the child `mode` as VICTIM_UID and returns what it printed.
fn as_victim(mode: &str, dir: &Path, job: &str) -> String {
    let out = spawn_child(mode, dir, job)
        .uid(VICTIM_UID)
        .gid(VICTIM_UID)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("RESULT:"))
        .unwrap_or_else(|| panic!("the victim printed no result: {text:?}"))
        .to_string()
}

fn expect_taken(result: &str, path: &Path) {
    assert!(result.starts_with("ERR permanent=true "), "{result}");
    assert!(result.contains(&path.display().to_string()), "{result}");
    assert!(result.contains(&format!("uid {SQUATTER_UID}")), "{result}");
    assert!(result.contains(&format!("uid {VICTIM_UID}")), "{result}");
    // The squatter's user name too, where the user database knows it.
    if let Some(name) = user_of(SQUATTER_UID) {
        assert!(result.contains(&format!("user {name}")), "{result}");
    }
}

/// The login name of `uid` from /etc/passwd, if listed there.
fn user_of(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 2 && f[2] == uid.to_string()).then(|| f[0].to_string())
    })
}

#[test]
fn a_name_another_user_took_first_is_a_permanent_error_naming_path_and_owner() {
    if !is_root() {
        eprintln!("skipped: needs root to create another user's file and run as a third user");
        return;
    }
    let s = Scratch::new();
    let dir = sticky_dir(&s);
    // The victim's own segment name is taken: it cannot be renamed over (sticky directory).
    let own = squat(&dir, "lockstep-sq1-0");
    expect_taken(&as_victim("victim", &dir, "sq1"), &own);
    // A peer's name is taken: the peer could never replace it, so the victim stops at once.
    let peer = squat(&dir, "lockstep-sq2-1");
    expect_taken(&as_victim("victim-attach", &dir, "sq2"), &peer);
    // Keyed names do not follow from the job id: the squatter's guess is harmless.
    let _guess = squat(&dir, "lockstep-sq3-0");
    assert_eq!(as_victim("victim-keyed", &dir, "sq3"), "OK");
    // Nothing of the victim's is left, and the squatter's files are untouched.
    let left: Vec<(String, u32)> = files(&dir)
        .into_iter()
        .map(|f| {
            let uid = std::fs::symlink_metadata(dir.join(&f)).unwrap().uid();
            (f, uid)
        })
        .collect();
    assert!(left.iter().all(|(_, uid)| *uid == SQUATTER_UID), "{left:?}");
    assert_eq!(left.len(), 3, "{left:?}");
}

#[test]
fn a_name_taken_error_is_typed_and_permanent_and_others_are_not() {
    let e = CommError::NameTaken {
        path: "/dev/shm/lockstep-j-0".into(),
        uid: 1001,
        user: Some("mallory".into()),
        me: 1000,
    };
    assert!(e.is_permanent());
    let m = e.to_string();
    assert!(
        m.contains("/dev/shm/lockstep-j-0") && m.contains("user mallory (uid 1001)"),
        "{m}"
    );
    assert!(!CommError::Rendezvous("x".into()).is_permanent());
    assert!(!CommError::setup("x", "y").is_permanent());
}
