//! The OpenAPI 3.1 description of the HTTP API, served at `GET /v1/openapi.json`.
//!
//! Nothing here is written by hand: every handler declares its method, path, parameters,
//! body and answers with `#[utoipa::path]`, the wire types derive `utoipa::ToSchema`, and the
//! router of [`crate::app`] is built from those same declarations (utoipa-axum's
//! `OpenApiRouter` with `routes!`, see `route_table` in `lib.rs`). A route therefore cannot be
//! served without being in the document, and the document cannot list a route that is not
//! served; `tests/openapi.rs` checks both against the real router.
//!
//! What this module adds is what the router construction knows and a handler does not: who
//! may call a group of routes ([`Access`], written as each operation's `security` with the
//! refusals it implies), the two security schemes, and the shared error answers.
//!
//! The document is served without an API key: it is the same for every workspace, shows no
//! data and no configuration, and code generators and API explorers fetch it before they
//! have a key. It is rendered once and served from memory, so answering it costs nothing.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::path::{Operation, PathItem, Paths};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Content, OpenApi, Ref, RefOr};
use utoipa::{Modify, ToSchema};

use crate::error::ErrorBody;

/// Name of the API-key security scheme (`Authorization: Bearer <api key>`).
pub const API_KEY: &str = "api_key";
/// Name of the run-token security scheme of the remote Host API.
pub const RUN_TOKEN: &str = "run_token";
/// The role an admin-only operation lists in its `api_key` requirement (OpenAPI 3.1 allows
/// role names there for non-OAuth schemes).
pub const ADMIN_ROLE: &str = "admin";

/// Who may call a group of routes. [`mark`] writes it into the document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No credentials (health, metrics, this document).
    Public,
    /// Any API key of the workspace.
    Client,
    /// An API key with the `admin` role; a `client` key gets `403 permission_denied`.
    Admin,
    /// The run token of an active run (the remote Host API), never an API key.
    RunToken,
}

/// The base document: info, tags, security schemes, the error answers every operation
/// shares. The router construction adds the paths.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Switchboard API",
        description = "The Switchboard gateway's HTTP API. Every `/v1` route takes \
            `Authorization: Bearer <api key>` unless its `security` says otherwise; errors \
            have one shape, `Error`, whose `code` decides the status. Lists page the same \
            way: `limit` and `cursor` in, `{items, next_cursor, has_more}` out.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    modifiers(&Shared),
    // Schemas only query parameters name (utoipa collects those of bodies on its own).
    components(schemas(sb_store::Direction)),
    tags(
        (name = "events", description = "Ingest and routing of events"),
        (name = "runs", description = "Runs, their results and streams"),
        (name = "conversations", description = "Conversation transcripts"),
        (name = "sessions", description = "Sessions of the turn API"),
        (name = "turns", description = "Turns: idempotent, resumable, cancellable"),
        (name = "agents", description = "Agents (admin to change)"),
        (name = "runners", description = "Registered runners (admin)"),
        (name = "schedules", description = "Schedules (admin)"),
        (name = "resources", description = "Models, tools and knowledge bases (admin)"),
        (name = "keys", description = "API keys (admin)"),
        (name = "host", description = "The remote Host API for runners outside a worker"),
        (name = "meta", description = "Health, readiness, metrics and this document"),
    )
)]
pub struct ApiDoc;

/// Adds the security schemes and the shared error answers to [`ApiDoc`].
struct Shared;

impl Modify for Shared {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            API_KEY,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A workspace API key (`switchboard keys create`). Operations that \
                         list the `admin` role need a key with that role.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            RUN_TOKEN,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The token of an active run (`ctx.runtime.metadata.host_api.token`).",
                    ))
                    .build(),
            ),
        );
        let mut schemas = Vec::new();
        <ErrorBody<'static> as ToSchema>::schemas(&mut schemas);
        schemas.push((
            <ErrorBody<'static> as ToSchema>::name().into_owned(),
            <ErrorBody<'static> as utoipa::PartialSchema>::schema(),
        ));
        components.schemas.extend(schemas);
        for (name, description) in SHARED_RESPONSES {
            components
                .responses
                .insert((*name).to_owned(), RefOr::T(error_response(description)));
        }
    }
}

/// The error answers in `components/responses`, referenced by [`mark`].
const SHARED_RESPONSES: &[(&str, &str)] = &[
    (
        "Error",
        "An error: `{code, message}` with the status of its code (`invalid_argument` 400 or \
         422, `not_found` 404, `conflict` 409, `payload_too_large` 413, `deadline_exceeded` \
         504, `unavailable` 503, `internal` 500, …)",
    ),
    (
        "Unauthorized",
        "`unauthorized`: missing or unknown credentials",
    ),
    (
        "PermissionDenied",
        "`permission_denied`: the API key has the `client` role; this operation needs `admin`",
    ),
    (
        "RateLimited",
        "`rate_limited`: the key's request rate or open streams are used up; see `Retry-After`",
    ),
];

fn error_response(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            Content::new(Some(Ref::from_schema_name(
                <ErrorBody<'static> as ToSchema>::name(),
            ))),
        )
        .build()
}

/// Records `access` on every operation of `paths` that has no `security` yet (so an
/// operation marked [`Access::Admin`] first keeps it when its group is marked
/// [`Access::Client`]), with the refusals it implies and the shared `default` error.
pub fn mark(paths: &mut Paths, access: Access) {
    for item in paths.paths.values_mut() {
        for operation in operations_mut(item) {
            if operation.security.is_some() {
                continue;
            }
            operation.security = Some(vec![match access {
                Access::Public => SecurityRequirement::default(),
                Access::Client => SecurityRequirement::new(API_KEY, Vec::<String>::new()),
                Access::Admin => SecurityRequirement::new(API_KEY, [ADMIN_ROLE]),
                Access::RunToken => SecurityRequirement::new(RUN_TOKEN, Vec::<String>::new()),
            }]);
            let refusals: &[(&str, &str)] = match access {
                Access::Public => &[],
                Access::Client => &[("401", "Unauthorized"), ("429", "RateLimited")],
                Access::Admin => &[
                    ("401", "Unauthorized"),
                    ("403", "PermissionDenied"),
                    ("429", "RateLimited"),
                ],
                Access::RunToken => &[("401", "Unauthorized")],
            };
            for (status, name) in refusals.iter().chain(&[("default", "Error")]) {
                operation
                    .responses
                    .responses
                    .entry((*status).to_owned())
                    .or_insert_with(|| RefOr::Ref(Ref::from_response_name(*name)));
            }
        }
    }
}

/// The operations of a path item.
pub fn operations_mut(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// The document, rendered once from `route_table` in `lib.rs`.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    crate::openapi_document()
        .to_json()
        .unwrap_or_else(|error| format!(r#"{{"error": "cannot render the document: {error}"}}"#))
});

/// `GET /v1/openapi.json`: this API's OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "meta",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json"))
)]
pub async fn openapi_json() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
}
