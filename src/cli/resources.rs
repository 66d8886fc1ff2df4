//! `switchboard models|tools|kb|schedules`: the workspace resource registry and the
//! schedules, through the gateway API (`/v1/models`, `/v1/tools`, `/v1/knowledge-bases`,
//! `/v1/schedules`), so the gateway's validation is the only one. A resource is named by its
//! name or its id (schedules, which have no unique name, by id). Lists print a table, or the
//! gateway's JSON with `--json`; everything else prints the gateway's JSON answer.
//!
//! `update` sends only the flags given, as a `PATCH` (the gateway merges and validates the
//! result as a registration); `delete` of a resource an agent still uses is refused by the
//! gateway with `409 conflict` naming the agents.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use reqwest::Method;
use serde_json::{Map, Value, json};

use crate::cli::gateway::{GatewayCommandArgs, json_flag};
use crate::cli::output::{
    self, Collection, KNOWLEDGE_BASES, MODELS, TOOLS, cell, print_json, print_table,
};
use crate::client::GatewayClient;

/// `switchboard models`.
#[derive(Debug, Clone, Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    pub command: ModelsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The fields of a model registration (all optional: `add` requires some of them, `update`
/// sends only those given).
#[derive(Debug, Clone, Args)]
pub struct ModelFields {
    /// `llm` or `rerank` [add default: llm].
    #[arg(long)]
    kind: Option<String>,
    /// Base URL, e.g. http://127.0.0.1:8000/v1.
    #[arg(long)]
    base_url: Option<String>,
    /// The provider's model name.
    #[arg(long)]
    model_name: Option<String>,
    /// NAME of the environment variable holding the API key on the workers (never the key).
    #[arg(long, value_name = "ENV_VAR")]
    api_key_env: Option<String>,
    /// Context window in tokens.
    #[arg(long)]
    context_window: Option<i64>,
    /// Extra request body fields, a JSON object.
    #[arg(long, value_name = "JSON")]
    extra_args: Option<String>,
}

impl ModelFields {
    fn body(self, name: Option<String>) -> anyhow::Result<Map<String, Value>> {
        let mut body = Map::new();
        put(&mut body, "name", name.map(Value::String));
        put(&mut body, "kind", self.kind.map(Value::String));
        put(&mut body, "base_url", self.base_url.map(Value::String));
        put(&mut body, "model_name", self.model_name.map(Value::String));
        put(
            &mut body,
            "api_key_env",
            self.api_key_env.map(Value::String),
        );
        put(
            &mut body,
            "context_window",
            self.context_window.map(Value::from),
        );
        put(
            &mut body,
            "extra_args",
            json_flag("extra-args", self.extra_args.as_deref())?,
        );
        Ok(body)
    }
}

/// The `models` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ModelsCommand {
    /// Register an OpenAI-compatible model.
    Add {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        fields: ModelFields,
    },
    /// List the workspace's models.
    List,
    /// Show one model (name or id).
    Show {
        /// Name or id.
        #[arg(value_name = "MODEL")]
        model: String,
    },
    /// Change a model (name or id): only the flags given change.
    Update {
        /// Name or id.
        #[arg(value_name = "MODEL")]
        model: String,
        /// New name.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        fields: ModelFields,
    },
    /// Delete a model (name or id); refused while an agent uses it.
    Delete {
        /// Name or id.
        #[arg(value_name = "MODEL")]
        model: String,
    },
}

/// `switchboard tools`.
#[derive(Debug, Clone, Args)]
pub struct ToolsArgs {
    #[command(subcommand)]
    pub command: ToolsCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The fields of a tool registration.
#[derive(Debug, Clone, Args)]
pub struct ToolFields {
    /// Shown to models.
    #[arg(long)]
    description: Option<String>,
    /// JSON schema of the parameters.
    #[arg(long, value_name = "JSON")]
    parameters: Option<String>,
    /// Where calls are POSTed (the tool's own URL; `--url` is the gateway's).
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// Timeout of one call.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Static header whose value the workers read from an environment variable:
    /// `Header=ENV_VAR` (repeatable; replaces all headers on update).
    #[arg(long = "header-env", value_name = "HEADER=ENV_VAR")]
    headers_env: Vec<String>,
}

impl ToolFields {
    fn body(self, name: Option<String>) -> anyhow::Result<Map<String, Value>> {
        let mut body = Map::new();
        put(&mut body, "name", name.map(Value::String));
        put(
            &mut body,
            "description",
            self.description.map(Value::String),
        );
        put(
            &mut body,
            "parameters",
            json_flag("parameters", self.parameters.as_deref())?,
        );
        put(&mut body, "url", self.endpoint.map(Value::String));
        put(&mut body, "timeout_ms", self.timeout_ms.map(Value::from));
        if !self.headers_env.is_empty() {
            let mut headers = BTreeMap::new();
            for h in &self.headers_env {
                let (header, env) = h
                    .split_once('=')
                    .with_context(|| format!("--header-env `{h}` is not HEADER=ENV_VAR"))?;
                headers.insert(header.to_owned(), env.to_owned());
            }
            body.insert("headers_env".into(), json!(headers));
        }
        Ok(body)
    }
}

/// The `tools` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ToolsCommand {
    /// Register an HTTP tool (calls are POSTed as JSON to --endpoint).
    Add {
        /// Unique name in the workspace.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        fields: ToolFields,
    },
    /// List the workspace's tools.
    List,
    /// Show one tool (name or id).
    Show {
        /// Name or id.
        #[arg(value_name = "TOOL")]
        tool: String,
    },
    /// Change a tool (name or id): only the flags given change.
    Update {
        /// Name or id.
        #[arg(value_name = "TOOL")]
        tool: String,
        /// New name (refused while an agent grants the tool by its name).
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        fields: ToolFields,
    },
    /// Delete a tool (name or id); refused while an agent grants it.
    Delete {
        /// Name or id.
        #[arg(value_name = "TOOL")]
        tool: String,
    },
}

/// `switchboard kb`.
#[derive(Debug, Clone, Args)]
pub struct KbArgs {
    #[command(subcommand)]
    pub command: KbCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
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
    /// Show one knowledge base (name or id).
    Show {
        /// Name or id.
        #[arg(value_name = "KB")]
        kb: String,
    },
    /// Rename or describe a knowledge base (name or id).
    Update {
        /// Name or id.
        #[arg(value_name = "KB")]
        kb: String,
        /// New name.
        #[arg(long)]
        name: Option<String>,
        /// New description.
        #[arg(long)]
        description: Option<String>,
    },
    /// Delete a knowledge base with its documents; refused while an agent uses it.
    Delete {
        /// Name or id.
        #[arg(value_name = "KB")]
        kb: String,
    },
    /// Add a text document (chunked and indexed by the gateway), from a local file or from
    /// an artifact of the workspace.
    AddDoc {
        /// Knowledge base (name or id).
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
    /// List the documents of a knowledge base.
    Docs {
        /// Knowledge base (name or id).
        #[arg(long)]
        kb: String,
    },
    /// Change a document's title or metadata.
    UpdateDoc {
        /// Knowledge base (name or id).
        #[arg(long)]
        kb: String,
        /// Document id.
        #[arg(value_name = "DOCUMENT_ID")]
        document: String,
        /// New title.
        #[arg(long)]
        title: Option<String>,
        /// New metadata, a JSON object.
        #[arg(long, value_name = "JSON")]
        metadata: Option<String>,
    },
    /// Delete a document (its chunks leave the index with it).
    DeleteDoc {
        /// Knowledge base (name or id).
        #[arg(long)]
        kb: String,
        /// Document id.
        #[arg(value_name = "DOCUMENT_ID")]
        document: String,
    },
}

/// `switchboard schedules`.
#[derive(Debug, Clone, Args)]
pub struct SchedulesArgs {
    #[command(subcommand)]
    pub command: SchedulesCommand,
    #[command(flatten)]
    pub common: GatewayCommandArgs,
}

/// The `schedules` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum SchedulesCommand {
    /// Create a schedule.
    Create {
        /// `interval`, `cron` or `once`.
        #[arg(long)]
        kind: String,
        /// `15m`, `0 9 * * 1-5` (UTC) or an RFC 3339 time.
        #[arg(long)]
        spec: String,
        /// The event to ingest at every fire time: a `POST /v1/events` body (JSON).
        #[arg(long, value_name = "JSON")]
        event: String,
        /// Label.
        #[arg(long)]
        name: Option<String>,
        /// Create it paused.
        #[arg(long)]
        paused: bool,
    },
    /// List the workspace's schedules.
    List,
    /// Show one schedule.
    Show {
        /// Schedule id.
        #[arg(value_name = "SCHEDULE_ID")]
        schedule: String,
    },
    /// Change a schedule: only the flags given change.
    Update {
        /// Schedule id.
        #[arg(value_name = "SCHEDULE_ID")]
        schedule: String,
        /// `interval`, `cron` or `once`.
        #[arg(long)]
        kind: Option<String>,
        /// New spec.
        #[arg(long)]
        spec: Option<String>,
        /// New event (JSON).
        #[arg(long, value_name = "JSON")]
        event: Option<String>,
        /// New label.
        #[arg(long)]
        name: Option<String>,
    },
    /// Pause a schedule: it does not fire until resumed.
    Pause {
        /// Schedule id.
        #[arg(value_name = "SCHEDULE_ID")]
        schedule: String,
    },
    /// Resume a paused schedule; its next fire time is computed from now.
    Resume {
        /// Schedule id.
        #[arg(value_name = "SCHEDULE_ID")]
        schedule: String,
    },
    /// Delete a schedule.
    Delete {
        /// Schedule id.
        #[arg(value_name = "SCHEDULE_ID")]
        schedule: String,
    },
}

/// Sets `key` when the flag was given.
fn put(body: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(value) = value {
        body.insert(key.to_owned(), value);
    }
}

/// Prints a list answer: a table of `columns` (`(header, key)`), or the JSON.
fn print_list(list: &Value, json: bool, columns: &[(&str, &str)]) -> anyhow::Result<ExitCode> {
    if json {
        print_json(list)?;
    } else {
        let rows: Vec<Vec<String>> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|item| columns.iter().map(|(_, key)| cell(item, key)).collect())
            .collect();
        let headers: Vec<&str> = columns.iter().map(|(h, _)| *h).collect();
        print_table(&headers, &rows);
    }
    Ok(ExitCode::SUCCESS)
}

fn print(v: &Value) -> anyhow::Result<ExitCode> {
    print_json(v)?;
    Ok(ExitCode::SUCCESS)
}

/// `GET`, `PATCH` or `DELETE` of the item `name_or_id` of `collection`.
async fn one(
    c: &GatewayClient,
    method: Method,
    collection: Collection,
    name_or_id: &str,
    body: Option<Map<String, Value>>,
) -> anyhow::Result<ExitCode> {
    let id = output::resolve(c, collection, name_or_id).await?;
    let path = format!("{}/{id}", collection.path);
    let deleting = method == Method::DELETE;
    let answer = c
        .json(method, &path, body.map(Value::Object).as_ref())
        .await?;
    if deleting {
        eprintln!("{} {id} deleted", collection.what);
        Ok(ExitCode::SUCCESS)
    } else {
        print(&answer)
    }
}

/// Runs a `models` subcommand.
pub async fn models(args: ModelsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    match args.command {
        ModelsCommand::Add { name, fields } => {
            let mut body = fields.body(Some(name))?;
            body.entry("kind").or_insert_with(|| json!("llm"));
            print(
                &c.json(Method::POST, "/v1/models", Some(&Value::Object(body)))
                    .await?,
            )
        }
        ModelsCommand::List => print_list(
            &output::list_all(&c, "/v1/models").await?,
            args.common.json,
            &[
                ("MODEL_ID", "model_id"),
                ("NAME", "name"),
                ("KIND", "kind"),
                ("MODEL", "model_name"),
                ("BASE_URL", "base_url"),
            ],
        ),
        ModelsCommand::Show { model } => one(&c, Method::GET, MODELS, &model, None).await,
        ModelsCommand::Update {
            model,
            name,
            fields,
        } => one(&c, Method::PATCH, MODELS, &model, Some(fields.body(name)?)).await,
        ModelsCommand::Delete { model } => one(&c, Method::DELETE, MODELS, &model, None).await,
    }
}

/// Runs a `tools` subcommand.
pub async fn tools(args: ToolsArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    match args.command {
        ToolsCommand::Add { name, fields } => {
            anyhow::ensure!(fields.endpoint.is_some(), "--endpoint is required");
            let mut body = fields.body(Some(name))?;
            body.insert("kind".into(), json!("http"));
            print(
                &c.json(Method::POST, "/v1/tools", Some(&Value::Object(body)))
                    .await?,
            )
        }
        ToolsCommand::List => print_list(
            &output::list_all(&c, "/v1/tools").await?,
            args.common.json,
            &[
                ("TOOL_ID", "tool_id"),
                ("NAME", "name"),
                ("ENDPOINT", "url"),
            ],
        ),
        ToolsCommand::Show { tool } => one(&c, Method::GET, TOOLS, &tool, None).await,
        ToolsCommand::Update { tool, name, fields } => {
            one(&c, Method::PATCH, TOOLS, &tool, Some(fields.body(name)?)).await
        }
        ToolsCommand::Delete { tool } => one(&c, Method::DELETE, TOOLS, &tool, None).await,
    }
}

/// Runs a `kb` subcommand.
pub async fn kb(args: KbArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    match args.command {
        KbCommand::Create { name, description } => {
            let body = json!({"name": name, "description": description});
            print(
                &c.json(Method::POST, "/v1/knowledge-bases", Some(&body))
                    .await?,
            )
        }
        KbCommand::List => print_list(
            &output::list_all(&c, "/v1/knowledge-bases").await?,
            args.common.json,
            &[
                ("KB_ID", "kb_id"),
                ("NAME", "name"),
                ("DESCRIPTION", "description"),
            ],
        ),
        KbCommand::Show { kb } => one(&c, Method::GET, KNOWLEDGE_BASES, &kb, None).await,
        KbCommand::Update {
            kb,
            name,
            description,
        } => {
            let mut body = Map::new();
            put(&mut body, "name", name.map(Value::String));
            put(&mut body, "description", description.map(Value::String));
            one(&c, Method::PATCH, KNOWLEDGE_BASES, &kb, Some(body)).await
        }
        KbCommand::Delete { kb } => one(&c, Method::DELETE, KNOWLEDGE_BASES, &kb, None).await,
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
            let kb = output::resolve(&c, KNOWLEDGE_BASES, &kb).await?;
            let path = format!("/v1/knowledge-bases/{kb}/documents");
            let indexing = output::spinner("indexing");
            let answer = c.json(Method::POST, &path, Some(&body)).await;
            indexing.finish_and_clear();
            print(&answer?)
        }
        KbCommand::Docs { kb } => {
            let kb = output::resolve(&c, KNOWLEDGE_BASES, &kb).await?;
            print_list(
                &output::list_all(&c, &format!("/v1/knowledge-bases/{kb}/documents")).await?,
                args.common.json,
                &[
                    ("DOCUMENT_ID", "document_id"),
                    ("TITLE", "title"),
                    ("CHUNKS", "chunks"),
                    ("BYTES", "size_bytes"),
                ],
            )
        }
        KbCommand::UpdateDoc {
            kb,
            document,
            title,
            metadata,
        } => {
            let kb = output::resolve(&c, KNOWLEDGE_BASES, &kb).await?;
            let mut body = Map::new();
            put(&mut body, "title", title.map(Value::String));
            put(
                &mut body,
                "metadata",
                json_flag("metadata", metadata.as_deref())?,
            );
            let path = format!("/v1/knowledge-bases/{kb}/documents/{document}");
            print(
                &c.json(Method::PATCH, &path, Some(&Value::Object(body)))
                    .await?,
            )
        }
        KbCommand::DeleteDoc { kb, document } => {
            let kb = output::resolve(&c, KNOWLEDGE_BASES, &kb).await?;
            let path = format!("/v1/knowledge-bases/{kb}/documents/{document}");
            c.json(Method::DELETE, &path, None).await?;
            eprintln!("document {document} deleted");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Runs a `schedules` subcommand.
pub async fn schedules(args: SchedulesArgs) -> anyhow::Result<ExitCode> {
    let c = args.common.client()?;
    let patch = |schedule: &str, body: Map<String, Value>| {
        let path = format!("/v1/schedules/{schedule}");
        (path, Value::Object(body))
    };
    match args.command {
        SchedulesCommand::Create {
            kind,
            spec,
            event,
            name,
            paused,
        } => {
            let body = json!({
                "kind": kind, "spec": spec, "name": name, "enabled": !paused,
                "event": json_flag("event", Some(&event))?,
            });
            print(&c.json(Method::POST, "/v1/schedules", Some(&body)).await?)
        }
        SchedulesCommand::List => print_list(
            &output::list_all(&c, "/v1/schedules").await?,
            args.common.json,
            &[
                ("SCHEDULE_ID", "schedule_id"),
                ("NAME", "name"),
                ("KIND", "kind"),
                ("SPEC", "spec"),
                ("ENABLED", "enabled"),
                ("NEXT_FIRE_AT", "next_fire_at"),
            ],
        ),
        SchedulesCommand::Show { schedule } => print(
            &c.json(Method::GET, &format!("/v1/schedules/{schedule}"), None)
                .await?,
        ),
        SchedulesCommand::Update {
            schedule,
            kind,
            spec,
            event,
            name,
        } => {
            let mut body = Map::new();
            put(&mut body, "kind", kind.map(Value::String));
            put(&mut body, "spec", spec.map(Value::String));
            put(&mut body, "event", json_flag("event", event.as_deref())?);
            put(&mut body, "name", name.map(Value::String));
            let (path, body) = patch(&schedule, body);
            print(&c.json(Method::PATCH, &path, Some(&body)).await?)
        }
        SchedulesCommand::Pause { schedule } => {
            let (path, body) = patch(
                &schedule,
                Map::from_iter([("enabled".into(), json!(false))]),
            );
            print(&c.json(Method::PATCH, &path, Some(&body)).await?)
        }
        SchedulesCommand::Resume { schedule } => {
            let (path, body) = patch(&schedule, Map::from_iter([("enabled".into(), json!(true))]));
            print(&c.json(Method::PATCH, &path, Some(&body)).await?)
        }
        SchedulesCommand::Delete { schedule } => {
            c.json(Method::DELETE, &format!("/v1/schedules/{schedule}"), None)
                .await?;
            eprintln!("schedule {schedule} deleted");
            Ok(ExitCode::SUCCESS)
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
    fn tool_endpoint_is_not_the_gateway_url() {
        let cli = Cli::try_parse_from([
            "switchboard",
            "tools",
            "add",
            "--name",
            "w",
            "--endpoint",
            "http://t:9/w",
            "--url",
            "http://gw:1",
        ])
        .unwrap();
        let Command::Tools(tools) = cli.command else {
            panic!("not tools")
        };
        assert_eq!(tools.common.gateway.url, "http://gw:1");
        let ToolsCommand::Add { fields, .. } = tools.command else {
            panic!("not add")
        };
        let body = fields.body(Some("w".into())).unwrap();
        assert_eq!(body["url"], "http://t:9/w");
    }

    #[test]
    fn update_sends_only_the_flags_given() {
        let cli = Cli::try_parse_from([
            "switchboard",
            "models",
            "update",
            "gpt",
            "--context-window",
            "8",
        ])
        .unwrap();
        let Command::Models(models) = cli.command else {
            panic!("not models")
        };
        let ModelsCommand::Update { name, fields, .. } = models.command else {
            panic!("not update")
        };
        let body = fields.body(name).unwrap();
        assert_eq!(Value::Object(body), json!({"context_window": 8}));
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
