//! `switchboard send` and `switchboard bench`: HTTP clients of a running gateway.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;

use super::{ConfigArgs, Overrides};

/// Gateway URL used when `--url` and `SWITCHBOARD_URL` are absent (the `dev` default address).
pub const DEFAULT_GATEWAY_URL: &str = "http://127.0.0.1:8080";

/// Where the client finds the gateway and its API key. The flags are `global`: a command
/// with subcommands accepts them before or after the subcommand (`models --url U list` and
/// `models list --url U` are the same), and no subcommand may define a flag of these names.
#[derive(Debug, Clone, Args)]
pub struct GatewayClientArgs {
    /// Base URL of the gateway.
    #[arg(
        long,
        global = true,
        env = "SWITCHBOARD_URL",
        default_value = DEFAULT_GATEWAY_URL,
        value_name = "URL"
    )]
    pub url: String,
    /// API key (`switchboard keys create` prints one). Prefer --api-key-file or the
    /// environment: command lines are visible to other users of the machine.
    #[arg(
        long,
        global = true,
        env = "SWITCHBOARD_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,
    /// File containing the API key (surrounding whitespace is ignored). Without a key,
    /// ./.switchboard/api-key (kept by `switchboard dev`) is read when it exists.
    #[arg(long, global = true, value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
}

impl GatewayClientArgs {
    /// The API key from `--api-key`/`SWITCHBOARD_API_KEY` or `--api-key-file`, if any.
    pub fn api_key(&self) -> anyhow::Result<Option<String>> {
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read API key file {}", path.display()))?;
            let key = text.trim();
            anyhow::ensure!(!key.is_empty(), "API key file {} is empty", path.display());
            return Ok(Some(key.to_owned()));
        }
        Ok(self
            .api_key
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned))
    }
}

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

/// `switchboard bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Total runs to start.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub runs: u32,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub concurrency: u32,
    /// Distinct conversations the runs are spread over.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub conversations: u32,
    /// Words per message (the echo runner streams one delta per word).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub text_words: u32,
    /// A run without a terminal result this many seconds after its post counts as lost.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub run_timeout: u64,
    /// Print the summary as JSON on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Processes whose CPU time over the measured window is reported one by one (the
    /// gateway, orchestrators, workers, runners, broker, databases), comma-separated.
    #[arg(long, value_name = "PID,...", value_delimiter = ',')]
    pub pids: Vec<u32>,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// The API key of the flags or the environment, else `./.switchboard/api-key` (kept by
/// `switchboard dev`) when it exists.
fn resolve_api_key(gateway: &GatewayClientArgs) -> anyhow::Result<Option<String>> {
    super::api::api_key_or_default(
        gateway.api_key()?,
        std::path::Path::new(super::api::DEV_API_KEY_FILE),
    )
}

/// Posts one message and prints the streamed reply.
pub async fn send(args: SendArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(Overrides::default())?;
    let api_key = resolve_api_key(&args.gateway)?;
    super::send::run(args, api_key).await
}

/// Drives load and prints throughput and latency percentiles.
pub async fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(Overrides::default())?;
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.conversations > 0, "--conversations must be at least 1");
    let api_key = resolve_api_key(&args.gateway)?;
    super::bench::run(args, api_key).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

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

    #[test]
    fn bench_defaults() {
        let cli = Cli::try_parse_from(["switchboard", "bench", "--runs", "10", "--json"]).unwrap();
        let Command::Bench(b) = cli.command else {
            panic!()
        };
        assert_eq!(
            (b.runs, b.concurrency, b.conversations, b.text_words),
            (10, 32, 100, 8)
        );
        assert!(b.json);
    }
}
