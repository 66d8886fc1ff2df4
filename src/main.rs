//! The `switchboard` binary: parses the command line and hands over to
//! [`switchboard::cli::run`].
//!
//! Everything else lives in the library (`switchboard::cli` and the role crates); this file
//! only wires.

use std::process::ExitCode;

use clap::Parser;
use switchboard::cli;

/// mimalloc instead of glibc's malloc: a run allocates and frees many small buffers on
/// several threads (JSON bodies, rows, frames), and glibc's arenas spent about a fifth of the
/// embedded host's CPU in `malloc`/`free`/`malloc_consolidate` under load (perf, 64 runs in
/// flight); mimalloc's thread-local free lists make those calls cheap. Its 2.x line (the
/// crate's `v2` feature), not the 3.x it builds by default: on the embedded benchmark the
/// allocator's functions were 14 % of the host's profile with 3.x and 10.5 % with 2.x, and
/// three alternating pairs measured 3–6 % less machine CPU per run with 2.x. `main` first
/// tells it to keep freed pages mapped a while and has the bundled SQLite allocate from it
/// ([`switchboard::allocator`]).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    switchboard::allocator::keep_freed_pages();
    switchboard::allocator::sqlite_allocates_with_mimalloc();
    let args = cli::Cli::parse();
    let runtime = match cli::runtime::build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the Tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(args)) {
        Ok(code) => code,
        Err(error) => {
            // `{:#}` prints the whole context chain on one line: "cannot connect: …: …".
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
