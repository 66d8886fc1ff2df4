//! The attacks of the security review (issue 10, SPEC §14), each reproduced from outside as a
//! tenant holding one API key would act, and shown refused, in embedded mode (one process,
//! SQLite) and in cluster mode (separate gateway, orchestrator and worker processes on
//! Postgres, Redis and RabbitMQ).
//!
//! [`tenant_cannot_reach_host_secrets_or_network`] is written once against a [`Client`] and
//! a [`ResourceRegistry`] and run on both deployments, configured as production is: no
//! `egress.allow` (public addresses only) and one secret in `secrets.allow`. Against it:
//!
//! 1. **Environment exfiltration**: models and tools naming the host's own variables
//!    (`SWITCHBOARD__BUS__URL`, `…DATABASE__URL`, `…SESSIONS__URL`) or any variable not
//!    made available are refused at registration; a row naming one that reached the
//!    registry anyway (written before the policy, or by hand) is refused by the worker before
//!    any connection, and the listener it points at receives nothing.
//! 2. **SSRF**: every target of the review (metadata `169.254.169.254` and its names,
//!    link-local, loopback service ports by every spelling, `0.0.0.0`, private ranges, URLs
//!    with credentials) is refused at registration; a host *name* that resolves to loopback
//!    (what DNS rebinding achieves) passes registration and is refused at connect time, and
//!    the local listener it resolves to receives nothing.
//!
//! Needs the binaries: `cargo build --workspace --bins` (scripts/test does it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::extract::State;
use sb_protocol::ids::WorkspaceId;
use sb_store::{ApiKeyRole, ModelKind, NewModel, NewTool, ResourceRegistry, Tenancy};
use sb_tests::cluster::{ClusterSpec, TestCluster as Deployment};
use sb_tests::script::{API, agent, code, require_api_runner, script, serve_local, unique};
use sb_tests::{Client, TestCluster};
use serde_json::{Value, json};

/// The one secret the deployments make available (`secrets.allow`). Its value is set on the
/// cluster's processes; the embedded worker is this test process, where it is unset.
const SECRET: &str = "SB_SECURITY_TEST_KEY";

/// A listener that counts every request it gets, on any path: what an attacker points a
/// model or a tool at to collect what the worker sends.
async fn listener() -> (String, Arc<AtomicU32>) {
    let hits = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .fallback(|State(hits): State<Arc<AtomicU32>>| async move {
            hits.fetch_add(1, Ordering::SeqCst);
            "{}"
        })
        .with_state(hits.clone());
    (serve_local(app).await, hits)
}

/// `POST path` must be refused `400 invalid_argument` with `needle` in the message.
async fn refused(client: &Client, path: &str, body: Value, needle: &str) {
    let response = client.post(path, &body).await;
    assert_eq!(response.status, 400, "{body}: {}", response.body);
    assert_eq!(
        response.body["code"], "invalid_argument",
        "{}",
        response.body
    );
    let message = response.body["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{body}: {message}");
}

fn model(name: &str, base_url: &str, key_env: Option<&str>) -> Value {
    json!({"name": name, "kind": "llm", "base_url": base_url, "model_name": "m",
           "api_key_env": key_env})
}

fn tool(name: &str, url: &str, header_env: Option<&str>) -> Value {
    let headers = header_env.map_or_else(|| json!({}), |env| json!({"Authorization": env}));
    json!({"name": name, "kind": "http", "url": url, "headers_env": headers})
}

/// The scenario of the module docs, on a deployment reached through `client` whose registry
/// is `registry`.
async fn tenant_cannot_reach_host_secrets_or_network(
    client: &Client,
    registry: &dyn ResourceRegistry,
) {
    require_api_runner();
    let (base, hits) = listener().await;
    let port = base.rsplit(':').next().expect("a port").to_owned();

    // 1. Exfiltration of the worker's environment, refused at registration.
    for (env, needle) in [
        ("SWITCHBOARD__BUS__URL", "host's own configuration"),
        ("SWITCHBOARD__DATABASE__URL", "host's own configuration"),
        ("SWITCHBOARD__SESSIONS__URL", "host's own configuration"),
        ("switchboard__database__url", "host's own configuration"),
        ("HOME", "secrets.allow"),
        ("AWS_SECRET_ACCESS_KEY", "secrets.allow"),
    ] {
        refused(
            client,
            "/v1/models",
            model(&unique("m"), "https://api.example.com/v1", Some(env)),
            needle,
        )
        .await;
        refused(
            client,
            "/v1/tools",
            tool(&unique("t"), "https://api.example.com/t", Some(env)),
            needle,
        )
        .await;
    }

    // 2. SSRF targets, refused at registration.
    let targets = [
        (
            "http://169.254.169.254/latest/meta-data/iam/".to_owned(),
            "metadata",
        ),
        ("http://[fd00:ec2::254]/latest/".to_owned(), "metadata"),
        (
            "http://metadata.google.internal/computeMetadata/v1/".to_owned(),
            "metadata",
        ),
        ("http://169.254.42.1/".to_owned(), "link-local"),
        ("http://[fe80::1]/".to_owned(), "link-local"),
        (format!("http://127.0.0.1:{port}/v1"), "loopback"),
        (format!("http://127.1:{port}/v1"), "loopback"),
        (format!("http://2130706433:{port}/v1"), "loopback"),
        (format!("http://[::1]:{port}/v1"), "loopback"),
        (format!("http://[::ffff:127.0.0.1]:{port}/v1"), "loopback"),
        ("http://127.0.0.1:6379/".to_owned(), "loopback"),
        ("http://127.0.0.1:5432/".to_owned(), "loopback"),
        ("http://127.0.0.1:5672/".to_owned(), "loopback"),
        (format!("http://0.0.0.0:{port}/v1"), "unspecified"),
        ("http://10.0.0.1/".to_owned(), "private"),
        ("http://172.16.0.1/".to_owned(), "private"),
        ("http://192.168.0.1/".to_owned(), "private"),
        ("http://100.64.0.1/".to_owned(), "shared"),
        (
            "https://user:password@api.example.com/v1".to_owned(),
            "credentials",
        ),
        ("file:///etc/passwd".to_owned(), "http or https"),
    ];
    for (url, needle) in &targets {
        refused(client, "/v1/models", model(&unique("m"), url, None), needle).await;
        refused(client, "/v1/tools", tool(&unique("t"), url, None), needle).await;
    }
    for path in ["/v1/models", "/v1/tools"] {
        let listed = client.get(path).await;
        assert_eq!(
            listed.body["items"],
            json!([]),
            "nothing stored: {}",
            listed.body
        );
    }

    // 3. At connect time: a name resolving to loopback (DNS rebinding) registers, but the
    //    worker refuses every address it resolves to.
    let rebinding = format!("http://localhost:{port}");
    let created = client
        .post(
            "/v1/models",
            &model("rebind", &format!("{rebinding}/v1"), None),
        )
        .await
        .expect(201);
    let rebind_model = created.str("model_id").to_owned();
    client
        .post(
            "/v1/tools",
            &tool("rebind", &format!("{rebinding}/tool"), None),
        )
        .await
        .expect(201);

    // 4. Rows that name a forbidden secret but reached the registry anyway (registered
    //    before the policy existed, or written by hand): the worker refuses the reference
    //    before it builds a request, so no value leaves it.
    let workspace = WorkspaceId::default_workspace();
    let legacy_model = registry
        .create_model(NewModel {
            workspace_id: workspace.clone(),
            name: "legacy".into(),
            kind: ModelKind::Llm,
            base_url: "https://api.example.com/v1".into(),
            model_name: "m".into(),
            api_key_env: Some("SWITCHBOARD__DATABASE__URL".into()),
            context_window: None,
            extra_args: None,
        })
        .await
        .expect("a legacy row");
    registry
        .create_tool(NewTool {
            workspace_id: workspace,
            name: "legacy".into(),
            kind: "http".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            config: json!({"url": "https://api.example.com/t", "timeout_ms": 2000,
                           "max_response_bytes": 1024,
                           "headers_env": {"Authorization": "SWITCHBOARD__BUS__URL"}}),
        })
        .await
        .expect("a legacy row");

    let conversation = unique("security");
    let legacy_model = legacy_model.model_id.to_string();
    agent(
        client,
        &conversation,
        API,
        json!({"resource_policy": {
            "allowed_model_uuids": [rebind_model, legacy_model],
            "allowed_tool_names": ["rebind", "legacy"],
        }}),
    )
    .await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    let call =
        |action: &str, params: Value| json!({"do": "call", "action": action, "params": params});
    let outcomes = script(
        client,
        &conversation,
        json!([
            call(
                "invoke_llm",
                json!({"llm_model_uuid": rebind_model, "messages": messages})
            ),
            call(
                "call_tool",
                json!({"tool_name": "rebind", "parameters": {}})
            ),
            call(
                "invoke_llm",
                json!({"llm_model_uuid": legacy_model, "messages": messages})
            ),
            call(
                "call_tool",
                json!({"tool_name": "legacy", "parameters": {}})
            ),
        ]),
    )
    .await;
    let message = |i: usize| {
        outcomes[i]["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    for (i, outcome) in outcomes.iter().enumerate() {
        assert_eq!(code(outcome), "invalid_argument", "step {i}: {outcome}");
        assert_eq!(outcome["error"]["retryable"], false, "step {i}: {outcome}");
    }
    for i in [0, 1] {
        assert!(message(i).contains("loopback"), "step {i}: {}", message(i));
    }
    for i in [2, 3] {
        assert!(
            message(i).contains("host's own configuration"),
            "step {i}: {}",
            message(i)
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the listener received nothing"
    );
}

/// A `client` key (what an application holds) sends events and reads their runs, but cannot
/// register a model, a tool, a knowledge base, an agent, a schedule or a key (`403
/// permission_denied`, nothing stored); revoked through `client`'s gateway, it is refused on
/// its very next request on `other` (another gateway in cluster mode, which had the key in
/// its cache).
async fn client_keys_cannot_administer(client: &Client, other: &Client) {
    let created = client
        .post("/v1/keys", &json!({"name": "app", "role": "client"}))
        .await
        .expect(201);
    let key_id = created.str("key_id").to_owned();
    let app = other.with_key(Some(created.str("key")));
    let agent_body =
        json!({"name": unique("agent"), "runner_id": "plugin:switchboard/echo/default"});
    let schedule = json!({"name": "s", "kind": "interval", "spec": "1h",
                          "event": {"event_type": "message.received", "source": "scheduler",
                                    "conversation_id": "c", "input": {"text": "x"}}});
    for (path, body) in [
        ("/v1/models", model("m", "https://api.example.com/v1", None)),
        ("/v1/tools", tool("t", "https://api.example.com/t", None)),
        ("/v1/knowledge-bases", json!({"name": "kb"})),
        ("/v1/agents", agent_body),
        ("/v1/schedules", schedule),
        ("/v1/keys", json!({"role": "admin"})),
    ] {
        let response = app.post(path, &body).await;
        assert_eq!(response.status, 403, "{path}: {}", response.body);
        assert_eq!(
            response.body["code"], "permission_denied",
            "{path}: {}",
            response.body
        );
    }
    for path in [
        "/v1/models",
        "/v1/tools",
        "/v1/knowledge-bases",
        "/v1/schedules",
    ] {
        let listed = client.get(path).await;
        assert_eq!(listed.body["items"], json!([]), "{path}: nothing stored");
    }
    // What an application needs still works with the client key.
    let conversation = unique("client");
    let event = app.send_message(&conversation, "hello").await;
    let run = app.run_of(event).await;
    let terminal = app.wait_run_terminal(run).await;
    assert_eq!(terminal["status"], "completed", "{terminal}");
    // Revoked: refused on the next request.
    let revoked = client.delete(&format!("/v1/keys/{key_id}")).await;
    assert!((200..300).contains(&revoked.status), "{}", revoked.body);
    assert_eq!(app.get("/v1/agents").await.status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_client_keys_cannot_administer() {
    let cluster = TestCluster::builder().start().await;
    client_keys_cannot_administer(cluster.client(), cluster.client()).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_client_keys_cannot_administer() {
    let spec = ClusterSpec {
        gateways: 2,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    };
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    client_keys_cannot_administer(&deployment.client(0), &deployment.client(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_tenant_cannot_reach_host_secrets_or_network() {
    let cluster = TestCluster::builder()
        .config("secrets.allow", SECRET)
        .start()
        .await;
    tenant_cannot_reach_host_secrets_or_network(
        cluster.client(),
        cluster.stores().resources.as_ref(),
    )
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_tenant_cannot_reach_host_secrets_or_network() {
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    }
    .env(SECRET, "sb-security-test-value")
    .env("SWITCHBOARD__SECRETS__ALLOW", SECRET);
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    tenant_cannot_reach_host_secrets_or_network(&deployment.client(0), deployment.store()).await;
}

// ---------------------------------------------------------------------------------------------
// Runner ↔ host
// ---------------------------------------------------------------------------------------------

/// A runner probes its confinement and tries the deployment's Redis at `redis` (cluster
/// mode): it cannot read its worker's environment, runs with `no_new_privs`, the sandbox's
/// limits and a private `TMPDIR`, as a non-root user when the worker is root, and a Redis
/// that requires a password answers it nothing but `NOAUTH`.
async fn runner_is_confined(client: &Client, redis: Option<std::net::SocketAddr>) {
    require_api_runner();
    let conversation = unique("confined");
    agent(client, &conversation, API, json!({})).await;
    let mut steps = vec![json!({"do": "probe"})];
    if let Some(addr) = redis {
        steps.push(json!({"do": "tcp", "addr": addr.to_string(), "send": "PING\r\n"}));
        steps.push(json!({"do": "tcp", "addr": addr.to_string(), "send": "KEYS *\r\n"}));
    }
    let outcomes = script(client, &conversation, Value::Array(steps)).await;
    let probe = &outcomes[0]["data"];
    assert_eq!(
        probe["parent_environ"]["readable"], false,
        "the worker's environment is readable: {probe}"
    );
    assert_eq!(probe["no_new_privs"], "1", "{probe}");
    if nix::unistd::geteuid().is_root() {
        assert_ne!(
            probe["uid"], 0,
            "a root worker runs runners as another user: {probe}"
        );
    }
    assert_eq!(probe["tmpdir_mode"], 0o700, "{probe}");
    assert_eq!(probe["tmpdir_uid"], probe["uid"], "{probe}");
    let limits = probe["limits"].as_str().unwrap_or_default();
    let limit = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    assert!(limit("Max open files").contains(&"1024"), "{limits}");
    assert!(limit("Max processes").contains(&"512"), "{limits}");
    for outcome in &outcomes[1..] {
        let answer = outcome["data"]["answer"].as_str().unwrap_or_default();
        assert!(
            answer.starts_with("-NOAUTH"),
            "Redis answered a runner: {outcome}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_runner_is_confined() {
    let cluster = TestCluster::builder().start().await;
    runner_is_confined(cluster.client(), None).await;
    cluster.shutdown().await;
}

/// A `redis-server` of this test's own that requires a password, as a production
/// deployment's does (docker-compose.yml): the shared local Redis of the suites has none.
struct PasswordRedis {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    password: String,
}

impl PasswordRedis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let password = unique("redis-pw");
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--requirepass",
                &password,
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (Debian's redis-server package) is installed");
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Self {
            child,
            addr,
            password,
        }
    }

    fn url(&self) -> String {
        format!("redis://:{}@{}", self.password, self.addr)
    }
}

impl Drop for PasswordRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_runner_is_confined_and_cannot_reach_redis() {
    let redis = PasswordRedis::start();
    let services = sb_tests::cluster::Services {
        redis_url: redis.url(),
        ..sb_tests::cluster::Services::from_env()
    };
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    };
    let deployment = match Deployment::spawn_on(services, spec).await {
        Ok(d) => d,
        Err(e) => panic!("cannot start the test cluster: {e}"),
    };
    runner_is_confined(&deployment.client(0), Some(redis.addr)).await;
    drop(deployment);
}

// ---------------------------------------------------------------------------------------------
// Run ↔ run, across workspaces
// ---------------------------------------------------------------------------------------------

/// The misbehaving test runner in shared mode (`tests/runners/test-shared`): its `wire`
/// script writes raw protocol lines and reports the host's answers.
const TEST_SHARED: &str = "plugin:switchboard-tests/test-shared/default";

/// A shared-mode runner process of workspace `default` tries a Host API call as an active
/// run of another workspace (whose id it learnt somehow): the host refuses it, and the other
/// run is untouched. Each workspace gets its own shared process, and the gate checks every
/// call's run against the connection's runs and workspace (SECURITY.md).
async fn shared_process_cannot_call_as_another_workspace(client: &Client, tenancy: &dyn Tenancy) {
    let workspace = WorkspaceId::new(unique("other")).expect("a workspace id");
    let key = tenancy
        .create_api_key(&workspace, Some("other tenant"), ApiKeyRole::Admin)
        .await
        .expect("a key of the other workspace");
    let other = client.with_key(Some(&key.plaintext));

    // The victim: a run of the other workspace that stays active.
    let victim_conversation = unique("victim");
    other
        .create_agent(&json!({"name": unique("victim"), "runner_id": TEST_SHARED,
                              "scope": {"conversation_id": victim_conversation}}))
        .await
        .expect(201);
    let victim_event = other.send_message(&victim_conversation, "stall").await;
    let victim = other.run_of(victim_event).await;
    sb_tests::wait_for("the victim run to start", || async {
        (other.get_run(victim).await["status"] == "running").then_some(())
    })
    .await;

    // The attacker: a run of workspace `default` on the same runner, calling as the victim.
    let conversation = unique("attacker");
    agent(client, &conversation, TEST_SHARED, json!({})).await;
    let lines = json!([
        {"op": "api", "id": "steal-1", "run_id": victim.to_string(),
         "action": "get_host_version", "params": {}},
        {"op": "api", "id": "steal-2", "run_id": victim.to_string(),
         "action": "history_page", "params": {}},
    ]);
    let event = client
        .send_message(&conversation, &format!("wire 2 {lines}"))
        .await;
    let run = client.run_of(event).await;
    let terminal = client.wait_run_terminal(run).await;
    assert_eq!(terminal["status"], "completed", "{terminal}");
    let items = client.run_events(run, 0).await;
    let report = items
        .iter()
        .find(|i| i.result_type == "message.completed")
        .and_then(|i| sb_tests::script::content_of(i, "message"))
        .expect("the runner reported the answers");
    let answers: Vec<Value> = serde_json::from_str(&report).expect("a JSON array of answers");
    assert_eq!(answers.len(), 2, "{answers:?}");
    for answer in &answers {
        assert!(
            answer.get("data").is_none_or(Value::is_null),
            "answered: {answer}"
        );
        let code = answer["error"]["code"].as_str().unwrap_or_default();
        assert!(matches!(code, "not_found" | "unauthorized"), "{answer}");
    }
    // The victim is still running, untouched; end it.
    assert_eq!(other.get_run(victim).await["status"], "running");
    let cancelled = other
        .post(&format!("/v1/runs/{victim}/cancel"), &json!({}))
        .await;
    assert!((200..300).contains(&cancelled.status), "{}", cancelled.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_shared_process_cannot_call_as_another_workspace() {
    let cluster = TestCluster::builder().start().await;
    shared_process_cannot_call_as_another_workspace(
        cluster.client(),
        cluster.stores().tenancy.as_ref(),
    )
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_shared_process_cannot_call_as_another_workspace() {
    let spec = ClusterSpec {
        gateways: 1,
        orchestrators: 1,
        workers: 1,
        env: Vec::new(),
    };
    let Some(deployment) = Deployment::spawn_or_skip(spec).await else {
        return;
    };
    shared_process_cannot_call_as_another_workspace(&deployment.client(0), deployment.store())
        .await;
}
