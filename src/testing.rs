//! The in-memory host every end-to-end suite runs on (feature `testing`): gateway,
//! orchestrator and worker in the test process, wired exactly as `switchboard dev` wires them
//! ([`crate::embedded`]), on the embedded backends — SQLite in a temporary data directory,
//! the in-process bus and session store — with the gateway on `127.0.0.1:0`.
//!
//! It is the one home of that wiring: the `sb-tests` harness (`TestCluster`) and the gateway
//! client's tests start the system through [`InMemoryHost`], so no suite re-implements a
//! role or the result path to get a running host. The role crates' own suites, which need
//! one role on the memory backends, keep a fixture of their own in their `tests/support`
//! (they cannot depend on this crate: it depends on them).
//!
//! The bootstrap gives workspace `default`, an admin API key ([`InMemoryHost::api_key`])
//! and, unless [`InMemoryHostBuilder::without_default_agent`], a workspace-wide echo agent
//! for `message.received`. Runners come only from the directories given with
//! [`InMemoryHostBuilder::runners_dir`] (the worker's bundled lookup is off, so where the
//! tests run from does not matter).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sb_common::config::{ConfigLoader, SwitchboardConfig};
use sb_common::shutdown::Shutdown;
use sb_store::Stores;
use sb_worker::WorkerOptions;
use tempfile::TempDir;

use crate::embedded::{self, Bootstrap, Embedded, EmbeddedOptions, Roles, StopReport};

/// Options of an [`InMemoryHost`].
#[derive(Debug, Clone)]
pub struct InMemoryHostBuilder {
    default_agent: bool,
    overrides: Vec<(String, String)>,
    runners_dirs: Vec<PathBuf>,
    data_dir: Option<Arc<TempDir>>,
}

impl Default for InMemoryHostBuilder {
    fn default() -> Self {
        Self {
            default_agent: true,
            overrides: Vec::new(),
            runners_dirs: Vec::new(),
            data_dir: None,
        }
    }
}

impl InMemoryHostBuilder {
    /// Without the workspace-wide echo agent (the workspace starts with no agent).
    #[must_use]
    pub fn without_default_agent(mut self) -> Self {
        self.default_agent = false;
        self
    }

    /// Sets a configuration key (dotted, as in `switchboard.toml`), e.g.
    /// `("worker.slots", "2")`; applied after the in-memory defaults, in order.
    #[must_use]
    pub fn config(mut self, key: &str, value: impl ToString) -> Self {
        self.overrides.push((key.to_owned(), value.to_string()));
        self
    }

    /// Adds a plugins directory the worker loads runners from (`worker.runners_dirs`).
    #[must_use]
    pub fn runners_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runners_dirs.push(dir.into());
        self
    }

    /// Reuses a data directory (a restart on the same database and API key).
    #[must_use]
    pub fn data_dir(mut self, dir: Arc<TempDir>) -> Self {
        self.data_dir = Some(dir);
        self
    }

    /// The configuration of the host in `data_dir`.
    #[must_use]
    pub fn configuration(&self, data_dir: &Path) -> SwitchboardConfig {
        let runners: Vec<String> = self
            .runners_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let mut loader = ConfigLoader::new()
            .without_file()
            .set("database.url", sqlite_url(&data_dir.join("switchboard.db")))
            .set("bus.kind", "memory")
            .set("sessions.kind", "memory")
            .set("gateway.http_addr", "127.0.0.1:0")
            .set("worker.runners_dirs", runners);
        for (key, value) in &self.overrides {
            loader = loader.set(key.clone(), value.as_str());
        }
        loader.load().expect("test configuration")
    }

    /// Starts the host. Panics when it does not start.
    pub async fn start(self) -> InMemoryHost {
        let dir = match &self.data_dir {
            Some(dir) => Arc::clone(dir),
            None => Arc::new(tempfile::tempdir().expect("temporary data directory")),
        };
        let config = self.configuration(dir.path());
        let options = EmbeddedOptions {
            roles: Roles::ALL,
            bootstrap: Some(Bootstrap {
                data_dir: dir.path().to_path_buf(),
                default_agent: self.default_agent,
            }),
            worker: WorkerOptions {
                // Only the configured directories: where the tests run from does not matter.
                bundled_runners: false,
                ..WorkerOptions::default()
            },
        };
        let process = embedded::start_with(config, options, Shutdown::new())
            .await
            .expect("the in-memory host starts");
        InMemoryHost {
            process: Some(process),
            dir,
            builder: self,
        }
    }
}

/// Gateway, orchestrator and worker in this process, on the embedded backends (see the
/// module docs). Dropping it starts the same stop as [`Embedded`]'s drop.
pub struct InMemoryHost {
    process: Option<Embedded>,
    dir: Arc<TempDir>,
    builder: InMemoryHostBuilder,
}

impl std::fmt::Debug for InMemoryHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryHost")
            .field("data_dir", &self.dir.path())
            .field("url", &self.process.as_ref().and_then(Embedded::base_url))
            .finish_non_exhaustive()
    }
}

impl InMemoryHost {
    /// Options before starting.
    #[must_use]
    pub fn builder() -> InMemoryHostBuilder {
        InMemoryHostBuilder::default()
    }

    /// The running process.
    #[must_use]
    pub fn process(&self) -> &Embedded {
        self.process.as_ref().expect("the host is running")
    }

    /// The gateway's base URL (`http://127.0.0.1:<port>`).
    #[must_use]
    pub fn base_url(&self) -> String {
        self.process().base_url().expect("the gateway runs")
    }

    /// The admin API key of workspace `default` the bootstrap created.
    #[must_use]
    pub fn api_key(&self) -> &str {
        self.process()
            .api_key()
            .expect("the bootstrap created a key")
    }

    /// The stores of the host's database.
    #[must_use]
    pub fn stores(&self) -> &Stores {
        self.process().stores()
    }

    /// The configuration in use.
    #[must_use]
    pub fn config(&self) -> &SwitchboardConfig {
        self.process().config()
    }

    /// The data directory (SQLite file, API key).
    #[must_use]
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the host (the same ordered drain as ctrl-c on `switchboard dev`).
    pub async fn shutdown(mut self) -> StopReport {
        self.stop().await
    }

    /// Stops the host, then starts a new one on the same data directory with the same
    /// options (what a user restarting `switchboard dev` gets).
    pub async fn restart(mut self) -> (StopReport, InMemoryHost) {
        let report = self.stop().await;
        let builder = self.builder.clone().data_dir(Arc::clone(&self.dir));
        (report, builder.start().await)
    }

    async fn stop(&mut self) -> StopReport {
        match self.process.take() {
            Some(process) => process.shutdown().await,
            None => StopReport::default(),
        }
    }
}

/// `sqlite://<absolute path>?mode=rwc`, percent-encoding anything unusual in the path.
fn sqlite_url(path: &Path) -> String {
    let text = path.to_str().expect("temporary paths are UTF-8");
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    format!("sqlite://{encoded}?mode=rwc")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_are_absolute_and_encoded() {
        assert_eq!(
            sqlite_url(Path::new("/tmp/a b/x.db")),
            "sqlite:///tmp/a%20b/x.db?mode=rwc"
        );
    }
}
