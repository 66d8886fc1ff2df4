//! `switchboard models|tools|kb`: the workspace resource registry, through the gateway API
//! (`/v1/models`, `/v1/tools`, `/v1/knowledge-bases`), so the gateway's validation is the
//! only one. Answers are printed as JSON on stdout.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use reqwest::Method;
use serde_json::{Value, json};

use super::api::GatewayClient;
use super::client::GatewayClientArgs;

/// `switchboard models`.
#[derive(Debug, Clone, Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    pub command: ModelsCommand,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// The `models` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ModelsCommand {
    /// Register an OpenAI-compatible model.
    Add {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        /// `llm` or `rerank`.
        #[arg(long, default_value = "llm")]
        kind: String,
        /// Base URL, e.g. http://127.0.0.1:8000/v1.
        #[arg(long)]
        base_url: String,
        /// The provider's model name.
        #[arg(long)]
        model_name: String,
        /// NAME of the environment variable holding the API key on the workers (never the key).
        #[arg(long, value_name = "ENV_VAR")]
        api_key_env: Option<String>,
        /// Context window in tokens.
        #[arg(long)]
        context_window: Option<i64>,
        /// Extra request body fields, a JSON object.
        #[arg(long, value_name = "JSON")]
        extra_args: Option<String>,
    },
    /// List the workspace's models.
    List,
}

/// `switchboard tools`.
#[derive(Debug, Clone, Args)]
pub struct ToolsArgs {
    #[command(subcommand)]
    pub command: ToolsCommand,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// The `tools` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ToolsCommand {
    /// Register an HTTP tool (calls are POSTed as JSON to --url).
    Add {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        /// Shown to models.
        #[arg(long, default_value = "")]
        description: String,
        /// JSON schema of the parameters.
        #[arg(long, value_name = "JSON")]
        parameters: Option<String>,
        /// Where calls are POSTed.
        #[arg(long)]
        url: String,
        /// Timeout of one call.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Static header whose value the workers read from an environment variable:
        /// `Header=ENV_VAR` (repeatable).
        #[arg(long = "header-env", value_name = "HEADER=ENV_VAR")]
        headers_env: Vec<String>,
    },
    /// List the workspace's tools.
    List,
}

/// `switchboard kb`.
#[derive(Debug, Clone, Args)]
pub struct KbArgs {
    #[command(subcommand)]
    pub command: KbCommand,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// The `kb` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum KbCommand {
    /// Create a knowledge base.
    Create {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        /// Free text.
        #[arg(long)]
        description: Option<String>,
    },
    /// List the workspace's knowledge bases.
    List,
    /// Add a text document (chunked and indexed by the gateway), from a local file or from
    /// an artifact of the workspace.
    AddDoc {
        /// Knowledge base id.
        #[arg(long)]
        kb: String,
        /// Title returned with every hit.
        #[arg(long)]
        title: String,
        /// Text file to upload.
        #[arg(long, value_name = "FILE", required_unless_present = "artifact")]
        file: Option<PathBuf>,
        /// Id of an artifact of the workspace whose content (UTF-8 text) is the document.
        #[arg(long, value_name = "ID", conflicts_with = "file")]
        artifact: Option<String>,
    },
}

fn parse_json(flag: &str, text: Option<&str>) -> anyhow::Result<Option<Value>> {
    text.map(|t| serde_json::from_str(t).with_context(|| format!("--{flag} is not valid JSON")))
        .transpose()
}

async fn client(gateway: &GatewayClientArgs) -> anyhow::Result<GatewayClient> {
    let key = super::api::api_key_or_default(
        gateway.api_key()?,
        std::path::Path::new(super::api::DEV_API_KEY_FILE),
    )?;
    GatewayClient::new(&gateway.url, key.as_deref())
}

fn print(v: &Value) -> anyhow::Result<ExitCode> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(ExitCode::SUCCESS)
}

/// Runs a `models` subcommand.
pub async fn models(args: ModelsArgs) -> anyhow::Result<ExitCode> {
    let c = client(&args.gateway).await?;
    match args.command {
        ModelsCommand::Add {
            name,
            kind,
            base_url,
            model_name,
            api_key_env,
            context_window,
            extra_args,
        } => {
            let body = json!({
                "name": name, "kind": kind, "base_url": base_url, "model_name": model_name,
                "api_key_env": api_key_env, "context_window": context_window,
                "extra_args": parse_json("extra-args", extra_args.as_deref())?,
            });
            print(&c.json(Method::POST, "/v1/models", Some(&body)).await?)
        }
        ModelsCommand::List => print(&c.json(Method::GET, "/v1/models", None).await?),
    }
}

/// Runs a `tools` subcommand.
pub async fn tools(args: ToolsArgs) -> anyhow::Result<ExitCode> {
    let c = client(&args.gateway).await?;
    match args.command {
        ToolsCommand::Add {
            name,
            description,
            parameters,
            url,
            timeout_ms,
            headers_env,
        } => {
            let mut headers = BTreeMap::new();
            for h in &headers_env {
                let (header, env) = h
                    .split_once('=')
                    .with_context(|| format!("--header-env `{h}` is not HEADER=ENV_VAR"))?;
                headers.insert(header.to_owned(), env.to_owned());
            }
            let body = json!({
                "name": name, "description": description, "kind": "http", "url": url,
                "parameters": parse_json("parameters", parameters.as_deref())?,
                "timeout_ms": timeout_ms, "headers_env": headers,
            });
            print(&c.json(Method::POST, "/v1/tools", Some(&body)).await?)
        }
        ToolsCommand::List => print(&c.json(Method::GET, "/v1/tools", None).await?),
    }
}

/// Runs a `kb` subcommand.
pub async fn kb(args: KbArgs) -> anyhow::Result<ExitCode> {
    let c = client(&args.gateway).await?;
    match args.command {
        KbCommand::Create { name, description } => {
            let body = json!({"name": name, "description": description});
            print(
                &c.json(Method::POST, "/v1/knowledge-bases", Some(&body))
                    .await?,
            )
        }
        KbCommand::List => print(&c.json(Method::GET, "/v1/knowledge-bases", None).await?),
        KbCommand::AddDoc {
            kb,
            title,
            file,
            artifact,
        } => {
            let body = match (file, artifact) {
                (Some(file), _) => {
                    let text = std::fs::read_to_string(&file)
                        .with_context(|| format!("cannot read {}", file.display()))?;
                    json!({"title": title, "text": text})
                }
                (None, Some(artifact)) => json!({"title": title, "artifact_id": artifact}),
                // clap requires one of the two.
                (None, None) => anyhow::bail!("give --file or --artifact"),
            };
            let path = format!("/v1/knowledge-bases/{kb}/documents");
            print(&c.json(Method::POST, &path, Some(&body)).await?)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn add_doc(args: &[&str]) -> Result<KbCommand, clap::Error> {
        let mut argv = vec!["switchboard", "kb", "add-doc", "--kb", "k1", "--title", "t"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).map(|cli| match cli.command {
            Command::Kb(kb) => kb.command,
            other => panic!("not kb: {other:?}"),
        })
    }

    #[test]
    fn add_doc_takes_a_file_or_an_artifact() {
        let KbCommand::AddDoc { file, artifact, .. } = add_doc(&["--file", "a.txt"]).unwrap()
        else {
            panic!("not add-doc")
        };
        assert_eq!((file, artifact), (Some(PathBuf::from("a.txt")), None));
        let KbCommand::AddDoc { file, artifact, .. } = add_doc(&["--artifact", "art-1"]).unwrap()
        else {
            panic!("not add-doc")
        };
        assert_eq!((file, artifact.as_deref()), (None, Some("art-1")));
        // Exactly one of the two.
        assert!(add_doc(&[]).is_err());
        assert!(add_doc(&["--file", "a.txt", "--artifact", "art-1"]).is_err());
    }
}
