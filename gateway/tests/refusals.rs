//! Issue 15 finding 7: every refusal has the one JSON error shape, `{code, message}`,
//! including those made before a handler runs (axum's path, query and body rejections, which
//! answer plain text such as `Invalid URL: …` by default), and NUL characters, which
//! PostgreSQL cannot store, are refused with `400 invalid_argument` (finding 2). Raw requests:
//! through the router (`oneshot`) and, for what only a socket shows, over TCP.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

mod support;

use support::Harness;

async fn harness() -> Harness {
    Harness::start(sb_gateway::GatewayOptions::default()).await
}

fn assert_shape(status: StatusCode, body: &Value, expected: StatusCode, code: &str, needle: &str) {
    assert_eq!(status, expected, "{body}");
    assert_eq!(body["code"], code, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(needle),
        "{message:?} should mention {needle:?}"
    );
}

#[tokio::test]
async fn path_ids_that_are_not_utf8_get_the_error_shape() {
    let h = harness().await;
    for uri in [
        "/v1/conversations/%FF/transcript",
        "/v1/runs/%C3%28",
        "/v1/runs/%E2%82/events",
        "/v1/agents/a%80b",
        "/v1/schedules/%FE",
        "/v1/keys/%FF",
    ] {
        let method = if uri.starts_with("/v1/keys") {
            "DELETE"
        } else {
            "GET"
        };
        let (status, body) = h.call(method, uri, None).await;
        assert_shape(
            status,
            &body,
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "UTF-8",
        );
        assert!(
            body["message"].as_str().unwrap().contains("`id`") || uri.contains("conversations"),
            "{uri}: {body}"
        );
    }
    // The remote Host API answers in the runner-facing shape.
    let (status, body) = h
        .call(
            "POST",
            "/v1/host/%FF",
            Some(&json!({"run_id": "r", "params": {}})),
        )
        .await;
    assert_shape(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "UTF-8",
    );
    assert_eq!(body["retryable"], false, "{body}");
}

#[tokio::test]
async fn nul_in_path_query_or_body_is_a_clear_400() {
    let h = harness().await;
    for (method, uri, body) in [
        ("GET", "/v1/runs/%00", None),
        ("GET", "/v1/conversations/c%00/transcript", None),
        ("GET", "/v1/runs?conversation_id=%00", None),
        ("GET", "/v1/runs?%00=1", None),
        (
            "POST",
            "/v1/events",
            Some(
                json!({"event_type": "message.received", "source": "api", "input": {"text": "a\u{0}"}}),
            ),
        ),
        (
            "POST",
            "/v1/agents",
            Some(json!({"name": "\u{0}", "runner_id": "r", "scope": {}})),
        ),
    ] {
        let (status, answer) = h.call(method, uri, body.as_ref()).await;
        assert_shape(
            status,
            &answer,
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "NUL",
        );
    }
    // The six characters `\u0000` (an escaped backslash, then text) are not a NUL.
    let (status, answer) = h
        .call(
            "POST",
            "/v1/events",
            Some(&json!({"event_type": "message.received", "source": "api", "input": {"text": "\\u0000"}})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
}

#[tokio::test]
async fn bad_queries_and_bodies_get_the_error_shape() {
    let h = harness().await;
    let (status, body) = h.call("GET", "/v1/runs?limit=abc", None).await;
    assert_shape(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "query",
    );
    // No JSON content type.
    let request = Request::builder()
        .method("POST")
        .uri("/v1/events")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .body(Body::from("{}"))
        .unwrap();
    let (status, body) = h.send_json(request).await;
    assert_shape(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "Content-Type",
    );
    let (status, body) = h.call("POST", "/v1/runs/x/cancel", None).await;
    assert_eq!(body["code"], "not_found", "{status} {body}");
}

/// Sends `request` as raw bytes to a real server on `h`'s router; the status and the body.
async fn raw_http(h: &Harness, request: Vec<u8>) -> (u16, Vec<u8>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = h.app();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before reading everything: a write error is fine.
    let _ = stream.write_all(&request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    server.abort();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| answer[at + 4..].to_vec())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn over_a_socket_path_rejections_are_json_and_hyper_refusals_are_documented() {
    let h = harness().await;
    let request = format!(
        "GET /v1/runs/%FF HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\nconnection: close\r\n\r\n",
        h.key
    );
    let (status, body) = raw_http(&h, request.into_bytes()).await;
    assert_eq!(status, 400);
    let body: Value = serde_json::from_slice(&body).expect("a json body");
    assert_eq!(body["code"], "invalid_argument", "{body}");

    // A request head over hyper's read buffer (~400 KiB) is refused by hyper itself, before
    // any router or middleware sees a request: `431` with an empty body and the connection
    // closed (see the `sb_gateway::error` docs, "Refusals below the router").
    let request = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\nconnection: close\r\n\r\n",
        "a".repeat(600 * 1024)
    );
    let (status, body) = raw_http(&h, request.into_bytes()).await;
    assert_eq!(status, 431);
    assert!(body.is_empty(), "{}", String::from_utf8_lossy(&body));
    // So is a head with more than 100 header fields.
    let fields: String = (0..120).map(|i| format!("x-h{i}: v\r\n")).collect();
    let request = format!("GET /healthz HTTP/1.1\r\nhost: x\r\n{fields}connection: close\r\n\r\n");
    let (status, body) = raw_http(&h, request.into_bytes()).await;
    assert_eq!(status, 431);
    assert!(body.is_empty(), "{}", String::from_utf8_lossy(&body));
}
