//! What a worker is given: the services it talks to ([`WorkerDeps`]) and how it finds its
//! runners and serves their Host API calls ([`WorkerOptions`]). Plain data, in a module of
//! its own so that startup, the job pipeline and the front all read it without importing
//! each other.

use std::sync::Arc;

use sb_common::bus::Bus;
use sb_common::bus::topology::Topology;
use sb_common::config::SwitchboardConfig;
use sb_common::session::SessionStore;
use sb_store::Stores;

use crate::outlet::ResultOutlet;
use crate::plugins::CommandLookup;
use sb_host_api::api_gate::Dispatcher;

/// Everything the worker talks to.
#[derive(Clone)]
pub struct WorkerDeps {
    /// The message bus (jobs in, results out, control).
    pub bus: Arc<dyn Bus>,
    /// Active-run sessions, leases, cancel flags.
    pub sessions: Arc<dyn SessionStore>,
    /// The ledger (claims) and the runner registry.
    pub stores: Stores,
    /// The whole configuration (the `worker` and `limits` sections are used).
    pub config: Arc<SwitchboardConfig>,
    /// Exchange and queue names shared by every role of the deployment.
    pub topology: Topology,
}

impl std::fmt::Debug for WorkerDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerDeps")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

/// How the worker finds its runners and serves their Host API calls.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Also load the bundled runners directory (see
    /// [`bundled_runners_dir`](crate::plugins::bundled_runners_dir)) after the
    /// configured `worker.runners_dirs`. Default `true`.
    pub bundled_runners: bool,
    /// Where runner commands are looked up.
    pub command_lookup: CommandLookup,
    /// Serves Host API calls that passed the gate; `None` (the default) serves them with
    /// [`ActionDispatcher`](sb_host_api::actions::ActionDispatcher) over the worker's stores and
    /// session store and the configured `[limits]`.
    pub dispatcher: Option<Arc<dyn Dispatcher>>,
    /// Where the runs' result items go; `None` (the default): the results queue, for an
    /// orchestrator's result sink (see [`ResultOutlet`]).
    pub outlet: Option<Arc<dyn ResultOutlet>>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            bundled_runners: true,
            command_lookup: CommandLookup::from_env(),
            dispatcher: None,
            outlet: None,
        }
    }
}

impl std::fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("bundled_runners", &self.bundled_runners)
            .field("command_lookup", &self.command_lookup)
            .field("outlet", &self.outlet.is_some())
            .finish_non_exhaustive()
    }
}
