//! `switchboard sessions …` and `switchboard turns start|show|wait|events|cancel`: the
//! service API of sessions and turns (`/v1/sessions`, `/v1/turns`), for scripts and for
//! trying an integration by hand.
//!
//! `turns start` sends an idempotency key (`--key`, default a fresh UUID, printed on
//! stderr), so running the same command again with the same key returns the same turn
//! instead of starting another; `turns wait` long-polls in rounds of at most 30 s until the
//! turn is terminal or `--timeout` passes (it never starts anything).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use reqwest::Method;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::cli::gateway::{GatewayCommandArgs, json_flag};
use crate::cli::output::{self, AGENTS, cell, print_json, print_table};

/// `switchboard sessions`.
#[derive(Debug, Clone, Args)]
pub struct SessionsArgs {
    #[command(subcommand)]
    pub command: SessionsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The `sessions` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum SessionsCommand {
    /// Create a session for an agent (name or id); prints its id.
    Create {
        /// The agent of every turn.
        #[arg(long, value_name = "AGENT")]
        agent: String,
        /// Metadata, a JSON object.
        #[arg(long, value_name = "JSON")]
        metadata: Option<String>,
    },
    /// List the workspace's sessions.
    List {
        /// Page size.
        #[arg(long, default_value_t = 20, value_name = "N")]
        limit: u64,
        /// Continue after this cursor.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one session.
    Show {
        /// Session id.
        #[arg(value_name = "SESSION_ID")]
        session_id: String,
    },
    /// The user and assistant turns of a session.
    History {
        /// Session id.
        #[arg(value_name = "SESSION_ID")]
        session_id: String,
    },
    /// Close a session: later turns are refused.
    Close {
        /// Session id.
        #[arg(value_name = "SESSION_ID")]
        session_id: String,
    },
}

/// `switchboard turns`.
#[derive(Debug, Clone, Args)]
pub struct TurnsArgs {
    #[command(subcommand)]
    pub command: TurnsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The `turns` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum TurnsCommand {
    /// Start a turn; prints the receipt (`turn_id`).
    Start {
        /// Session id.
        #[arg(long, value_name = "SESSION_ID")]
        session: String,
        /// The user's text.
        #[arg(value_name = "TEXT")]
        text: String,
        /// Idempotency key [default: a new UUID, printed on stderr].
        #[arg(long, value_name = "KEY")]
        key: Option<String>,
        /// Wait for the turn to end and print its snapshot instead of the receipt.
        #[arg(long)]
        wait: bool,
    },
    /// The turn's current snapshot.
    Show {
        /// Turn id.
        #[arg(value_name = "TURN_ID")]
        turn_id: String,
    },
    /// Wait until the turn ends (or --timeout), then print its snapshot.
    Wait {
        /// Turn id.
        #[arg(value_name = "TURN_ID")]
        turn_id: String,
        /// Give up after this many seconds (the current snapshot is printed).
        #[arg(long, default_value_t = 300, value_name = "SECS")]
        timeout: u64,
    },
    /// The turn's events after a sequence number.
    Events {
        /// Turn id.
        #[arg(value_name = "TURN_ID")]
        turn_id: String,
        /// Only events after this sequence.
        #[arg(long, default_value_t = 0, value_name = "N")]
        after: u64,
        /// Page size.
        #[arg(long, value_name = "N")]
        limit: Option<u64>,
    },
    /// Cancel a running turn (a finished one is left as it is).
    Cancel {
        /// Turn id.
        #[arg(value_name = "TURN_ID")]
        turn_id: String,
    },
}

/// Runs a `sessions` subcommand.
pub async fn sessions(args: SessionsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    let json = args.common.json;
    let answer = match args.command {
        SessionsCommand::Create { agent, metadata } => {
            let agent_id = output::resolve(&c, AGENTS, &agent).await?;
            let mut body = json!({"agent_id": agent_id});
            if let Some(m) = json_flag("metadata", metadata.as_deref())? {
                body["metadata"] = m;
            }
            let created = c.json(Method::POST, "/v1/sessions", Some(&body)).await?;
            if !json {
                println!("{}", cell(&created, "session_id"));
                return Ok(ExitCode::SUCCESS);
            }
            created
        }
        SessionsCommand::List { limit, cursor } => {
            let mut path = format!("/v1/sessions?limit={limit}");
            if let Some(cursor) = cursor {
                path.push_str(&format!("&cursor={cursor}"));
            }
            let page = c.json(Method::GET, &path, None).await?;
            if !json {
                let rows: Vec<Vec<String>> = page["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        ["session_id", "agent_id", "status", "created_at"]
                            .map(|k| cell(s, k))
                            .to_vec()
                    })
                    .collect();
                print_table(&["SESSION_ID", "AGENT_ID", "STATUS", "CREATED_AT"], &rows);
                return Ok(ExitCode::SUCCESS);
            }
            page
        }
        SessionsCommand::Show { session_id } => {
            c.json(Method::GET, &format!("/v1/sessions/{session_id}"), None)
                .await?
        }
        SessionsCommand::History { session_id } => {
            c.json(
                Method::GET,
                &format!("/v1/sessions/{session_id}/history"),
                None,
            )
            .await?
        }
        SessionsCommand::Close { session_id } => {
            c.json(Method::DELETE, &format!("/v1/sessions/{session_id}"), None)
                .await?;
            json!({"closed": session_id})
        }
    };
    print_json(&answer)?;
    Ok(ExitCode::SUCCESS)
}

/// Longest single `GET /v1/turns/{id}/wait` (the gateway caps it as well).
const WAIT_ROUND: Duration = Duration::from_secs(30);

/// Long-polls `turn_id` until it is terminal or `timeout` passed; the last snapshot.
async fn wait_turn(
    c: &crate::client::GatewayClient,
    turn_id: &str,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let deadline = Instant::now() + timeout;
    let waiting = output::spinner(format!("waiting for turn {turn_id}"));
    loop {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(WAIT_ROUND);
        let path = format!("/v1/turns/{turn_id}/wait?timeout_ms={}", left.as_millis());
        let snapshot = c.json(Method::GET, &path, None).await;
        let snapshot = match snapshot {
            Ok(s) => s,
            Err(e) => {
                waiting.finish_and_clear();
                return Err(e);
            }
        };
        let terminal = matches!(
            snapshot["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        );
        if terminal || Instant::now() >= deadline {
            waiting.finish_and_clear();
            return Ok(snapshot);
        }
    }
}

/// Runs a `turns` subcommand.
pub async fn turns(args: TurnsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    let answer = match args.command {
        TurnsCommand::Start {
            session,
            text,
            key,
            wait,
        } => {
            let key = key.unwrap_or_else(|| {
                let key = uuid::Uuid::new_v4().to_string();
                eprintln!("idempotency key: {key}");
                key
            });
            let body = json!({"idempotency_key": key, "text": text});
            let receipt = c
                .json(
                    Method::POST,
                    &format!("/v1/sessions/{session}/turns"),
                    Some(&body),
                )
                .await?;
            if wait {
                let turn_id = cell(&receipt, "turn_id");
                wait_turn(&c, &turn_id, Duration::from_secs(300)).await?
            } else {
                receipt
            }
        }
        TurnsCommand::Show { turn_id } => {
            c.json(Method::GET, &format!("/v1/turns/{turn_id}"), None)
                .await?
        }
        TurnsCommand::Wait { turn_id, timeout } => {
            wait_turn(&c, &turn_id, Duration::from_secs(timeout)).await?
        }
        TurnsCommand::Events {
            turn_id,
            after,
            limit,
        } => {
            let mut path = format!("/v1/turns/{turn_id}/events?after_sequence={after}");
            if let Some(limit) = limit {
                path.push_str(&format!("&limit={limit}"));
            }
            c.json(Method::GET, &path, None).await?
        }
        TurnsCommand::Cancel { turn_id } => {
            c.json(Method::POST, &format!("/v1/turns/{turn_id}/cancel"), None)
                .await?
        }
    };
    print_json(&answer)?;
    Ok(ExitCode::SUCCESS)
}
