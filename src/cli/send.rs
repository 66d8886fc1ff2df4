//! `switchboard send "hello"`: posts one user message to a running gateway and prints the
//! agent's reply as it streams.
//!
//! - The API key comes from `--api-key`/`SWITCHBOARD_API_KEY` or `--api-key-file`; without
//!   either, from `./.switchboard/api-key` (the file `switchboard dev` keeps in its default
//!   data directory) when it exists; otherwise the request goes without a key.
//! - Without `--conversation`, a new conversation id is generated and printed on stderr
//!   (once the gateway has accepted the message) so the next `send` can continue it.
//! - The run is followed as described in [`crate::client::follow`]: the post answers with the run's
//!   stream, and a dropped connection is resumed from the run's stream with
//!   `Last-Event-ID`, so no piece of the reply is lost or printed twice.
//! - `message.delta` text goes to stdout as it arrives (flushed); a message that was not
//!   streamed (only `message.completed`, or `run.completed` carrying a message) is printed
//!   whole; the output ends with a newline ([`ReplyPrinter`]).
//! - `run.failed` prints its error on stderr and exits non-zero; so does an event that
//!   started no run (`unrouted`, `rejected`), with the gateway's reason. An event steered
//!   into an already active run of the conversation (`claimed`) is reported on stderr and
//!   is a success: that run answers it.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use sb_protocol::result::AgentRunResult;
use tokio::time::Instant;

use clap::Args;

use crate::cli::config::{ConfigArgs, Overrides};
use crate::cli::gateway::GatewayClientArgs;
use crate::client::{
    FollowError, FollowOptions, GatewayClient, NewEvent, delta_text, message_text,
};

/// Actor id used when `$USER` is not set.
const DEFAULT_ACTOR: &str = "cli";

/// `switchboard send`.
#[derive(Debug, Clone, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The message text.
    #[arg(value_name = "TEXT")]
    pub text: String,
    /// Conversation to post into; reuse it to continue a conversation [default: a new one].
    #[arg(long, value_name = "ID")]
    pub conversation: Option<String>,
    /// Give up when the reply has not ended after this many seconds.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    pub timeout: u64,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// Posts one message and prints the streamed reply.
pub async fn send(args: SendArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(Overrides::default())?;
    let api_key = args.gateway.resolved_api_key()?;
    run(args, api_key).await
}

/// Runs `send` with the resolved API key.
pub async fn run(args: SendArgs, api_key: Option<String>) -> anyhow::Result<ExitCode> {
    let client = GatewayClient::new(&args.gateway.url, api_key.as_deref())?;
    let (conversation, generated) = match args.conversation {
        Some(c) => (c, false),
        None => (format!("cli-{}", uuid::Uuid::now_v7()), true),
    };
    let actor = std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty() && u.len() <= 255)
        .unwrap_or_else(|| DEFAULT_ACTOR.to_owned());
    let options = FollowOptions {
        deadline: Some(Instant::now() + Duration::from_secs(args.timeout)),
        ..FollowOptions::default()
    };
    let mut follower = client.follow(
        NewEvent::message(&conversation, &actor, &args.text),
        format!("send-{}", uuid::Uuid::new_v4()),
        options,
    );

    let mut printer = ReplyPrinter::default();
    let mut stdout = std::io::stdout();
    // Until the first item: routing and the runner's start can take a while.
    let mut waiting = Some(crate::cli::output::spinner("waiting for the reply"));
    let outcome = loop {
        let next = follower.next().await;
        if let Some(spinner) = waiting.take() {
            spinner.finish_and_clear();
        }
        match next {
            Ok(Some(item)) => {
                write_out(&mut stdout, &printer.on_result(&item))?;
                if item.result_type == "run.failed" {
                    break Err(run_failed(&item));
                }
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(follow_error(e, args.timeout)),
        }
    };
    write_out(&mut stdout, printer.finish())?;
    // Only worth mentioning if the gateway took the message.
    if generated && (follower.event_id().is_some() || follower.run_id().is_some()) {
        eprintln!("conversation: {conversation} (continue it with --conversation {conversation})");
    }
    match outcome {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(Outcome::Claimed(note)) => {
            eprintln!("{note}");
            Ok(ExitCode::SUCCESS)
        }
        Err(Outcome::Failed(error)) => Err(error),
    }
}

/// How a follow that did not complete normally ends.
enum Outcome {
    /// Steered into an active run: not an error.
    Claimed(String),
    Failed(anyhow::Error),
}

fn write_out(out: &mut std::io::Stdout, text: &str) -> anyhow::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let mut lock = out.lock();
    lock.write_all(text.as_bytes())
        .and_then(|()| lock.flush())
        .context("cannot write to stdout")
}

fn run_failed(item: &AgentRunResult) -> Outcome {
    let field = |k: &str| {
        item.data
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
    };
    let retryable = item
        .data
        .get("retryable")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let (code, error) = (field("code"), field("error"));
    Outcome::Failed(anyhow::anyhow!(
        "run {} failed: {} ({}{})",
        item.run_id,
        if error.is_empty() {
            "no error message"
        } else {
            error
        },
        if code.is_empty() { "no code" } else { code },
        if retryable { ", retryable" } else { "" }
    ))
}

fn follow_error(error: FollowError, timeout_secs: u64) -> Outcome {
    match error {
        FollowError::NotRun { ref status, .. } if status == "claimed" => {
            Outcome::Claimed(error.to_string())
        }
        FollowError::Api { ref code, .. } if code == "unauthorized" => {
            Outcome::Failed(anyhow::anyhow!(
                "{error}; pass --api-key, --api-key-file or SWITCHBOARD_API_KEY \
                 (`switchboard keys create` issues a key; `switchboard dev` keeps one in \
                 ./.switchboard/api-key)"
            ))
        }
        FollowError::TimedOut => Outcome::Failed(anyhow::anyhow!(
            "no terminal result within {timeout_secs} s (raise --timeout to wait longer)"
        )),
        other => Outcome::Failed(anyhow::Error::new(other)),
    }
}

/// Turns the result stream into the text printed on stdout.
///
/// Deltas are printed as they come. A `message.completed` (or a `run.completed` carrying a
/// message) closes the streamed message without printing it again, or, if nothing of it
/// was streamed, prints it whole. Separate messages are separated by a newline, and the
/// output ends with one ([`finish`](Self::finish)).
#[derive(Debug, Default)]
pub struct ReplyPrinter {
    /// Deltas of the current message were printed.
    streaming: bool,
    /// Text of the last completed message (a `run.completed` repeating it is not printed).
    last_completed: Option<String>,
    wrote_any: bool,
    ends_with_newline: bool,
}

impl ReplyPrinter {
    /// The text to print for `item` (often empty).
    pub fn on_result(&mut self, item: &AgentRunResult) -> String {
        match item.result_type.as_str() {
            "message.delta" => {
                let Some(text) = delta_text(item).filter(|t| !t.is_empty()) else {
                    return String::new();
                };
                let mut out = String::new();
                if !self.streaming {
                    out.push_str(self.separator());
                }
                self.streaming = true;
                out.push_str(&text);
                self.emit(out)
            }
            "message.completed" => {
                let text = message_text(item).unwrap_or_default();
                self.complete(text)
            }
            "run.completed" => match message_text(item) {
                Some(text) if self.streaming || self.last_completed.as_deref() != Some(&*text) => {
                    self.complete(text)
                }
                _ => String::new(),
            },
            _ => String::new(),
        }
    }

    /// The final newline, if the output does not end with one.
    #[must_use]
    pub fn finish(&self) -> &'static str {
        self.separator()
    }

    fn complete(&mut self, text: String) -> String {
        let out = if self.streaming || text.is_empty() {
            String::new()
        } else {
            format!("{}{text}", self.separator())
        };
        self.streaming = false;
        self.last_completed = Some(text);
        self.emit(out)
    }

    fn separator(&self) -> &'static str {
        if self.wrote_any && !self.ends_with_newline {
            "\n"
        } else {
            ""
        }
    }

    fn emit(&mut self, out: String) -> String {
        if !out.is_empty() {
            self.wrote_any = true;
            self.ends_with_newline = out.ends_with('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser as _;
    use serde_json::json;

    fn item(t: &str, data: serde_json::Value) -> AgentRunResult {
        serde_json::from_value(json!({"run_id": "r", "type": t, "data": data})).unwrap()
    }

    fn print(items: &[AgentRunResult]) -> String {
        let mut p = ReplyPrinter::default();
        let mut out: String = items.iter().map(|i| p.on_result(i)).collect();
        out.push_str(p.finish());
        out
    }

    fn delta(s: &str) -> AgentRunResult {
        item(
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": s}}),
        )
    }

    fn completed(s: &str) -> AgentRunResult {
        item(
            "message.completed",
            json!({"message": {"role": "assistant", "content": s}}),
        )
    }

    #[test]
    fn deltas_are_printed_and_the_completed_message_is_not_repeated() {
        let done = item("run.completed", json!({"finish_reason": "stop"}));
        assert_eq!(
            print(&[delta("hel"), delta("lo"), completed("hello"), done.clone()]),
            "hello\n"
        );
        // Only a completed message: printed whole.
        assert_eq!(print(&[completed("hi there"), done.clone()]), "hi there\n");
        // Blocks: the text blocks, in order.
        let blocks = item(
            "message.completed",
            json!({"message": {"role": "assistant", "content": [
                {"type": "reasoning", "text": "hmm"}, {"type": "text", "text": "a"},
                {"type": "text", "text": "b"}]}}),
        );
        assert_eq!(print(&[blocks]), "ab\n");
        // Nothing at all: no stray newline.
        assert_eq!(print(&[done]), "");
    }

    #[test]
    fn run_completed_message_is_printed_once() {
        let with_msg = |s: &str| {
            item(
                "run.completed",
                json!({"finish_reason": "stop", "message": {"role": "assistant", "content": s}}),
            )
        };
        assert_eq!(print(&[with_msg("final")]), "final\n");
        assert_eq!(
            print(&[delta("fi"), delta("nal"), with_msg("final")]),
            "final\n"
        );
        assert_eq!(print(&[completed("final"), with_msg("final")]), "final\n");
        assert_eq!(print(&[completed("one"), with_msg("two")]), "one\ntwo\n");
        let null_msg = item(
            "run.completed",
            json!({"finish_reason": "stop", "message": null}),
        );
        assert_eq!(print(&[completed("x"), null_msg]), "x\n");
    }

    #[test]
    fn messages_are_separated_and_other_results_ignored() {
        let tool = item(
            "tool.call.started",
            json!({"tool_call_id": "1", "tool_name": "t"}),
        );
        assert_eq!(
            print(&[
                delta("a"),
                completed("a"),
                tool,
                delta("b\n"),
                completed("b\n"),
                completed("c")
            ]),
            "a\nb\nc\n"
        );
    }

    fn send_args(argv: &[&str]) -> Result<SendArgs, clap::Error> {
        let mut full = vec!["switchboard", "send"];
        full.extend_from_slice(argv);
        Cli::try_parse_from(full).map(|c| match c.command {
            Command::Send(a) => a,
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn send_parses_text_and_flags() {
        let a = send_args(&["hello there", "--conversation", "c1", "--api-key", " k1 "]).unwrap();
        assert_eq!(a.text, "hello there");
        assert_eq!(a.conversation.as_deref(), Some("c1"));
        assert_eq!(a.gateway.api_key().unwrap().as_deref(), Some("k1"));
        assert!(send_args(&[]).is_err(), "text is required");
    }

    #[test]
    fn api_key_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "sbk_secret\n").unwrap();
        let a = send_args(&["hi", "--api-key-file", path.to_str().unwrap()]).unwrap();
        assert_eq!(a.gateway.api_key().unwrap().as_deref(), Some("sbk_secret"));

        std::fs::write(&path, "  \n").unwrap();
        assert!(a.gateway.api_key().is_err(), "empty key file");
        let missing = send_args(&["hi", "--api-key-file", "/nonexistent/key"]).unwrap();
        assert!(missing.gateway.api_key().is_err());
    }

    #[test]
    fn api_key_and_api_key_file_conflict() {
        assert!(send_args(&["hi", "--api-key", "a", "--api-key-file", "f"]).is_err());
    }
}
