//! The suite's own RabbitMQ, Redis and Postgres: one process each, on free ports, with every
//! file in one temporary directory, so that stopping, killing or restarting them never touches
//! the shared services other engineers' tests use (5432 / 6379 / 5672).
//!
//! | service | started as | restart |
//! | --- | --- | --- |
//! | Redis | `redis-server --port P --save "" --appendonly no` | SIGTERM, start again: it comes back **empty** (no persistence) |
//! | Postgres | `initdb` once, then `postgres -D <dir> -p P` as user `postgres` when run as root (Postgres refuses root) | fast shutdown (SIGINT), start on the same data directory |
//! | RabbitMQ | the broker's own `sbin/rabbitmq-server`, node `sbchaos-<id>@localhost`, every `RABBITMQ_*` path in the directory, no plugins | SIGTERM (the script stops the node), start on the same Mnesia directory (durable queues survive) |
//!
//! The RabbitMQ node differs from the shared one only by name, ports and directories; it
//! registers with the machine's one `epmd`, which is designed for several nodes. The script
//! is started directly (not the distribution's `/usr/sbin` wrapper, which switches to user
//! `rabbitmq` and reads `/etc/rabbitmq/rabbitmq-env.conf`, whose node name is the shared
//! broker's), with `HOME` in the directory (a cookie of its own).
//!
//! The processes stay in the test's process group (a test runner killing the group takes
//! them along); [`OwnServices`] stops them when dropped, during a panic too, and keeps the
//! directory (logs) when the test panics.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sb_common::bus::Bus as _;
use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
use sb_tests::cluster::Services;

/// Longest wait for a service to accept connections after a start.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Longest wait for a service to exit after its stop signal; then it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Result of the service operations.
pub type Result<T, E = BoxError> = std::result::Result<T, E>;

/// One of the three services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    /// RabbitMQ.
    RabbitMq,
    /// Redis.
    Redis,
    /// Postgres.
    Postgres,
}

/// The service executables found on this machine.
#[derive(Debug, Clone)]
pub struct Binaries {
    redis_server: PathBuf,
    /// Directory of `postgres`, `initdb`, `pg_isready`.
    postgres_bin: PathBuf,
    rabbitmq_server: PathBuf,
}

impl Binaries {
    /// Looks for `redis-server` (on `PATH`), the newest `/usr/lib/postgresql/*/bin` and
    /// `/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server`. The error names what
    /// is missing.
    pub fn find() -> std::result::Result<Self, String> {
        let mut missing = Vec::new();
        let redis_server = on_path("redis-server");
        if redis_server.is_none() {
            missing.push("redis-server (on PATH)");
        }
        let postgres_bin = newest_match("/usr/lib/postgresql", "", "bin")
            .filter(|dir| dir.join("postgres").is_file() && dir.join("initdb").is_file());
        if postgres_bin.is_none() {
            missing.push("postgres and initdb (/usr/lib/postgresql/*/bin)");
        }
        let rabbitmq_server = newest_match(
            "/usr/lib/rabbitmq/lib",
            "rabbitmq_server-",
            "sbin/rabbitmq-server",
        )
        .filter(|path| path.is_file());
        if rabbitmq_server.is_none() {
            missing.push("rabbitmq-server (/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin)");
        }
        match (redis_server, postgres_bin, rabbitmq_server) {
            (Some(redis_server), Some(postgres_bin), Some(rabbitmq_server)) => Ok(Self {
                redis_server,
                postgres_bin,
                rabbitmq_server,
            }),
            _ => Err(missing.join(", ")),
        }
    }
}

/// `name` in a directory of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

/// `<root>/<entry starting with prefix>/<tail>` for the entry that sorts last (versions
/// compared by their numbers, so `15` after `9`).
fn newest_match(root: &str, prefix: &str, tail: &str) -> Option<PathBuf> {
    let version = |name: &str| -> Vec<u64> {
        name.trim_start_matches(prefix)
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(prefix))
        .max_by_key(|name| version(name))
        .map(|name| Path::new(root).join(name).join(tail))
}

/// A free TCP port on 127.0.0.1 (bound and released; the small race is acceptable here).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// The uid and gid a Postgres server runs as: user `postgres` when this process is root
/// (the server refuses to run as root), else the current user (`None`).
fn postgres_user() -> Result<Option<(u32, u32)>> {
    if !nix::unistd::Uid::effective().is_root() {
        return Ok(None);
    }
    let user = nix::unistd::User::from_name("postgres")?
        .ok_or("running as root, Postgres needs a user `postgres` to run as")?;
    Ok(Some((user.uid.as_raw(), user.gid.as_raw())))
}

/// One server process and how to start it again.
struct Server {
    service: Service,
    port: u16,
    child: Option<Child>,
    log: PathBuf,
}

/// The three services (see the module docs). Dropping it stops them.
pub struct OwnServices {
    binaries: Binaries,
    dir: Option<tempfile::TempDir>,
    node_name: String,
    rabbit_dist_port: u16,
    postgres_user: Option<(u32, u32)>,
    servers: Vec<Server>,
    urls: Services,
}

impl std::fmt::Debug for OwnServices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnServices")
            .field("urls", &self.urls)
            .finish_non_exhaustive()
    }
}

impl OwnServices {
    /// Creates the directory, initializes Postgres, starts the three servers and waits until
    /// each accepts connections.
    pub async fn start(binaries: Binaries) -> Result<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let dir = tempfile::Builder::new()
            .prefix(&format!("sb-chaos-{id}-"))
            .tempdir()?;
        let postgres_user = postgres_user()?;
        // Postgres (another user) must reach its directory inside ours.
        set_mode(dir.path(), 0o755)?;
        for sub in ["logs", "redis", "rabbitmq", "rabbitmq/home"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let (redis_port, postgres_port, amqp_port, rabbit_dist_port) =
            (free_port()?, free_port()?, free_port()?, free_port()?);
        let mut services = Self {
            binaries,
            node_name: format!("sbchaos-{id}@localhost"),
            rabbit_dist_port,
            postgres_user,
            servers: Vec::new(),
            urls: Services {
                database_url: format!("postgres://postgres@127.0.0.1:{postgres_port}/postgres"),
                redis_url: format!("redis://127.0.0.1:{redis_port}"),
                amqp_url: format!("amqp://guest:guest@127.0.0.1:{amqp_port}/%2f"),
            },
            dir: Some(dir),
        };
        services.write_rabbitmq_files(amqp_port)?;
        services.init_postgres()?;
        for (service, port) in [
            (Service::RabbitMq, amqp_port),
            (Service::Redis, redis_port),
            (Service::Postgres, postgres_port),
        ] {
            let log = services.dir().join("logs").join(format!("{service:?}.log"));
            services.servers.push(Server {
                service,
                port,
                child: None,
                log,
            });
            services.spawn(service)?;
        }
        // The broker takes longest: the others are ready while it boots.
        for service in [Service::Redis, Service::Postgres, Service::RabbitMq] {
            services.wait_ready(service).await?;
        }
        Ok(services)
    }

    /// The URLs a cluster uses ([`sb_tests::cluster::TestCluster::spawn_on`]).
    #[must_use]
    pub fn urls(&self) -> &Services {
        &self.urls
    }

    /// The directory (logs, data).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .map_or(Path::new("."), tempfile::TempDir::path)
    }

    /// Stops `service` the orderly way and starts it again on the same port (and data, for
    /// Postgres and RabbitMQ; Redis comes back empty). Returns when it accepts connections.
    pub async fn restart(&mut self, service: Service) -> Result<()> {
        self.restart_after(service, Duration::ZERO).await
    }

    /// [`Self::restart`], with `service` kept down for `outage` before it starts again.
    pub async fn restart_after(&mut self, service: Service, outage: Duration) -> Result<()> {
        self.stop(service);
        tokio::time::sleep(outage).await;
        self.spawn(service)?;
        self.wait_ready(service).await
    }

    fn server(&mut self, service: Service) -> &mut Server {
        self.servers
            .iter_mut()
            .find(|s| s.service == service)
            .expect("every service has a server")
    }

    fn write_rabbitmq_files(&self, amqp_port: u16) -> Result<()> {
        let base = self.dir().join("rabbitmq");
        std::fs::write(
            base.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{amqp_port}\n\
                 log.console = true\nlog.console.level = warning\nlog.file = false\n"
            ),
        )?;
        std::fs::write(base.join("enabled_plugins"), "[].\n")?;
        std::fs::write(base.join("advanced.config"), "[].\n")?;
        std::fs::write(base.join("rabbitmq-env.conf"), "")?;
        Ok(())
    }

    /// `initdb` into `<dir>/postgres` (trust authentication, user `postgres`).
    fn init_postgres(&self) -> Result<()> {
        let data = self.dir().join("postgres");
        std::fs::create_dir_all(&data)?;
        set_mode(&data, 0o700)?;
        if let Some((uid, gid)) = self.postgres_user {
            std::os::unix::fs::chown(&data, Some(uid), Some(gid))?;
        }
        let log = File::create(self.dir().join("logs").join("initdb.log"))?;
        let mut command = Command::new(self.binaries.postgres_bin.join("initdb"));
        command
            .args(["-D", &data.display().to_string()])
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .current_dir(self.dir());
        self.as_postgres(&mut command);
        let status = command.status()?;
        if !status.success() {
            return Err(format!(
                "initdb failed ({status}); see {}",
                self.dir().join("logs/initdb.log").display()
            )
            .into());
        }
        Ok(())
    }

    fn as_postgres(&self, command: &mut Command) {
        use std::os::unix::process::CommandExt as _;
        if let Some((uid, gid)) = self.postgres_user {
            command.uid(uid).gid(gid);
        }
    }

    fn spawn(&mut self, service: Service) -> Result<()> {
        let dir = self.dir().to_path_buf();
        let (port, log) = {
            let server = self.server(service);
            (server.port, server.log.clone())
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let mut command = match service {
            Service::Redis => {
                let mut c = Command::new(&self.binaries.redis_server);
                c.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--save", "", "--appendonly", "no"])
                    .args(["--dir", &dir.join("redis").display().to_string()]);
                c
            }
            Service::Postgres => {
                let mut c = Command::new(self.binaries.postgres_bin.join("postgres"));
                c.args(["-D", &dir.join("postgres").display().to_string()])
                    .args(["-p", &port.to_string(), "-h", "127.0.0.1"])
                    .args(["-k", &dir.join("postgres").display().to_string()])
                    // Durability is not under test (the server is stopped orderly); speed is.
                    .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
                    .args(["-c", "full_page_writes=off", "-c", "max_connections=100"]);
                self.as_postgres(&mut c);
                c
            }
            Service::RabbitMq => {
                let base = dir.join("rabbitmq");
                let mut c = Command::new(&self.binaries.rabbitmq_server);
                c.env("HOME", base.join("home"))
                    .env("RABBITMQ_CONF_ENV_FILE", base.join("rabbitmq-env.conf"))
                    .env("RABBITMQ_NODENAME", &self.node_name)
                    .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
                    .env("RABBITMQ_NODE_PORT", port.to_string())
                    .env("RABBITMQ_DIST_PORT", self.rabbit_dist_port.to_string())
                    .env("RABBITMQ_MNESIA_BASE", base.join("mnesia"))
                    .env("RABBITMQ_LOG_BASE", base.join("log"))
                    .env(
                        "RABBITMQ_ENABLED_PLUGINS_FILE",
                        base.join("enabled_plugins"),
                    )
                    .env("RABBITMQ_CONFIG_FILE", base.join("rabbitmq"))
                    .env(
                        "RABBITMQ_ADVANCED_CONFIG_FILE",
                        base.join("advanced.config"),
                    )
                    .env("RABBITMQ_PID_FILE", base.join("rabbitmq.pid"))
                    .env("ERL_EPMD_ADDRESS", "127.0.0.1")
                    .env_remove("RABBITMQ_ALLOW_INPUT")
                    .env_remove("ERL_FLAGS");
                c
            }
        };
        command
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {service:?}: {e}"))?;
        self.server(service).child = Some(child);
        Ok(())
    }

    /// Polls until `service` answers: Redis `PING`, an accepted Postgres TCP connection
    /// followed by `pg_isready`, an AMQP connection.
    async fn wait_ready(&mut self, service: Service) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.server(service).child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    return Err(format!(
                        "{service:?} exited during start ({status}):\n{}",
                        tail(&self.server(service).log, 30)
                    )
                    .into());
                }
            }
            if self.answers(service).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{service:?} is not ready after {START_TIMEOUT:?}:\n{}",
                    tail(&self.server(service).log, 30)
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn answers(&mut self, service: Service) -> bool {
        let port = self.server(service).port;
        match service {
            Service::Redis => redis_ping(port).await,
            Service::Postgres => {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                    && Command::new(self.binaries.postgres_bin.join("pg_isready"))
                        .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                        .status()
                        .is_ok_and(|s| s.success())
            }
            Service::RabbitMq => {
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_err()
                {
                    return false;
                }
                let options = AmqpOptions::new(self.urls.amqp_url.clone(), "sb-chaos readiness");
                match tokio::time::timeout(Duration::from_secs(10), AmqpBus::connect(options)).await
                {
                    Ok(Ok(bus)) => {
                        let _ = bus.close().await;
                        true
                    }
                    _ => false,
                }
            }
        }
    }

    /// Stops `service`: its stop signal, then SIGKILL of it and its descendants after
    /// `STOP_TIMEOUT`.
    pub fn stop(&mut self, service: Service) {
        let server = self.server(service);
        let Some(mut child) = server.child.take() else {
            return;
        };
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        let pid = child.id();
        let signal = match service {
            // Fast shutdown: active transactions are rolled back, connections closed.
            Service::Postgres => Signal::SIGINT,
            Service::Redis | Service::RabbitMq => Signal::SIGTERM,
        };
        let family = descendants(pid);
        let _ = kill(pid_of(pid), signal);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(child.try_wait(), Ok(None)) {
            eprintln!("{service:?} did not stop within {STOP_TIMEOUT:?}; killing it");
            let _ = child.kill();
            let _ = child.wait();
        }
        // Whatever the server left behind (the broker's `beam.smp` under its script, a
        // Postgres backend) goes too.
        for pid in family.into_iter().chain(descendants(pid)) {
            let _ = kill(pid_of(pid), Signal::SIGKILL);
        }
    }
}

impl Drop for OwnServices {
    fn drop(&mut self) {
        for service in [Service::Redis, Service::Postgres, Service::RabbitMq] {
            self.stop(service);
        }
        if std::thread::panicking() || std::env::var_os(sb_tests::cluster::KEEP_LOGS_VAR).is_some()
        {
            if let Some(dir) = self.dir.take() {
                eprintln!("chaos services' files kept in {}", dir.keep().display());
            }
        }
    }
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX))
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// `PING` on a raw connection; `+PONG` back.
async fn redis_ping(port: u16) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream.write_all(b"PING\r\n").await?;
        let mut answer = [0u8; 7];
        stream.read_exact(&mut answer).await?;
        Ok::<bool, std::io::Error>(&answer == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), attempt).await,
        Ok(Ok(true))
    )
}

/// Every live descendant of `root` (Linux `/proc`), children before grandchildren.
#[must_use]
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid …`; comm may contain spaces and parentheses.
            let rest = &stat[stat.rfind(')')? + 1..];
            let mut fields = rest.split_whitespace();
            let state = fields.next()?;
            let ppid = fields.next()?.parse().ok()?;
            (state != "Z").then_some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// The last `lines` lines of a log file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    format!("--- {} ---\n{}", path.display(), all[from..].join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_include_grandchildren() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while descendants(child.id()).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let family = descendants(child.id());
        assert_eq!(family.len(), 1, "{family:?}");
        let mine = descendants(std::process::id());
        assert!(mine.contains(&child.id()) && mine.contains(&family[0]));
        for pid in family {
            let _ = kill(pid_of(pid), Signal::SIGKILL);
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
