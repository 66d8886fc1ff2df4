//! `switchboard runs list|show|tail` and `switchboard agents list|create|delete`: the
//! operator's view of a running gateway (`/v1/runs`, `/v1/agents`), as a table or `--json`.
//!
//! `runs tail` follows one run (`GET /v1/runs/{id}/stream`) until its terminal item, or a
//! conversation (`GET /v1/conversations/{id}/stream`, every run of it) until interrupted.
//! A dropped connection is resumed with `Last-Event-ID` (and `after_sequence` for a run), so
//! no item is printed twice or skipped; items of a run whose sequence is not above the last
//! one printed are dropped.

use std::collections::HashMap;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use futures::Stream;
use reqwest::Method;
use reqwest::header::CONTENT_TYPE;
use sb_protocol::result::AgentRunResult;
use serde_json::{Value, json};

use crate::cli::gateway::{GatewayCommandArgs, json_flag};
use crate::cli::output::{self, AGENTS, cell, item_style, print_json, print_table};
use crate::client::sse::{Backoff, LAST_EVENT_ID, SseParser, SseStream};
use crate::client::{GatewayClient, delta_text, message_text};

/// `switchboard runs`.
#[derive(Debug, Clone, Args)]
pub struct RunsArgs {
    #[command(subcommand)]
    pub command: RunsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The `runs` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum RunsCommand {
    /// List runs, newest first.
    List {
        /// Only this status (queued, running, completed, failed, cancelled, …).
        #[arg(long)]
        status: Option<String>,
        /// Only runs of this agent (name or id).
        #[arg(long, value_name = "AGENT")]
        agent: Option<String>,
        /// Only runs of this conversation.
        #[arg(long, value_name = "ID")]
        conversation: Option<String>,
        /// Page size.
        #[arg(long, default_value_t = 20, value_name = "N")]
        limit: u64,
        /// Continue after this cursor (`next_cursor` of the previous page).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one run and its items.
    Show {
        /// Run id.
        #[arg(value_name = "RUN_ID")]
        run_id: String,
    },
    /// Follow a run (until it ends) or a conversation (until interrupted) live.
    Tail {
        /// Run id.
        #[arg(value_name = "RUN_ID", required_unless_present = "conversation")]
        run_id: Option<String>,
        /// Follow every run of this conversation instead.
        #[arg(long, value_name = "ID", conflicts_with = "run_id")]
        conversation: Option<String>,
    },
}

/// `switchboard agents`.
#[derive(Debug, Clone, Args)]
pub struct AgentsArgs {
    #[command(subcommand)]
    pub command: AgentsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The `agents` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum AgentsCommand {
    /// List the workspace's agents.
    List,
    /// Show one agent (name or id).
    Show {
        /// Name or id.
        #[arg(value_name = "AGENT")]
        agent: String,
    },
    /// Create an agent.
    Create {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        /// Runner id, e.g. `plugin:switchboard/echo`.
        #[arg(long, value_name = "RUNNER_ID")]
        runner: String,
        /// Runner configuration, a JSON object.
        #[arg(long, value_name = "JSON")]
        runner_config: Option<String>,
        /// Scope, a JSON object (`bot_id`, `channel`, `conversation_id`, `actor_id`).
        #[arg(long, value_name = "JSON")]
        scope: Option<String>,
        /// Resource policy, a JSON object (`allowed_tool_names`, …).
        #[arg(long, value_name = "JSON")]
        resource_policy: Option<String>,
        /// `scope` or `direct`.
        #[arg(long)]
        routing: Option<String>,
        /// Create it disabled.
        #[arg(long)]
        disabled: bool,
        /// Free text.
        #[arg(long)]
        description: Option<String>,
    },
    /// Delete an agent (name or id).
    Delete {
        /// Name or id.
        #[arg(value_name = "AGENT")]
        agent: String,
    },
}

/// Runs a `runs` subcommand.
pub async fn runs(args: RunsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    let json = args.common.json;
    match args.command {
        RunsCommand::List {
            status,
            agent,
            conversation,
            limit,
            cursor,
        } => {
            let agent_id = match agent {
                Some(a) => Some(output::resolve(&c, AGENTS, &a).await?),
                None => None,
            };
            let mut query = vec![("limit", limit.to_string())];
            query.extend(status.map(|s| ("status", s)));
            query.extend(agent_id.map(|a| ("agent_id", a)));
            query.extend(conversation.map(|s| ("conversation_id", s)));
            query.extend(cursor.map(|s| ("cursor", s)));
            let path = format!("/v1/runs?{}", encode_query(&query));
            let page = c.json(Method::GET, &path, None).await?;
            if json {
                print_json(&page)?;
            } else {
                let rows: Vec<Vec<String>> = items(&page)
                    .iter()
                    .map(|r| {
                        [
                            "run_id",
                            "status",
                            "agent_id",
                            "conversation_id",
                            "created_at",
                        ]
                        .map(|k| cell(r, k))
                        .to_vec()
                    })
                    .collect();
                print_table(
                    &["RUN_ID", "STATUS", "AGENT_ID", "CONVERSATION", "CREATED_AT"],
                    &rows,
                );
                if let Some(next) = page["next_cursor"].as_str() {
                    eprintln!("more: --cursor {next}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        RunsCommand::Show { run_id } => {
            let run = c
                .json(Method::GET, &format!("/v1/runs/{run_id}"), None)
                .await?;
            let events = c
                .json(Method::GET, &format!("/v1/runs/{run_id}/events"), None)
                .await?;
            if json {
                print_json(&json!({"run": run, "events": events["items"]}))?;
            } else {
                for key in [
                    "run_id",
                    "status",
                    "agent_id",
                    "runner_id",
                    "conversation_id",
                    "worker_id",
                    "attempt",
                    "created_at",
                    "ended_at",
                ] {
                    println!("{key:<16}{}", cell(&run, key));
                }
                if let Some(error) = run.get("error").filter(|e| !e.is_null()) {
                    println!(
                        "{:<16}{}: {}",
                        "error",
                        cell(error, "code"),
                        cell(error, "message")
                    );
                }
                for item in items(&events) {
                    if let Ok(item) = serde_json::from_value::<AgentRunResult>(item.clone()) {
                        println!("{}", item_line(&item));
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        RunsCommand::Tail {
            run_id,
            conversation,
        } => {
            let target = match (run_id, conversation) {
                (Some(run), _) => Tail::Run(run),
                (None, Some(conversation)) => Tail::Conversation(conversation),
                (None, None) => anyhow::bail!("give a RUN_ID or --conversation"),
            };
            tail(&c, &target, json).await
        }
    }
}

/// Runs an `agents` subcommand.
pub async fn agents(args: AgentsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    let json = args.common.json;
    match args.command {
        AgentsCommand::List => {
            let list = output::list_all(&c, "/v1/agents").await?;
            if json {
                print_json(&list)?;
            } else {
                let rows: Vec<Vec<String>> = items(&list)
                    .iter()
                    .map(|a| {
                        ["agent_id", "name", "runner_id", "enabled", "routing"]
                            .map(|k| cell(a, k))
                            .to_vec()
                    })
                    .collect();
                print_table(&["AGENT_ID", "NAME", "RUNNER", "ENABLED", "ROUTING"], &rows);
            }
        }
        AgentsCommand::Show { agent } => {
            let id = output::resolve(&c, AGENTS, &agent).await?;
            print_json(
                &c.json(Method::GET, &format!("/v1/agents/{id}"), None)
                    .await?,
            )?;
        }
        AgentsCommand::Create {
            name,
            runner,
            runner_config,
            scope,
            resource_policy,
            routing,
            disabled,
            description,
        } => {
            let mut body = json!({"name": name, "runner_id": runner, "enabled": !disabled});
            let fields = [
                (
                    "runner_config",
                    json_flag("runner-config", runner_config.as_deref())?,
                ),
                ("scope", json_flag("scope", scope.as_deref())?),
                (
                    "resource_policy",
                    json_flag("resource-policy", resource_policy.as_deref())?,
                ),
                ("routing", routing.map(Value::String)),
                ("description", description.map(Value::String)),
            ];
            for (key, value) in fields {
                if let Some(value) = value {
                    body[key] = value;
                }
            }
            let created = c.json(Method::POST, "/v1/agents", Some(&body)).await?;
            if json {
                print_json(&created)?;
            } else {
                println!("{}", cell(&created, "agent_id"));
            }
        }
        AgentsCommand::Delete { agent } => {
            let id = output::resolve(&c, AGENTS, &agent).await?;
            c.json(Method::DELETE, &format!("/v1/agents/{id}"), None)
                .await?;
            if json {
                print_json(&json!({"deleted": id}))?;
            } else {
                eprintln!("agent {id} deleted");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The `items` of a list answer.
fn items(list: &Value) -> Vec<Value> {
    list["items"].as_array().cloned().unwrap_or_default()
}

/// `k=v&…` with the values percent-encoded.
fn encode_query(pairs: &[(&str, String)]) -> String {
    url_encoded(pairs)
}

fn url_encoded(pairs: &[(&str, String)]) -> String {
    let mut url = reqwest::Url::parse("http://x/").expect("static URL");
    url.query_pairs_mut()
        .extend_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())));
    url.query().unwrap_or_default().to_owned()
}

/// What `runs tail` follows.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tail {
    Run(String),
    Conversation(String),
}

impl Tail {
    /// The stream path, resuming after `after` for a run.
    fn path(&self, after: u64) -> String {
        match self {
            Self::Run(id) => format!("/v1/runs/{id}/stream?after_sequence={after}"),
            Self::Conversation(id) => format!("/v1/conversations/{id}/stream"),
        }
    }
}

type BodyStream = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// Consecutive failed connections after which `tail` gives up.
const TAIL_MAX_ATTEMPTS: u32 = 8;

/// Follows `target`, printing each new item; see the module docs.
async fn tail(c: &GatewayClient, target: &Tail, json: bool) -> anyhow::Result<ExitCode> {
    let mut parser = SseParser::default();
    // Last sequence printed, per run (a conversation interleaves runs).
    let mut printed: HashMap<String, u64> = HashMap::new();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let waiting = output::spinner(match target {
        Tail::Run(id) => format!("waiting for run {id}"),
        Tail::Conversation(id) => format!("waiting for conversation {id}"),
    });
    loop {
        let after = match target {
            Tail::Run(id) => printed.get(id).copied().unwrap_or(0),
            Tail::Conversation(_) => 0,
        };
        let mut request = c.request(Method::GET, &target.path(after));
        if let Some(id) = parser.last_event_id() {
            request = request.header(LAST_EVENT_ID, id.to_owned());
        }
        let failure = match request.send().await {
            Err(e) => format!("cannot reach the gateway: {e}"),
            Ok(response) if !response.status().is_success() => {
                let status = response.status();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                waiting.finish_and_clear();
                anyhow::bail!(
                    "gateway answered {status}: {}: {}",
                    cell(&body, "code"),
                    cell(&body, "message")
                );
            }
            Ok(response)
                if !response
                    .headers()
                    .get(CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("text/event-stream")) =>
            {
                waiting.finish_and_clear();
                anyhow::bail!("{} is not an event stream", target.path(after));
            }
            Ok(response) => {
                let body: BodyStream = Box::pin(response.bytes_stream());
                let mut stream = SseStream::new(body, std::mem::take(&mut parser), None);
                let outcome = loop {
                    match stream.next_event().await {
                        Ok(Some(frame)) if frame.event == "error" => {
                            waiting.finish_and_clear();
                            let body: Value = serde_json::from_str(&frame.data).unwrap_or_default();
                            anyhow::bail!(
                                "stream ended with {}: {}",
                                cell(&body, "code"),
                                cell(&body, "message")
                            );
                        }
                        Ok(Some(frame)) => {
                            let Ok(item) = serde_json::from_str::<AgentRunResult>(&frame.data)
                            else {
                                continue; // a frame that is not an item (keep-alive, receipt)
                            };
                            let run = if item.run_id.is_empty() {
                                match target {
                                    Tail::Run(id) => id.clone(),
                                    Tail::Conversation(_) => String::new(),
                                }
                            } else {
                                item.run_id.clone()
                            };
                            let seq = item.sequence.unwrap_or(0);
                            let last = printed.entry(run.clone()).or_insert(0);
                            if seq != 0 && seq <= *last {
                                continue; // a replay after a resume
                            }
                            *last = seq.max(*last);
                            backoff.reset();
                            waiting.suspend(|| {
                                if json {
                                    println!("{}", frame.data);
                                } else if matches!(target, Tail::Conversation(_)) {
                                    // Runs interleave: each line starts with its run.
                                    let short: String = run.chars().take(8).collect();
                                    println!("{short} {}", item_line(&item));
                                } else {
                                    println!("{}", item_line(&item));
                                }
                            });
                            let terminal =
                                matches!(item.result_type.as_str(), "run.completed" | "run.failed");
                            if terminal && matches!(target, Tail::Run(_)) {
                                waiting.finish_and_clear();
                                return Ok(if item.result_type == "run.completed" {
                                    ExitCode::SUCCESS
                                } else {
                                    ExitCode::FAILURE
                                });
                            }
                        }
                        Ok(None) => break "the stream ended".to_owned(),
                        Err(e) => break e.to_string(),
                    }
                };
                parser = stream.into_parser();
                outcome
            }
        };
        if backoff.attempts() >= TAIL_MAX_ATTEMPTS {
            waiting.finish_and_clear();
            anyhow::bail!("lost the stream: {failure}");
        }
        waiting.set_message(format!("reconnecting ({failure})"));
        tokio::time::sleep(backoff.next_delay(parser.retry())).await;
    }
}

/// One item as a line: `seq type text`, the type coloured by kind when stdout is a
/// terminal.
fn item_line(item: &AgentRunResult) -> String {
    let text = delta_text(item)
        .or_else(|| message_text(item))
        .or_else(|| {
            item.data
                .get("tool_name")
                .or_else(|| item.data.get("name"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .or_else(|| {
            item.data
                .get("error")
                .map(|e| format!("{}: {}", cell(e, "code"), cell(e, "message")))
        })
        .unwrap_or_default();
    let seq = item
        .sequence
        .map_or_else(|| "-".to_owned(), |s| s.to_string());
    let kind = item_style(&item.result_type).apply_to(format!("{:<22}", item.result_type));
    format!("{seq:>4} {kind} {text}").trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    #[test]
    fn gateway_flags_go_before_or_after_the_subcommand() {
        for argv in [
            vec![
                "switchboard",
                "runs",
                "--url",
                "http://h:1",
                "--json",
                "list",
            ],
            vec![
                "switchboard",
                "runs",
                "list",
                "--url",
                "http://h:1",
                "--json",
            ],
        ] {
            let Command::Runs(runs) = Cli::try_parse_from(&argv).unwrap().command else {
                panic!("not runs")
            };
            assert_eq!(runs.common.gateway.url, "http://h:1", "{argv:?}");
            assert!(runs.common.json);
        }
    }

    #[test]
    fn tail_takes_a_run_or_a_conversation() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["switchboard", "runs", "tail"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv)
        };
        assert!(parse(&["r1"]).is_ok());
        assert!(parse(&["--conversation", "c1"]).is_ok());
        assert!(parse(&[]).is_err());
        assert!(parse(&["r1", "--conversation", "c1"]).is_err());
        assert_eq!(
            Tail::Run("r".into()).path(4),
            "/v1/runs/r/stream?after_sequence=4"
        );
    }

    #[test]
    fn queries_are_encoded() {
        assert_eq!(
            url_encoded(&[("status", "a b".into()), ("conversation_id", "c&d".into())]),
            "status=a+b&conversation_id=c%26d"
        );
    }
}
