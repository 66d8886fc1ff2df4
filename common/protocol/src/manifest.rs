//! Runner discovery: the typed manifest, capabilities, permissions and runner ids
//! (PROTOCOL_V1 §4, host-behaviour §2–§3).
//!
//! Capabilities and permissions are *closed*: an unknown key or permission value makes the
//! manifest invalid, and the worker then skips that runner with a warning (SPEC §4.1). This
//! is what stops a typo such as `"histroy": ["page"]` from silently granting nothing, and a
//! newer runner from claiming a permission this host does not understand.
//!
//! ```
//! use sb_protocol::manifest::{AgentRunnerPermissions, HistoryOp};
//! let p: AgentRunnerPermissions =
//!     serde_json::from_str(r#"{"history": ["page"]}"#).unwrap();
//! assert!(p.has_history(HistoryOp::Page));
//! assert!(!p.has_history(HistoryOp::Search));
//! assert!(serde_json::from_str::<AgentRunnerPermissions>(r#"{"history": ["delete"]}"#).is_err());
//! assert!(serde_json::from_str::<AgentRunnerPermissions>(r#"{"shell": []}"#).is_err());
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What a runner can do; used by the host for UI and for deciding which resource kinds to
/// project. A capability is never a grant: access comes from [`AgentRunnerPermissions`]
/// intersected with the binding policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentRunnerCapabilities {
    /// The runner may return `message.delta`.
    pub streaming: bool,
    /// The runner may call the Host tool API (tools are projected only if set).
    pub tool_calling: bool,
    /// The runner may call the Host knowledge API (KBs are projected only if set).
    pub knowledge_retrieval: bool,
    /// The runner can handle non-text input and artifacts.
    pub multimodal_input: bool,
    /// The runner wants skill facts and skill-authoring tools (skills projected only if set).
    pub skill_authoring: bool,
    /// The runner honours `cancel` cooperatively.
    pub interrupt: bool,
    /// The runner pulls follow-up messages of its conversation with `steering_pull`
    /// (host-behaviour §3; enables steering claims, SPEC §7).
    pub steering: bool,
}

macro_rules! op_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $(
                #[doc = concat!("`", $text, "`")]
                $variant,
            )+
        }

        impl $name {
            /// Every value, in canonical order.
            pub const ALL: &'static [$name] = &[$(Self::$variant),+];

            /// The wire text.
            #[must_use]
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownOperation;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    other => Err(UnknownOperation {
                        kind: stringify!($name),
                        value: other.to_owned(),
                    }),
                }
            }
        }
    };
}

/// An operation name that is not one of the allowed values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} value `{value}`")]
pub struct UnknownOperation {
    /// The operation enum that rejected the value.
    pub kind: &'static str,
    /// The rejected text.
    pub value: String,
}

op_enum!(
    /// Operations on models.
    ModelOp { Invoke => "invoke", Stream => "stream", Rerank => "rerank" }
);
op_enum!(
    /// Operations on tools.
    ToolOp { Detail => "detail", Call => "call" }
);
op_enum!(
    /// Operations on knowledge bases.
    KnowledgeBaseOp { List => "list", Retrieve => "retrieve" }
);
op_enum!(
    /// Operations on conversation history (transcript).
    HistoryOp { Page => "page", Search => "search" }
);
op_enum!(
    /// Operations on the event log.
    EventOp { Get => "get", Page => "page" }
);
op_enum!(
    /// Operations on artifacts.
    ArtifactOp { Metadata => "metadata", Read => "read" }
);
op_enum!(
    /// Storage areas.
    StorageOp { Plugin => "plugin", Workspace => "workspace" }
);
op_enum!(
    /// File sources.
    FileOp { Config => "config", Knowledge => "knowledge" }
);

/// The upper bound of host resources a runner asks for (PROTOCOL_V1 §4.4). Effective access
/// is `permissions ∩ binding.resource_policy ∩ runner config ∩ what exists`, frozen per run.
///
/// Permissions only bound resources the host owns; they say nothing about what a runner
/// process can do natively (shell, network), which the process sandbox governs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentRunnerPermissions {
    /// `invoke`, `stream`, `rerank`.
    pub models: Vec<ModelOp>,
    /// `detail`, `call`.
    pub tools: Vec<ToolOp>,
    /// `list`, `retrieve`.
    pub knowledge_bases: Vec<KnowledgeBaseOp>,
    /// `page`, `search`.
    pub history: Vec<HistoryOp>,
    /// `get`, `page`.
    pub events: Vec<EventOp>,
    /// `metadata`, `read`.
    pub artifacts: Vec<ArtifactOp>,
    /// `plugin`, `workspace`.
    pub storage: Vec<StorageOp>,
    /// `config`, `knowledge`.
    pub files: Vec<FileOp>,
}

impl AgentRunnerPermissions {
    /// Whether `models` contains `op`.
    #[must_use]
    pub fn has_model(&self, op: ModelOp) -> bool {
        self.models.contains(&op)
    }
    /// Whether `tools` contains `op`.
    #[must_use]
    pub fn has_tool(&self, op: ToolOp) -> bool {
        self.tools.contains(&op)
    }
    /// Whether `knowledge_bases` contains `op`.
    #[must_use]
    pub fn has_knowledge_base(&self, op: KnowledgeBaseOp) -> bool {
        self.knowledge_bases.contains(&op)
    }
    /// Whether `history` contains `op`.
    #[must_use]
    pub fn has_history(&self, op: HistoryOp) -> bool {
        self.history.contains(&op)
    }
    /// Whether `events` contains `op`.
    #[must_use]
    pub fn has_event(&self, op: EventOp) -> bool {
        self.events.contains(&op)
    }
    /// Whether `artifacts` contains `op`.
    #[must_use]
    pub fn has_artifact(&self, op: ArtifactOp) -> bool {
        self.artifacts.contains(&op)
    }
    /// Whether `storage` contains `op`.
    #[must_use]
    pub fn has_storage(&self, op: StorageOp) -> bool {
        self.storage.contains(&op)
    }
    /// Whether `files` contains `op`.
    #[must_use]
    pub fn has_file(&self, op: FileOp) -> bool {
        self.files.contains(&op)
    }
}

/// Localised text: locale → text, e.g. `{"en_US": "Echo", "zh_Hans": "回声"}`.
///
/// ```
/// use sb_protocol::manifest::I18nObject;
/// let label = I18nObject::en("Echo").with("zh_Hans", "回声");
/// assert_eq!(label.get("zh_Hans"), Some("回声"));
/// assert_eq!(label.get("fr_FR"), Some("Echo")); // falls back to en_US
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct I18nObject(pub BTreeMap<String, String>);

impl I18nObject {
    /// The fallback locale.
    pub const DEFAULT_LOCALE: &'static str = "en_US";

    /// A text in `en_US` only.
    pub fn en(text: impl Into<String>) -> Self {
        let mut map = BTreeMap::new();
        map.insert(Self::DEFAULT_LOCALE.to_owned(), text.into());
        Self(map)
    }

    /// Adds or replaces one locale.
    #[must_use]
    pub fn with(mut self, locale: impl Into<String>, text: impl Into<String>) -> Self {
        self.0.insert(locale.into(), text.into());
        self
    }

    /// The text for `locale`, else `en_US`, else any text; `None` only when empty.
    #[must_use]
    pub fn get(&self, locale: &str) -> Option<&str> {
        self.0
            .get(locale)
            .or_else(|| self.0.get(Self::DEFAULT_LOCALE))
            .or_else(|| self.0.values().next())
            .map(String::as_str)
    }

    /// Whether there is no text at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One field of a DynamicForm config schema (`config_schema`), describing a binding
/// config form (host-behaviour §4.2).
///
/// The DynamicForm vocabulary is large and owned by the UI, so only the fields the host
/// interprets are typed (`name`, `type`, `default`); everything else (`label`,
/// `description`, `required`, `options`, …) is kept verbatim in `extra`.
///
/// ```
/// use sb_protocol::manifest::DynamicFormItemSchema;
/// let item: DynamicFormItemSchema = serde_json::from_str(
///     r#"{"name": "model", "type": "llm-model-selector", "required": true}"#).unwrap();
/// assert_eq!(item.item_type, "llm-model-selector");
/// assert_eq!(item.extra["required"], true);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DynamicFormItemSchema {
    /// The config key this field fills.
    pub name: String,
    /// The field type, e.g. `string`, `prompt-editor`, `llm-model-selector`, `file`.
    #[serde(rename = "type")]
    pub item_type: String,
    /// The default value, if any (used to build a default config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Value>,
    /// All other keys, kept as given.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The typed runner manifest (PROTOCOL_V1 §4.2). `id` must be the runner's
/// [`RunnerId`] text; `name` is the runner name inside its plugin (e.g. `default`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRunnerManifest {
    /// `plugin:<author>/<plugin>/<runner>`.
    pub id: String,
    /// Runner name within the plugin.
    pub name: String,
    /// Display name.
    pub label: I18nObject,
    /// Display description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<I18nObject>,
    /// What the runner can do (not a grant).
    #[serde(default)]
    pub capabilities: AgentRunnerCapabilities,
    /// Upper bound of host resources the runner asks for.
    #[serde(default)]
    pub permissions: AgentRunnerPermissions,
    /// The binding config form.
    #[serde(default)]
    pub config_schema: Vec<DynamicFormItemSchema>,
    /// Display/diagnostic information only; nothing may depend on it.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

impl AgentRunnerManifest {
    /// Parses `id` and checks that it is a valid runner id whose runner part is `name`.
    pub fn runner_id(&self) -> Result<RunnerId, RunnerIdError> {
        let id: RunnerId = self.id.parse()?;
        if id.runner() != self.name {
            return Err(RunnerIdError::NameMismatch {
                id: self.id.clone(),
                name: self.name.clone(),
            });
        }
        Ok(id)
    }
}

/// A runner id, `plugin:<author>/<plugin>/<runner>` (host-behaviour §2).
///
/// The source is always `plugin`: built-in adapters must not bypass the plugin, runtime and
/// proxy permission chain (PROTOCOL_V1 §13). Parsing requires exactly three non-empty parts.
/// Serialized as its text.
///
/// ```
/// use sb_protocol::manifest::RunnerId;
/// let id: RunnerId = "plugin:acme/echo/default".parse().unwrap();
/// assert_eq!(id.plugin_id(), "acme/echo");
/// assert_eq!(id.runner(), "default");
/// assert_eq!(id.to_string(), "plugin:acme/echo/default");
/// assert!("builtin:acme/echo/default".parse::<RunnerId>().is_err());
/// assert!("plugin:acme/echo".parse::<RunnerId>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunnerId {
    author: String,
    plugin: String,
    runner: String,
}

/// Why a runner id was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunnerIdError {
    /// The id does not start with a source prefix.
    #[error("runner id `{0}` must start with `plugin:`")]
    MissingSource(String),
    /// The source is not `plugin`.
    #[error("runner id `{id}` has source `{source_name}`, only `plugin` is allowed")]
    UnsupportedSource {
        /// The full id.
        id: String,
        /// The rejected source.
        source_name: String,
    },
    /// Not exactly three `/`-separated parts.
    #[error("runner id `{0}` must have exactly three parts: plugin:<author>/<plugin>/<runner>")]
    WrongPartCount(String),
    /// One of the three parts is empty.
    #[error("runner id `{0}` has an empty part")]
    EmptyPart(String),
    /// A part contains whitespace or a control character.
    #[error("runner id `{0}` contains whitespace or control characters")]
    InvalidChar(String),
    /// The manifest `id` does not end with the manifest `name`.
    #[error("runner id `{id}` does not match runner name `{name}`")]
    NameMismatch {
        /// The manifest id.
        id: String,
        /// The manifest name.
        name: String,
    },
}

impl RunnerId {
    /// The only allowed source.
    pub const SOURCE: &'static str = "plugin";

    /// Builds an id from its parts (`format_runner_id`), validating each part.
    pub fn new(
        author: impl Into<String>,
        plugin: impl Into<String>,
        runner: impl Into<String>,
    ) -> Result<Self, RunnerIdError> {
        let (author, plugin, runner) = (author.into(), plugin.into(), runner.into());
        format!("{}:{author}/{plugin}/{runner}", Self::SOURCE).parse()
    }

    /// Plugin author.
    #[must_use]
    pub fn author(&self) -> &str {
        &self.author
    }

    /// Plugin name.
    #[must_use]
    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// Runner name within the plugin.
    #[must_use]
    pub fn runner(&self) -> &str {
        &self.runner
    }

    /// The plugin identity `<author>/<plugin>` that Host API calls are checked against.
    #[must_use]
    pub fn plugin_id(&self) -> String {
        format!("{}/{}", self.author, self.plugin)
    }

    /// Whether `s` looks like a plugin runner id (plain prefix check, no validation).
    #[must_use]
    pub fn is_plugin_runner_id(s: &str) -> bool {
        s.starts_with("plugin:")
    }
}

impl FromStr for RunnerId {
    type Err = RunnerIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((source, rest)) = s.split_once(':') else {
            return Err(RunnerIdError::MissingSource(s.to_owned()));
        };
        if source != Self::SOURCE {
            return Err(RunnerIdError::UnsupportedSource {
                id: s.to_owned(),
                source_name: source.to_owned(),
            });
        }
        let parts: Vec<&str> = rest.split('/').collect();
        let [author, plugin, runner] = parts.as_slice() else {
            return Err(RunnerIdError::WrongPartCount(s.to_owned()));
        };
        if parts.iter().any(|p| p.is_empty()) {
            return Err(RunnerIdError::EmptyPart(s.to_owned()));
        }
        if parts
            .iter()
            .any(|p| p.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(RunnerIdError::InvalidChar(s.to_owned()));
        }
        Ok(Self {
            author: (*author).to_owned(),
            plugin: (*plugin).to_owned(),
            runner: (*runner).to_owned(),
        })
    }
}

impl fmt::Display for RunnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}/{}/{}",
            Self::SOURCE,
            self.author,
            self.plugin,
            self.runner
        )
    }
}

impl TryFrom<String> for RunnerId {
    type Error = RunnerIdError;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        value.parse()
    }
}

impl From<RunnerId> for String {
    fn from(id: RunnerId) -> String {
        id.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn capabilities_reject_unknown_keys_and_default_false() {
        let caps: AgentRunnerCapabilities = serde_json::from_value(json!({})).unwrap();
        assert_eq!(caps, AgentRunnerCapabilities::default());
        let caps: AgentRunnerCapabilities =
            serde_json::from_value(json!({"streaming": true, "steering": true})).unwrap();
        assert!(caps.streaming && caps.steering && !caps.interrupt);
        let err =
            serde_json::from_value::<AgentRunnerCapabilities>(json!({"memory": true})).unwrap_err();
        assert!(err.to_string().contains("memory"), "{err}");
        // bools only
        assert!(
            serde_json::from_value::<AgentRunnerCapabilities>(json!({"streaming": "yes"})).is_err()
        );
    }

    #[test]
    fn permissions_reject_unknown_keys_and_values() {
        let full = json!({
            "models": ["invoke", "stream", "rerank"],
            "tools": ["detail", "call"],
            "knowledge_bases": ["list", "retrieve"],
            "history": ["page", "search"],
            "events": ["get", "page"],
            "artifacts": ["metadata", "read"],
            "storage": ["plugin", "workspace"],
            "files": ["config", "knowledge"],
        });
        let p: AgentRunnerPermissions = serde_json::from_value(full.clone()).unwrap();
        assert_eq!(serde_json::to_value(&p).unwrap(), full);
        assert!(p.has_model(ModelOp::Rerank) && p.has_file(FileOp::Knowledge));
        assert!(p.has_storage(StorageOp::Workspace) && p.has_event(EventOp::Get));
        assert!(p.has_tool(ToolOp::Call) && p.has_knowledge_base(KnowledgeBaseOp::List));
        assert!(p.has_artifact(ArtifactOp::Read) && p.has_history(HistoryOp::Search));

        assert!(
            serde_json::from_value::<AgentRunnerPermissions>(json!({"platform": ["send"]}))
                .is_err()
        );
        for (key, bad) in [
            ("models", "embed"),
            ("tools", "execute"),
            ("knowledge_bases", "write"),
            ("history", "delete"),
            ("events", "search"),
            ("artifacts", "write"),
            ("storage", "global"),
            ("files", "upload"),
        ] {
            let err = serde_json::from_value::<AgentRunnerPermissions>(json!({key: [bad]}))
                .expect_err(key);
            assert!(err.to_string().contains(bad), "{err}");
        }
        // an empty object means no permissions
        let none: AgentRunnerPermissions = serde_json::from_value(json!({})).unwrap();
        assert_eq!(none, AgentRunnerPermissions::default());
    }

    #[test]
    fn op_enums_parse_and_display() {
        for op in ModelOp::ALL {
            assert_eq!(op.as_str().parse::<ModelOp>().unwrap(), *op);
        }
        let err = "push".parse::<StorageOp>().unwrap_err();
        assert_eq!(err.to_string(), "unknown StorageOp value `push`");
    }

    #[test]
    fn runner_id_rules() {
        let id: RunnerId = "plugin:a/b/c".parse().unwrap();
        assert_eq!((id.author(), id.plugin(), id.runner()), ("a", "b", "c"));
        assert_eq!(id.plugin_id(), "a/b");
        assert_eq!(RunnerId::new("a", "b", "c").unwrap(), id);

        assert!(matches!(
            "a/b/c".parse::<RunnerId>(),
            Err(RunnerIdError::MissingSource(_))
        ));
        assert!(matches!(
            "builtin:a/b/c".parse::<RunnerId>(),
            Err(RunnerIdError::UnsupportedSource { .. })
        ));
        assert!(matches!(
            "Plugin:a/b/c".parse::<RunnerId>(),
            Err(RunnerIdError::UnsupportedSource { .. })
        ));
        for bad in ["plugin:a/b", "plugin:a/b/c/d", "plugin:", "plugin:abc"] {
            assert!(
                matches!(
                    bad.parse::<RunnerId>(),
                    Err(RunnerIdError::WrongPartCount(_))
                ),
                "{bad}"
            );
        }
        for bad in ["plugin:/b/c", "plugin:a//c", "plugin:a/b/", "plugin://"] {
            assert!(
                matches!(bad.parse::<RunnerId>(), Err(RunnerIdError::EmptyPart(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            "plugin:a b/b/c".parse::<RunnerId>(),
            Err(RunnerIdError::InvalidChar(_))
        ));
        assert!(RunnerId::new("a", "b/x", "c").is_err());

        assert_eq!(serde_json::to_value(&id).unwrap(), json!("plugin:a/b/c"));
        assert!(serde_json::from_value::<RunnerId>(json!("plugin:a/b")).is_err());
        assert!(RunnerId::is_plugin_runner_id("plugin:whatever"));
    }

    #[test]
    fn manifest_parses_with_defaults_and_checks_id() {
        let m: AgentRunnerManifest = serde_json::from_value(json!({
            "id": "plugin:acme/echo/default",
            "name": "default",
            "label": {"en_US": "Echo"},
            "config_schema": [{"name": "prompt", "type": "prompt-editor", "default": []}]
        }))
        .unwrap();
        assert_eq!(m.capabilities, AgentRunnerCapabilities::default());
        assert_eq!(m.runner_id().unwrap().plugin_id(), "acme/echo");
        assert_eq!(m.config_schema[0].default, Some(json!([])));

        let mut bad = m.clone();
        bad.name = "other".into();
        assert!(matches!(
            bad.runner_id(),
            Err(RunnerIdError::NameMismatch { .. })
        ));

        // unknown capability inside a manifest rejects the whole manifest
        assert!(
            serde_json::from_value::<AgentRunnerManifest>(json!({
                "id": "plugin:acme/echo/default", "name": "default", "label": {},
                "capabilities": {"telepathy": true}
            }))
            .is_err()
        );
    }
}
