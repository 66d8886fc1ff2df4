//! Confinement of runner processes (SPEC §14 "Runner ↔ host").
//!
//! A runner is plugin code: it sees only its stdio and its Host API. What the kernel would
//! otherwise let it reach is closed here:
//!
//! | threat (same host, same user) | closed by |
//! | --- | --- |
//! | read `/proc/<worker>/environ` or `mem`, `ptrace` the worker | [`make_undumpable`] at worker start: a non-dumpable process's `/proc` files belong to root and `ptrace` needs `CAP_SYS_PTRACE` |
//! | any same-user access to the worker and its files | a worker running as root runs runners as [`SandboxConfig::user`] (`nobody` by default) and never as root unless `allow_root` |
//! | regain privileges through a setuid binary or file capabilities | `no_new_privs` |
//! | exhaust the host (CPU, memory, descriptors, fork bomb) | `RLIMIT_CPU`, `RLIMIT_AS`, `RLIMIT_NOFILE`, `RLIMIT_NPROC` |
//! | read other runners' temporary files in a shared `/tmp` | a private `TMPDIR` per process (mode 0700, owned by the runner), removed with it |
//!
//! The cleared environment, the own process group and kill-on-drop are in the `process`
//! module; this module decides *who* the process runs as and *what limits* it
//! gets, and prepares them before the fork so the child only makes system calls.
//!
//! A worker that does not run as root cannot switch users: its runners run as itself, and
//! then non-dumpability is what keeps them out of the worker's memory and environment.

use std::fs::Permissions;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use nix::sys::resource::{Resource, getrlimit, rlim_t, setrlimit};
use nix::unistd::{Gid, Uid, User, getegid, geteuid};
use sb_common::config::SandboxConfig;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use tempfile::TempDir;
use tokio::process::Command;

/// The user runners run as when [`SandboxConfig::user`] is unset.
pub const DEFAULT_RUNNER_USER: &str = "nobody";

/// The environment variable that names a runner's private temporary directory.
pub const TMPDIR_VAR: &str = "TMPDIR";

/// Why a runner process (or the worker) could not be confined. A runner that cannot be
/// confined is not started.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The runner would run as root, and `worker.sandbox.allow_root` is off.
    #[error(
        "refusing to start a runner as root: {reason}; set worker.sandbox.user to an \
         unprivileged user, or worker.sandbox.allow_root = true to allow it"
    )]
    RootRefused {
        /// Why the runner would be root.
        reason: String,
    },
    /// The user database could not be read.
    #[error("cannot look up runner user `{user}`: {source}")]
    UserLookup {
        /// The configured (or default) user name.
        user: String,
        #[source]
        source: nix::Error,
    },
    /// The private temporary directory could not be made.
    #[error("cannot create the private temporary directory of a runner under {}: {source}", .root.display())]
    TempDir {
        /// `worker.sandbox.temp_root`, or the system's temporary directory.
        root: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `prctl(PR_SET_DUMPABLE, 0)` failed.
    #[error("cannot make the worker non-dumpable: {0}")]
    Undumpable(#[source] nix::Error),
}

impl HasErrorCode for SandboxError {
    fn code(&self) -> ErrorCode {
        match self {
            // Configuration the operator must change: retrying cannot help.
            Self::RootRefused { .. } | Self::Undumpable(_) => ErrorCode::Internal,
            // The user database (NSS) or the disk may recover.
            Self::UserLookup { .. } | Self::TempDir { .. } => ErrorCode::Unavailable,
        }
    }
}

/// Makes the calling process non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`), for the life of
/// the process: its `/proc/<pid>/environ`, `mem`, `maps`, `fd/` become unreadable to every
/// process without `CAP_SYS_PTRACE` — same-user runners included — it cannot be
/// `ptrace`-attached, and it writes no core dump (which would hold the same secrets).
///
/// The worker calls this when it starts (`Worker::spawn_with`), which covers both
/// the `switchboard worker` role and the embedded `switchboard dev` process (the flag is
/// per process, so the gateway and orchestrator running beside it are covered too). It is
/// idempotent. Runner processes are not affected: `execve` resets the flag for them.
pub fn make_undumpable() -> Result<(), SandboxError> {
    nix::sys::prctl::set_dumpable(false).map_err(SandboxError::Undumpable)
}

/// Who a runner process runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerUser {
    pub uid: Uid,
    pub gid: Gid,
    /// The worker switches to this user when it starts the process (it runs as root);
    /// `false`: the process runs as the worker's own user.
    pub switch: bool,
}

/// Decides who runners run as (pure: the worker's effective ids and the user database are
/// passed in).
///
/// - A worker that is not root cannot switch: runners run as the worker's user.
/// - A root worker runs them as `config.user` (unset: [`DEFAULT_RUNNER_USER`]).
/// - If that would be root — the user is root, or it does not exist so the process would
///   keep the worker's root — the start is refused unless `config.allow_root`.
pub fn resolve_user(
    config: &SandboxConfig,
    worker: (Uid, Gid),
    lookup: impl FnOnce(&str) -> nix::Result<Option<User>>,
) -> Result<RunnerUser, SandboxError> {
    let (euid, egid) = worker;
    let as_worker = RunnerUser {
        uid: euid,
        gid: egid,
        switch: false,
    };
    if !euid.is_root() {
        return Ok(as_worker);
    }
    let name = config.user.as_deref().unwrap_or(DEFAULT_RUNNER_USER);
    let user = lookup(name).map_err(|source| SandboxError::UserLookup {
        user: name.to_owned(),
        source,
    })?;
    match user {
        Some(user) if !user.uid.is_root() => Ok(RunnerUser {
            uid: user.uid,
            gid: user.gid,
            switch: true,
        }),
        Some(user) if config.allow_root => Ok(RunnerUser {
            uid: user.uid,
            gid: user.gid,
            switch: true,
        }),
        Some(user) => Err(SandboxError::RootRefused {
            reason: format!("worker.sandbox.user `{}` is root (uid 0)", user.name),
        }),
        None if config.allow_root => {
            tracing::warn!(
                user = name,
                "runner user does not exist; runners run as root (worker.sandbox.allow_root)"
            );
            Ok(as_worker)
        }
        None => Err(SandboxError::RootRefused {
            reason: format!(
                "runner user `{name}` does not exist, so the runner would keep the worker's root"
            ),
        }),
    }
}

/// The resource limits of one runner process, computed before the fork so that the child
/// only has to make `setrlimit` calls. Each is set as both the soft and the hard limit (a
/// runner cannot raise it again), capped at the worker's current hard limit (which a
/// process that is not privileged could not exceed anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    entries: [Option<(Resource, rlim_t)>; 4],
}

impl Limits {
    /// The limits `config` asks for, capped by `hard` (the current hard limit of a
    /// resource; [`getrlimit`] in production).
    pub fn from_config(config: &SandboxConfig, hard: impl Fn(Resource) -> rlim_t) -> Self {
        let capped = |resource: Resource, wanted: u64| {
            let wanted = rlim_t::try_from(wanted).unwrap_or(rlim_t::MAX);
            Some((resource, wanted.min(hard(resource))))
        };
        // Whole seconds, rounded up: a limit of 0 s would kill the runner before it starts.
        let cpu = config
            .cpu_time
            .map(|t| t.as_secs() + u64::from(t.subsec_nanos() > 0))
            .map(|secs| secs.max(1));
        Self {
            entries: [
                cpu.and_then(|secs| capped(Resource::RLIMIT_CPU, secs)),
                config
                    .memory_bytes
                    .and_then(|bytes| capped(Resource::RLIMIT_AS, bytes)),
                capped(Resource::RLIMIT_NOFILE, u64::from(config.open_files.get())),
                capped(Resource::RLIMIT_NPROC, u64::from(config.processes.get())),
            ],
        }
    }

    /// The limits that are set, in order.
    pub fn iter(&self) -> impl Iterator<Item = (Resource, rlim_t)> + '_ {
        self.entries.iter().flatten().copied()
    }

    /// Runs in the forked child, before `execve`: `no_new_privs`, then the limits. Only
    /// system calls (no allocation, no lock), so it is async-signal-safe.
    fn apply_in_child(&self) -> std::io::Result<()> {
        nix::sys::prctl::set_no_new_privs().map_err(errno_to_io)?;
        for (resource, value) in self.iter() {
            setrlimit(resource, value, value).map_err(errno_to_io)?;
        }
        Ok(())
    }
}

/// `io::Error::from_raw_os_error` does not allocate (safe in the forked child).
fn errno_to_io(errno: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(errno as i32)
}

/// The current hard limit of `resource` (unlimited if it cannot be read).
fn current_hard_limit(resource: Resource) -> rlim_t {
    getrlimit(resource).map_or(rlim_t::MAX, |(_, hard)| hard)
}

/// Everything one runner process is confined with, prepared in the worker before the
/// spawn. Keep it (see [`Confinement::into_temp_dir`]) for as long as the process lives:
/// dropping it removes the private temporary directory.
#[derive(Debug)]
pub struct Confinement {
    user: RunnerUser,
    limits: Limits,
    temp_dir: TempDir,
}

impl Confinement {
    /// Resolves the runner user and the limits from `config` and creates the private
    /// temporary directory (mode 0700, owned by the runner user).
    pub fn prepare(config: &SandboxConfig) -> Result<Self, SandboxError> {
        let user = resolve_user(config, (geteuid(), getegid()), User::from_name)?;
        let limits = Limits::from_config(config, current_hard_limit);
        let root = config.temp_root.clone().unwrap_or_else(std::env::temp_dir);
        let temp_dir = private_temp_dir(&root, user).map_err(|source| SandboxError::TempDir {
            root: root.clone(),
            source,
        })?;
        Ok(Self {
            user,
            limits,
            temp_dir,
        })
    }

    /// Who the process runs as.
    #[must_use]
    pub fn user(&self) -> RunnerUser {
        self.user
    }

    /// The private temporary directory (`TMPDIR` of the process).
    #[must_use]
    pub fn temp_dir(&self) -> &Path {
        self.temp_dir.path()
    }

    /// Applies the confinement to `cmd`: the user, `TMPDIR` (after the allowlisted
    /// variables, so a manifest cannot point it elsewhere), `no_new_privs` and the limits.
    pub fn apply(&self, cmd: &mut Command) {
        if self.user.switch {
            // std drops the supplementary groups of a root parent when a uid is set, then
            // calls setgid, then setuid, all before the pre_exec hook.
            cmd.uid(self.user.uid.as_raw()).gid(self.user.gid.as_raw());
        }
        cmd.env(TMPDIR_VAR, self.temp_dir.path());
        install_pre_exec(cmd, self.limits);
    }

    /// The temporary directory to keep with the process.
    #[must_use]
    pub fn into_temp_dir(self) -> TempDir {
        self.temp_dir
    }
}

/// Installs the child-side part of the confinement. The only `unsafe` of the workspace.
#[allow(unsafe_code)]
fn install_pre_exec(cmd: &mut Command, limits: Limits) {
    // SAFETY: the hook runs in the forked child before `execve`, where only
    // async-signal-safe operations are allowed. `Limits::apply_in_child` makes only
    // `prctl(PR_SET_NO_NEW_PRIVS)` and `setrlimit` system calls through nix, on plain values
    // copied into the closure before the fork; it neither allocates (errors are raw OS
    // errors) nor takes locks, and touches no state shared with the parent.
    unsafe {
        cmd.pre_exec(move || limits.apply_in_child());
    }
}

/// `<root>/sb-runner-XXXXXX`, mode 0700, owned by `user`.
fn private_temp_dir(root: &Path, user: RunnerUser) -> std::io::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("sb-runner-")
        .permissions(Permissions::from_mode(0o700))
        .tempdir_in(root)?;
    // The mode is subject to the umask only in the sense of removing bits; set it exactly.
    std::fs::set_permissions(dir.path(), Permissions::from_mode(0o700))?;
    if user.switch {
        std::os::unix::fs::chown(dir.path(), Some(user.uid.as_raw()), Some(user.gid.as_raw()))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn user(name: &str, uid: u32, gid: u32) -> User {
        User {
            name: name.into(),
            passwd: CString::default(),
            uid: Uid::from_raw(uid),
            gid: Gid::from_raw(gid),
            gecos: CString::default(),
            dir: PathBuf::from("/nonexistent"),
            shell: PathBuf::from("/usr/sbin/nologin"),
        }
    }

    fn db(name: &str) -> nix::Result<Option<User>> {
        Ok(match name {
            "nobody" => Some(user("nobody", 65534, 65534)),
            "runner" => Some(user("runner", 1500, 1600)),
            "root" | "toor" => Some(user(name, 0, 0)),
            _ => None,
        })
    }

    const ROOT: (Uid, Gid) = (Uid::from_raw(0), Gid::from_raw(0));
    const ALICE: (Uid, Gid) = (Uid::from_raw(1000), Gid::from_raw(1000));

    fn sandbox(user: Option<&str>, allow_root: bool) -> SandboxConfig {
        SandboxConfig {
            user: user.map(str::to_owned),
            allow_root,
            ..SandboxConfig::default()
        }
    }

    #[test]
    fn a_root_worker_runs_runners_as_the_configured_user_or_nobody() {
        let u = resolve_user(&sandbox(None, false), ROOT, db).unwrap();
        assert_eq!(
            (u.uid.as_raw(), u.gid.as_raw(), u.switch),
            (65534, 65534, true)
        );
        let u = resolve_user(&sandbox(Some("runner"), false), ROOT, db).unwrap();
        assert_eq!(
            (u.uid.as_raw(), u.gid.as_raw(), u.switch),
            (1500, 1600, true)
        );
    }

    #[test]
    fn a_root_runner_is_refused_unless_allowed() {
        for name in ["root", "toor", "no-such-user"] {
            let e = resolve_user(&sandbox(Some(name), false), ROOT, db).unwrap_err();
            assert!(matches!(e, SandboxError::RootRefused { .. }), "{name}: {e}");
            let text = e.to_string();
            assert!(text.contains(name) && text.contains("allow_root"), "{text}");
            assert_eq!(e.code(), ErrorCode::Internal);

            let u = resolve_user(&sandbox(Some(name), true), ROOT, db).unwrap();
            assert!(u.uid.is_root(), "{name}: allowed");
        }
    }

    #[test]
    fn a_worker_that_is_not_root_runs_runners_as_itself() {
        for name in [None, Some("root"), Some("runner"), Some("no-such-user")] {
            let u = resolve_user(&sandbox(name, false), ALICE, |_| {
                panic!("no lookup without root")
            })
            .unwrap();
            assert_eq!((u.uid, u.gid, u.switch), (ALICE.0, ALICE.1, false));
        }
    }

    #[test]
    fn a_failed_lookup_is_an_error_not_root() {
        let e = resolve_user(&sandbox(None, true), ROOT, |_| Err(nix::Error::EIO)).unwrap_err();
        assert!(matches!(e, SandboxError::UserLookup { .. }), "{e}");
        assert_eq!(e.code(), ErrorCode::Unavailable);
    }

    #[test]
    fn limits_are_capped_by_the_hard_limit_and_round_cpu_time_up() {
        let config = SandboxConfig {
            cpu_time: Some(Duration::from_millis(1500)),
            memory_bytes: Some(1 << 30),
            open_files: NonZeroU32::new(4096).unwrap(),
            processes: NonZeroU32::new(64).unwrap(),
            ..SandboxConfig::default()
        };
        let hard = |r: Resource| match r {
            Resource::RLIMIT_NOFILE => 1024,
            _ => rlim_t::MAX,
        };
        let limits: Vec<_> = Limits::from_config(&config, hard).iter().collect();
        assert_eq!(
            limits,
            vec![
                (Resource::RLIMIT_CPU, 2),
                (Resource::RLIMIT_AS, 1 << 30),
                (Resource::RLIMIT_NOFILE, 1024),
                (Resource::RLIMIT_NPROC, 64),
            ]
        );
        let unset = SandboxConfig {
            cpu_time: None,
            memory_bytes: None,
            ..SandboxConfig::default()
        };
        let limits: Vec<_> = Limits::from_config(&unset, |_| rlim_t::MAX)
            .iter()
            .map(|(r, _)| r)
            .collect();
        assert_eq!(
            limits,
            vec![Resource::RLIMIT_NOFILE, Resource::RLIMIT_NPROC]
        );
        let tiny = SandboxConfig {
            cpu_time: Some(Duration::from_millis(1)),
            ..SandboxConfig::default()
        };
        assert_eq!(
            Limits::from_config(&tiny, |_| rlim_t::MAX).iter().next(),
            Some((Resource::RLIMIT_CPU, 1))
        );
    }

    #[test]
    fn the_private_temp_dir_is_0700_and_removed_on_drop() {
        let root = tempfile::tempdir().unwrap();
        let me = RunnerUser {
            uid: geteuid(),
            gid: getegid(),
            switch: false,
        };
        let dir = private_temp_dir(root.path(), me).unwrap();
        let path = dir.path().to_path_buf();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
        std::fs::write(path.join("scratch"), b"x").unwrap();
        drop(dir);
        assert!(!path.exists());
    }
}
