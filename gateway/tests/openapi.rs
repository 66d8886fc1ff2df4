//! `GET /v1/openapi.json`: the document is valid OpenAPI 3.1, and it and the real router
//! describe the same routes.
//!
//! The router and the document come from the same declarations (`routes!` over the
//! handlers' `#[utoipa::path]`, see `sb_gateway::route_table`), so these tests guard what
//! could still drift: a route added with a plain `.route(…)` (served, not documented), a
//! documented operation the router does not serve, a method served on a documented path that
//! the document leaves out, and the `admin` role in the document disagreeing with the layer
//! that enforces it.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use sb_gateway::GatewayOptions;
use serde_json::Value;
use support::Harness;
use tower::ServiceExt;

/// The methods a route can serve (axum answers `HEAD` for every `GET` on its own).
const METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

async fn harness() -> Harness {
    Harness::start(GatewayOptions::default()).await
}

/// The document as served, without an API key.
async fn document(h: &Harness) -> Value {
    let request = Request::get("/v1/openapi.json")
        .body(Body::empty())
        .expect("request");
    let response = h.app().oneshot(request).await.expect("router");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/json",
        "the document is JSON"
    );
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    serde_json::from_slice(&bytes).expect("the document parses as JSON")
}

/// `(path, method) → operation` of the document.
fn operations(doc: &Value) -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in METHODS {
            if let Some(op) = item.get(method.to_lowercase()) {
                out.insert((path.clone(), method.to_owned()), op.clone());
            }
        }
    }
    out
}

/// `path` with every `{param}` replaced by a value that names nothing.
fn concrete(path: &str) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').expect("closed template") + open;
        out.push_str("00000000-0000-7000-8000-000000000000");
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The status of `method uri` (with `key` as bearer, if any). The body is not read: some
/// routes answer a stream that stays open.
async fn status_of(h: &Harness, method: &str, uri: &str, key: Option<&str>) -> StatusCode {
    let mut request = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).expect("method"))
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let body = if matches!(method, "POST" | "PUT" | "PATCH") {
        Body::from("{}")
    } else {
        Body::empty()
    };
    let response = h
        .app()
        .oneshot(request.body(body).expect("request"))
        .await
        .expect("router");
    response.status()
}

/// The security requirement names (and roles) of an operation.
fn security(op: &Value) -> Vec<(String, Vec<String>)> {
    op["security"]
        .as_array()
        .expect("every operation states its security")
        .iter()
        .flat_map(|req| {
            req.as_object()
                .expect("requirement object")
                .iter()
                .map(|(name, roles)| {
                    let roles = roles
                        .as_array()
                        .expect("roles")
                        .iter()
                        .map(|r| r.as_str().expect("role").to_owned())
                        .collect();
                    (name.clone(), roles)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every `$ref` in `value` (JSON pointers into the document).
fn refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                if key == "$ref" {
                    out.push(v.as_str().expect("$ref is a string").to_owned());
                } else {
                    refs(v, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn the_document_is_valid_openapi_3_1() {
    let h = harness().await;
    let doc = document(&h).await;
    // `SWITCHBOARD_OPENAPI_OUT=api.json cargo nextest run -p sb-gateway --test openapi`
    // writes the document without a running gateway (for client generators).
    if let Some(out) = std::env::var_os("SWITCHBOARD_OPENAPI_OUT") {
        std::fs::write(out, serde_json::to_string_pretty(&doc).unwrap()).expect("write");
    }

    // The structure parses as an OpenAPI 3.1 document.
    let text = doc.to_string();
    let spec = oas3::from_json(&text).expect("the document parses as OpenAPI 3.1");
    let version = spec
        .validate_version()
        .expect("a supported OpenAPI version");
    assert_eq!((version.major, version.minor), (3, 1), "OpenAPI 3.1");

    // Every reference resolves inside the document.
    let mut all_refs = Vec::new();
    refs(&doc, &mut all_refs);
    assert!(!all_refs.is_empty());
    for pointer in &all_refs {
        let local = pointer
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("{pointer} is not a local reference"));
        assert!(doc.pointer(local).is_some(), "{pointer} does not resolve");
    }

    let schemes = doc["components"]["securitySchemes"]
        .as_object()
        .expect("security schemes");
    let mut ids = BTreeSet::new();
    for ((path, method), op) in operations(&doc) {
        let what = format!("{method} {path}");
        // Resolved through the parser as well: parameters, body, answers.
        let parsed = spec
            .operation(&Method::from_bytes(method.as_bytes()).unwrap(), &path)
            .unwrap_or_else(|| panic!("{what}: missing from the parsed document"));
        let parameters = parsed
            .parameters(&spec)
            .unwrap_or_else(|e| panic!("{what}: parameters do not resolve: {e}"));
        parsed
            .request_body(&spec)
            .unwrap_or_else(|e| panic!("{what}: request body does not resolve: {e}"));
        let responses = parsed.responses(&spec);
        assert_eq!(
            responses.len(),
            op["responses"].as_object().expect("responses").len(),
            "{what}: every answer resolves"
        );

        let id = op["operationId"].as_str().expect("operationId").to_owned();
        assert!(
            ids.insert(id.clone()),
            "{what}: operationId {id} is not unique"
        );

        // Every path template parameter is declared as a path parameter.
        for segment in path.split('/') {
            if let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                assert!(
                    parameters
                        .iter()
                        .any(|p| p.name == name
                            && matches!(p.location, oas3::spec::ParameterIn::Path)),
                    "{what}: path parameter {name} is not declared"
                );
            }
        }

        // A success answer, and errors in the one shape.
        assert!(
            responses.keys().any(|status| status.starts_with('2')),
            "{what}: no success answer"
        );
        assert_eq!(
            op["responses"]["default"]["$ref"], "#/components/responses/Error",
            "{what}: errors are documented in the one shape"
        );
        for (name, _) in security(&op) {
            assert!(schemes.contains_key(&name), "{what}: unknown scheme {name}");
        }
    }
    assert_eq!(
        doc["components"]["schemas"]["Error"]["properties"]["code"]["$ref"],
        "#/components/schemas/ErrorCode",
        "the error shape names its code"
    );
    let codes = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .expect("the codes are listed");
    assert_eq!(codes.len(), sb_protocol::error::ErrorCode::ALL.len());
}

#[tokio::test]
async fn the_router_serves_exactly_the_documented_routes() {
    let h = harness().await;
    let doc = document(&h).await;
    let operations = operations(&doc);
    let paths: BTreeSet<&String> = operations.keys().map(|(path, _)| path).collect();
    assert!(
        paths.len() > 40,
        "every route is listed ({} paths)",
        paths.len()
    );
    for path in [
        "/v1/events",
        "/v1/sessions/{id}/turns",
        "/v1/openapi.json",
        "/v1/host/{action}",
    ] {
        assert!(paths.contains(&path.to_owned()), "{path} is documented");
    }

    for path in &paths {
        let uri = concrete(path);
        for method in METHODS {
            let status = status_of(&h, method, &uri, None).await;
            match operations.get(&((*path).clone(), method.to_owned())) {
                // Documented: routed, so it reaches its guard (or, public, its handler).
                Some(op) => {
                    let guarded = security(op).iter().any(|(name, _)| !name.is_empty());
                    if guarded {
                        assert_eq!(
                            status,
                            StatusCode::UNAUTHORIZED,
                            "{method} {path}: documented as guarded, so it is routed and refuses no credentials"
                        );
                    } else {
                        assert!(
                            status != StatusCode::NOT_FOUND
                                && status != StatusCode::METHOD_NOT_ALLOWED,
                            "{method} {path}: documented but not served ({status})"
                        );
                    }
                }
                // Not documented: the router must not serve it either.
                None => assert_eq!(
                    status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path}: served but not documented"
                ),
            }
        }
    }
}

#[tokio::test]
async fn the_admin_role_in_the_document_is_the_one_enforced() {
    let h = harness().await;
    let doc = document(&h).await;
    let client = h.client_key("default").await;
    for ((path, method), op) in operations(&doc) {
        let Some((_, roles)) = security(&op)
            .into_iter()
            .find(|(name, _)| name == "api_key")
        else {
            continue;
        };
        let status = status_of(&h, &method, &concrete(&path), Some(&client)).await;
        if roles.iter().any(|r| r == "admin") {
            assert_eq!(
                status,
                StatusCode::FORBIDDEN,
                "{method} {path}: documented admin-only, refused to a client key"
            );
            assert!(
                op["responses"]["403"].is_object(),
                "{method} {path}: the refusal is documented"
            );
        } else {
            assert_ne!(
                status,
                StatusCode::FORBIDDEN,
                "{method} {path}: documented for client keys, refused to one"
            );
        }
    }
}

/// A route added beside the route table (`.route("/v1/…", …)`) would be served without being
/// documented, and no request above would find it. The router construction has no such
/// call; this keeps it that way.
#[test]
fn no_route_is_added_beside_the_route_table() {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let mut files = Vec::new();
    let mut dirs = vec![std::path::PathBuf::from(src)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    for file in files {
        let compact = code_of(&std::fs::read_to_string(&file).expect("source"));
        for needle in [".route(\"/v1", ".route_service(\"/v1", ".nest(\"/v1"] {
            assert!(
                !compact.contains(needle),
                "{}: a `/v1` route outside `routes!` is not in the OpenAPI document; declare it \
                 with `#[utoipa::path]` and add it to `route_table` (see sb_gateway's docs)",
                file.display()
            );
        }
    }
    let compact = code_of(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
            .expect("lib.rs"),
    );
    assert!(
        !compact.contains(".route("),
        "src/lib.rs: every route of the router goes through `routes!`"
    );
}

/// The code of a source file without comment lines and whitespace.
fn code_of(source: &str) -> String {
    source
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .flat_map(str::split_whitespace)
        .collect()
}
