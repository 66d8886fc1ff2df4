//! The echo and local-agent runners built into the `switchboard` binary.
//!
//! A fresh `switchboard dev` binds its default agent to the official echo runner
//! (`plugin:switchboard/echo/default`, `runners/echo`), or, given a model, to the official
//! local agent (`plugin:switchboard/local-agent/default`, `runners/local-agent`). Those
//! runners are binaries of their own, which `cargo build --workspace` and the Docker image
//! build, but `cargo run -- dev` (the README's first command) builds only the `switchboard`
//! binary. Rather than leave the first message of a new user unanswered, the binary carries
//! the same runners behind a hidden subcommand (`switchboard runner echo|local-agent`), and
//! `dev` registers them through generated plugin directories **only when the standalone
//! runner cannot be loaded** ([`runner_loads`]); the official plugin always wins when it is
//! there.
//!
//! The runners are the very same code as the standalone binaries (the `sb-runner-echo` and
//! `sb-runner-local-agent` libraries; the local agent's manifest is its `manifest.toml`
//! with only the command replaced), so the two cannot behave differently on the wire.

use std::io;
use std::path::{Path, PathBuf};

use sb_worker::plugins::{CommandLookup, MANIFEST_FILES, load_plugin_dir};
use serde_json::json;

/// Runner id of the official echo runner (and of the built-in copy).
pub const ECHO_RUNNER_ID: &str = "plugin:switchboard/echo/default";

/// Name of the plugin directory [`write_echo_plugin`] creates.
pub const ECHO_PLUGIN_DIR: &str = "switchboard-echo";

/// Runner id of the official local agent (and of the built-in copy).
pub const LOCAL_AGENT_RUNNER_ID: &str = sb_runner_local_agent::RUNNER_ID;

/// Name of the plugin directory [`write_local_agent_plugin`] creates.
pub const LOCAL_AGENT_PLUGIN_DIR: &str = "switchboard-local-agent";

/// Serves the echo runner on stdin/stdout until the host says `shutdown` or closes stdin.
/// Blocks the calling thread.
pub fn serve_echo() -> io::Result<()> {
    sb_runner_echo::serve()
}

/// Serves the local agent on stdin/stdout until the host says `shutdown` or closes stdin.
/// Blocks the calling thread.
pub fn serve_local_agent() -> io::Result<()> {
    sb_runner_local_agent::serve()
}

/// Writes (or rewrites) a plugin directory under `root` holding the local agent's manifest
/// with its command replaced by `<program> runner local-agent`; returns `root`, the plugins
/// directory to add to `worker.runners_dirs`.
pub fn write_local_agent_plugin(root: &Path, program: &Path) -> io::Result<PathBuf> {
    let plugin_dir = root.join(LOCAL_AGENT_PLUGIN_DIR);
    std::fs::create_dir_all(&plugin_dir)?;
    let program = program.to_str().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("executable path {} is not valid UTF-8", program.display()),
        )
    })?;
    let manifest: toml::Value =
        toml::from_str(sb_runner_local_agent::MANIFEST_TOML).map_err(io::Error::other)?;
    let mut manifest = serde_json::to_value(manifest).map_err(io::Error::other)?;
    let runners = manifest["runners"]
        .as_array_mut()
        .ok_or_else(|| io::Error::other("the local agent's manifest has no runners"))?;
    for runner in runners {
        runner["execution"]["command"] = json!(program);
        runner["execution"]["args"] = json!(["runner", "local-agent"]);
    }
    let text = serde_json::to_string_pretty(&manifest).map_err(io::Error::other)?;
    std::fs::write(plugin_dir.join("manifest.json"), text)?;
    Ok(root.to_path_buf())
}

/// Whether the plugin directories `dirs` (searched like the worker does, in order) yield a
/// loadable runner `runner_id`: a manifest that declares it and a command that resolves.
/// Nothing is logged: the worker reports skipped plugins itself when it loads them.
pub fn runner_loads(dirs: &[PathBuf], runner_id: &str, lookup: &CommandLookup) -> bool {
    dirs.iter().any(|dir| {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return false;
        };
        entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .any(|plugin_dir| {
                plugin_dir.is_dir()
                    && MANIFEST_FILES.iter().any(|f| plugin_dir.join(f).is_file())
                    && load_plugin_dir(&plugin_dir, lookup).is_ok_and(|runners| {
                        runners.iter().any(|r| {
                            r.as_ref()
                                .is_ok_and(|r| r.runner_id.to_string() == runner_id)
                        })
                    })
            })
    })
}

/// Writes (or rewrites) a plugins directory under `root` holding one plugin that runs the
/// built-in echo runner as `<program> runner echo`, and returns the plugins directory to add
/// to `worker.runners_dirs`. `program` should be the absolute path of the running
/// `switchboard` executable. The manifest is JSON so that any path is escaped correctly.
pub fn write_echo_plugin(root: &Path, program: &Path) -> io::Result<PathBuf> {
    let plugin_dir = root.join(ECHO_PLUGIN_DIR);
    std::fs::create_dir_all(&plugin_dir)?;
    let program = program.to_str().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("executable path {} is not valid UTF-8", program.display()),
        )
    })?;
    let manifest = json!({
        "plugin": {"author": "switchboard", "name": "echo", "version": env!("CARGO_PKG_VERSION")},
        "runners": [{
            "name": "default",
            "label": {"en_US": "Echo"},
            "description": {"en_US": "Streams the input back (built into the switchboard binary)."},
            "capabilities": {"streaming": true},
            "permissions": {"history": ["page"]},
            "config_schema": [],
            "execution": {
                "command": program,
                "args": ["runner", "echo"],
                "mode": "shared",
                "max_concurrency": 64,
                "pool": "default",
                "env": ["RUST_LOG"],
            },
        }],
    });
    let text = serde_json::to_string_pretty(&manifest).map_err(io::Error::other)?;
    std::fs::write(plugin_dir.join("manifest.json"), text)?;
    Ok(root.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_plugin_loads_as_the_echo_runner() {
        let dir = tempfile::tempdir().unwrap();
        // Any existing file works as the program: resolution only checks that it exists.
        let program = std::env::current_exe().unwrap();
        let plugins = write_echo_plugin(dir.path(), &program).unwrap();
        let lookup = CommandLookup::default();
        assert!(runner_loads(
            std::slice::from_ref(&plugins),
            ECHO_RUNNER_ID,
            &lookup
        ));
        assert!(!runner_loads(
            std::slice::from_ref(&plugins),
            "plugin:switchboard/echo/other",
            &lookup
        ));

        let runners = load_plugin_dir(&plugins.join(ECHO_PLUGIN_DIR), &lookup).unwrap();
        let runner = runners.into_iter().next().unwrap().unwrap();
        assert_eq!(runner.program, program);
        assert_eq!(runner.execution.args, ["runner", "echo"]);
    }

    #[test]
    fn the_generated_plugin_loads_as_the_local_agent_with_its_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let program = std::env::current_exe().unwrap();
        let plugins = write_local_agent_plugin(dir.path(), &program).unwrap();
        let lookup = CommandLookup::default();
        assert!(runner_loads(
            std::slice::from_ref(&plugins),
            LOCAL_AGENT_RUNNER_ID,
            &lookup
        ));
        // Both built-ins side by side in one plugins directory.
        write_echo_plugin(dir.path(), &program).unwrap();
        assert!(runner_loads(
            std::slice::from_ref(&plugins),
            ECHO_RUNNER_ID,
            &lookup
        ));

        let runners = load_plugin_dir(&plugins.join(LOCAL_AGENT_PLUGIN_DIR), &lookup).unwrap();
        let runner = runners.into_iter().next().unwrap().unwrap();
        assert_eq!(runner.program, program);
        assert_eq!(runner.execution.args, ["runner", "local-agent"]);
        let descriptor = serde_json::to_value(&runner.manifest).unwrap();
        assert_eq!(
            descriptor["capabilities"]["tool_calling"], true,
            "{descriptor}"
        );
        assert_eq!(descriptor["capabilities"]["steering"], true);
        let schema: Vec<&str> = descriptor["config_schema"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        assert_eq!(schema, sb_runner_local_agent::config::keys::ALL);
    }

    #[test]
    fn the_official_local_agent_manifest_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("runners/local-agent");
        // Its command is found next to the worker executable, as cargo lays binaries out;
        // resolution only checks that the file exists.
        let exe_dir = tempfile::tempdir().unwrap();
        let bin = exe_dir.path().join("local-agent");
        std::fs::write(&bin, b"").unwrap();
        let lookup = CommandLookup {
            exe_dir: Some(exe_dir.path().to_path_buf()),
            path: None,
        };
        let runners = load_plugin_dir(&dir, &lookup).unwrap();
        let runner = runners.into_iter().next().unwrap().unwrap();
        assert_eq!(runner.runner_id.to_string(), LOCAL_AGENT_RUNNER_ID);
        assert_eq!(runner.program, bin);
    }

    #[test]
    fn missing_commands_and_directories_do_not_load() {
        let dir = tempfile::tempdir().unwrap();
        let plugins = write_echo_plugin(dir.path(), &dir.path().join("no-such-binary")).unwrap();
        let lookup = CommandLookup::default();
        assert!(!runner_loads(&[plugins], ECHO_RUNNER_ID, &lookup));
        assert!(!runner_loads(
            &[dir.path().join("absent")],
            ECHO_RUNNER_ID,
            &lookup
        ));
    }
}
