//! `/v1/artifacts` on the real router (in-memory SQLite, memory bus and session store): the
//! workspace boundary, the upload cap and body limit, sha256 verification, multipart
//! refusals, runner-made and external artifacts, and `Range` answers.

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use base64::Engine as _;
use sb_gateway::GatewayOptions;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_store::{ArtifactContent, ArtifactScope, NewArtifact};
use serde_json::{Value, json};
use tower::ServiceExt;

mod support;

use support::Harness;

/// The upload cap of these tests (`limits.artifact_upload_bytes`).
const CAP: usize = 1024;

async fn harness() -> Harness {
    Harness::start(GatewayOptions {
        artifact_upload_bytes: CAP,
        ..GatewayOptions::default()
    })
    .await
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `GET uri` with `range`: status, headers and the raw body.
async fn download(
    h: &Harness,
    uri: &str,
    range: Option<&str>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let mut request = Request::builder()
        .uri(uri)
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key));
    if let Some(range) = range {
        request = request.header(header::RANGE, range);
    }
    let response = h
        .app()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    (status, headers, body)
}

#[tokio::test]
async fn artifacts_are_scoped_to_the_workspace() {
    let h = harness().await;
    let (status, created) = h
        .call(
            "POST",
            "/v1/artifacts",
            Some(&json!({"content_base64": b64(b"mine")})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["artifact_id"].as_str().unwrap();
    assert_eq!(created["artifact_type"], "file");
    assert_eq!(created["scope"], "workspace");

    let other = h.api_key("elsewhere").await;
    for uri in [
        format!("/v1/artifacts/{id}"),
        format!("/v1/artifacts/{id}/content"),
    ] {
        let (status, body) = h.call_as(&other, "GET", &uri, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{uri}: {body}");
        assert_eq!(body["code"], "not_found");
        // The same answer as an id that does not exist.
        let (status, _) = h.call_as(&other, "GET", "/v1/artifacts/none", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn uploads_are_capped_and_verified() {
    let h = harness().await;
    let h = &h;
    let upload = |body: Value| async move { h.call("POST", "/v1/artifacts", Some(&body)).await };

    let (status, body) = upload(json!({"content_base64": b64(&[1u8; CAP])})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = upload(json!({"content_base64": b64(&[1u8; CAP + 1])})).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(body["code"], "payload_too_large");

    let (status, body) =
        upload(json!({"content_base64": b64(b"x"), "sha256": "f".repeat(64)})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = upload(json!({"content_base64": "%%%"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = upload(json!({"content_base64": b64(b"x"), "metadata": [1]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = upload(json!({"content_base64": b64(b"x"), "unknown": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    // A declared length over the route's body limit is refused before the body is read;
    // the route's limit is larger than the gateway's (1 MiB by default) only for uploads.
    let request = Request::builder()
        .method("POST")
        .uri("/v1/artifacts")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, (CAP * 4 + 1024 * 1024).to_string())
        .body(Body::empty())
        .unwrap();
    let (status, body) = h.send_json(request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");

    // Neither JSON nor multipart.
    let request = Request::builder()
        .method("POST")
        .uri("/v1/artifacts")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from("hello"))
        .unwrap();
    let (status, body) = h.send_json(request).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test]
async fn multipart_uploads_stream_under_the_cap() {
    let h = harness().await;
    let multipart = |parts: &str| {
        Request::builder()
            .method("POST")
            .uri("/v1/artifacts")
            .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
            .header(header::CONTENT_TYPE, "multipart/form-data; boundary=b")
            .body(Body::from(format!("{parts}--b--\r\n")))
            .unwrap()
    };
    let file = |content: &str| {
        format!(
            "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.bin\"\r\n\r\n{content}\r\n"
        )
    };
    let (status, body) = h
        .send_json(multipart(&format!(
            "--b\r\nContent-Disposition: form-data; name=\"metadata\"\r\n\r\n{{\"k\": 1}}\r\n{}",
            file("data")
        )))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["name"], "f.bin");
    assert_eq!(body["size_bytes"], 4);
    assert_eq!(body["metadata"]["k"], 1);

    let (status, body) = h.send_json(multipart(&file(&"x".repeat(CAP + 1)))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    let (status, body) = h.send_json(multipart("")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = h
        .send_json(multipart(&format!(
            "--b\r\nContent-Disposition: form-data; name=\"colour\"\r\n\r\nred\r\n{}",
            file("data")
        )))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test]
async fn content_answers_ranges() {
    let h = harness().await;
    // A runner-made artifact: the same rows as uploads, downloaded the same way.
    let mut made = NewArtifact::inline(
        WorkspaceId::new("default").unwrap(),
        "image",
        "runner",
        ArtifactScope::Run,
        b"0123456789".to_vec(),
    );
    made.id = Some("runner-made".into());
    made.mime_type = Some("image/png".into());
    made.run_id = Some(RunId::new());
    h.stores.artifacts.put(made).await.unwrap();

    let (status, headers, body) = download(&h, "/v1/artifacts/runner-made/content", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, b"0123456789");
    assert_eq!(headers[header::CONTENT_TYPE], "image/png");
    assert_eq!(headers[header::CONTENT_LENGTH], "10");
    assert_eq!(headers[header::ACCEPT_RANGES], "bytes");
    assert!(headers.contains_key(header::ETAG));

    for (range, part, content_range) in [
        ("bytes=2-4", &b"234"[..], "bytes 2-4/10"),
        ("bytes=7-", b"789", "bytes 7-9/10"),
        ("bytes=-2", b"89", "bytes 8-9/10"),
        ("bytes=9-99", b"9", "bytes 9-9/10"),
    ] {
        let (status, headers, body) =
            download(&h, "/v1/artifacts/runner-made/content", Some(range)).await;
        assert_eq!(status, StatusCode::PARTIAL_CONTENT, "{range}");
        assert_eq!(body, part, "{range}");
        assert_eq!(headers[header::CONTENT_RANGE], content_range, "{range}");
        assert_eq!(headers[header::CONTENT_LENGTH], part.len().to_string());
    }
    for range in ["bytes=10-", "bytes=0-1,3-4", "lines=1-2", "bytes=x"] {
        let (status, headers, body) =
            download(&h, "/v1/artifacts/runner-made/content", Some(range)).await;
        assert_eq!(status, StatusCode::RANGE_NOT_SATISFIABLE, "{range}");
        assert_eq!(headers[header::CONTENT_RANGE], "bytes */10", "{range}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["code"], "invalid_argument", "{range}: {body}");
    }

    // Content the host does not store is not downloadable; its metadata says where it is.
    let mut external = NewArtifact::inline(
        WorkspaceId::new("default").unwrap(),
        "file",
        "platform",
        ArtifactScope::Workspace,
        Vec::new(),
    );
    external.id = Some("external".into());
    external.content = ArtifactContent::Url("https://example.com/f".into());
    h.stores.artifacts.put(external).await.unwrap();
    let (status, meta) = h.call("GET", "/v1/artifacts/external", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(meta["storage_key"], "https://example.com/f");
    let (status, _, _) = download(&h, "/v1/artifacts/external/content", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
