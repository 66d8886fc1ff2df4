//! CPU time from `/proc`, for `switchboard bench`: the machine's busy time (all processes,
//! from `/proc/stat`) and, per process, its user + system time (`/proc/<pid>/stat`), each
//! as a sample whose difference over the measured window is the CPU that window cost.
//!
//! Machine CPU per run is steadier than throughput on a shared machine: it does not depend
//! on how long other work held the cores, only on how much of them the runs took (plus
//! whatever else ran in the window, which is why benchmarks want a quiet machine).
//!
//! Both files count in `USER_HZ` ticks, which the kernel fixes at 100 per second for every
//! userspace ABI it exposes (whatever its internal `HZ`).

use std::collections::BTreeMap;

/// Ticks per second in `/proc/stat` and `/proc/<pid>/stat`.
const USER_HZ: f64 = 100.0;

/// Busy and total ticks of all CPUs (the `cpu` line of `/proc/stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MachineTicks {
    /// user + nice + system + irq + softirq + steal.
    pub busy: u64,
    /// busy + idle + iowait.
    pub total: u64,
}

/// Parses the aggregate `cpu` line of a `/proc/stat` text.
#[must_use]
pub fn parse_proc_stat(text: &str) -> Option<MachineTicks> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    Some(MachineTicks {
        busy,
        total: busy + get(3) + get(4),
    })
}

/// user + system ticks of one process from its `/proc/<pid>/stat` text. The command name
/// (field 2) is in parentheses and may itself contain spaces and parentheses, so fields are
/// counted after the last `)`.
#[must_use]
pub fn parse_pid_stat(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(3) ppid(4) … utime(14) stime(15) → indices 11 and 12 here.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// A short name for a process from its `/proc/<pid>/cmdline` text (NUL-separated): the
/// program's file name, and for `switchboard` its subcommand (`switchboard gateway`), so the
/// processes of a deployment group into roles.
#[must_use]
pub fn process_label(cmdline: &[u8]) -> String {
    let mut args = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned());
    let program = args.next().unwrap_or_default();
    // Some servers rewrite their argv into one string: `postgres: 15/main: checkpointer`,
    // `redis-server 127.0.0.1:6379`.
    let program = program.split([':', ' ']).next().unwrap_or_default();
    let name = program.rsplit('/').next().unwrap_or_default().to_owned();
    if name == "switchboard" {
        match args.next() {
            Some(sub) => format!("switchboard {sub}"),
            None => name,
        }
    } else {
        name
    }
}

/// One reading of the machine and of the watched processes.
#[derive(Debug, Clone, Default)]
pub struct CpuSample {
    machine: Option<MachineTicks>,
    pids: BTreeMap<u32, u64>,
    labels: BTreeMap<u32, String>,
}

impl CpuSample {
    /// Reads `/proc/stat` and `/proc/<pid>/stat` of each of `pids` (a process that is gone
    /// or unreadable is left out).
    #[must_use]
    pub fn take(pids: &[u32]) -> Self {
        let machine = std::fs::read_to_string("/proc/stat")
            .ok()
            .as_deref()
            .and_then(parse_proc_stat);
        let pids: BTreeMap<u32, u64> = pids
            .iter()
            .filter_map(|&pid| {
                let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                Some((pid, parse_pid_stat(&text)?))
            })
            .collect();
        let labels = pids
            .keys()
            .map(|&pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                (pid, process_label(&cmdline))
            })
            .collect();
        Self {
            machine,
            pids,
            labels,
        }
    }

    /// CPU seconds the machine was busy between `self` (earlier) and `later`, and each
    /// process's CPU seconds in that window.
    #[must_use]
    pub fn until(&self, later: &Self) -> CpuUsage {
        let machine = match (self.machine, later.machine) {
            (Some(a), Some(b)) => Some(b.busy.saturating_sub(a.busy) as f64 / USER_HZ),
            _ => None,
        };
        let mut by_label: BTreeMap<String, f64> = BTreeMap::new();
        let pids = self
            .pids
            .iter()
            .filter_map(|(pid, before)| {
                let after = later.pids.get(pid)?;
                let secs = after.saturating_sub(*before) as f64 / USER_HZ;
                if let Some(label) = self.labels.get(pid) {
                    *by_label.entry(label.clone()).or_default() += secs;
                }
                Some((*pid, secs))
            })
            .collect();
        CpuUsage {
            machine,
            pids,
            by_label,
        }
    }
}

/// CPU seconds spent over a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuUsage {
    /// All processes of the machine (`None` without `/proc/stat`).
    pub machine: Option<f64>,
    /// Each watched process.
    pub pids: BTreeMap<u32, f64>,
    /// The watched processes summed by [`process_label`] (e.g. every `postgres` backend).
    pub by_label: BTreeMap<String, f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_ticks_count_busy_states_only() {
        let text = "cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 50 2 25 500 10 1 1 0 0 0\nintr 1\n";
        assert_eq!(
            parse_proc_stat(text),
            Some(MachineTicks {
                busy: 100 + 5 + 50 + 3 + 2 + 1,
                total: 161 + 1000 + 20,
            })
        );
        assert_eq!(parse_proc_stat("intr 1\n"), None);
    }

    #[test]
    fn process_ticks_survive_odd_command_names() {
        let stat = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 170 30 0 0 20 0 8 0";
        assert_eq!(parse_pid_stat(stat), Some(200));
        assert_eq!(parse_pid_stat("garbage"), None);
    }

    #[test]
    fn usage_is_the_difference_in_seconds() {
        let before = CpuSample {
            machine: Some(MachineTicks {
                busy: 1_000,
                total: 5_000,
            }),
            pids: BTreeMap::from([(1, 100), (2, 50)]),
            labels: BTreeMap::from([(1, "postgres".to_owned()), (2, "postgres".to_owned())]),
        };
        let after = CpuSample {
            machine: Some(MachineTicks {
                busy: 1_250,
                total: 5_400,
            }),
            pids: BTreeMap::from([(1, 150)]),
            labels: BTreeMap::new(),
        };
        let usage = before.until(&after);
        assert_eq!(usage.machine, Some(2.5));
        assert_eq!(usage.pids, BTreeMap::from([(1, 0.5)]));
        assert_eq!(
            usage.by_label,
            BTreeMap::from([("postgres".to_owned(), 0.5)])
        );
    }

    #[test]
    fn labels_name_roles_and_programs() {
        assert_eq!(
            process_label(b"/x/target/release/switchboard\0gateway\0--http-addr\0a\0"),
            "switchboard gateway"
        );
        assert_eq!(
            process_label(b"postgres: postgres test 127.0.0.1(5) idle\0"),
            "postgres"
        );
        assert_eq!(process_label(b"/usr/bin/redis-server\0"), "redis-server");
        assert_eq!(
            process_label(b"redis-server 127.0.0.1:6379\0"),
            "redis-server"
        );
        assert_eq!(
            process_label(b"postgres: 15/main: checkpointer \0"),
            "postgres"
        );
        assert_eq!(process_label(b""), "");
    }

    #[test]
    fn this_machine_is_readable() {
        let sample = CpuSample::take(&[std::process::id()]);
        assert!(sample.machine.is_some());
        assert!(sample.pids.contains_key(&std::process::id()));
    }
}
