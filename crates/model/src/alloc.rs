//! Allocator tuning for training processes.
//!
//! Why: every training step allocates and frees activation and gradient buffers of hundreds of
//! kilobytes to megabytes. glibc serves blocks above its mmap threshold (128 KiB at first, then
//! adapting) with fresh `mmap`s and returns them with `munmap`, so each step page-faults its
//! whole working set again; keeping such blocks in the heap turns that into reuse, which on the
//! benchmark MLP cut `loss_and_grad`'s time by more than half. Only the calling
//! binary should decide this, once at start-up, so it is an explicit function, not a side
//! effect of building a model.

/// Largest value glibc accepts for `M_MMAP_THRESHOLD` on 64-bit targets
/// (`DEFAULT_MMAP_THRESHOLD_MAX` = 32 MiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 * 1024 * 1024;

/// Keeps allocations up to 32 MiB in the malloc heap and stops glibc from trimming the heap
/// back to the OS after every free. Returns whether the setting was applied: `false` on
/// platforms without glibc (where the system allocator behaves differently; consider a
/// `#[global_allocator]` such as mimalloc there). Affects speed only, never results.
pub fn tune_allocator_for_training() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
