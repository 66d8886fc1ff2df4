//! Retention and artifacts over HTTP (issue 14 items 4 and 5), written once against a
//! [`Client`] so that embedded and cluster mode run the same steps. The deployment must run
//! with a short result retention ([`RESULT_RETENTION`], [`RETENTION_INTERVAL`]; see
//! [`retention_settings`]).

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::script::{API, agent, start_script, unique};
use crate::{ApiResponse, Client, wait_for};

/// `retention.run_results` of the deployment under test.
pub const RESULT_RETENTION: &str = "1s";
/// `retention.interval` of the deployment under test.
pub const RETENTION_INTERVAL: &str = "200ms";

/// The `(key, value)` settings the scenario needs (dotted keys).
#[must_use]
pub fn retention_settings() -> [(&'static str, &'static str); 2] {
    [
        ("retention.run_results", RESULT_RETENTION),
        ("retention.interval", RETENTION_INTERVAL),
    ]
}

async fn session(client: &Client, agent_id: &str) -> String {
    client
        .post("/v1/sessions", &json!({"agent_id": agent_id}))
        .await
        .expect(201)
        .str("session_id")
        .to_owned()
}

/// A completed turn's result goes after `retention.run_results`: its snapshot says
/// `expired: true` with `result_expired`, its events say `gap: true`, the run says so too,
/// and a retry with the same key answers the same turn without running it again.
pub async fn result_expiry_scenario(client: &Client, echo_runner: &str) {
    let agent_id = client
        .create_agent(&json!({
            "name": unique("retention"),
            "runner_id": echo_runner,
            "scope": {"conversation_id": unique("not-this-one")},
        }))
        .await
        .expect(201)
        .str("agent_id")
        .to_owned();
    let session_id = session(client, &agent_id).await;
    let turns = format!("/v1/sessions/{session_id}/turns");
    let request = json!({"idempotency_key": "kept:1", "text": "remember me briefly"});
    let turn_id = client
        .post(&turns, &request)
        .await
        .expect(202)
        .str("turn_id")
        .to_owned();
    let expired = wait_for("the turn's result to expire", || async {
        let snapshot = client
            .get(&format!("/v1/turns/{turn_id}"))
            .await
            .expect(200)
            .body;
        (snapshot["expired"] == true).then_some(snapshot)
    })
    .await;
    assert_eq!(expired["status"], "completed", "{expired}");
    assert_eq!(expired["failure"]["code"], "result_expired", "{expired}");
    assert!(expired.get("result").is_none(), "{expired}");
    let last_sequence = expired["last_sequence"].as_i64().unwrap();
    assert!(last_sequence >= 1, "{expired}");

    let events = client
        .get(&format!("/v1/turns/{turn_id}/events?after_sequence=0"))
        .await
        .expect(200)
        .body;
    assert_eq!(events["gap"], true, "{events}");
    assert_eq!(events["events"], json!([]), "{events}");
    assert_eq!(events["snapshot"]["expired"], true, "{events}");
    let wait = client
        .get(&format!("/v1/turns/{turn_id}/wait?timeout_ms=100"))
        .await
        .expect(200)
        .body;
    assert_eq!(wait["failure"]["code"], "result_expired", "{wait}");

    let run = client
        .get(&format!("/v1/runs/{turn_id}"))
        .await
        .expect(200)
        .body;
    assert_eq!(run["expired"], true, "{run}");
    let page = client
        .get(&format!("/v1/runs/{turn_id}/events?after_sequence=0"))
        .await
        .expect(200)
        .body;
    assert_eq!(page["items"], json!([]), "{page}");
    assert_eq!(
        (page["expired"].clone(), page["gap"].clone()),
        (json!(true), json!(true)),
        "{page}"
    );
    // Nothing is missing after the last sequence: no gap there.
    let page = client
        .get(&format!(
            "/v1/runs/{turn_id}/events?after_sequence={last_sequence}"
        ))
        .await
        .expect(200)
        .body;
    assert_eq!(page["gap"], false, "{page}");

    // The same key and request: the same turn, not run again.
    let again = client.post(&turns, &request).await.expect(202);
    assert_eq!(again.str("turn_id"), turn_id);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let runs = client
        .get(&format!(
            "/v1/runs?conversation_id=session:{session_id}&limit=100"
        ))
        .await
        .expect(200)
        .body;
    assert_eq!(runs["items"].as_array().unwrap().len(), 1, "{runs}");
    let snapshot = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200)
        .body;
    assert_eq!(snapshot["failure"]["code"], "result_expired", "{snapshot}");
}

/// `GET path` with extra headers.
async fn get_with(client: &Client, path: &str, headers: &[(&str, &str)]) -> ApiResponse {
    let mut builder = client.request(reqwest::Method::GET, path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    Client::send(builder).await
}

fn header<'a>(response: &'a ApiResponse, name: &str) -> &'a str {
    response
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Artifacts over HTTP: JSON and multipart uploads (sha256 verified), metadata, content with
/// `Range`, and a runner-made artifact downloaded the same way.
pub async fn artifacts_scenario(client: &Client) {
    let content = b"hello artifact world";
    let sha = hex::encode(Sha256::digest(content));
    let encoded = base64::engine::general_purpose::STANDARD.encode(content);

    let refused = client
        .post(
            "/v1/artifacts",
            &json!({"content_base64": encoded, "sha256": "0".repeat(64)}),
        )
        .await
        .expect(400);
    assert_eq!(refused.body["code"], "invalid_argument", "{}", refused.body);

    let created = client
        .post(
            "/v1/artifacts",
            &json!({"name": "hello.txt", "content_type": "text/plain", "content_base64": encoded,
                    "sha256": sha, "metadata": {"purpose": "test"}}),
        )
        .await
        .expect(201);
    let id = created.str("artifact_id").to_owned();
    assert_eq!(created.body["sha256"], sha.as_str());
    assert_eq!(created.body["size_bytes"], content.len());
    assert_eq!(created.body["source"], "api");

    let meta = client
        .get(&format!("/v1/artifacts/{id}"))
        .await
        .expect(200)
        .body;
    assert_eq!(meta["name"], "hello.txt");
    assert_eq!(meta["mime_type"], "text/plain");
    assert_eq!(meta["metadata"]["purpose"], "test");

    let full = get_with(client, &format!("/v1/artifacts/{id}/content"), &[])
        .await
        .expect(200);
    assert_eq!(full.body, Value::String("hello artifact world".into()));
    assert_eq!(header(&full, "content-type"), "text/plain");
    assert_eq!(header(&full, "content-length"), "20");
    assert_eq!(header(&full, "accept-ranges"), "bytes");

    let part = get_with(
        client,
        &format!("/v1/artifacts/{id}/content"),
        &[("range", "bytes=6-13")],
    )
    .await
    .expect(206);
    assert_eq!(part.body, Value::String("artifact".into()));
    assert_eq!(header(&part, "content-range"), "bytes 6-13/20");
    assert_eq!(header(&part, "content-length"), "8");

    let beyond = get_with(
        client,
        &format!("/v1/artifacts/{id}/content"),
        &[("range", "bytes=50-")],
    )
    .await
    .expect(416);
    assert_eq!(header(&beyond, "content-range"), "bytes */20");
    assert_eq!(beyond.body["code"], "invalid_argument", "{}", beyond.body);

    client
        .get("/v1/artifacts/no-such-artifact")
        .await
        .expect(404);

    // multipart/form-data: the file part's name and type become the artifact's.
    let boundary = "sb-test-boundary";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"sha256\"\r\n\r\n{sha}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n\
         Content-Type: text/markdown\r\n\r\nhello artifact world\r\n--{boundary}--\r\n"
    );
    let uploaded = Client::send(
        client
            .request(reqwest::Method::POST, "/v1/artifacts")
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(body),
    )
    .await
    .expect(201);
    assert_eq!(uploaded.body["name"], "up.txt", "{}", uploaded.body);
    assert_eq!(uploaded.body["mime_type"], "text/markdown");
    assert_eq!(uploaded.body["sha256"], sha.as_str());

    // A runner-made artifact (an `artifact.created` result) downloads the same way.
    crate::script::require_api_runner();
    let conversation = unique("artifacts");
    agent(client, &conversation, API, json!({})).await;
    let made = unique("made");
    let (_, run_id) = start_script(
        client,
        &conversation,
        &json!([{"do": "emit", "type": "artifact.created", "data": {
            "artifact_type": "file", "artifact_id": made, "name": "note.txt",
            "mime_type": "text/plain", "content_base64": "bWFkZSBieSBhIHJ1bg=="}}]),
    )
    .await;
    let run = client.wait_run_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let meta = wait_for("the runner's artifact", || async {
        let got = client.get(&format!("/v1/artifacts/{made}")).await;
        (got.status == 200).then_some(got.body)
    })
    .await;
    assert_eq!(meta["source"], "runner", "{meta}");
    assert_eq!(meta["run_id"], run_id.to_string());
    let downloaded = get_with(client, &format!("/v1/artifacts/{made}/content"), &[])
        .await
        .expect(200);
    assert_eq!(downloaded.body, Value::String("made by a run".into()));
}
