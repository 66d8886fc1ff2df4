//! The in-process gateway the HTTP suites drive: the real router over an in-memory SQLite
//! store (migrated), the memory bus with the topology declared under a unique prefix, and
//! the memory session store, plus an admin API key of workspace `default`. Each suite adds
//! its own helpers in an `impl Harness` block of its own. [`Harness::sibling`] is a second
//! gateway process on the same database, bus and session store.

#![allow(dead_code)]

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, TopologyOptions, declare_topology};
use sb_common::session::memory::MemorySessionStore;
use sb_common::shutdown::Shutdown;
use sb_gateway::{AppState, GatewayDeps, GatewayOptions, app};
use sb_protocol::ids::WorkspaceId;
use sb_store::{ApiKeyRole, SqlStore, SqlStoreOptions, Stores};
use serde_json::Value;
use tower::ServiceExt;

/// One gateway and what it runs on. Dropping it stops the gateway's background tasks.
pub struct Harness {
    pub state: AppState,
    pub stores: Stores,
    pub bus: Arc<MemoryBus>,
    pub topology: Topology,
    pub sessions: Arc<MemorySessionStore>,
    /// An admin API key of workspace `default`.
    pub key: String,
    pub shutdown: Shutdown,
    /// What the gateway was started with (siblings get the same).
    pub options: GatewayOptions,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

impl Harness {
    /// A gateway with `options`.
    pub async fn start(options: GatewayOptions) -> Self {
        let options_for_siblings = options.clone();
        let store = SqlStore::connect(
            "sqlite::memory:",
            &SqlStoreOptions {
                migrate: true,
                ..SqlStoreOptions::default()
            },
        )
        .await
        .expect("sqlite");
        let stores = Stores::from_sql(store);
        let bus = Arc::new(MemoryBus::new());
        let topology = declare_topology(
            bus.as_ref(),
            &TopologyOptions {
                name_prefix: format!("test-{}.switchboard", uuid::Uuid::new_v4().simple()),
                ..TopologyOptions::default()
            },
        )
        .await
        .expect("topology");
        let shutdown = Shutdown::new();
        let sessions = Arc::new(MemorySessionStore::new());
        let deps = GatewayDeps {
            stores: stores.clone(),
            bus: bus.clone(),
            sessions: sessions.clone(),
            topology: topology.clone(),
        };
        let state = AppState::new(deps, options, shutdown.clone())
            .await
            .expect("state");
        let mut harness = Self {
            state,
            stores,
            bus,
            topology,
            sessions,
            key: String::new(),
            shutdown,
            options: options_for_siblings,
        };
        harness.key = harness.api_key("default").await;
        harness
    }

    /// Another gateway (its own state: key cache, limiters, delivery queue) on this one's
    /// database, bus and session store, as a second gateway process of a deployment.
    pub async fn sibling(&self) -> Self {
        let mut options = self.options.clone();
        options.gateway_id = format!("gw-sibling-{}", uuid::Uuid::new_v4().simple());
        let shutdown = Shutdown::new();
        let deps = GatewayDeps {
            stores: self.stores.clone(),
            bus: self.bus.clone(),
            sessions: self.sessions.clone(),
            topology: self.topology.clone(),
        };
        let state = AppState::new(deps, options.clone(), shutdown.clone())
            .await
            .expect("state");
        Self {
            state,
            stores: self.stores.clone(),
            bus: self.bus.clone(),
            topology: self.topology.clone(),
            sessions: self.sessions.clone(),
            key: self.key.clone(),
            shutdown,
            options,
        }
    }

    /// A new admin API key of `workspace` (created if needed).
    pub async fn api_key(&self, workspace: &str) -> String {
        self.key_with_role(workspace, ApiKeyRole::Admin).await
    }

    /// A new client API key of `workspace` (created if needed).
    pub async fn client_key(&self, workspace: &str) -> String {
        self.key_with_role(workspace, ApiKeyRole::Client).await
    }

    async fn key_with_role(&self, workspace: &str, role: ApiKeyRole) -> String {
        self.stores
            .tenancy
            .create_api_key(
                &WorkspaceId::new(workspace).expect("workspace id"),
                Some("test"),
                role,
            )
            .await
            .expect("api key")
            .plaintext
    }

    /// The router over this gateway's state.
    pub fn app(&self) -> Router {
        app(self.state.clone())
    }

    /// Sends `request` through the router; the status and the body as JSON (`Null` when
    /// the body is not JSON).
    pub async fn send_json(&self, request: Request<Body>) -> (StatusCode, Value) {
        let response: Response = self.app().oneshot(request).await.expect("router");
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// `method uri` with API key `key` and an optional JSON body.
    pub async fn call_as(
        &self,
        key: &str,
        method: &str,
        uri: &str,
        body: Option<&Value>,
    ) -> (StatusCode, Value) {
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
            .expect("request");
        self.send_json(request).await
    }

    /// `method uri` with the `default` workspace's key.
    pub async fn call(&self, method: &str, uri: &str, body: Option<&Value>) -> (StatusCode, Value) {
        self.call_as(&self.key, method, uri, body).await
    }
}
