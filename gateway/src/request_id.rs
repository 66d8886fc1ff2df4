//! The request id: one per request, in the `x-request-id` response header, in every error
//! body (`request_id`) and on the request's tracing span, so a client's report of a refusal
//! finds the log lines of exactly that request.
//!
//! tower-http's `SetRequestIdLayer` makes the id (a UUID) unless the request brings one, and
//! `PropagateRequestIdLayer` copies it to the response. A client's own id is kept only when
//! it is one plain token ([`is_usable`]): the id goes into logs and bodies verbatim, so a
//! huge, repeated or control-character value is replaced by a fresh one
//! ([`drop_unusable`]) rather than trusted.

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;

/// The header carrying the id, in requests and responses.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client-chosen id kept.
pub const MAX_LEN: usize = 128;

/// Whether a client's `x-request-id` is kept: 1 to [`MAX_LEN`] characters of
/// `[A-Za-z0-9-_.:]`, the alphabet of idempotency keys (UUIDs and trace ids fit).
pub fn is_usable(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_LEN
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// The request's id, once the layers set it.
pub fn of(headers: &HeaderMap) -> Option<&str> {
    headers.get(HEADER).and_then(|v| v.to_str().ok())
}

/// Middleware (outside `SetRequestIdLayer`) removing a client's `x-request-id` unless it is
/// a single usable value, so the layer makes a fresh one.
pub async fn drop_unusable(mut request: Request, next: Next) -> Response {
    let mut values = request.headers().get_all(HEADER).iter();
    let keep = matches!((values.next(), values.next()), (Some(value), None) if is_usable(value));
    if !keep {
        request.headers_mut().remove(HEADER);
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_tokens_are_kept_and_anything_else_replaced() {
        for kept in ["a", "0b6c-4e1f", "trace:1.2_3", &"x".repeat(MAX_LEN)] {
            assert!(is_usable(&HeaderValue::from_str(kept).unwrap()), "{kept}");
        }
        for dropped in [
            "",
            "a b",
            "a/b",
            "<script>",
            "'; drop",
            &"x".repeat(MAX_LEN + 1),
        ] {
            assert!(
                !is_usable(&HeaderValue::from_str(dropped).unwrap()),
                "{dropped}"
            );
        }
        assert!(!is_usable(&HeaderValue::from_bytes(b"\xff").unwrap()));
    }
}
