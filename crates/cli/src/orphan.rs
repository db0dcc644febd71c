//! A worker whose launcher died must not linger or die by a panic.
//!
//! Two ways a worker learns it: a watchdog thread sees its parent process change (the launcher was
//! killed and the worker was re-parented), or a write to the launcher's pipes fails (`println!`
//! would panic with status 101 there). Either way the worker tries to say so on stderr and exits
//! with [`EXIT_ORPHANED`]. Its peers see it leave and fail their collectives naming it, so the
//! whole group ends within the collective timeout.

use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

/// The launcher's pid, once this worker watches it.
static LAUNCHER: OnceLock<i32> = OnceLock::new();

/// Exit status of a worker that stopped because its launcher was gone.
pub const EXIT_ORPHANED: i32 = 4;

/// How often the watchdog looks at the parent.
const POLL: Duration = Duration::from_millis(250);

fn leave(rank: usize, why: &str) -> ! {
    // The launcher's stderr pipe may be gone too: a failed write changes nothing.
    let _ = writeln!(
        std::io::stderr(),
        "lockstep worker rank {rank}: {why}; stopping (exit status {EXIT_ORPHANED})"
    );
    std::process::exit(EXIT_ORPHANED)
}

/// Start the watchdog for a worker started by the launcher (its current parent).
pub fn watch_launcher(rank: usize) {
    // SAFETY: getppid has no preconditions.
    let launcher = *LAUNCHER.get_or_init(|| unsafe { libc::getppid() });
    std::thread::Builder::new()
        .name("launcher-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(POLL);
            // SAFETY: as above.
            if unsafe { libc::getppid() } != launcher {
                leave(rank, &format!("its launcher (pid {launcher}) is gone"));
            }
        })
        .expect("spawning the launcher watchdog");
}

/// Did this worker lose its launcher? (Then a failure of its own — a peer that left first — is
/// reported as the orphaning it really is.)
pub fn is_orphaned() -> bool {
    // SAFETY: getppid has no preconditions.
    LAUNCHER
        .get()
        .is_some_and(|&launcher| unsafe { libc::getppid() } != launcher)
}

/// Leave as an orphan if this worker is one, waiting up to `settle` for the kernel to say so:
/// a killed launcher's pipes close before its children are re-parented, so a peer that saw the
/// pipe close and left can make this worker fail while `getppid` still names the dying launcher.
pub fn exit_if_orphaned(rank_hint: &str, settle: Duration) {
    let deadline = std::time::Instant::now() + settle;
    while !is_orphaned() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if is_orphaned() {
        let _ = writeln!(
            std::io::stderr(),
            "lockstep worker{rank_hint}: its launcher is gone; stopping (exit status {EXIT_ORPHANED})"
        );
        std::process::exit(EXIT_ORPHANED);
    }
}

/// Write one line to stdout (`to_stdout`) or stderr without panicking; a closed pipe means the
/// launcher is gone.
pub fn emit(rank: usize, to_stdout: bool, line: &str) {
    let written = if to_stdout {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").and_then(|_| out.flush())
    } else {
        writeln!(std::io::stderr(), "{line}")
    };
    if written.is_err() {
        leave(rank, "its launcher stopped reading its output");
    }
}
