//! The gateway's HTTP/1 server: the accept loop, the connection options, and the head limits
//! that go with them.
//!
//! Why not `axum::serve`: it does not expose hyper's connection builder, and hyper answers a
//! request head over *its* limits itself, before any request exists for the router: a bare
//! `431`/`414` with no body. Here hyper's ceilings ([`HYPER_MAX_HEADERS`],
//! [`HYPER_MAX_BUF`]) sit well above the gateway's own limits ([`MAX_HEADERS`],
//! [`MAX_HEADER_BYTES`], [`MAX_TARGET_BYTES`]), which [`refuse_oversized_head`] enforces
//! with the one error shape (and a request id). Only a head beyond hyper's ceilings, or one
//! hyper cannot parse at all (see the table in [`crate::error`]), still gets hyper's bare
//! answer: some limit must hold before a request can be routed.
//!
//! Connections get `TCP_NODELAY` (SSE frames and small JSON answers leave at once, instead of
//! waiting ~40 ms for the client's delayed ACK behind Nagle) and hyper's header read timeout
//! (30 s: a client trickling a head cannot hold a connection forever). On shutdown the loop
//! stops accepting and waits for the open connections to finish their requests (streams end
//! on shutdown themselves).

use axum::Router;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;

/// Header fields a request may have (each value of a repeated field counts); more is `431`.
pub const MAX_HEADERS: usize = 100;

/// Bytes of header fields a request may have (names, values and their `: ` and CRLF); more is
/// `431`.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Bytes of the request target (path and query); longer is `414`.
pub const MAX_TARGET_BYTES: usize = 8 * 1024;

/// Hyper's header-field ceiling: ten times [`MAX_HEADERS`], so that ours answers first.
pub const HYPER_MAX_HEADERS: usize = 10 * MAX_HEADERS;

/// Hyper's read buffer, which bounds a whole head: 1 MiB, sixteen times
/// [`MAX_HEADER_BYTES`] (and above hyper's own 64 KiB limit on the request target).
pub const HYPER_MAX_BUF: usize = 1024 * 1024;

/// Middleware refusing a head over the gateway's limits with `431` (header fields) or `414`
/// (request target), in the one error shape.
pub async fn refuse_oversized_head(request: Request, next: Next) -> Result<Response, ApiError> {
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |pq| pq.as_str().len());
    if target > MAX_TARGET_BYTES {
        return Err(ApiError::uri_too_long(MAX_TARGET_BYTES));
    }
    let headers = request.headers();
    if headers.len() > MAX_HEADERS {
        return Err(ApiError::header_too_large(format!(
            "the request has {} header fields; at most {MAX_HEADERS} are accepted",
            headers.len()
        )));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return Err(ApiError::header_too_large(format!(
            "the request's header fields are {bytes} bytes; at most {MAX_HEADER_BYTES} are accepted"
        )));
    }
    Ok(next.run(request).await)
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then waits for the open
/// connections to finish.
pub async fn serve(listener: TcpListener, app: Router, shutdown: CancellationToken) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .max_headers(HYPER_MAX_HEADERS)
        .max_buf_size(HYPER_MAX_BUF);
    let graceful = GracefulShutdown::new();
    let mut listener = listener;
    loop {
        // axum's `Listener::accept` retries failed accepts (with a pause on EMFILE).
        let (tcp, _peer) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = shutdown.cancelled() => break,
        };
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on a connection");
        }
        let connection =
            builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
