//! The bad-input corpus (issue 15 item 3): generated bad requests against every route of a
//! real gateway (embedded mode, over TCP, so hyper's own refusals are exercised too).
//!
//! Cases come from one list of routes ([`ROUTES`]) and a seeded generator, so a failure
//! reproduces exactly: malformed and truncated JSON, wrong types, deep nesting, huge bodies,
//! invalid UTF-8 in paths, queries and bodies, header abuse (huge and many headers, bad
//! content types, duplicate and odd authorization), extreme limits and cursors, odd ids,
//! NUL and other control characters, injection-looking strings, and every method a route does
//! not serve. Each answer must be:
//!
//! - no `5xx`, within a per-request timeout (no crash, no hang);
//! - a refusal (`4xx`) in the one error shape: JSON `{code, message, request_id}` with a
//!   known code and the `request_id` of the `x-request-id` header; `405` with `Allow`.
//!
//! The only refusals allowed without a body are hyper's for bytes that are not HTTP/1 or a
//! head beyond hyper's ceilings (see `sb_gateway::error`, "Refusals below the router"):
//! those cases are marked [`Expect::Parser`] and must still be a `4xx` and close the
//! connection.
//!
//! A new route is added to [`ROUTES`] (one line); `every_registered_route_is_in_the_corpus`
//! fails until it is. Run: `cargo nextest run -p sb-tests --test bad_input` (add
//! `--no-capture` for the summary of cases per route and statuses).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sb_tests::{TestCluster, message};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The seed of the generator; change it to explore, keep it to reproduce.
const SEED: u64 = 0x5b_15_03;

/// Longest a single request may take before it counts as a hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Requests in flight at once.
const CONCURRENCY: usize = 6;

/// The gateway's body limit in this suite (`gateway.max_body_bytes`).
const MAX_BODY: usize = 256 * 1024;

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    /// An API key (admin routes included: the suite's key is an admin key).
    Key,
    /// The remote Host API: a run token, never an API key.
    RunToken,
    /// No authentication.
    None,
}

/// One route of the gateway: its path template (`{name}` parameters), the methods it serves,
/// a well-formed body to mutate for the methods that take one, and who may call it.
struct Route {
    path: &'static str,
    methods: &'static [&'static str],
    body: fn() -> Option<Value>,
    auth: Auth,
}

const fn route(
    path: &'static str,
    methods: &'static [&'static str],
    body: fn() -> Option<Value>,
) -> Route {
    Route {
        path,
        methods,
        body,
        auth: Auth::Key,
    }
}

fn no_body() -> Option<Value> {
    None
}

/// Every route of the gateway. Add new routes here.
const ROUTES: &[Route] = &[
    route("/v1/events", &["POST"], || Some(message("corpus", "hello"))),
    route("/v1/events/{id}", &["GET"], no_body),
    route("/v1/events/{id}/wait", &["GET"], no_body),
    route("/v1/runs", &["GET"], no_body),
    route("/v1/runs/{id}", &["GET"], no_body),
    route("/v1/runs/{id}/events", &["GET"], no_body),
    route("/v1/runs/{id}/cancel", &["POST"], || Some(json!({}))),
    route("/v1/runs/{id}/stream", &["GET"], no_body),
    route("/v1/conversations/{id}/transcript", &["GET"], no_body),
    route("/v1/conversations/{id}/stream", &["GET"], no_body),
    route("/v1/sessions", &["GET", "POST"], || {
        Some(json!({"agent_id": "agent-1", "metadata": {"k": "v"}}))
    }),
    route("/v1/sessions/{id}", &["GET", "DELETE"], no_body),
    route("/v1/sessions/{id}/history", &["GET"], no_body),
    route("/v1/sessions/{id}/turns", &["POST"], || {
        Some(json!({"idempotency_key": "k-1", "text": "hi"}))
    }),
    route("/v1/turns/{id}", &["GET"], no_body),
    route("/v1/turns/{id}/events", &["GET"], no_body),
    route("/v1/turns/{id}/wait", &["GET"], no_body),
    route("/v1/turns/{id}/cancel", &["POST"], || Some(json!({}))),
    route("/v1/runners", &["GET"], no_body),
    route("/v1/agents", &["GET", "POST"], || {
        Some(
            json!({"name": "corpus", "runner_id": "plugin:t/t/t", "scope": {"bot_id": "corpus"}, "routing": "direct"}),
        )
    }),
    route("/v1/agents/{id}", &["GET", "PATCH", "DELETE"], || {
        Some(json!({"description": "d", "enabled": true}))
    }),
    route("/v1/schedules", &["GET", "POST"], || {
        Some(
            json!({"name": "s", "kind": "interval", "spec": "15m", "event": message("corpus", "tick")}),
        )
    }),
    route("/v1/schedules/{id}", &["GET", "PATCH", "DELETE"], || {
        Some(json!({"name": "s2", "spec": "30m", "enabled": false}))
    }),
    route("/v1/models", &["GET", "POST"], || {
        Some(
            json!({"name": "m", "kind": "llm", "base_url": "http://127.0.0.1:9/v1", "model_name": "x"}),
        )
    }),
    route("/v1/tools", &["GET", "POST"], || {
        Some(
            json!({"name": "t", "description": "d", "url": "http://127.0.0.1:9/tool", "parameters": {"type": "object"}}),
        )
    }),
    route("/v1/knowledge-bases", &["GET", "POST"], || {
        Some(json!({"name": "kb", "description": "d"}))
    }),
    route("/v1/models/{id}", &["GET", "PATCH", "DELETE"], || {
        Some(json!({"model_name": "y", "base_url": "http://127.0.0.1:9/v2"}))
    }),
    route("/v1/tools/{id}", &["GET", "PATCH", "DELETE"], || {
        Some(json!({"description": "d2", "timeout_ms": 1000}))
    }),
    route(
        "/v1/knowledge-bases/{id}",
        &["GET", "PATCH", "DELETE"],
        || Some(json!({"description": "d2"})),
    ),
    route(
        "/v1/knowledge-bases/{kb_id}/documents",
        &["GET", "POST"],
        || Some(json!({"title": "t", "text": "some text"})),
    ),
    route(
        "/v1/knowledge-bases/{kb_id}/documents/{id}",
        &["PATCH", "DELETE"],
        || Some(json!({"title": "t2", "text": "other text"})),
    ),
    route("/v1/keys", &["GET", "POST"], || {
        Some(json!({"name": "k", "role": "client"}))
    }),
    route("/v1/keys/{id}", &["DELETE"], no_body),
    route("/v1/artifacts", &["POST"], || {
        Some(json!({"name": "a.txt", "content_type": "text/plain", "content_base64": "aGk="}))
    }),
    route("/v1/artifacts/{id}", &["GET"], no_body),
    route("/v1/artifacts/{id}/content", &["GET"], no_body),
    route("/v1/openapi.json", &["GET"], no_body),
    Route {
        path: "/v1/host/{action}",
        methods: &["POST"],
        body: || Some(json!({"run_id": "r", "params": {}})),
        auth: Auth::RunToken,
    },
    Route {
        path: "/",
        methods: &["GET"],
        body: no_body,
        auth: Auth::None,
    },
    Route {
        path: "/console/{file}",
        methods: &["GET"],
        body: no_body,
        auth: Auth::None,
    },
    Route {
        path: "/healthz",
        methods: &["GET"],
        body: no_body,
        auth: Auth::None,
    },
    Route {
        path: "/readyz",
        methods: &["GET"],
        body: no_body,
        auth: Auth::None,
    },
    Route {
        path: "/metrics",
        methods: &["GET"],
        body: no_body,
        auth: Auth::None,
    },
];

/// What a case's answer may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Anything but a `5xx`; a refusal in the one shape.
    Structured,
    /// `405` with `Allow`, in the one shape.
    MethodNotAllowed,
    /// Not HTTP/1, or a head beyond hyper's ceilings: hyper's own bare `4xx`, then the
    /// connection closes.
    Parser,
}

/// One generated request.
struct Case {
    route: &'static str,
    kind: &'static str,
    request: Vec<u8>,
    expect: Expect,
}

/// Ids of every flavour: empty-ish, long, NUL and control characters (percent-encoded),
/// invalid UTF-8, traversal, injection, numbers, unicode.
const ODD_IDS: &[&str] = &[
    "x",
    "-1",
    "0",
    "99999999999999999999999999",
    "%00",
    "a%00b",
    "%01%02%1F%7F",
    "%0A%0D",
    "%FF%FE",
    "%C3%28",
    "%ED%A0%80",
    "..",
    "..%2F..%2Fetc%2Fpasswd",
    "%2E%2E%2F%2E%2E%2F",
    "%27%20OR%201%3D1%20--",
    "1%3BDROP%20TABLE%20runs",
    "%7B%7B7*7%7D%7D",
    "%24%7Bjndi%3Aldap%3A%2F%2Fx%7D",
    "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
    "%F0%9F%92%A5",
    "null",
    "%20",
    "a%2Fb",
    "00000000-0000-0000-0000-000000000000",
    "0190b8d2-0000-7000-8000-000000000000",
];

/// Query strings of every flavour, for the `GET` routes.
const ODD_QUERIES: &[&str] = &[
    "limit=-1",
    "limit=0",
    "limit=99999999999999999999999",
    "limit=abc",
    "limit=1e3",
    "limit=1&limit=2",
    "limit=%00",
    "cursor=garbage",
    "cursor=%FF%FE",
    "cursor=-1",
    "cursor=%27%20OR%201%3D1",
    "cursor=eyJ4IjoxfQ",
    "after_sequence=-5",
    "after_sequence=18446744073709551616",
    "after_sequence=abc",
    "timeout_ms=-1",
    "timeout_ms=99999999999999",
    "timeout_ms=1",
    "status=bogus",
    "conversation_id=%00",
    "conversation_id=%FF",
    "stream=maybe",
    "%00=1",
    "%FF=%FE",
    "a[b]=c",
    "&&&===",
    "limit",
];

/// Strings to put where a string is expected.
const ODD_STRINGS: &[&str] = &[
    "",
    "\u{1}\u{2}\u{1b}[31m",
    "\u{7f}\u{85}\u{2028}",
    "' OR '1'='1",
    "1; DROP TABLE runs; --",
    "../../etc/passwd",
    "{{7*7}}${7*7}<%= 7*7 %>",
    "${jndi:ldap://x/a}",
    "<script>alert(1)</script>",
    "\u{feff}bom",
    "\u{d7ff}\u{e000}\u{10ffff}",
];

/// `path` with every `{param}` replaced by `id`.
fn fill(path: &str, id: &str) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .map_or(rest.len(), |e| start + e + 1);
        out.push_str(id);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A plausible id for a path (so that the query and body cases reach the handler).
fn plain_target(route: &Route) -> String {
    let id = if route.path.contains("{action}") {
        "get_state"
    } else {
        "0190b8d2-0000-7000-8000-000000000000"
    };
    fill(route.path, id)
}

/// Builds raw HTTP/1.1 requests.
struct RequestBuilder {
    host: String,
    key: String,
}

impl RequestBuilder {
    fn build(
        &self,
        method: &str,
        target: &[u8],
        auth: Auth,
        headers: &[(&str, Vec<u8>)],
        body: Option<&[u8]>,
        content_type: Option<&str>,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(target);
        out.extend_from_slice(b" HTTP/1.1\r\n");
        out.extend_from_slice(format!("host: {}\r\nconnection: close\r\n", self.host).as_bytes());
        match auth {
            Auth::Key => {
                out.extend_from_slice(format!("authorization: Bearer {}\r\n", self.key).as_bytes())
            }
            Auth::RunToken => out.extend_from_slice(b"authorization: Bearer not-a-run-token\r\n"),
            Auth::None => {}
        }
        for (name, value) in headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        if let Some(body) = body {
            if let Some(content_type) = content_type {
                out.extend_from_slice(format!("content-type: {content_type}\r\n").as_bytes());
            }
            out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(body);
        } else {
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    fn json(&self, method: &str, target: &str, auth: Auth, body: &[u8]) -> Vec<u8> {
        self.build(
            method,
            target.as_bytes(),
            auth,
            &[],
            Some(body),
            Some("application/json"),
        )
    }
}

/// Mutations of a well-formed JSON body.
fn body_mutations(template: &Value, rng: &mut StdRng) -> Vec<(&'static str, Vec<u8>)> {
    let text = serde_json::to_vec(template).unwrap();
    let mut out: Vec<(&'static str, Vec<u8>)> = vec![
        ("empty body", Vec::new()),
        ("json null", b"null".to_vec()),
        ("json array", b"[]".to_vec()),
        ("json string", b"\"x\"".to_vec()),
        ("json number", b"1e400".to_vec()),
        ("not json", b"hello".to_vec()),
        ("trailing garbage", [text.clone(), b"}}".to_vec()].concat()),
        ("two documents", [text.clone(), text.clone()].concat()),
        (
            "bom prefix",
            [b"\xef\xbb\xbf".to_vec(), text.clone()].concat(),
        ),
        (
            "invalid utf-8 in a string",
            br#"{"name": "\xff\xfe", "text": "\xc3\x28"}"#.to_vec(),
        ),
        ("raw nul byte", b"{\"name\": \"a\0b\"}".to_vec()),
        (
            "escaped nul",
            br#"{"name": "a\u0000b", "text": "\u0000"}"#.to_vec(),
        ),
        (
            "lone surrogate",
            br#"{"name": "\ud800", "text": "\udfff"}"#.to_vec(),
        ),
        ("bad escape", br#"{"name": "\x41"}"#.to_vec()),
        (
            "deep array",
            [vec![b'['; 20_000], vec![b']'; 20_000]].concat(),
        ),
        ("deep object", {
            let mut v = b"{\"a\":".repeat(5_000);
            v.extend_from_slice(b"1");
            v.extend(std::iter::repeat_n(b'}', 5_000));
            v
        }),
        ("duplicate keys", {
            let mut v = text.clone();
            if v.len() > 2 {
                let inner = v[1..v.len() - 1].to_vec();
                v.truncate(v.len() - 1);
                v.push(b',');
                v.extend_from_slice(&inner);
                v.push(b'}');
            }
            v
        }),
        (
            "huge number",
            br#"{"limit": 123456789012345678901234567890, "name": 1e308}"#.to_vec(),
        ),
        ("wide object", {
            let fields: Vec<String> = (0..5_000).map(|i| format!("\"f{i}\":{i}")).collect();
            format!("{{{}}}", fields.join(",")).into_bytes()
        }),
    ];
    // Truncated at random points.
    for _ in 0..4 {
        if text.len() > 1 {
            let at = rng.random_range(1..text.len());
            out.push(("truncated json", text[..at].to_vec()));
        }
    }
    // Each top-level field replaced by a value of another type, or by an odd string.
    if let Value::Object(map) = template {
        let wrong: [Value; 7] = [
            json!(null),
            json!(true),
            json!(-1),
            json!(1.5e300),
            json!([1, "a", null]),
            json!({"nested": {"deeper": []}}),
            json!("x".repeat(70_000)),
        ];
        for field in map.keys() {
            for value in &wrong {
                let mut mutated = map.clone();
                mutated.insert(field.clone(), value.clone());
                out.push(("wrong type", serde_json::to_vec(&mutated).unwrap()));
            }
            let mut mutated = map.clone();
            mutated.insert(
                field.clone(),
                json!(ODD_STRINGS[rng.random_range(0..ODD_STRINGS.len())]),
            );
            out.push(("odd string", serde_json::to_vec(&mutated).unwrap()));
            let mut mutated = map.clone();
            mutated.remove(field);
            out.push(("missing field", serde_json::to_vec(&mutated).unwrap()));
        }
        let mut mutated = map.clone();
        mutated.insert("unknown_field".into(), json!({"x": 1}));
        out.push(("unknown field", serde_json::to_vec(&mutated).unwrap()));
    }
    out
}

/// Every case for every route.
fn cases(builder: &RequestBuilder) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(SEED);
    let mut cases = Vec::new();
    let all_methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "FOO"];
    for route in ROUTES {
        let target = plain_target(route);
        let push = |cases: &mut Vec<Case>, kind, request, expect| {
            cases.push(Case {
                route: route.path,
                kind,
                request,
                expect,
            });
        };
        // Methods the route does not serve.
        for method in all_methods {
            if !route.methods.contains(&method) && method != "HEAD" {
                let request = builder.build(method, target.as_bytes(), route.auth, &[], None, None);
                push(
                    &mut cases,
                    "unserved method",
                    request,
                    Expect::MethodNotAllowed,
                );
            }
        }
        for method in route.methods {
            let body = (route.body)().filter(|_| *method != "GET" && *method != "DELETE");
            // Odd ids.
            if route.path.contains('{') {
                for id in ODD_IDS {
                    let path = fill(route.path, id);
                    let request = match &body {
                        Some(body) => builder.json(
                            method,
                            &path,
                            route.auth,
                            &serde_json::to_vec(body).unwrap(),
                        ),
                        None => builder.build(method, path.as_bytes(), route.auth, &[], None, None),
                    };
                    push(&mut cases, "odd id", request, Expect::Structured);
                }
                let long = "x".repeat(rng.random_range(300..4_000));
                let request = builder.build(
                    method,
                    fill(route.path, &long).as_bytes(),
                    route.auth,
                    &[],
                    None,
                    None,
                );
                push(&mut cases, "long id", request, Expect::Structured);
                // Raw bytes no HTTP client sends: hyper refuses them.
                for raw in [&b"a\xffb"[..], b"a b", b"a\x01b"] {
                    let mut path = fill(route.path, "@").into_bytes();
                    let at = path.iter().position(|&b| b == b'@').unwrap();
                    path.splice(at..=at, raw.iter().copied());
                    let request = builder.build(method, &path, route.auth, &[], None, None);
                    push(
                        &mut cases,
                        "raw bytes in the target",
                        request,
                        Expect::Parser,
                    );
                }
            }
            // Queries (on every method: a handler must not choke on one it ignores).
            for query in ODD_QUERIES {
                let path = format!("{target}?{query}");
                let request = builder.build(method, path.as_bytes(), route.auth, &[], None, None);
                push(&mut cases, "odd query", request, Expect::Structured);
            }
            let long_query = format!(
                "{target}?cursor={}",
                "a".repeat(rng.random_range(2_000..7_000))
            );
            let request = builder.build(method, long_query.as_bytes(), route.auth, &[], None, None);
            push(&mut cases, "long query", request, Expect::Structured);
            let too_long = format!("{target}?cursor={}", "a".repeat(10_000));
            let request = builder.build(method, too_long.as_bytes(), route.auth, &[], None, None);
            push(
                &mut cases,
                "request target over the limit",
                request,
                Expect::Structured,
            );
            // Headers.
            for (kind, auth, headers) in header_cases(builder, &mut rng) {
                let auth = if auth { route.auth } else { Auth::None };
                let request = builder.build(method, target.as_bytes(), auth, &headers, None, None);
                push(&mut cases, kind, request, Expect::Structured);
            }
            let huge = vec![("x-huge", vec![b'a'; 2 * 1024 * 1024])];
            let request = builder.build(method, target.as_bytes(), route.auth, &huge, None, None);
            push(
                &mut cases,
                "head beyond hyper's ceiling",
                request,
                Expect::Parser,
            );
            let request = builder.build(
                method,
                target.as_bytes(),
                route.auth,
                &[("x-bad", b"a\x01b".to_vec())],
                None,
                None,
            );
            push(
                &mut cases,
                "control byte in a header value",
                request,
                Expect::Parser,
            );
            // Framing no HTTP/1 server may guess at (RFC 9112 §6.3): hyper refuses it.
            for (kind, name, value) in [
                ("unparsable content-length", "content-length", &b"abc"[..]),
                ("negative content-length", "content-length", b"-1"),
                (
                    "transfer-encoding without chunked",
                    "transfer-encoding",
                    b"gzip",
                ),
                ("control byte in content-type", "content-type", b"\x7f"),
            ] {
                let request = builder.build(
                    method,
                    target.as_bytes(),
                    route.auth,
                    &[(name, value.to_vec())],
                    None,
                    None,
                );
                push(&mut cases, kind, request, Expect::Parser);
            }
            // Bodies.
            let Some(template) = body else { continue };
            for (kind, bytes) in body_mutations(&template, &mut rng) {
                let request = builder.json(method, &target, route.auth, &bytes);
                push(&mut cases, kind, request, Expect::Structured);
            }
            let good = serde_json::to_vec(&template).unwrap();
            for content_type in [
                None,
                Some("text/plain"),
                Some("application/x-www-form-urlencoded"),
                Some("application/json; charset=latin1"),
                Some("multipart/form-data; boundary=x"),
                Some("application/json+x; q=\""),
            ] {
                let request = builder.build(
                    method,
                    target.as_bytes(),
                    route.auth,
                    &[],
                    Some(&good),
                    content_type,
                );
                push(&mut cases, "content type", request, Expect::Structured);
            }
            let huge = vec![b' '; MAX_BODY * 2];
            let request = builder.json(method, &target, route.auth, &huge);
            push(
                &mut cases,
                "body over the limit",
                request,
                Expect::Structured,
            );
            // Chunked, over the limit: no content-length to refuse it early.
            let mut request = builder.build(
                method,
                target.as_bytes(),
                route.auth,
                &[
                    ("content-type", b"application/json".to_vec()),
                    ("transfer-encoding", b"chunked".to_vec()),
                ],
                None,
                None,
            );
            for _ in 0..(MAX_BODY * 2 / 65_536) {
                request.extend_from_slice(b"10000\r\n");
                request.extend(std::iter::repeat_n(b' ', 65_536));
                request.extend_from_slice(b"\r\n");
            }
            request.extend_from_slice(b"0\r\n\r\n");
            push(
                &mut cases,
                "chunked body over the limit",
                request,
                Expect::Structured,
            );
            // Declared longer than sent: the body never completes (the request timeout answers).
            let mut request = builder.build(
                method,
                target.as_bytes(),
                route.auth,
                &[
                    ("content-type", b"application/json".to_vec()),
                    ("content-length", b"100".to_vec()),
                ],
                None,
                None,
            );
            request.extend_from_slice(b"{\"a\":");
            push(
                &mut cases,
                "short body, then close",
                request,
                Expect::Structured,
            );
        }
    }
    cases
}

/// One header-abuse case: its kind, whether the route's own auth is sent too, the headers.
type HeaderCase = (&'static str, bool, Vec<(&'static str, Vec<u8>)>);

/// Header abuse.
fn header_cases(builder: &RequestBuilder, rng: &mut StdRng) -> Vec<HeaderCase> {
    let many: Vec<(&'static str, Vec<u8>)> = (0..150)
        .map(|i| ("x-many", format!("{i}").into_bytes()))
        .collect();
    vec![
        ("no authorization", false, vec![]),
        (
            "empty bearer",
            false,
            vec![("authorization", b"Bearer ".to_vec())],
        ),
        (
            "basic auth",
            false,
            vec![("authorization", b"Basic dXNlcjpwYXNz".to_vec())],
        ),
        (
            "bearer without scheme",
            false,
            vec![("authorization", builder.key.clone().into_bytes())],
        ),
        (
            "lowercase bearer",
            false,
            vec![(
                "authorization",
                format!("bearer {}", builder.key).into_bytes(),
            )],
        ),
        (
            "unknown key",
            false,
            vec![("authorization", b"Bearer sk_live_not_a_key".to_vec())],
        ),
        (
            "non-ascii key",
            false,
            vec![("authorization", b"Bearer \xff\xfe".to_vec())],
        ),
        (
            "injection key",
            false,
            vec![("authorization", b"Bearer ' OR '1'='1".to_vec())],
        ),
        (
            "huge key",
            false,
            vec![(
                "authorization",
                format!("Bearer {}", "k".repeat(rng.random_range(20_000..60_000))).into_bytes(),
            )],
        ),
        (
            "duplicate authorization",
            true,
            vec![("authorization", b"Bearer other".to_vec())],
        ),
        ("many headers", true, many),
        (
            "headers over the limit",
            true,
            vec![("x-big", vec![b'a'; 70 * 1024])],
        ),
        (
            "garbage request id",
            true,
            vec![("x-request-id", b"<script> \xff".to_vec())],
        ),
        (
            "long request id",
            true,
            vec![("x-request-id", vec![b'r'; 5_000])],
        ),
        (
            "two request ids",
            true,
            vec![
                ("x-request-id", b"a".to_vec()),
                ("x-request-id", b"b".to_vec()),
            ],
        ),
        (
            "odd accept",
            true,
            vec![("accept", b"text/html;q=0.1, */*;q=abc".to_vec())],
        ),
        (
            "last-event-id garbage",
            true,
            vec![("last-event-id", b"-99999999999999999999".to_vec())],
        ),
        (
            "range garbage",
            true,
            vec![("range", b"bytes=99999999999999999999-1".to_vec())],
        ),
        (
            "idempotency key odd",
            true,
            vec![("idempotency-key", b"\xff../../'".to_vec())],
        ),
        (
            "idempotency key long",
            true,
            vec![("idempotency-key", vec![b'k'; 4_000])],
        ),
        (
            "expect continue",
            true,
            vec![("expect", b"100-continue".to_vec())],
        ),
    ]
}

/// What came back for one case.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// Sends one raw request and reads the answer (the whole body for a refusal, the head only
/// for a success, which may be a stream).
async fn send(addr: &str, request: Vec<u8>) -> Result<Answer, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut reader, mut writer) = stream.into_split();
    // Written concurrently: the gateway may answer (and stop reading) before it has all.
    let write = tokio::spawn(async move {
        let _ = writer.write_all(&request).await;
        // Keep the write half open until the answer is read (a half-close could read as the
        // client giving up).
        writer
    });
    let mut buf = Vec::new();
    let mut chunk = vec![0; 64 * 1024];
    let head_end = loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            break end;
        }
        let n = match reader.read(&mut chunk).await {
            Ok(n) => n,
            Err(e) if buf.is_empty() => return Err(format!("read: {e}")),
            Err(e) => return Err(format!("read after {} bytes: {e}", buf.len())),
        };
        if n == 0 {
            return Err(format!(
                "connection closed after {} bytes: {:?}",
                buf.len(),
                String::from_utf8_lossy(&buf)
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line: {head}"))?;
    let headers: Vec<(String, Vec<u8>)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().as_bytes().to_vec()))
        .collect();
    let mut answer = Answer {
        status,
        headers,
        body: buf[head_end + 4..].to_vec(),
    };
    if status < 400 {
        drop(write);
        return Ok(answer);
    }
    let length = answer
        .header("content-length")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse::<usize>().ok());
    loop {
        if length.is_some_and(|len| answer.body.len() >= len) {
            break;
        }
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.body.extend_from_slice(&chunk[..n]),
        }
    }
    if let Some(len) = length {
        answer.body.truncate(len);
    }
    drop(write);
    Ok(answer)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

const CODES: &[&str] = &[
    "invalid_argument",
    "unauthorized",
    "not_found",
    "conflict",
    "payload_too_large",
    "rate_limited",
    "deadline_exceeded",
    "budget_exceeded",
    "unavailable",
    "runtime_error",
    "internal",
    "cancelled",
    "tool_outcome_unknown",
    "permission_denied",
];

/// Why an answer breaks the rules, if it does.
fn check(case: &Case, answer: &Answer) -> Option<String> {
    if answer.status >= 500 {
        return Some(format!(
            "{} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        ));
    }
    match case.expect {
        Expect::Parser => {
            return (!(400..500).contains(&answer.status))
                .then(|| format!("expected hyper's refusal, got {}", answer.status));
        }
        Expect::MethodNotAllowed => {
            if answer.status != 405 {
                return Some(format!(
                    "expected 405, got {} (if the route now serves this method, add it to ROUTES)",
                    answer.status
                ));
            }
            let allow = answer.header("allow").map(String::from_utf8_lossy);
            let route = ROUTES.iter().find(|r| r.path == case.route).unwrap();
            match allow {
                None => return Some("405 without allow".into()),
                Some(allow) => {
                    for method in route.methods {
                        if !allow.split(',').any(|m| m.trim() == *method) {
                            return Some(format!("allow `{allow}` lacks {method}"));
                        }
                    }
                }
            }
        }
        Expect::Structured => {}
    }
    let request_id = answer
        .header("x-request-id")
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let Some(request_id) = request_id else {
        return Some(format!("{} without x-request-id", answer.status));
    };
    if answer.status < 400 {
        return None;
    }
    let Ok(body) = serde_json::from_slice::<Value>(&answer.body) else {
        return Some(format!(
            "{}: body is not json: {:?}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        ));
    };
    let code = body["code"].as_str().unwrap_or_default();
    if !CODES.contains(&code) {
        return Some(format!("{}: unknown code in {body}", answer.status));
    }
    if body["message"].as_str().is_none_or(str::is_empty) {
        return Some(format!("{}: no message in {body}", answer.status));
    }
    if body["request_id"].as_str() != Some(request_id.as_str()) {
        return Some(format!(
            "{}: request_id {} is not the header's {request_id}",
            answer.status, body["request_id"]
        ));
    }
    None
}

/// The corpus: zero 5xx, no hang, every refusal structured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_refuses_bad_input_in_the_one_shape() {
    let cluster = TestCluster::builder()
        .config("gateway.max_body_bytes", MAX_BODY)
        .config("gateway.request_timeout", "3s")
        .config("limits.requests_per_second_per_key", 1_000_000)
        .config("limits.requests_burst_per_key", 1_000_000)
        .config("limits.streams_per_key", 10_000)
        .start()
        .await;
    let base = cluster.client().base_url().to_owned();
    let addr = base.trim_start_matches("http://").to_owned();
    let builder = RequestBuilder {
        host: addr.clone(),
        key: cluster.process().api_key().expect("a key").to_owned(),
    };
    let mut registered = BTreeSet::new();
    for route in ROUTES {
        if serves(&addr, &builder, route).await {
            registered.insert(route.path);
        }
    }
    let cases: Vec<Case> = cases(&builder)
        .into_iter()
        .filter(|case| registered.contains(case.route))
        .collect();
    let absent: Vec<&str> = ROUTES
        .iter()
        .map(|r| r.path)
        .filter(|p| !registered.contains(*p))
        .collect();
    if !absent.is_empty() {
        println!("routes in ROUTES the gateway does not register (skipped): {absent:?}");
    }
    let total = cases.len();
    let addr = Arc::new(addr);
    let results: Vec<(Case, Result<Answer, String>)> = futures::stream::iter(cases)
        .map(|case| {
            let addr = Arc::clone(&addr);
            async move {
                let answer =
                    match tokio::time::timeout(REQUEST_TIMEOUT, send(&addr, case.request.clone()))
                        .await
                    {
                        Ok(answer) => answer,
                        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?} (hang)")),
                    };
                (case, answer)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;

    let mut per_route: BTreeMap<&str, (usize, BTreeMap<u16, usize>)> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut parser_refusals = 0;
    for (case, answer) in &results {
        let entry = per_route.entry(case.route).or_default();
        entry.0 += 1;
        match answer {
            Ok(answer) => {
                *entry.1.entry(answer.status).or_default() += 1;
                if case.expect == Expect::Parser {
                    parser_refusals += 1;
                }
                if let Some(why) = check(case, answer) {
                    failures.push(format!("{} [{}]: {why}", case.route, case.kind));
                }
            }
            Err(error) => failures.push(format!("{} [{}]: {error}", case.route, case.kind)),
        }
    }
    println!(
        "bad-input corpus: {total} cases (seed {SEED:#x}), {parser_refusals} refused by hyper's parser"
    );
    for (route, (count, statuses)) in &per_route {
        let statuses: Vec<String> = statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
        println!("  {route:<42} {count:>5}  {}", statuses.join(" "));
    }
    // The gateway is still healthy after all of it.
    let health = send(
        &addr,
        builder.build("GET", b"/healthz", Auth::None, &[], None, None),
    )
    .await;
    assert!(matches!(&health, Ok(a) if a.status == 200), "{health:?}");
    let mut distinct: BTreeSet<String> = BTreeSet::new();
    failures.retain(|f| distinct.insert(f.clone()));
    assert!(
        failures.is_empty(),
        "{} of {total} cases broke the rules:\n{}",
        failures.len(),
        failures.join("\n")
    );
    cluster.shutdown().await;
}

/// Whether the running gateway has `route` (a request with a plain target is not answered by
/// the router's fallback, `404 no such route`).
async fn serves(addr: &str, builder: &RequestBuilder, route: &Route) -> bool {
    let request = builder.build(
        route.methods[0],
        plain_target(route).as_bytes(),
        route.auth,
        &[],
        None,
        None,
    );
    let answer = send(addr, request).await.expect("the gateway answers");
    let body: Value = serde_json::from_slice(&answer.body).unwrap_or_default();
    !(answer.status == 404 && body["message"] == "no such route")
}

/// The routes registered in the gateway's sources (`.route("…"` and utoipa `path = "…"`).
fn registered_routes() -> BTreeSet<String> {
    let dir = sb_tests::repo_dir().join("gateway").join("src");
    let mut found = BTreeSet::new();
    let mut stack = vec![dir];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            // Unit tests build routers of their own.
            let text = text.split("#[cfg(test)]").next().unwrap_or_default();
            for marker in [".route(", "path = ", "_PATH: &str = "] {
                let mut rest = text;
                while let Some(at) = rest.find(marker) {
                    rest = &rest[at + marker.len()..];
                    let trimmed = rest.trim_start();
                    if let Some(literal) = trimmed.strip_prefix('"') {
                        if let Some(end) = literal.find('"') {
                            let path = &literal[..end];
                            let plain = path
                                .bytes()
                                .all(|b| b.is_ascii_alphanumeric() || b"/{}_.-".contains(&b));
                            if path.starts_with('/') && plain {
                                found.insert(path.to_owned());
                            }
                        }
                    }
                }
            }
        }
    }
    found
}

/// A route the gateway registers but the corpus does not know fails here: add it to
/// [`ROUTES`].
#[test]
fn every_registered_route_is_in_the_corpus() {
    let known: BTreeSet<&str> = ROUTES.iter().map(|r| r.path).collect();
    let registered = registered_routes();
    assert!(
        registered.contains("/v1/events"),
        "the scan found the routes: {registered:?}"
    );
    let missing: Vec<&String> = registered
        .iter()
        .filter(|p| !known.contains(p.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "routes missing from ROUTES in bad_input.rs: {missing:?}"
    );
}
