//! `switchboard dlq`: look at, replay and purge the dead-letter queue of a cluster
//! (`<bus.name_prefix>.dead`, SPEC §3).
//!
//! A message lands there when a consumer gave up on it for good, or when it was returned more
//! than `bus.delivery_limit` times (a poison message). Once the cause is fixed, `replay` sends
//! it back to the exchange and routing key it died from; the consumers are idempotent, so a
//! message that was in fact processed is not processed twice. The work is done by
//! [`DeadLetters`] (`sb_common::bus::dead_letters`), whose contract explains why nothing is
//! lost or duplicated by a peek and why a replay is at-least-once; this module only opens the
//! bus from the configuration and prints.
//!
//! The in-process bus of `switchboard dev` keeps its dead letters inside that process, so
//! there is nothing to reach from another one: the command refuses it with an explanation.

use std::io::Write;
use std::num::NonZeroUsize;
use std::process::ExitCode;

use anyhow::Context as _;
use base64::Engine as _;
use clap::{Args, Subcommand};
use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
use sb_common::bus::dead_letters::{DeadLetter, DeadLetters, ReplayOptions, ReplayReport};
use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus as _, BusError, QueueSpec};
use sb_common::config::{BusKind, SwitchboardConfig};
use serde::Serialize;

use crate::cli::config::{ConfigArgs, Overrides};

/// Characters of a body shown by `dlq list` (without `--json`).
const PREVIEW_CHARS: usize = 120;

/// `switchboard dlq`.
#[derive(Debug, Clone, Args)]
pub struct DlqArgs {
    #[command(subcommand)]
    pub command: DlqCommand,
}

/// The `dlq` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum DlqCommand {
    /// Show the dead letters (where each died and why, and its payload) without removing them.
    List(ListArgs),
    /// Send dead letters back to the exchange and routing key they died from.
    Replay(ReplayArgs),
    /// Delete every dead letter.
    Purge(PurgeArgs),
}

/// `switchboard dlq list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Show at most this many, from the head of the queue.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub limit: usize,
    /// Print one JSON document with every field and the whole payloads (as JSON when they are
    /// JSON, else base64).
    #[arg(long)]
    pub json: bool,
}

/// `switchboard dlq replay`: one of `--limit`, `--all` or `--id` is required, so a bare
/// `replay` does not send back a whole queue by accident.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("selection").required(true).multiple(true).args(["limit", "all", "id"])))]
pub struct ReplayArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Replay at most this many, from the head of the queue.
    #[arg(long, value_name = "N", conflicts_with = "all")]
    pub limit: Option<NonZeroUsize>,
    /// Replay every dead letter (those present when the replay starts).
    #[arg(long)]
    pub all: bool,
    /// Replay only the dead letters with this id (as printed by `dlq list`).
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,
}

impl ReplayArgs {
    fn options(&self) -> ReplayOptions {
        ReplayOptions {
            limit: self.limit.map(NonZeroUsize::get),
            id: self.id.clone(),
        }
    }
}

/// `switchboard dlq purge`.
#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Really delete them (without it, the command only says how many it would delete).
    #[arg(long)]
    pub yes: bool,
}

impl DlqCommand {
    fn config(&self) -> &ConfigArgs {
        match self {
            Self::List(args) => &args.config,
            Self::Replay(args) => &args.config,
            Self::Purge(args) => &args.config,
        }
    }
}

/// Runs a `dlq` subcommand; its results go to stdout, logs to stderr.
pub async fn run(args: DlqArgs) -> anyhow::Result<ExitCode> {
    let config = args
        .command
        .config()
        .load_and_init_logging(Overrides::default())?;
    let mut stdout = std::io::stdout().lock();
    execute(&config, &args.command, &mut stdout).await
}

/// Opens the configured bus, runs `command` on its dead queue, closes the bus.
pub async fn execute(
    config: &SwitchboardConfig,
    command: &DlqCommand,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let queue = dead_queue(config)?;
    let bus = connect(config).await?;
    let done = match command {
        DlqCommand::List(args) => list(&bus, &queue, args, out)
            .await
            .map(|()| ExitCode::SUCCESS),
        DlqCommand::Replay(args) => replay(&bus, &queue, args, out).await,
        DlqCommand::Purge(args) => purge(&bus, &queue, args, out).await,
    };
    let _ = bus.close().await;
    done
}

/// The dead queue of the configured deployment (its name and type).
fn dead_queue(config: &SwitchboardConfig) -> anyhow::Result<QueueSpec> {
    let options = crate::embedded::topology_options(config).context("bus configuration")?;
    Ok(Topology::new(options)
        .context("bus configuration")?
        .dead_queue())
}

/// Connects to the cluster's broker; the in-process bus is refused (see the module docs).
async fn connect(config: &SwitchboardConfig) -> anyhow::Result<AmqpBus> {
    let url = match (config.bus.kind, &config.bus.url) {
        (BusKind::Amqp, Some(url)) => url.expose().to_owned(),
        (BusKind::Memory, _) => anyhow::bail!(
            "the configured bus is the in-process one (bus.kind = memory): the dead letters of an \
             embedded deployment (`switchboard dev`) live inside that process and end with it, so \
             no other process can read them. To inspect a cluster's dead letters, set bus.kind = amqp \
             and bus.url (SWITCHBOARD__BUS__KIND=amqp, SWITCHBOARD__BUS__URL=amqp://…) as its roles do"
        ),
        // Validation requires the URL for `amqp`.
        (BusKind::Amqp, None) => anyhow::bail!("bus.url is required with bus.kind = amqp"),
    };
    let name = format!("switchboard dlq (pid {})", std::process::id());
    AmqpBus::connect(AmqpOptions::new(url, name))
        .await
        .context("cannot connect to the message bus")
}

/// Explains a failed operation on the dead queue.
fn failed(queue: &QueueSpec, error: BusError) -> anyhow::Error {
    match error {
        BusError::NotFound(_) => anyhow::anyhow!(
            "the dead-letter queue {:?} does not exist: no role of this deployment has started yet, \
             or bus.name_prefix differs from the one its roles use",
            queue.name
        ),
        other => anyhow::Error::new(other).context(format!("dead-letter queue {:?}", queue.name)),
    }
}

/// `dlq list`: prints the head of the dead queue, leaving it untouched.
pub async fn list(
    dead_letters: &dyn DeadLetters,
    queue: &QueueSpec,
    args: &ListArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let list = dead_letters
        .peek(queue, args.limit)
        .await
        .map_err(|e| failed(queue, e))?;
    if args.json {
        let document = JsonList {
            queue: &queue.name,
            total: list.total,
            letters: list.letters.iter().map(JsonLetter::from).collect(),
        };
        serde_json::to_writer_pretty(&mut *out, &document).context("cannot write the list")?;
        writeln!(out).context("cannot write the list")?;
        return Ok(());
    }
    let shown = list.letters.len();
    let count = plural(list.total, "dead letter");
    if shown < list.total {
        writeln!(out, "{count} in {}, showing the first {shown}", queue.name)
    } else {
        writeln!(out, "{count} in {}", queue.name)
    }
    .context("cannot write the list")?;
    for letter in &list.letters {
        write_letter(out, letter).context("cannot write the list")?;
    }
    Ok(())
}

/// `dlq replay`: sends the selected dead letters back; failure when any selected one was not
/// replayed.
pub async fn replay(
    dead_letters: &dyn DeadLetters,
    queue: &QueueSpec,
    args: &ReplayArgs,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let progress =
        crate::cli::output::spinner(format!("replaying the dead letters of {}", queue.name));
    let report = dead_letters.replay(queue, &args.options()).await;
    progress.finish_and_clear();
    let report = report.map_err(|e| failed(queue, e))?;
    write_report(out, queue, args, &report).context("cannot write the report")?;
    let nothing_matched = args.id.is_some() && report.replayed == 0 && report.left_in_place() == 0;
    Ok(if report.is_complete() && !nothing_matched {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `dlq purge`: deletes every dead letter with `--yes`; without it, says how many it would.
pub async fn purge(
    dead_letters: &dyn DeadLetters,
    queue: &QueueSpec,
    args: &PurgeArgs,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    if !args.yes {
        // `limit` 0 counts without taking anything.
        let total = dead_letters
            .peek(queue, 0)
            .await
            .map_err(|e| failed(queue, e))?
            .total;
        writeln!(
            out,
            "this would delete {} from {} for good; run `switchboard dlq purge --yes` to do it",
            plural(total, "dead letter"),
            queue.name
        )
        .context("cannot write")?;
        return Ok(ExitCode::FAILURE);
    }
    let purged = dead_letters
        .purge(queue)
        .await
        .map_err(|e| failed(queue, e))?;
    let purged = usize::try_from(purged).unwrap_or(usize::MAX);
    writeln!(
        out,
        "purged {} from {}",
        plural(purged, "dead letter"),
        queue.name
    )
    .context("cannot write")?;
    Ok(ExitCode::SUCCESS)
}

fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The message type shown: the AMQP `type` property, else the body's `schema`.
fn message_type(letter: &DeadLetter) -> Option<String> {
    letter.message_type.clone().or_else(|| letter.schema())
}

fn write_letter(out: &mut impl Write, letter: &DeadLetter) -> std::io::Result<()> {
    let mut head = format!("#{} id={}", letter.position, letter.id);
    if let Some(id) = &letter.message_id {
        if *id != letter.id {
            head.push_str(&format!(" message-id={id}"));
        }
    }
    if let Some(kind) = message_type(letter) {
        head.push_str(&format!(" type={kind}"));
    }
    head.push_str(&format!(" size={}", plural(letter.body.len(), "byte")));
    writeln!(out, "{head}")?;
    match &letter.death {
        Some(death) => writeln!(
            out,
            "  died in {} ({}, {}x); origin: exchange {:?}, routing key {:?}",
            death.queue, death.reason, death.count, death.exchange, death.routing_key
        )?,
        None => writeln!(
            out,
            "  no recorded origin (published to the dead-letter exchange directly): cannot be replayed"
        )?,
    }
    writeln!(out, "  {}", preview(&letter.body))
}

/// A one-line preview of a body: its text with control characters escaped, cut at
/// [`PREVIEW_CHARS`]; binary bodies as the start of their base64.
fn preview(body: &[u8]) -> String {
    let (text, what) = match std::str::from_utf8(body) {
        Ok(text) => (text.escape_debug().to_string(), ""),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(body),
            "base64: ",
        ),
    };
    let mut chars = text.chars();
    let mut shown: String = chars.by_ref().take(PREVIEW_CHARS).collect();
    if chars.next().is_some() {
        shown.push('…');
    }
    format!("{what}{shown}")
}

fn write_report(
    out: &mut impl Write,
    queue: &QueueSpec,
    args: &ReplayArgs,
    report: &ReplayReport,
) -> std::io::Result<()> {
    writeln!(
        out,
        "replayed {} of {} examined in {}",
        report.replayed,
        plural(report.examined, "dead letter"),
        queue.name
    )?;
    if let Some(id) = &args.id {
        if report.replayed == 0 && report.left_in_place() == 0 {
            writeln!(out, "no dead letter has id {id}")?;
        }
    }
    for letter in &report.without_origin {
        writeln!(
            out,
            "left in place: #{} id={}: no recorded origin",
            letter.position, letter.id
        )?;
    }
    for (letter, error) in &report.failed {
        writeln!(
            out,
            "left in place: #{} id={}: {error}",
            letter.position, letter.id
        )?;
    }
    if let Some(error) = &report.interrupted {
        writeln!(
            out,
            "interrupted: {error}; the dead letters not replayed are still in the queue (run the replay again)"
        )?;
    }
    Ok(())
}

#[derive(Serialize)]
struct JsonList<'a> {
    queue: &'a str,
    total: usize,
    letters: Vec<JsonLetter<'a>>,
}

#[derive(Serialize)]
struct JsonLetter<'a> {
    position: usize,
    id: &'a str,
    message_id: Option<&'a str>,
    #[serde(rename = "type")]
    message_type: Option<String>,
    death: Option<JsonDeath<'a>>,
    size: usize,
    /// The body when it is JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<serde_json::Value>,
    /// The body in base64 when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
}

#[derive(Serialize)]
struct JsonDeath<'a> {
    exchange: &'a str,
    routing_key: &'a str,
    queue: &'a str,
    reason: &'a str,
    count: u32,
}

impl<'a> From<&'a DeadLetter> for JsonLetter<'a> {
    fn from(letter: &'a DeadLetter) -> Self {
        let payload = serde_json::from_slice::<serde_json::Value>(&letter.body).ok();
        let payload_base64 = payload
            .is_none()
            .then(|| base64::engine::general_purpose::STANDARD.encode(&letter.body));
        Self {
            position: letter.position,
            id: &letter.id,
            message_id: letter.message_id.as_deref(),
            message_type: message_type(letter),
            death: letter.death.as_ref().map(|d| JsonDeath {
                exchange: &d.exchange,
                routing_key: &d.routing_key,
                queue: &d.queue,
                reason: d.reason.as_str(),
                count: d.count,
            }),
            size: letter.body.len(),
            payload,
            payload_base64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use sb_common::bus::memory::MemoryBus;
    use sb_common::bus::topology::declare_topology;
    use sb_common::bus::{ConsumeOptions, PublishOptions};
    use sb_common::config::ConfigLoader;

    fn parse(argv: &[&str]) -> Result<DlqCommand, clap::Error> {
        let mut full = vec!["switchboard", "dlq"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full)?.command {
            Command::Dlq(DlqArgs { command }) => Ok(command),
            other => panic!("{other:?}"),
        }
    }

    fn list_args(argv: &[&str]) -> ListArgs {
        let mut full = vec!["list"];
        full.extend_from_slice(argv);
        match parse(&full).unwrap() {
            DlqCommand::List(args) => args,
            other => panic!("{other:?}"),
        }
    }

    fn replay_args(argv: &[&str]) -> ReplayArgs {
        let mut full = vec!["replay"];
        full.extend_from_slice(argv);
        match parse(&full).unwrap() {
            DlqCommand::Replay(args) => args,
            other => panic!("{other:?}"),
        }
    }

    fn purge_args(argv: &[&str]) -> PurgeArgs {
        let mut full = vec!["purge"];
        full.extend_from_slice(argv);
        match parse(&full).unwrap() {
            DlqCommand::Purge(args) => args,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn flags_parse() {
        let list = list_args(&["--config", "x.toml", "--limit", "5", "--json"]);
        assert_eq!((list.limit, list.json), (5, true));
        assert_eq!(list_args(&[]).limit, 20);

        let all = replay_args(&["--all"]);
        assert_eq!(all.options(), ReplayOptions::default());
        let some = replay_args(&["--limit", "3", "--id", "abc"]);
        assert_eq!(
            some.options(),
            ReplayOptions {
                limit: Some(3),
                id: Some("abc".into())
            }
        );
        assert_eq!(replay_args(&["--id", "abc"]).options().limit, None);
        // A bare replay, a zero limit, and --limit with --all are refused.
        assert!(parse(&["replay"]).is_err());
        assert!(parse(&["replay", "--limit", "0"]).is_err());
        assert!(parse(&["replay", "--limit", "2", "--all"]).is_err());

        assert!(!purge_args(&[]).yes);
        assert!(purge_args(&["--yes", "-c", "x.toml"]).yes);
    }

    #[test]
    fn previews_are_one_short_line() {
        assert_eq!(preview(b"{\"a\":\n1}"), "{\\\"a\\\":\\n1}");
        let long = "x".repeat(PREVIEW_CHARS + 10);
        let shown = preview(long.as_bytes());
        assert_eq!(shown.chars().count(), PREVIEW_CHARS + 1);
        assert!(shown.ends_with('…'));
        assert_eq!(preview(&[0xff, 0x00, 0x10]), "base64: /wAQ");
    }

    #[tokio::test]
    async fn the_in_process_bus_is_refused_with_an_explanation() {
        let config = ConfigLoader::new().without_file().load().unwrap();
        let mut out = Vec::new();
        let err = execute(&config, &DlqCommand::List(list_args(&[])), &mut out)
            .await
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("bus.kind = memory"), "{msg}");
        assert!(msg.contains("SWITCHBOARD__BUS__URL"), "{msg}");
        assert!(out.is_empty());
    }

    /// A memory bus with a dead queue holding one dead job (died in the `default` pool's
    /// queue) and one message without origin.
    async fn memory_dead_queue() -> (MemoryBus, Topology) {
        let bus = MemoryBus::new();
        let options = sb_common::bus::topology::TopologyOptions::default();
        let topology = declare_topology(&bus, &options).await.unwrap();
        let job = br#"{"schema":"switchboard.job/1","run_id":"r1"}"#;
        bus.publish(
            &topology.runs_exchange(),
            "default",
            job[..].into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        let mut sub = bus
            .subscribe(&topology.runs_queue("default"), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        sub.next().await.unwrap().nack(false).await.unwrap();
        bus.publish(
            &topology.dead_exchange(),
            "",
            vec![0xff, 0xfe].into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        (bus, topology)
    }

    #[tokio::test]
    async fn list_shows_origin_reason_type_and_preview() {
        let (bus, topology) = memory_dead_queue().await;
        let queue = topology.dead_queue();
        let mut out = Vec::new();
        list(&bus, &queue, &list_args(&[]), &mut out).await.unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "2 dead letters in switchboard.dead");
        assert!(lines[1].starts_with("#1 id="), "{text}");
        assert!(lines[1].contains("type=switchboard.job/1"), "{text}");
        assert!(lines[1].ends_with("size=44 bytes"), "{text}");
        assert_eq!(
            lines[2],
            "  died in switchboard.runs.default (rejected, 1x); origin: exchange \"switchboard.runs\", routing key \"default\""
        );
        assert!(lines[3].contains(r#"\"run_id\":\"r1\""#), "{text}");
        assert!(lines[4].starts_with("#2 id="), "{text}");
        assert!(lines[5].contains("no recorded origin"), "{text}");
        assert_eq!(lines[6], "  base64: //4=");

        let mut out = Vec::new();
        list(&bus, &queue, &list_args(&["--limit", "1"]), &mut out)
            .await
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("2 dead letters in switchboard.dead, showing the first 1\n"));
        assert!(!text.contains("#2"), "{text}");
        assert_eq!(
            bus.ready_count(&queue.name),
            Some(2),
            "listing took nothing"
        );
    }

    #[tokio::test]
    async fn json_list_carries_whole_payloads() {
        let (bus, topology) = memory_dead_queue().await;
        let mut out = Vec::new();
        list(
            &bus,
            &topology.dead_queue(),
            &list_args(&["--json"]),
            &mut out,
        )
        .await
        .unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(doc["queue"], "switchboard.dead");
        assert_eq!(doc["total"], 2);
        let job = &doc["letters"][0];
        assert_eq!(job["position"], 1);
        assert_eq!(job["type"], "switchboard.job/1");
        assert_eq!(job["payload"]["run_id"], "r1");
        assert!(job.get("payload_base64").is_none());
        assert_eq!(job["death"]["exchange"], "switchboard.runs");
        assert_eq!(job["death"]["routing_key"], "default");
        assert_eq!(job["death"]["queue"], "switchboard.runs.default");
        assert_eq!(job["death"]["reason"], "rejected");
        assert_eq!(job["death"]["count"], 1);
        let binary = &doc["letters"][1];
        assert_eq!(binary["payload_base64"], "//4=");
        assert!(binary.get("payload").is_none());
        assert!(binary["death"].is_null());
    }

    #[tokio::test]
    async fn replay_reports_what_it_left_and_fails_unless_complete() {
        let (bus, topology) = memory_dead_queue().await;
        let queue = topology.dead_queue();
        let mut out = Vec::new();
        let code = replay(&bus, &queue, &replay_args(&["--all"]), &mut out)
            .await
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(code, ExitCode::FAILURE, "one could not be replayed");
        assert!(
            text.starts_with("replayed 1 of 2 dead letters examined in switchboard.dead\n"),
            "{text}"
        );
        assert!(text.contains("left in place: #2 id="), "{text}");
        assert!(text.contains("no recorded origin"), "{text}");
        assert_eq!(
            bus.ready_count(&topology.runs_queue("default").name),
            Some(1)
        );

        let mut out = Vec::new();
        let code = replay(&bus, &queue, &replay_args(&["--id", "nope"]), &mut out)
            .await
            .unwrap();
        assert_eq!(code, ExitCode::FAILURE);
        assert!(
            String::from_utf8(out)
                .unwrap()
                .contains("no dead letter has id nope")
        );
    }

    #[tokio::test]
    async fn purge_needs_yes() {
        let (bus, topology) = memory_dead_queue().await;
        let queue = topology.dead_queue();
        let mut out = Vec::new();
        let code = purge(&bus, &queue, &purge_args(&[]), &mut out)
            .await
            .unwrap();
        assert_eq!(code, ExitCode::FAILURE);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("would delete 2 dead letters"), "{text}");
        assert!(text.contains("--yes"), "{text}");
        assert_eq!(bus.ready_count(&queue.name), Some(2), "nothing deleted");

        let mut out = Vec::new();
        let code = purge(&bus, &queue, &purge_args(&["--yes"]), &mut out)
            .await
            .unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "purged 2 dead letters from switchboard.dead\n"
        );
        assert_eq!(bus.ready_count(&queue.name), Some(0));
    }

    fn amqp_url() -> String {
        std::env::var("SWITCHBOARD_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
    }

    /// The whole command against RabbitMQ, configured as an operator would (bus section with a
    /// unique name prefix): a job over its delivery limit is listed with its origin, replayed to
    /// its pool's queue, and a purge empties the dead queue. Skipped when no broker answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn list_replay_purge_on_rabbitmq() {
        let prefix = format!("test-{}.switchboard", uuid::Uuid::new_v4().simple());
        let config = ConfigLoader::new()
            .without_file()
            .set("bus.kind", "amqp")
            .set("bus.url", amqp_url())
            .set("bus.name_prefix", prefix.as_str())
            .set("bus.delivery_limit", "1")
            .set("bus.events_shards", "1")
            .set("bus.results_shards", "1")
            .load()
            .unwrap();
        let bus = match connect(&config).await {
            Ok(bus) => bus,
            Err(error) => {
                eprintln!("skipped: RabbitMQ is unreachable ({error:#})");
                return;
            }
        };
        let options = crate::embedded::topology_options(&config).unwrap();
        let topology = declare_topology(&bus, &options).await.unwrap();
        let outcome = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            drive_the_command(&config, &bus, &topology),
        )
        .await;
        topology.delete(&bus).await.unwrap();
        let _ = bus.close().await;
        outcome.expect("timed out");
    }

    async fn drive_the_command(config: &SwitchboardConfig, bus: &AmqpBus, topology: &Topology) {
        let job = br#"{"schema":"switchboard.job/1","run_id":"r-amqp"}"#;
        bus.publish(
            &topology.runs_exchange(),
            "default",
            job[..].into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        // Delivery limit 1: two deliveries, then dead.
        let mut sub = bus
            .subscribe(&topology.runs_queue("default"), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        for _ in 0..2 {
            sub.next().await.unwrap().nack(true).await.unwrap();
        }
        drop(sub);
        let dead = topology.dead_queue();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while bus.peek(&dead, 0).await.unwrap().total == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never dead-lettered"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }

        let run = |argv: &'static [&'static str]| async move {
            let mut out = Vec::new();
            let code = execute(config, &parse(argv).unwrap(), &mut out)
                .await
                .unwrap();
            (code, String::from_utf8(out).unwrap())
        };
        let (code, listed) = run(&["list"]).await;
        assert_eq!(code, ExitCode::SUCCESS);
        let dead_name = &dead.name;
        assert!(
            listed.starts_with(&format!("1 dead letter in {dead_name}\n")),
            "{listed}"
        );
        assert!(listed.contains("type=switchboard.job/1"), "{listed}");
        let runs = topology.runs_exchange();
        assert!(
            listed.contains(&format!(
                "died in {runs}.default (delivery_limit, 1x); origin: exchange \"{runs}\", routing key \"default\""
            )),
            "{listed}"
        );
        let (_, again) = run(&["list"]).await;
        assert_eq!(again, listed, "listing changes nothing");

        let (code, replayed) = run(&["replay", "--all"]).await;
        assert_eq!(code, ExitCode::SUCCESS, "{replayed}");
        assert_eq!(
            replayed,
            format!("replayed 1 of 1 dead letter examined in {dead_name}\n")
        );
        let mut sub = bus
            .subscribe(&topology.runs_queue("default"), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        let delivery = tokio::time::timeout(std::time::Duration::from_secs(10), sub.next())
            .await
            .expect("the replayed job arrives")
            .unwrap();
        assert_eq!(&delivery.body[..], job);
        assert_eq!(delivery.delivery_count, 0);
        // Dead again, to be purged.
        delivery.nack(false).await.unwrap();
        drop(sub);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while bus.peek(&dead, 0).await.unwrap().total == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never dead-lettered again"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }

        let (code, refused) = run(&["purge"]).await;
        assert_eq!(code, ExitCode::FAILURE);
        assert!(refused.contains("would delete 1 dead letter "), "{refused}");
        let (code, purged) = run(&["purge", "--yes"]).await;
        assert_eq!(code, ExitCode::SUCCESS);
        assert_eq!(purged, format!("purged 1 dead letter from {dead_name}\n"));
        let (_, empty) = run(&["list"]).await;
        assert_eq!(empty, format!("0 dead letters in {dead_name}\n"));
    }
}
