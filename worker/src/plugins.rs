//! Runner plugin discovery: manifests on disk → runner descriptors the worker can host
//! (SPEC §4.1).
//!
//! A plugins directory holds one directory per plugin; each has a `manifest.toml` (or
//! `manifest.yaml` / `manifest.yml` / `manifest.json`, read with the `config` crate):
//!
//! ```toml
//! [plugin]
//! author = "switchboard"
//! name = "echo"
//! version = "0.1.0"
//!
//! [[runners]]
//! name = "default"
//! label = { en_US = "Echo" }
//! description = { en_US = "Streams the input back." }
//! capabilities = { streaming = true }
//! permissions = { history = ["page"] }
//! config_schema = []
//!
//! [runners.execution]
//! command = "bin/echo"
//! args = []
//! mode = "shared"          # or "per_run"
//! max_concurrency = 64
//! pool = "default"
//! env = ["RUST_LOG"]       # passed through; everything else is cleared
//! ```
//!
//! Each `[[runners]]` entry becomes a [`PluginRunner`] with id
//! `plugin:<author>/<name>/<runner>`. Unknown keys are rejected everywhere in a runner entry
//! (capabilities and permissions are typed). A bad runner entry is skipped with a warning and
//! the others still load; a plugin whose `[plugin]` table is bad is skipped whole.
//!
//! # Resolving `execution.command`
//! In order, the first existing file wins ([`resolve_command`]):
//! 1. the path relative to the plugin directory (or the absolute path);
//! 2. the command's **file name** next to the running executable, then in that directory's
//!    parent — this finds binaries built by cargo (`target/<profile>/echo`) from the worker
//!    binary (`target/<profile>/switchboard`) and from test binaries
//!    (`target/<profile>/deps/…`);
//! 3. only for a bare name without a directory part, the `PATH`. (`bin/echo` is never looked
//!    up on `PATH`, where it would find the coreutils `echo`.)

use std::collections::HashSet;
use std::ffi::OsString;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use sb_protocol::manifest::{
    AgentRunnerCapabilities, AgentRunnerManifest, AgentRunnerPermissions, DynamicFormItemSchema,
    I18nObject, RunnerId,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::runner::process::ProcessSpec;
use crate::runner::{ExecutionMode, RunnerSpec};

/// Manifest file names tried in each plugin directory, in order.
pub const MANIFEST_FILES: [&str; 4] = [
    "manifest.toml",
    "manifest.yaml",
    "manifest.yml",
    "manifest.json",
];

/// The `[plugin]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginInfo {
    pub author: String,
    pub name: String,
    pub version: String,
    #[serde(default)]
    pub description: Option<I18nObject>,
}

/// `[runners.execution]`: how the worker runs the runner.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutionConfig {
    /// Executable, resolved by [`resolve_command`].
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default = "default_mode")]
    pub mode: ExecutionMode,
    /// `shared`: concurrent runs on the one process; `per_run`: concurrent processes.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: NonZeroUsize,
    /// Worker pool (queue `switchboard.runs.<pool>`) that hosts this runner.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// Environment variables passed through from the worker.
    #[serde(default)]
    pub env: Vec<String>,
}

fn default_mode() -> ExecutionMode {
    ExecutionMode::Shared
}

fn default_max_concurrency() -> NonZeroUsize {
    // Conservative: a manifest that says nothing gets moderate parallelism.
    NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN)
}

fn default_pool() -> String {
    "default".to_owned()
}

/// One `[[runners]]` entry as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunnerEntry {
    name: String,
    #[serde(default)]
    label: Option<I18nObject>,
    #[serde(default)]
    description: Option<I18nObject>,
    #[serde(default)]
    capabilities: AgentRunnerCapabilities,
    #[serde(default)]
    permissions: AgentRunnerPermissions,
    #[serde(default)]
    config_schema: Vec<DynamicFormItemSchema>,
    #[serde(default)]
    metadata: Map<String, Value>,
    execution: ExecutionConfig,
}

/// A runner found on disk, ready to host.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginRunner {
    pub runner_id: RunnerId,
    pub plugin: PluginInfo,
    /// The plugin directory (working directory of its processes).
    pub plugin_dir: PathBuf,
    /// The typed manifest (what the registry stores and the orchestrator authorizes from).
    pub manifest: AgentRunnerManifest,
    pub execution: ExecutionConfig,
    /// `execution.command`, resolved.
    pub program: PathBuf,
}

impl PluginRunner {
    /// What the runner host needs to start processes.
    #[must_use]
    pub fn runner_spec(&self) -> RunnerSpec {
        RunnerSpec {
            runner_id: self.runner_id.clone(),
            process: ProcessSpec {
                program: self.program.clone(),
                args: self.execution.args.clone(),
                env_allow: self.execution.env.clone(),
                cwd: Some(self.plugin_dir.clone()),
                label: self.runner_id.to_string(),
            },
            mode: self.execution.mode,
            max_concurrency: self.execution.max_concurrency,
        }
    }
}

/// Why a plugin or a runner was skipped.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot read plugins directory {}: {source}", .path.display())]
    ReadDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no manifest (manifest.toml, .yaml, .yml or .json) in {}", .0.display())]
    NoManifest(PathBuf),
    #[error("invalid manifest {}: {message}", .path.display())]
    Manifest { path: PathBuf, message: String },
    #[error("invalid runner #{index} in {}: {message}", .path.display())]
    Runner {
        path: PathBuf,
        index: usize,
        message: String,
    },
    #[error("runner {runner_id}: command `{command}` not found (looked in {}, next to the worker executable{path_note})", .plugin_dir.display())]
    CommandNotFound {
        runner_id: String,
        command: String,
        plugin_dir: PathBuf,
        path_note: &'static str,
    },
    #[error("runner {0} is defined twice; the first definition wins")]
    Duplicate(String),
}

/// The outcome of loading: the runners that loaded, and a warning per thing skipped.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub runners: Vec<PluginRunner>,
    pub skipped: Vec<PluginError>,
}

/// Where the commands are looked up (injectable for tests).
#[derive(Debug, Clone, Default)]
pub struct CommandLookup {
    /// Directory of the running executable (`std::env::current_exe()`'s parent).
    pub exe_dir: Option<PathBuf>,
    /// The `PATH` value.
    pub path: Option<OsString>,
}

impl CommandLookup {
    /// From the current process.
    #[must_use]
    pub fn from_env() -> Self {
        Self {
            exe_dir: std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf)),
            path: std::env::var_os("PATH"),
        }
    }
}

/// Loads every plugin under each of `dirs`, in order. A runner id found again in a later
/// directory is skipped (so put `--runners-dir` overrides before the bundled directory).
/// Every problem is logged as a warning and reported in [`LoadReport::skipped`].
#[must_use]
pub fn load_plugins(dirs: &[PathBuf], lookup: &CommandLookup) -> LoadReport {
    let mut report = LoadReport::default();
    let mut seen = HashSet::new();
    for dir in dirs {
        let mut entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .collect::<Vec<_>>(),
            Err(source) => {
                report.skipped.push(PluginError::ReadDir {
                    path: dir.clone(),
                    source,
                });
                continue;
            }
        };
        // Deterministic order, whatever the file system does.
        entries.sort();
        for plugin_dir in entries.into_iter().filter(|p| p.is_dir()) {
            if !MANIFEST_FILES.iter().any(|f| plugin_dir.join(f).is_file()) {
                // Not a plugin (e.g. a crate's `src/`): ignore quietly.
                continue;
            }
            match load_plugin_dir(&plugin_dir, lookup) {
                Ok(results) => {
                    for result in results {
                        match result {
                            Ok(runner) if !seen.insert(runner.runner_id.clone()) => {
                                report
                                    .skipped
                                    .push(PluginError::Duplicate(runner.runner_id.to_string()));
                            }
                            Ok(runner) => report.runners.push(runner),
                            Err(e) => report.skipped.push(e),
                        }
                    }
                }
                Err(e) => report.skipped.push(e),
            }
        }
    }
    for problem in &report.skipped {
        tracing::warn!(error = %problem, "runner skipped");
    }
    report
}

/// Loads one plugin directory: an error for the plugin as a whole, else one result per
/// `[[runners]]` entry.
pub fn load_plugin_dir(
    plugin_dir: &Path,
    lookup: &CommandLookup,
) -> Result<Vec<Result<PluginRunner, PluginError>>, PluginError> {
    let path = MANIFEST_FILES
        .iter()
        .map(|f| plugin_dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| PluginError::NoManifest(plugin_dir.to_path_buf()))?;
    let manifest_err = |message: String| PluginError::Manifest {
        path: path.clone(),
        message,
    };
    let raw: Value = config::Config::builder()
        .add_source(config::File::from(path.as_path()))
        .build()
        .and_then(config::Config::try_deserialize)
        .map_err(|e| manifest_err(e.to_string()))?;
    let Value::Object(mut top) = raw else {
        return Err(manifest_err("manifest is not a table".into()));
    };
    let plugin: PluginInfo = serde_json::from_value(top.remove("plugin").unwrap_or(Value::Null))
        .map_err(|e| manifest_err(format!("[plugin]: {e}")))?;
    let runners = match top.remove("runners") {
        None => Vec::new(),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(manifest_err("`runners` must be an array of tables".into())),
    };
    if let Some(key) = top.keys().next() {
        return Err(manifest_err(format!("unknown top-level key `{key}`")));
    }
    let plugin_dir = std::fs::canonicalize(plugin_dir).unwrap_or_else(|_| plugin_dir.to_path_buf());
    Ok(runners
        .into_iter()
        .enumerate()
        .map(|(index, raw)| {
            build_runner(&plugin, &plugin_dir, raw, lookup).map_err(|message| {
                PluginError::Runner {
                    path: path.clone(),
                    index,
                    message,
                }
            })?
        })
        .collect())
}

/// Outer error: the entry is malformed (a message); inner: the command is missing.
fn build_runner(
    plugin: &PluginInfo,
    plugin_dir: &Path,
    raw: Value,
    lookup: &CommandLookup,
) -> Result<Result<PluginRunner, PluginError>, String> {
    let entry: RunnerEntry = serde_json::from_value(raw).map_err(|e| e.to_string())?;
    let runner_id =
        RunnerId::new(&plugin.author, &plugin.name, &entry.name).map_err(|e| e.to_string())?;
    validate_execution(&entry.execution)?;
    let label = entry
        .label
        .unwrap_or_else(|| I18nObject::en(entry.name.clone()));
    let manifest = AgentRunnerManifest {
        id: runner_id.to_string(),
        name: entry.name,
        label,
        description: entry.description,
        capabilities: entry.capabilities,
        permissions: entry.permissions,
        config_schema: entry.config_schema,
        metadata: entry.metadata,
    };
    Ok(
        match resolve_command(&entry.execution.command, plugin_dir, lookup) {
            Some(program) => Ok(PluginRunner {
                runner_id,
                plugin: plugin.clone(),
                plugin_dir: plugin_dir.to_path_buf(),
                manifest,
                execution: entry.execution,
                program,
            }),
            None => Err(PluginError::CommandNotFound {
                runner_id: runner_id.to_string(),
                command: entry.execution.command.clone(),
                plugin_dir: plugin_dir.to_path_buf(),
                path_note: if has_dir_part(&entry.execution.command) {
                    ""
                } else {
                    ", on PATH"
                },
            }),
        },
    )
}

fn validate_execution(exec: &ExecutionConfig) -> Result<(), String> {
    if exec.command.trim().is_empty() {
        return Err("execution.command is empty".into());
    }
    let pool_ok = !exec.pool.is_empty()
        && exec.pool.len() <= 64
        && exec
            .pool
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if !pool_ok {
        return Err(format!(
            "execution.pool `{}` must be 1-64 characters of [A-Za-z0-9_-] (it names a queue)",
            exec.pool
        ));
    }
    for name in &exec.env {
        if name.is_empty() || name.contains(['=', '\0']) {
            return Err(format!(
                "execution.env entry `{name}` is not a variable name"
            ));
        }
    }
    Ok(())
}

fn has_dir_part(command: &str) -> bool {
    Path::new(command).components().count() > 1 || Path::new(command).is_absolute()
}

/// Resolves `command` (see the module docs for the order). `None` if no file is found.
#[must_use]
pub fn resolve_command(
    command: &str,
    plugin_dir: &Path,
    lookup: &CommandLookup,
) -> Option<PathBuf> {
    let as_given = Path::new(command);
    let relative = if as_given.is_absolute() {
        as_given.to_path_buf()
    } else {
        plugin_dir.join(as_given)
    };
    if relative.is_file() {
        return Some(relative);
    }
    let file_name = as_given.file_name()?;
    if let Some(exe_dir) = &lookup.exe_dir {
        let beside = std::iter::once(exe_dir.as_path()).chain(exe_dir.parent());
        for dir in beside {
            let candidate = dir.join(file_name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    if !has_dir_part(command) {
        if let Some(path) = &lookup.path {
            for dir in std::env::split_paths(path) {
                let candidate = dir.join(file_name);
                if candidate.is_file() {
                    return Some(candidate);
                }
            }
        }
    }
    None
}

/// The bundled runners directory: the configured one; else `<exe dir>/../../runners` (a
/// cargo build run from the repository: `target/<profile>/switchboard`); else `./runners`.
/// `None` if none of them exists.
#[must_use]
pub fn bundled_runners_dir(configured: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = configured {
        return Some(dir.to_path_buf());
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    let candidates = exe_dir
        .map(|d| d.join("..").join("..").join("runners"))
        .into_iter()
        .chain(std::iter::once(PathBuf::from("runners")));
    candidates.into_iter().find(|p| p.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const ECHO: &str = r#"
[plugin]
author = "switchboard"
name = "echo"
version = "0.1.0"

[[runners]]
name = "default"
label = { en_US = "Echo" }
description = { en_US = "Streams the input back." }
capabilities = { streaming = true }
permissions = { history = ["page"] }
config_schema = []

[runners.execution]
command = "bin/echo"
args = ["--flag"]
mode = "shared"
max_concurrency = 64
pool = "default"
env = ["RUST_LOG"]
"#;

    fn plugin(root: &Path, name: &str, file: &str, body: &str) -> PathBuf {
        let dir = root.join(name);
        fs::create_dir_all(dir.join("bin")).unwrap();
        fs::write(dir.join(file), body).unwrap();
        dir
    }

    fn executable(path: &Path) {
        use std::os::unix::fs::PermissionsExt;
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "#!/bin/sh\n").unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn no_lookup() -> CommandLookup {
        CommandLookup::default()
    }

    #[test]
    fn loads_the_documented_manifest_format() {
        let root = tempfile::tempdir().unwrap();
        let dir = plugin(root.path(), "echo", "manifest.toml", ECHO);
        executable(&dir.join("bin/echo"));
        let report = load_plugins(&[root.path().to_path_buf()], &no_lookup());
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        let [r] = &report.runners[..] else {
            panic!("{:?}", report.runners)
        };
        assert_eq!(r.runner_id.to_string(), "plugin:switchboard/echo/default");
        assert_eq!(r.manifest.id, "plugin:switchboard/echo/default");
        assert!(r.manifest.runner_id().is_ok());
        assert_eq!(r.manifest.label.get("en_US"), Some("Echo"));
        assert!(r.manifest.capabilities.streaming);
        assert_eq!(r.execution.mode, ExecutionMode::Shared);
        assert_eq!(r.execution.max_concurrency.get(), 64);
        assert_eq!(r.execution.env, vec!["RUST_LOG".to_owned()]);
        assert_eq!(r.program, fs::canonicalize(&dir).unwrap().join("bin/echo"));
        let spec = r.runner_spec();
        assert_eq!(spec.process.args, vec!["--flag".to_owned()]);
        assert_eq!(
            spec.process.cwd.as_deref(),
            Some(fs::canonicalize(&dir).unwrap().as_path())
        );
    }

    #[test]
    fn yaml_and_json_manifests_load_too() {
        let root = tempfile::tempdir().unwrap();
        let yaml = "plugin:\n  author: a\n  name: y\n  version: '1'\nrunners:\n  - name: r\n    label: {en_US: Y}\n    execution:\n      command: bin/run\n      mode: per_run\n";
        let dir = plugin(root.path(), "y", "manifest.yaml", yaml);
        executable(&dir.join("bin/run"));
        let json = r#"{"plugin": {"author": "a", "name": "j", "version": "1"},
            "runners": [{"name": "r", "execution": {"command": "bin/run", "max_concurrency": 2}}]}"#;
        let dir = plugin(root.path(), "j", "manifest.json", json);
        executable(&dir.join("bin/run"));
        let report = load_plugins(&[root.path().to_path_buf()], &no_lookup());
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        let ids: Vec<String> = report
            .runners
            .iter()
            .map(|r| r.runner_id.to_string())
            .collect();
        assert_eq!(ids, vec!["plugin:a/j/r", "plugin:a/y/r"]);
        assert_eq!(report.runners[1].execution.mode, ExecutionMode::PerRun);
        // Defaults: label from the name, pool "default", shared, 16.
        let j = &report.runners[0];
        assert_eq!(j.manifest.label.get("en_US"), Some("r"));
        assert_eq!(j.execution.pool, "default");
        assert_eq!(j.execution.mode, ExecutionMode::Shared);
    }

    #[test]
    fn a_bad_runner_is_skipped_and_the_others_load() {
        let root = tempfile::tempdir().unwrap();
        let body = r#"
[plugin]
author = "a"
name = "p"
version = "1"

[[runners]]
name = "good"
[runners.execution]
command = "bin/run"

[[runners]]
name = "unknown_capability"
capabilities = { telepathy = true }
[runners.execution]
command = "bin/run"

[[runners]]
name = "unknown_permission"
permissions = { history = ["delete"] }
[runners.execution]
command = "bin/run"

[[runners]]
name = "unknown_key"
colour = "blue"
[runners.execution]
command = "bin/run"

[[runners]]
name = "bad_mode"
[runners.execution]
command = "bin/run"
mode = "sometimes"

[[runners]]
name = "zero_concurrency"
[runners.execution]
command = "bin/run"
max_concurrency = 0

[[runners]]
name = "bad_pool"
[runners.execution]
command = "bin/run"
pool = "a.b"

[[runners]]
name = "missing_command"
[runners.execution]
command = "bin/nope"

[[runners]]
name = "no/slash"
[runners.execution]
command = "bin/run"
"#;
        let dir = plugin(root.path(), "p", "manifest.toml", body);
        executable(&dir.join("bin/run"));
        let report = load_plugins(&[root.path().to_path_buf()], &no_lookup());
        let ids: Vec<String> = report
            .runners
            .iter()
            .map(|r| r.runner_id.to_string())
            .collect();
        assert_eq!(ids, vec!["plugin:a/p/good"]);
        assert_eq!(report.skipped.len(), 8, "{:#?}", report.skipped);
        let text: Vec<String> = report.skipped.iter().map(ToString::to_string).collect();
        assert!(text.iter().any(|t| t.contains("telepathy")), "{text:?}");
        assert!(text.iter().any(|t| t.contains("delete")), "{text:?}");
        assert!(text.iter().any(|t| t.contains("colour")), "{text:?}");
        assert!(
            text.iter()
                .any(|t| t.contains("bin/nope") && t.contains("not found")),
            "{text:?}"
        );
    }

    #[test]
    fn a_bad_plugin_table_skips_the_plugin_only() {
        let root = tempfile::tempdir().unwrap();
        plugin(
            root.path(),
            "broken",
            "manifest.toml",
            "[plugin]\nauthor = \"a\"\n",
        );
        plugin(
            root.path(),
            "garbage",
            "manifest.toml",
            "this is = = not toml",
        );
        plugin(
            root.path(),
            "extra",
            "manifest.toml",
            "[plugin]\nauthor=\"a\"\nname=\"x\"\nversion=\"1\"\n[other]\nk=1\n",
        );
        let dir = plugin(root.path(), "ok", "manifest.toml", ECHO);
        executable(&dir.join("bin/echo"));
        // A directory without a manifest is not a plugin and not an error.
        fs::create_dir_all(root.path().join("src")).unwrap();
        let report = load_plugins(&[root.path().to_path_buf()], &no_lookup());
        assert_eq!(report.runners.len(), 1);
        assert_eq!(report.skipped.len(), 3, "{:#?}", report.skipped);
    }

    #[test]
    fn the_first_directory_wins_for_duplicate_runner_ids() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for root in [a.path(), b.path()] {
            let dir = plugin(root, "echo", "manifest.toml", ECHO);
            executable(&dir.join("bin/echo"));
        }
        let report = load_plugins(
            &[a.path().to_path_buf(), b.path().to_path_buf()],
            &no_lookup(),
        );
        assert_eq!(report.runners.len(), 1);
        assert!(
            report.runners[0]
                .plugin_dir
                .starts_with(fs::canonicalize(a.path()).unwrap())
        );
        assert!(matches!(report.skipped[..], [PluginError::Duplicate(_)]));
        // A missing directory is reported, not fatal.
        let report = load_plugins(&[PathBuf::from("/nonexistent/plugins")], &no_lookup());
        assert!(matches!(report.skipped[..], [PluginError::ReadDir { .. }]));
    }

    #[test]
    fn command_resolution_order() {
        let root = tempfile::tempdir().unwrap();
        let plugin_dir = root.path().join("plugin");
        let exe_dir = root.path().join("target/debug/deps");
        let path_dir = root.path().join("usr/bin");
        fs::create_dir_all(&plugin_dir).unwrap();
        fs::create_dir_all(&exe_dir).unwrap();
        let lookup = CommandLookup {
            exe_dir: Some(exe_dir.clone()),
            path: Some(std::env::join_paths([&path_dir]).unwrap()),
        };
        // Nothing anywhere.
        assert_eq!(resolve_command("bin/tool", &plugin_dir, &lookup), None);
        // On PATH: only bare names use it.
        executable(&path_dir.join("tool"));
        assert_eq!(resolve_command("bin/tool", &plugin_dir, &lookup), None);
        assert_eq!(
            resolve_command("tool", &plugin_dir, &lookup),
            Some(path_dir.join("tool"))
        );
        // The parent of the executable directory (cargo's target/<profile> seen from deps/).
        executable(&root.path().join("target/debug/tool"));
        assert_eq!(
            resolve_command("bin/tool", &plugin_dir, &lookup),
            Some(exe_dir.parent().unwrap().join("tool"))
        );
        // Next to the executable beats its parent.
        executable(&exe_dir.join("tool"));
        assert_eq!(
            resolve_command("tool", &plugin_dir, &lookup),
            Some(exe_dir.join("tool"))
        );
        // The plugin directory beats everything.
        executable(&plugin_dir.join("bin/tool"));
        assert_eq!(
            resolve_command("bin/tool", &plugin_dir, &lookup),
            Some(plugin_dir.join("bin/tool"))
        );
        // Absolute paths are taken as given.
        let abs = path_dir.join("tool");
        assert_eq!(
            resolve_command(
                abs.to_str().unwrap(),
                &plugin_dir,
                &CommandLookup::default()
            ),
            Some(abs)
        );
    }

    #[test]
    fn the_bundled_echo_manifest_parses() {
        // The real file shipped in the repository, with its command found next to a fake
        // executable directory.
        let repo_echo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../runners/echo");
        let fake_exe = tempfile::tempdir().unwrap();
        executable(&fake_exe.path().join("echo"));
        let lookup = CommandLookup {
            exe_dir: Some(fake_exe.path().to_path_buf()),
            path: None,
        };
        let results = load_plugin_dir(&repo_echo, &lookup).unwrap();
        let [Ok(runner)] = &results[..] else {
            panic!("{results:?}")
        };
        assert_eq!(
            runner.runner_id.to_string(),
            "plugin:switchboard/echo/default"
        );
        assert_eq!(runner.program, fake_exe.path().join("echo"));
        assert_eq!(runner.execution.max_concurrency.get(), 64);
    }
}
