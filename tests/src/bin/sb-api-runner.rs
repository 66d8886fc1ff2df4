//! `sb-api-runner`: a runner on the `sb-runner` SDK that calls the Host API as a script says
//! and reports every answer, for the end-to-end Host API suite (`tests/tests/host_api.rs`).
//!
//! The script is a JSON array of steps, taken from `context.config.steps` (the agent's
//! `runner_config`) or, when the config has none, from the input text. Each step is an object
//! whose `do` names what to do; the other keys are its arguments:
//!
//! | `do` | what it does (SDK method) |
//! | --- | --- |
//! | `history_page` | `history_page({conversation_id?, before_cursor?, after_cursor?, limit?, direction?, include_artifacts?})` |
//! | `history_search` | `history_search({query, filters?, top_k?})` |
//! | `event_get` / `event_page` | `event_get(event_id)` / `event_page({conversation_id?, event_types?, before_cursor?, limit?})` |
//! | `artifact_metadata` / `artifact_read` | `artifact_metadata(artifact_id)` / `artifact_read(artifact_id, offset, limit?)` |
//! | `state_get` / `state_set` / `state_delete` / `state_list` | the state methods (`scope`, `key`, `value`, `prefix`, `limit`) |
//! | `storage_get` / `storage_set` / `storage_delete` / `storage_keys` | the storage methods (`owner`: `plugin` or `workspace`; `storage_set` stores `text` as bytes) |
//! | `steering_pull` | `steering_pull(mode?, limit?)` |
//! | `get_host_version` | `get_host_version()` |
//! | `call` | `call(action, params)`: any action with raw params (models, tools, knowledge, prompt, files, ping, malformed arguments) |
//! | `call_stream` | `call_stream(action, params)`; the report adds the streamed `chunks` |
//! | `wait_steering` | pulls (`mode`, default `all`) every 20 ms until items arrive, at most `timeout_ms` (default 20 s) |
//! | `context` | reports the run's whole `AgentRunContext` |
//! | `announce` | a `message.delta` whose text is `{"run_id", "host_api"}` (the remote Host API of this run), so a test can act while the run is active |
//! | `emit` | emits a result of `type` with `data` (e.g. `state.updated`, `artifact.created`) |
//! | `wait_storage` | polls `storage_get(owner, key)` every 20 ms until the key exists, at most `timeout_ms` (default 20 s): a barrier the test opens by writing the key |
//! | `wait_cancel` | waits for the host's cancel, at most `timeout_ms` (default 60 s); after a cancel the script stops and the SDK ends the run `cancelled` |
//! | `sleep` | sleeps `ms` |
//! | `probe` | reports its own confinement: uid, `NoNewPrivs`, `TMPDIR` with mode and owner, whether the parent's (worker's) `/proc/<pid>/environ` is readable, `/proc/self/limits` |
//! | `tcp` | connects to `addr` (`ip:port`), writes `send`, returns what the peer answered within a second |
//! | `fail` | ends the run with `run.failed {code: "runner.scripted"}` (no report) |
//!
//! Before a step runs, every string argument equal to `$run_id`, `$event_id` or
//! `$conversation_id` is replaced by the run's own value, and `state_set` with `value_size: n`
//! stores a string of `n` bytes (for the size caps).
//!
//! The report is one `message.completed` whose text is the JSON object
//! `{"run_id", "host_api", "outcomes"}`: the run's remote Host API (`ctx.runtime.metadata.host_api`,
//! so a test can check that it closes with the run) and one outcome per step, in order:
//! `{"do", "ok": true, "data"}` or `{"do", "ok": false, "error": {code, message, retryable,
//! details}}` (the SDK's `AgentApiError`); then `run.completed`.

use std::time::{Duration, Instant};

use sb_runner::{
    AgentApiError, Emitter, ErrorCode, EventPageParams, HistoryPageParams, HistorySearchParams,
    HostApi, Run, RunError, Runner, StorageOwner,
};
use serde_json::{Map, Value, json};

struct ApiRunner;

/// One step's arguments.
struct Step<'a>(&'a Map<String, Value>);

impl Step<'_> {
    fn str(&self, key: &str) -> Option<String> {
        self.0.get(key).and_then(Value::as_str).map(str::to_owned)
    }

    fn string(&self, key: &str) -> String {
        self.str(key).unwrap_or_default()
    }

    fn u64(&self, key: &str) -> Option<u64> {
        self.0.get(key).and_then(Value::as_u64)
    }

    fn u32(&self, key: &str) -> Option<u32> {
        self.u64(key).and_then(|n| u32::try_from(n).ok())
    }

    fn value(&self, key: &str) -> Value {
        self.0.get(key).cloned().unwrap_or(Value::Null)
    }

    fn owner(&self) -> StorageOwner {
        match self.str("owner").as_deref() {
            Some("workspace") => StorageOwner::Workspace,
            _ => StorageOwner::Plugin,
        }
    }

    fn millis(&self, key: &str, default: u64) -> Duration {
        Duration::from_millis(self.u64(key).unwrap_or(default))
    }
}

/// What a step ends with.
enum Outcome {
    /// Report this answer and go on.
    Answer(Result<Value, AgentApiError>),
    /// The run was cancelled: stop the script (the SDK ends the run `cancelled`).
    Cancelled,
}

fn steps_of(run: &Run) -> Result<Vec<Value>, RunError> {
    if let Some(steps) = run.context().config.get("steps") {
        return steps
            .as_array()
            .cloned()
            .ok_or_else(|| RunError::new("runner.bad_script", "config.steps must be an array"));
    }
    match serde_json::from_str::<Value>(run.input_text()) {
        Ok(Value::Array(steps)) => Ok(steps),
        _ => Err(RunError::new(
            "runner.bad_script",
            "no script: set config.steps or send a JSON array of steps as the input text",
        )),
    }
}

fn history_page(api: &HostApi, s: &Step<'_>) -> Result<Value, AgentApiError> {
    api.history_page(&HistoryPageParams {
        conversation_id: s.str("conversation_id"),
        before_cursor: s.str("before_cursor"),
        after_cursor: s.str("after_cursor"),
        limit: s.u32("limit"),
        direction: s.str("direction"),
        include_artifacts: s.0.get("include_artifacts").and_then(Value::as_bool) == Some(true),
    })
}

fn wait_steering(run: &Run, s: &Step<'_>) -> Outcome {
    let until = Instant::now() + s.millis("timeout_ms", 20_000);
    let mode = s.str("mode");
    loop {
        match run.api().steering_pull(mode.as_deref(), s.u32("limit")) {
            Ok(answer) => {
                let pulled = answer["items"].as_array().is_some_and(|i| !i.is_empty());
                if pulled || Instant::now() >= until {
                    return Outcome::Answer(Ok(answer));
                }
            }
            Err(error) => return Outcome::Answer(Err(error)),
        }
        if run.cancelled_within(Duration::from_millis(20)) {
            return Outcome::Cancelled;
        }
    }
}

fn wait_storage(run: &Run, s: &Step<'_>) -> Outcome {
    let until = Instant::now() + s.millis("timeout_ms", 20_000);
    loop {
        match run.api().storage_get(s.owner(), &s.string("key")) {
            Ok(answer) => return Outcome::Answer(Ok(answer)),
            Err(error) if error.code == "not_found" && Instant::now() < until => {}
            Err(error) => return Outcome::Answer(Err(error)),
        }
        if run.cancelled_within(Duration::from_millis(20)) {
            return Outcome::Cancelled;
        }
    }
}

/// `ctx.runtime.metadata.host_api` (`{url, token}`), or `null`.
fn host_api_of(run: &Run) -> Value {
    run.context()
        .runtime
        .metadata
        .get("host_api")
        .cloned()
        .unwrap_or(Value::Null)
}

/// Replaces the `$run_id`, `$event_id` and `$conversation_id` placeholders, recursively.
fn substitute(value: &mut Value, run: &Run) {
    match value {
        Value::String(text) => {
            let replacement = match text.as_str() {
                "$run_id" => Some(run.run_id().to_string()),
                "$event_id" => Some(run.context().event.event_id.clone()),
                "$conversation_id" => run.context().context.conversation_id.clone(),
                _ => None,
            };
            if let Some(replacement) = replacement {
                *text = replacement;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| substitute(v, run)),
        Value::Object(fields) => fields.values_mut().for_each(|v| substitute(v, run)),
        _ => {}
    }
}

fn step(run: &Run, out: &Emitter, name: &str, s: &Step<'_>) -> Result<Outcome, RunError> {
    let api = run.api();
    let answer = match name {
        "history_page" => history_page(api, s),
        "history_search" => api.history_search(&HistorySearchParams {
            query: s.string("query"),
            filters: s.0.get("filters").cloned(),
            top_k: s.u32("top_k"),
        }),
        "event_get" => api.event_get(&s.string("event_id")),
        "event_page" => api.event_page(&EventPageParams {
            conversation_id: s.str("conversation_id"),
            event_types: s.0.get("event_types").and_then(|v| {
                v.as_array().map(|a| {
                    a.iter()
                        .filter_map(|t| t.as_str().map(str::to_owned))
                        .collect()
                })
            }),
            before_cursor: s.str("before_cursor"),
            limit: s.u32("limit"),
        }),
        "artifact_metadata" => api.artifact_metadata(&s.string("artifact_id")),
        "artifact_read" => api.artifact_read(
            &s.string("artifact_id"),
            s.u64("offset").unwrap_or(0),
            s.u64("limit"),
        ),
        "state_get" => api.state_get(&s.string("scope"), &s.string("key")),
        "state_set" => {
            let value = match s.u64("value_size") {
                Some(n) => Value::String("x".repeat(usize::try_from(n).unwrap_or(0))),
                None => s.value("value"),
            };
            api.state_set(&s.string("scope"), &s.string("key"), value)
        }
        "state_delete" => api.state_delete(&s.string("scope"), &s.string("key")),
        "state_list" => api.state_list(
            &s.string("scope"),
            s.str("prefix").as_deref(),
            s.u32("limit"),
        ),
        "storage_get" => api.storage_get(s.owner(), &s.string("key")),
        "storage_set" => api.storage_set(s.owner(), &s.string("key"), s.string("text").as_bytes()),
        "storage_delete" => api.storage_delete(s.owner(), &s.string("key")),
        "storage_keys" => api.storage_keys(s.owner()),
        "steering_pull" => api.steering_pull(s.str("mode").as_deref(), s.u32("limit")),
        "get_host_version" => api.get_host_version(),
        "call" => api.call(&s.string("action"), s.value("params")),
        "call_stream" => {
            let mut chunks = Vec::new();
            api.call_stream(&s.string("action"), s.value("params"), |c| chunks.push(c))
                .map(|data| json!({"data": data, "chunks": chunks}))
        }
        "wait_steering" => return Ok(wait_steering(run, s)),
        "wait_storage" => return Ok(wait_storage(run, s)),
        "fail" => return Err(RunError::new("runner.scripted", "the script says fail")),
        "context" => serde_json::to_value(run.context())
            .map_err(|e| AgentApiError::new(ErrorCode::Internal, e.to_string())),
        "announce" => {
            let text = json!({"run_id": run.run_id(), "host_api": host_api_of(run)}).to_string();
            out.delta(text)?;
            Ok(Value::Null)
        }
        "emit" => {
            out.result(&s.string("type"), s.value("data"))?;
            Ok(Value::Null)
        }
        "wait_cancel" => {
            if run.cancelled_within(s.millis("timeout_ms", 60_000)) {
                return Ok(Outcome::Cancelled);
            }
            Ok(json!({"cancelled": false}))
        }
        "sleep" => {
            if run.cancelled_within(s.millis("ms", 0)) {
                return Ok(Outcome::Cancelled);
            }
            Ok(Value::Null)
        }
        "probe" => Ok(probe()),
        "tcp" => tcp(&s.string("addr"), &s.string("send")),
        other => Err(AgentApiError::new(
            ErrorCode::InvalidArgument,
            format!("unknown script step `{other}`"),
        )),
    };
    Ok(Outcome::Answer(answer))
}

/// What a curious runner can learn about its confinement (tests/tests/security.rs): its
/// `Uid:` and `NoNewPrivs:` lines, its `TMPDIR` and that directory's mode and owner, whether
/// it can read its parent's (the worker's) environment, and its resource limits.
fn probe() -> Value {
    use std::os::unix::fs::MetadataExt as _;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
    };
    let parent = std::os::unix::process::parent_id();
    let parent_environ = match std::fs::read(format!("/proc/{parent}/environ")) {
        Ok(bytes) => json!({"readable": true, "bytes": bytes.len(),
                            "has_switchboard": String::from_utf8_lossy(&bytes).contains("SWITCHBOARD__")}),
        Err(e) => json!({"readable": false, "error": e.to_string()}),
    };
    let tmpdir = std::env::var("TMPDIR").ok();
    let tmp = tmpdir.as_deref().and_then(|d| std::fs::metadata(d).ok());
    json!({
        "uid": field("Uid:").and_then(|u| u.parse::<u64>().ok()),
        "no_new_privs": field("NoNewPrivs:"),
        "parent_environ": parent_environ,
        "tmpdir": tmpdir,
        "tmpdir_mode": tmp.as_ref().map(|m| m.mode() & 0o777),
        "tmpdir_uid": tmp.as_ref().map(std::os::unix::fs::MetadataExt::uid),
        "limits": std::fs::read_to_string("/proc/self/limits").unwrap_or_default(),
    })
}

/// Connects to `addr`, writes `send` and returns what the peer answered within a second:
/// a runner trying to talk to the deployment's Redis or RabbitMQ directly.
fn tcp(addr: &str, send: &str) -> Result<Value, AgentApiError> {
    use std::io::{Read as _, Write as _};
    let unavailable = |e: std::io::Error| AgentApiError::new(ErrorCode::Unavailable, e.to_string());
    let addr: std::net::SocketAddr = addr
        .parse()
        .map_err(|_| AgentApiError::new(ErrorCode::InvalidArgument, "addr must be ip:port"))?;
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(unavailable)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(unavailable)?;
    stream.write_all(send.as_bytes()).map_err(unavailable)?;
    let mut answer = vec![0u8; 4096];
    let n = stream.read(&mut answer).unwrap_or(0);
    Ok(json!({"answer": String::from_utf8_lossy(&answer[..n])}))
}

impl Runner for ApiRunner {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        let steps = steps_of(run)?;
        let mut outcomes = Vec::with_capacity(steps.len());
        for raw in &steps {
            let mut raw = raw.clone();
            substitute(&mut raw, run);
            let empty = Map::new();
            let args = Step(raw.as_object().unwrap_or(&empty));
            let name = args.string("do");
            let report = match step(run, out, &name, &args)? {
                Outcome::Cancelled => return Ok(()),
                Outcome::Answer(Ok(data)) => json!({"do": name, "ok": true, "data": data}),
                Outcome::Answer(Err(error)) => json!({"do": name, "ok": false, "error": error}),
            };
            outcomes.push(report);
        }
        let report = json!({
            "run_id": run.run_id(),
            "host_api": host_api_of(run),
            "outcomes": outcomes,
        });
        out.completed_text(report.to_string())?;
        out.run_completed()?;
        Ok(())
    }
}

fn main() -> std::io::Result<()> {
    sb_runner::serve(ApiRunner)
}
