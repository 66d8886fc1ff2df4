//! The operator CLI as a user runs it: the real `switchboard` binary (built by
//! `cargo build --bin switchboard`, or `SWITCHBOARD_BIN`) against an embedded host started by
//! the harness. Output is captured, so stdout is not a terminal: no colours, no spinners.

use std::process::Output;

use std::time::Duration;
use tokio::io::AsyncBufReadExt as _;

use sb_tests::cluster::switchboard_bin;
use sb_tests::{ECHO, TestCluster};
use serde_json::Value;

/// Runs `switchboard ARGS` against `cluster` (gateway URL and key from the environment, a
/// scratch working directory so no `.switchboard/api-key` is picked up).
async fn sb(cluster: &TestCluster, args: &[&str]) -> Output {
    let bin = switchboard_bin().expect("the switchboard binary");
    let dir = tempfile::tempdir().unwrap();
    let output = tokio::process::Command::new(bin)
        .args(args)
        .current_dir(dir.path())
        .env("SWITCHBOARD_URL", cluster.client().base_url())
        .env(
            "SWITCHBOARD_API_KEY",
            cluster.client().key().expect("a key"),
        )
        .env_remove("NO_COLOR")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("the command ends")
        .expect("the command runs")
}

/// [`sb`], which must succeed; its stdout.
async fn ok(cluster: &TestCluster, args: &[&str]) -> String {
    let out = sb(cluster, args).await;
    assert!(
        out.status.success(),
        "switchboard {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        !stdout.contains('\u{1b}'),
        "no escape codes off a terminal: {stdout:?}"
    );
    stdout
}

async fn ok_json(cluster: &TestCluster, args: &[&str]) -> Value {
    let stdout = ok(cluster, args).await;
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_are_edited_and_deleted_by_name() {
    let cluster = TestCluster::embedded().await;
    let c = &cluster;
    let model = ok_json(
        c,
        &[
            "models",
            "add",
            "--name",
            "gpt",
            "--base-url",
            "https://models.example.com/v1",
            "--model-name",
            "gpt-x",
        ],
    )
    .await;
    // Gateway flags before or after the subcommand; a name where an id would do.
    let url = c.client().base_url().to_owned();
    let updated = ok_json(
        c,
        &[
            "models",
            "--url",
            &url,
            "update",
            "gpt",
            "--context-window",
            "4096",
        ],
    )
    .await;
    assert_eq!(updated["model_id"], model["model_id"]);
    assert_eq!(updated["context_window"], 4096);
    let listed = ok_json(c, &["models", "list", "--json", "--url", &url]).await;
    assert_eq!(listed["items"][0]["context_window"], 4096);
    let table = ok(c, &["models", "list"]).await;
    assert!(
        table.starts_with("MODEL_ID") && table.contains("gpt"),
        "{table}"
    );

    // `--endpoint` is the tool's URL, `--url` the gateway's.
    let tool = ok_json(
        c,
        &[
            "tools",
            "add",
            "--name",
            "weather",
            "--endpoint",
            "https://tools.example.com/w",
            "--url",
            &url,
        ],
    )
    .await;
    assert_eq!(tool["url"], "https://tools.example.com/w");
    ok(
        c,
        &[
            "agents",
            "create",
            "--name",
            "forecaster",
            "--runner",
            ECHO,
            "--routing",
            "direct",
            "--resource-policy",
            r#"{"allowed_tool_names": ["weather"]}"#,
        ],
    )
    .await;
    let agents = ok_json(c, &["agents", "list", "--json"]).await;
    assert!(
        agents["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "forecaster"),
        "{agents}"
    );

    // Refused while the agent uses it: one error line naming the agent, exit code 1.
    let refused = sb(c, &["tools", "delete", "weather"]).await;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("conflict") && stderr.contains("forecaster"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("error:").count(),
        1,
        "printed once: {stderr}"
    );

    ok(c, &["agents", "delete", "forecaster"]).await;
    ok(c, &["tools", "delete", "weather"]).await;
    ok(c, &["models", "delete", "gpt"]).await;
    assert_eq!(
        ok_json(c, &["tools", "list", "--json"]).await["items"],
        serde_json::json!([])
    );

    let kb = ok_json(c, &["kb", "create", "--name", "manuals"]).await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "refunds take five days").unwrap();
    let doc = ok_json(
        c,
        &[
            "kb",
            "add-doc",
            "--kb",
            "manuals",
            "--title",
            "Refunds",
            "--file",
            file.path().to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(doc["kb_id"], kb["kb_id"]);
    let doc_id = doc["document_id"].as_str().unwrap();
    let edited = ok_json(
        c,
        &[
            "kb",
            "update-doc",
            "--kb",
            "manuals",
            doc_id,
            "--title",
            "Refund policy",
        ],
    )
    .await;
    assert_eq!(edited["title"], "Refund policy");
    ok(c, &["kb", "delete-doc", "--kb", "manuals", doc_id]).await;
    ok(c, &["kb", "delete", "manuals"]).await;

    let schedule = ok_json(
        c,
        &["schedules", "create", "--kind", "interval", "--spec", "1h", "--event",
          r#"{"event_type": "message.received", "source": "api", "conversation_id": "cron", "input": {"text": "tick"}}"#],
    )
    .await;
    let id = schedule["schedule_id"].as_str().unwrap();
    let paused = ok_json(c, &["schedules", "pause", id]).await;
    assert_eq!(
        (paused["enabled"].clone(), paused["next_fire_at"].clone()),
        (false.into(), Value::Null)
    );
    let resumed = ok_json(c, &["schedules", "resume", id]).await;
    assert_eq!(resumed["enabled"], true);
    assert!(resumed["next_fire_at"].is_i64());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_listed_shown_and_tailed() {
    let cluster = TestCluster::embedded().await;
    let c = &cluster;
    let event = c.client().send_message("cli-tail", "one two three").await;
    let run_id = c.client().run_of(event).await.to_string();
    c.client().wait_run_terminal(run_id.parse().unwrap()).await;

    let runs = ok_json(c, &["runs", "list", "--conversation", "cli-tail", "--json"]).await;
    assert_eq!(runs["items"][0]["run_id"], run_id.as_str(), "{runs}");
    let shown = ok_json(c, &["runs", "show", &run_id, "--json"]).await;
    assert_eq!(shown["run"]["status"], "completed");
    assert!(shown["events"].as_array().unwrap().len() >= 2);

    // A finished run: tail replays its items and ends with the terminal one (exit 0).
    let tail = ok(c, &["runs", "tail", &run_id]).await;
    let lines: Vec<&str> = tail.lines().collect();
    assert!(lines.last().unwrap().contains("run.completed"), "{tail}");
    assert!(tail.contains("message.delta"), "{tail}");
    let json_lines = ok(c, &["runs", "tail", &run_id, "--json"]).await;
    for line in json_lines.lines() {
        let item: Value = serde_json::from_str(line).unwrap();
        assert_eq!(item["run_id"], run_id.as_str());
    }
    // A conversation: every run of it, live, until interrupted.
    let mut follower = tokio::process::Command::new(switchboard_bin().unwrap())
        .args(["runs", "tail", "--conversation", "cli-tail"])
        .env("SWITCHBOARD_URL", c.client().base_url())
        .env("SWITCHBOARD_API_KEY", c.client().key().unwrap())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(follower.stdout.take().unwrap()).lines();
    // The stream starts with the runs active when it opens: give it a moment to open.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = c.client().send_message("cli-tail", "four five").await;
    let second_run = c.client().run_of(second).await.to_string();
    let followed = tokio::time::timeout(Duration::from_secs(30), async {
        let mut seen = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            seen.push(line.clone());
            if line.contains("run.completed") {
                return seen;
            }
        }
        seen
    })
    .await
    .expect("the new run of the conversation was followed to its end");
    assert!(
        followed.iter().all(|l| l.starts_with(&second_run[..8])),
        "each line names its run: {followed:?}"
    );
    assert!(followed.iter().any(|l| l.contains("four")), "{followed:?}");
    follower.kill().await.unwrap();
    let runs = ok_json(c, &["runs", "list", "--conversation", "cli-tail", "--json"]).await;
    assert_eq!(runs["items"][0]["run_id"], second_run.as_str());

    let unknown = sb(c, &["runs", "tail", &uuid::Uuid::now_v7().to_string()]).await;
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("not_found"));
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_turns_from_the_command_line() {
    let cluster = TestCluster::embedded().await;
    let c = &cluster;
    let agent = c.client().conversation_agent("cli-sessions", ECHO).await;
    let session = ok(c, &["sessions", "create", "--agent", &agent]).await;
    let session = session.trim();
    let first = ok_json(
        c,
        &[
            "turns",
            "start",
            "--session",
            session,
            "--key",
            "k-1",
            "hello there",
            "--wait",
        ],
    )
    .await;
    assert_eq!(first["status"], "completed", "{first}");
    let again = ok_json(
        c,
        &[
            "turns",
            "start",
            "--session",
            session,
            "--key",
            "k-1",
            "hello there",
        ],
    )
    .await;
    assert_eq!(again["turn_id"], first["turn_id"], "same key, same turn");
    let turn = first["turn_id"].as_str().unwrap();
    let events = ok_json(c, &["turns", "events", turn, "--after", "1"]).await;
    assert!(
        events["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["sequence"].as_u64() > Some(1))
    );
    let cancel = ok_json(c, &["turns", "cancel", turn]).await;
    assert_eq!(cancel["cancelled"], false, "{cancel}");
    let waited = ok_json(c, &["turns", "wait", turn, "--timeout", "5"]).await;
    assert_eq!(waited["status"], "completed");
    ok(c, &["sessions", "close", session]).await;
    let refused = sb(c, &["turns", "start", "--session", session, "again"]).await;
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("conflict"));
    cluster.shutdown().await;
}
