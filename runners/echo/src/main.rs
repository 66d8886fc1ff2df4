//! The `echo` binary started by `runners/echo/manifest.toml`; the runner is in the library.

fn main() -> std::io::Result<()> {
    sb_runner_echo::serve()
}
