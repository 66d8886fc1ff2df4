//! Shared boundaries of Switchboard: configuration, the message bus, the active-run session
//! store, shutdown and telemetry. Protocol types live in `sb-protocol`, persistence in
//! `sb-store`.
//!
//! # Layout
//! - [`config`]: the configuration tree, its loader (defaults → file → env → CLI) and `validate()`.
//!   The sections of [`telemetry`], [`secrets`] and [`egress`] live with those modules and are
//!   re-exported by `config`, which depends on them and never the reverse.
//! - [`egress`]: which addresses model and tool calls may reach (SPEC §14).
//! - [`secrets`]: which environment variables models and tools may reference (SPEC §14).
//! - [`group_commit`]: natural batching of concurrent writes into one commit (the ingest's
//!   group commit), and of reads of a changing value into one read (`SharedRead`).
//! - [`error`]: re-export of the closed error-code set and the `HasErrorCode` trait, plus
//!   `ShutdownError`.
//! - [`bus`]: the `Bus` trait (publish with confirm, subscribe with manual ack), its in-memory
//!   backend, the RabbitMQ backend (feature `amqp`) and the topology names.
//! - [`retry`]: the one retry policy (exponential delays from the `backoff` crate) of every
//!   loop that waits before trying again.
//! - [`session`]: the `SessionStore` trait (run sessions, leases, steering lists, counters), its
//!   in-memory backend and the Redis backend (feature `redis`).
//! - [`shutdown`]: root cancellation token + task tracker + signal listener + drain with a deadline.
//! - [`sse`]: server-sent events (`text/event-stream`) parsed by the WHATWG rules: the one
//!   parser of model provider streams, the CLI and the test harness.
//! - [`telemetry`]: tracing initialisation, metric names and a small Prometheus registry.
//! - `testing` (feature `test-util`): conformance suites shared by every backend.

pub mod bus;
pub mod config;
pub mod egress;
mod env_list;
pub mod error;
pub mod group_commit;
pub mod retry;
pub mod secrets;
pub mod session;
pub mod shutdown;
pub mod sse;
pub mod telemetry;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
