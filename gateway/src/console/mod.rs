//! The web console (SPEC §10.1): `GET /` and `GET /console/{file}`, a small single-page
//! application served from files compiled into the binary.
//!
//! # Why it looks like this
//! - **No build step, no CDN.** The assets under `assets/` are plain HTML, CSS and ES
//!   modules, embedded with `include_bytes!` (as Meilisearch, mdBook and Zola embed theirs):
//!   the binary is the whole deployment and the console works offline. Editing a file and
//!   rebuilding the gateway is the whole front-end workflow.
//! - **No authentication for the assets.** They are the same for everyone and hold no data;
//!   every call the page makes goes to `/v1` with `Authorization: Bearer <key>`, the key typed
//!   at sign-in and kept in the tab's `sessionStorage` only.
//! - **Streams without a key in a URL.** `EventSource` cannot send headers, so the page reads
//!   the SSE endpoints (`/v1/runs/{id}/stream`) with `fetch` and parses the frames itself,
//!   resuming after a dropped connection with `after_sequence` = the last sequence it showed
//!   (no gap, no duplicate: the stream's contract, see [`crate::stream`]).
//! - **A strict Content-Security-Policy.** Scripts, styles and connections come from this
//!   origin only, nothing inline (the HTML has no inline script or style, so the policy can
//!   forbid them), no framing (`frame-ancestors 'none'`); `nosniff` and `no-referrer` too.
//!
//! These routes are outside `/v1`, so they are not part of the API (nor of its OpenAPI
//! document), and no API key is asked for. An unknown `/console/…` file is a `404` (which the
//! gateway's error layer answers in its one JSON shape, like every other error).

use axum::Router;
use axum::extract::Path;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
    X_FRAME_OPTIONS,
};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// The policy of every console response (see the module docs).
pub const CONTENT_SECURITY_POLICY_VALUE: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// One embedded file.
struct Asset {
    /// The name under `/console/`.
    name: &'static str,
    /// Its `Content-Type`.
    content_type: &'static str,
    /// Its bytes.
    body: &'static [u8],
}

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// The page itself, answered at `/`.
const INDEX: Asset = Asset {
    name: "index.html",
    content_type: HTML,
    body: include_bytes!("assets/index.html"),
};

/// Every file under `/console/`.
const ASSETS: &[Asset] = &[
    INDEX,
    Asset {
        name: "console.css",
        content_type: CSS,
        body: include_bytes!("assets/console.css"),
    },
    Asset {
        name: "app.js",
        content_type: JS,
        body: include_bytes!("assets/app.js"),
    },
    Asset {
        name: "api.js",
        content_type: JS,
        body: include_bytes!("assets/api.js"),
    },
    Asset {
        name: "sse.js",
        content_type: JS,
        body: include_bytes!("assets/sse.js"),
    },
    Asset {
        name: "items.js",
        content_type: JS,
        body: include_bytes!("assets/items.js"),
    },
    Asset {
        name: "chat.js",
        content_type: JS,
        body: include_bytes!("assets/chat.js"),
    },
    Asset {
        name: "runs.js",
        content_type: JS,
        body: include_bytes!("assets/runs.js"),
    },
    Asset {
        name: "resources.js",
        content_type: JS,
        body: include_bytes!("assets/resources.js"),
    },
    Asset {
        name: "dom.js",
        content_type: JS,
        body: include_bytes!("assets/dom.js"),
    },
];

/// The console's routes: `GET /` (the page) and `GET /console/{file}` (its assets). Generic
/// over the state so it merges into the gateway's router without touching it.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(index))
        .route("/console/{file}", get(asset))
}

async fn index() -> Response {
    serve(&INDEX)
}

async fn asset(Path(file): Path<String>) -> Response {
    match find(&file) {
        Some(asset) => serve(asset),
        None => with_security_headers(
            (
                StatusCode::NOT_FOUND,
                [(CONTENT_TYPE, "text/plain; charset=utf-8")],
                "no such console file\n",
            )
                .into_response(),
        ),
    }
}

/// The embedded file called `name`, if any (names are flat: no directories).
fn find(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|asset| asset.name == name)
}

fn serve(asset: &'static Asset) -> Response {
    let response = (
        [
            (CONTENT_TYPE, asset.content_type),
            // The files change with the binary: the browser revalidates instead of keeping a
            // stale console after an upgrade.
            (CACHE_CONTROL, "no-cache"),
        ],
        asset.body,
    )
        .into_response();
    with_security_headers(response)
}

fn with_security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let fixed: [(HeaderName, &'static str); 4] = [
        (CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY_VALUE),
        (X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (X_FRAME_OPTIONS, "DENY"),
        (REFERRER_POLICY, "no-referrer"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use axum::body::{Body, to_bytes};
    use axum::http::Request;
    use tower::ServiceExt as _;

    use super::*;

    async fn get(path: &str) -> Response {
        router::<()>()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn the_page_is_served_at_the_root_with_a_strict_policy() {
        let response = get("/").await;
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers[CONTENT_TYPE], HTML);
        let csp = headers[CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.contains("script-src 'self'"), "{csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(headers[X_CONTENT_TYPE_OPTIONS], "nosniff");
        let body = to_bytes(response.into_body(), usize::MAX).await.unwrap();
        let html = String::from_utf8(body.to_vec()).unwrap();
        assert!(html.contains(r#"<script type="module" src="/console/app.js">"#));
    }

    #[tokio::test]
    async fn every_asset_is_served_with_its_type() {
        for asset in ASSETS {
            let response = get(&format!("/console/{}", asset.name)).await;
            assert_eq!(response.status(), StatusCode::OK, "{}", asset.name);
            assert_eq!(response.headers()[CONTENT_TYPE], asset.content_type);
            assert!(!asset.body.is_empty(), "{}", asset.name);
        }
    }

    #[tokio::test]
    async fn an_unknown_file_is_a_plain_404() {
        let response = get("/console/nope.js").await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            response.headers()[CONTENT_TYPE],
            "text/plain; charset=utf-8"
        );
        assert_eq!(response.headers()[X_CONTENT_TYPE_OPTIONS], "nosniff");
    }

    /// The page may not rely on inline code: the policy forbids it.
    #[test]
    fn the_html_has_no_inline_script_or_style() {
        let html = std::str::from_utf8(INDEX.body).unwrap();
        assert!(!html.contains("<style"));
        assert!(!html.contains(" style="));
        let handler = html.split(" on").skip(1).find(|rest| {
            let name: String = rest.chars().take_while(char::is_ascii_lowercase).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(handler.is_none(), "inline event handler: on{handler:?}");
        for script in html.split("<script").skip(1) {
            assert!(
                script.trim_start().starts_with("type=\"module\" src="),
                "{script}"
            );
        }
    }

    /// Every module imported by another is embedded (a missing one would only show in a
    /// browser).
    #[test]
    fn every_imported_module_is_embedded() {
        for asset in ASSETS.iter().filter(|a| a.content_type == JS) {
            let text = std::str::from_utf8(asset.body).unwrap();
            for line in text.lines().filter(|l| l.starts_with("import ")) {
                let name = line
                    .rsplit_once("\"./")
                    .and_then(|(_, rest)| rest.split_once('"'))
                    .map(|(name, _)| name)
                    .unwrap_or_else(|| panic!("{}: unexpected import {line}", asset.name));
                assert!(find(name).is_some(), "{} imports {name}", asset.name);
            }
        }
    }
}
