//! The `local-agent` binary started by `runners/local-agent/manifest.toml`; the runner is in
//! the library.

fn main() -> std::io::Result<()> {
    sb_runner_local_agent::serve()
}
