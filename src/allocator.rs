//! The allocators' tuning, applied first thing in `main`: mimalloc 2.x is the `switchboard`
//! binary's global allocator (`main.rs`), [`keep_freed_pages`] sets how soon it gives unused
//! memory back, and [`sqlite_allocates_with_mimalloc`] makes the bundled SQLite allocate from
//! it too (it would otherwise use glibc's `malloc`). Each function's documentation says why.

use std::ffi::{c_int, c_long, c_void};

use libmimalloc_sys::{
    mi_free, mi_good_size, mi_malloc, mi_option_set, mi_option_t, mi_realloc, mi_usable_size,
};
use libsqlite3_sys::{SQLITE_CONFIG_MALLOC, SQLITE_OK, sqlite3_config, sqlite3_mem_methods};

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
/// operator's choice stays theirs).
///
/// Why: mimalloc returns the pages of a freed span to the OS (`MADV_DONTNEED`) 10 ms after
/// they fall empty by default. A run's buffers (bodies, frames, batches, rows) are freed when
/// the run ends and the next runs allocate them again, so under steady load the same pages
/// were given back and faulted in again, each zero-filled by the kernel on first touch: a
/// profile of a worker at 64 runs in flight had 8.7 % of its CPU on the instruction of
/// `_mi_page_malloc` that first touches a block, and `perf stat` counted ≈ 12 page faults per
/// run in the three cluster roles and ≈ 4.4 in the embedded host. Kept for a second, a page
/// freed by one run is reused by the next; memory freed after a burst still goes back to
/// the OS a second later (arenas ten, mimalloc's multiplier), so an idle host shrinks as
/// before.
///
/// Call it first thing in `main`; it only changes when freed memory is returned, never what
/// is allocated, so calling it later is harmless too.
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

/// Makes the bundled SQLite allocate from mimalloc instead of glibc's `malloc`.
///
/// Why: SQLite calls the C library's allocator, not the process's Rust one, and it allocates
/// and frees on every statement: each statement with a `RETURNING` clause (the hot writes
/// return the ids and sequences they wrote) collects its rows in a temporary B-tree whose
/// page cache is allocated and freed with it, ≈ 1.9 times per run in the embedded host
/// (uprobes on `pcache1TruncateUnsafe`, 64 runs in flight). glibc's `malloc`, `free`,
/// `malloc_consolidate` and `unlink_chunk` were ≈ 11 % of the SQLite threads' CPU, and its
/// heap growing back after each trim was most of the host's page faults: `perf stat` over
/// 3 s at 64 in flight counted 1,151–1,627 page faults before, 205–306 after, and 15–30 %
/// fewer context switches per run (glibc's arena locks).
///
/// Process-wide and only possible before SQLite initializes (its first connection): call it
/// first thing in `main`, before any thread uses SQLite. Later, SQLite refuses it and keeps
/// its own allocator, which changes nothing but speed. Returns whether SQLite took it.
pub fn sqlite_allocates_with_mimalloc() -> bool {
    let methods = sqlite3_mem_methods {
        xMalloc: Some(sqlite_malloc),
        xFree: Some(sqlite_free),
        xRealloc: Some(sqlite_realloc),
        xSize: Some(sqlite_size),
        xRoundup: Some(sqlite_roundup),
        xInit: Some(sqlite_init),
        xShutdown: Some(sqlite_shutdown),
        pAppData: std::ptr::null_mut(),
    };
    // SAFETY: `SQLITE_CONFIG_MALLOC` takes one argument, a pointer to a
    // `sqlite3_mem_methods`, which SQLite copies before returning (the struct may be a
    // local). Its functions are sound for any input SQLite passes (see each). Not thread
    // safe per SQLite's documentation: the caller runs it before any other thread uses SQLite.
    #[allow(unsafe_code)]
    let rc = unsafe { sqlite3_config(SQLITE_CONFIG_MALLOC, &raw const methods) };
    rc == SQLITE_OK
}

// The allocator functions SQLite calls (`sqlite3_mem_methods`). SQLite never passes a size
// below 1 to `xMalloc`/`xRealloc`, never a null pointer to `xFree`/`xSize`, and only pointers
// these functions returned; mimalloc's blocks are 16-byte aligned (SQLite needs 8).

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_malloc(size: c_int) -> *mut c_void {
    // SAFETY: `mi_malloc` takes any size; a non-positive one asks for nothing.
    unsafe { mi_malloc(usize::try_from(size).unwrap_or(0)) }
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_free(block: *mut c_void) {
    // SAFETY: `block` came from `sqlite_malloc`/`sqlite_realloc` (mimalloc) and SQLite
    // frees it once.
    unsafe { mi_free(block) }
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_realloc(block: *mut c_void, size: c_int) -> *mut c_void {
    // SAFETY: as `sqlite_free`; on failure `mi_realloc` returns null and leaves `block`.
    unsafe { mi_realloc(block, usize::try_from(size).unwrap_or(0)) }
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_size(block: *mut c_void) -> c_int {
    // SAFETY: `block` is a live mimalloc block (see `sqlite_free`). SQLite's sizes fit its
    // `int` (it never asks for more than `SQLITE_MAX_ALLOCATION_SIZE`, below 2 GiB).
    c_int::try_from(unsafe { mi_usable_size(block) }).unwrap_or(c_int::MAX)
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_roundup(size: c_int) -> c_int {
    // SAFETY: `mi_good_size` only computes a size class.
    let good = unsafe { mi_good_size(usize::try_from(size).unwrap_or(0)) };
    c_int::try_from(good).unwrap_or(size)
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_init(_app_data: *mut c_void) -> c_int {
    SQLITE_OK
}

#[allow(unsafe_code)]
unsafe extern "C" fn sqlite_shutdown(_app_data: *mut c_void) {}

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

    /// The test below, run in a process of its own: SQLite takes an allocator only before
    /// its first use, and other tests of this binary use it (all in one process under
    /// `cargo test`).
    const SQLITE_CHILD_ENV: &str = "SB_TEST_SQLITE_ALLOCATOR_CHILD";

    #[test]
    fn sqlite_allocates_from_mimalloc() {
        if std::env::var_os(SQLITE_CHILD_ENV).is_none() {
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "allocator::tests::sqlite_allocates_from_mimalloc",
                ])
                .args(["--nocapture", "--test-threads", "1"])
                .env(SQLITE_CHILD_ENV, "1")
                .status()
                .unwrap();
            assert!(
                status.success(),
                "the check in a fresh process failed: {status}"
            );
            return;
        }
        assert!(
            sqlite_allocates_with_mimalloc(),
            "SQLite was not used before"
        );
        // SAFETY: SQLite's public allocator and a database of its own, used as documented:
        // every block freed once, the statement text NUL-terminated, the handle closed.
        #[allow(unsafe_code)]
        unsafe {
            use libsqlite3_sys::{
                sqlite3, sqlite3_close, sqlite3_exec, sqlite3_free, sqlite3_malloc, sqlite3_open,
            };
            let block = sqlite3_malloc(100);
            assert!(!block.is_null());
            assert!(
                libmimalloc_sys::mi_is_in_heap_region(block),
                "SQLite allocated from mimalloc"
            );
            sqlite3_free(block);
            // A database works on it: pages, statements, a `RETURNING` B-tree, growing rows.
            let mut db: *mut sqlite3 = std::ptr::null_mut();
            assert_eq!(sqlite3_open(c":memory:".as_ptr(), &raw mut db), SQLITE_OK);
            let sql = c"CREATE TABLE t (v TEXT); \
                WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000) \
                INSERT INTO t SELECT printf('%.*c', i, 'x') FROM n RETURNING length(v); \
                UPDATE t SET v = v || v RETURNING v; DELETE FROM t;";
            let rc = sqlite3_exec(
                db,
                sql.as_ptr(),
                None,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            assert_eq!(rc, SQLITE_OK);
            assert_eq!(sqlite3_close(db), SQLITE_OK);
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
