//! A typed out-of-memory report from a worker: the launcher learns that a worker ran out of memory
//! from this message and the abort that follows it, never from what the allocator printed.
//!
//! Why an allocator: when an allocation fails, Rust's standard library prints a line and aborts
//! the process (SIGABRT); no panic, no hook on stable Rust. Running out of memory recurs on every
//! attempt, so the launcher must not restart it, and it must tell it from any other abort. This
//! allocator forwards every call to the system allocator; when one fails it writes the protocol
//! line `{"kind":"out-of-memory","bytes":N}` with one `write(2)` from a stack buffer (allocating
//! there would fail again) before handing the failure back to Rust, which aborts. The launcher
//! counts a worker as out of memory only when both arrive: the report, then SIGABRT (a failed
//! allocation that the program handles, like `try_reserve`, is not an abort).
//!
//! Installed as the `#[global_allocator]` of every binary that links lockstep with its default
//! feature `report-oom`; a binary with its own allocator turns that feature off, and an allocator
//! abort is then an ordinary crash (restarted up to `max_restarts`). Reports are written only
//! once a process has become a worker ([`enable`]), so the launcher's own output stays clean.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::protocol::PREFIX;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// From now on, failed allocations of this process are reported to its launcher.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The system allocator, reporting allocations that fail (see the module docs).
pub struct ReportingAllocator;

// SAFETY: every call is forwarded unchanged to `System`, which upholds `GlobalAlloc`'s contract;
// the report only reads `layout` and writes to file descriptor 2.
unsafe impl GlobalAlloc for ReportingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            report(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on unchanged.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            report(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            report(new_size);
        }
        p
    }
}

/// Longest report line: the prefix, the JSON with 20 digits, the newlines.
const LINE_CAPACITY: usize = 96;

fn report(bytes: usize) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let mut buf = [0u8; LINE_CAPACITY];
    let len = report_line(bytes as u64, &mut buf);
    // SAFETY: writes `len` initialised bytes of a stack buffer to stderr; nothing is allocated.
    // A short or failed write loses the report, and the abort is then an ordinary crash.
    unsafe { libc::write(2, buf.as_ptr().cast(), len) };
}

/// Writes the report line into `buf` without allocating; returns its length. It starts with a
/// newline, so it begins a line even if the worker was halfway through printing one.
fn report_line(bytes: u64, buf: &mut [u8; LINE_CAPACITY]) -> usize {
    let mut len = 0;
    let mut put = |part: &[u8]| {
        buf[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    };
    put(b"\n");
    put(PREFIX.as_bytes());
    put(br#"{"kind":"out-of-memory","bytes":"#);
    let mut digits = [0u8; 20];
    put(crate::decimal::digits(bytes, &mut digits));
    put(b"}\n");
    len
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::WorkerMessage;

    /// The hand-written line is exactly the protocol's message, for any size.
    #[test]
    fn the_report_line_parses_as_the_protocol_message() {
        for bytes in [0, 7, 10, 35_184_372_088_832, u64::MAX] {
            let mut buf = [0u8; LINE_CAPACITY];
            let len = report_line(bytes, &mut buf);
            let text = std::str::from_utf8(&buf[..len]).unwrap();
            assert!(text.starts_with('\n') && text.ends_with('\n'), "{text:?}");
            let parsed = WorkerMessage::parse(text.trim()).unwrap().unwrap();
            assert_eq!(parsed, WorkerMessage::OutOfMemory { bytes });
        }
    }
}
