//! How a consumer loop finishes with a message: [`settle`] acks, requeues or dead-letters a
//! delivery from the outcome of handling it, and [`pause`] waits out a backoff unless
//! shutdown begins.
//!
//! The events and results loops share them, so the disposition of a failure is decided in
//! exactly one place (from its error code, [`ErrorCode::disposition`]); they live beside the
//! loops rather than in the service (`service`), which only spawns and supervises them.
//!
//! [`ErrorCode::disposition`]: sb_protocol::error::ErrorCode::disposition

use std::time::Duration;

use sb_common::bus::Delivery;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::error::{Disposition, HasErrorCode};

use crate::deps::OrchestratorOptions;
use crate::error::Result;

/// Settles a delivery from the outcome of handling it, by the error code's disposition
/// (the project's one mapping): `Ack` removes it, `Retry` requeues it after a backoff
/// (cut short by shutdown), `DeadLetter` rejects it to the dead-letter exchange.
pub(crate) async fn settle(
    delivery: Delivery,
    outcome: &Result<()>,
    queue: &str,
    options: &OrchestratorOptions,
    shutdown: &Shutdown,
) {
    let disposition = match outcome {
        Ok(()) => Disposition::Ack,
        Err(error) => {
            let disposition = error.code().disposition();
            match disposition {
                Disposition::Ack => {
                    tracing::info!(%error, queue, "message handled with a final error")
                }
                Disposition::Retry => {
                    tracing::warn!(%error, queue, attempts = delivery.delivery_count, "message will be retried")
                }
                Disposition::DeadLetter => tracing::error!(%error, queue, "message dead-lettered"),
            }
            disposition
        }
    };
    let (label, settled) = match disposition {
        Disposition::Ack => ("ack", delivery.ack().await),
        Disposition::Retry => {
            let delay = options.retry_delay(delivery.delivery_count);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
            ("retry", delivery.nack(true).await)
        }
        Disposition::DeadLetter => ("dead_letter", delivery.nack(false).await),
    };
    if let Err(error) = settled {
        // The broker will redeliver it; every handler is idempotent.
        tracing::warn!(%error, queue, "could not settle a delivery");
    }
    Metrics::global().inc(
        names::BUS_CONSUMED_TOTAL,
        &[("queue", queue), ("disposition", label)],
    );
}

/// Waits `delay` unless shutdown begins first; `false` on shutdown.
pub(crate) async fn pause(delay: Duration, shutdown: &Shutdown) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}
