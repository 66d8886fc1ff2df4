//! The global allocator's tuning: mimalloc 2.x is the `switchboard` binary's allocator
//! (`main.rs`), and [`keep_freed_pages`] sets how soon it gives unused memory back.
//!
//! Why: mimalloc returns the pages of a freed span to the OS (`MADV_DONTNEED`) 10 ms after
//! they fall empty by default. A run's buffers (bodies, frames, batches, rows) are freed when
//! the run ends and the next runs allocate them again, so under steady load the same pages
//! were given back and faulted in again, each zero-filled by the kernel on first touch: a
//! profile of a worker at 64 runs in flight had 8.7 % of its CPU on the instruction of
//! `_mi_page_malloc` that first touches a block, and `perf stat` counted ≈ 12 page faults per
//! run in the three cluster roles and ≈ 4.4 in the embedded host. Kept for a second, a page
//! freed by one run is reused by the next; memory freed after a burst still goes back to
//! the OS a second later (arenas ten, mimalloc's multiplier), so an idle host shrinks as
//! before.

use std::ffi::c_long;

use libmimalloc_sys::{mi_option_set, mi_option_t};

/// How long a page mimalloc no longer uses stays mapped before it is returned to the OS,
/// in milliseconds (mimalloc's default is 10).
pub const PURGE_DELAY_MS: c_long = 1_000;

/// The environment variable mimalloc reads the purge delay from; set, it wins over
/// [`PURGE_DELAY_MS`].
pub const PURGE_DELAY_ENV: &str = "MIMALLOC_PURGE_DELAY";

/// `mi_option_purge_delay` of `enum mi_option_e` in mimalloc 2.x's `mimalloc.h`, which the
/// sys crate has no constant for. The test below checks it by its default (10 ms), so an
/// upgrade that renumbers the options fails there instead of setting another option.
const MI_OPTION_PURGE_DELAY: mi_option_t = 15;

/// Sets mimalloc's purge delay to [`PURGE_DELAY_MS`] unless [`PURGE_DELAY_ENV`] is set (an
/// operator's choice stays theirs). Call it first thing in `main`; it only changes when
/// freed memory is returned, never what is allocated, so calling it later is harmless too.
pub fn keep_freed_pages() {
    if std::env::var_os(PURGE_DELAY_ENV).is_some() {
        return;
    }
    // SAFETY: `mi_option_set` writes one entry of mimalloc's option table (an atomic store);
    // it takes no pointers and is safe to call from any thread at any time.
    #[allow(unsafe_code)]
    unsafe {
        mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS);
    }
}

#[cfg(test)]
mod tests {
    use libmimalloc_sys::mi_option_get;

    use super::*;

    /// mimalloc's current purge delay in milliseconds.
    fn purge_delay_ms() -> c_long {
        // SAFETY: `mi_option_get` reads one entry of mimalloc's option table (initializing
        // it from the environment on first use); it takes no pointers.
        #[allow(unsafe_code)]
        unsafe {
            mi_option_get(MI_OPTION_PURGE_DELAY)
        }
    }

    /// One test, not two: both read and write the process's one option table.
    #[test]
    fn the_purge_delay_is_the_option_set() {
        if let Some(value) = std::env::var_os(PURGE_DELAY_ENV) {
            keep_freed_pages();
            if let Some(value) = value.to_str().and_then(|v| v.parse::<c_long>().ok()) {
                assert_eq!(purge_delay_ms(), value, "the environment's value wins");
            }
            return;
        }
        // mimalloc's documented default for `purge_delay`: the index names that option.
        assert_eq!(purge_delay_ms(), 10);
        keep_freed_pages();
        assert_eq!(purge_delay_ms(), PURGE_DELAY_MS);
    }
}
