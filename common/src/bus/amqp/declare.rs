//! Declarations: exchanges, queues and bindings, with the registry that lets the link
//! re-declare them after a reconnection.
//!
//! Every declaration goes through the link's topology channel one at a time (see "Shape" in
//! the parent module), and every successful one is recorded in the `Declarations`
//! (queues with their *current* bindings), which [`Link::redeclare`] replays on a fresh
//! connection. The mapping of a [`QueueSpec`] onto RabbitMQ arguments
//! ([`queue_arguments`]) lives here too.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};

use super::failure::{Failure, classify};
use super::link::{Inner, Link};
use crate::bus::{
    Binding, BusError, ExchangeKind, ExchangeSpec, QueueKind, QueueSpec, QueueType, QueueUse,
    Result, check_key, check_name, in_use,
};

fn exchange_kind(kind: ExchangeKind) -> lapin::ExchangeKind {
    match kind {
        ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        ExchangeKind::Topic => lapin::ExchangeKind::Topic,
        ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
    }
}

/// Declare options and arguments of a queue spec.
fn queue_arguments(spec: &QueueSpec) -> (QueueDeclareOptions, FieldTable) {
    let mut args = FieldTable::default();
    let options = match spec.kind {
        QueueKind::Durable => QueueDeclareOptions {
            durable: true,
            exclusive: false,
            auto_delete: false,
            ..Default::default()
        },
        QueueKind::Exclusive => QueueDeclareOptions {
            durable: false,
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        },
    };
    if spec.effective_queue_type() == QueueType::Quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    if let Some(limit) = spec.effective_delivery_limit() {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(limit)),
        );
    }
    if let Some(dlx) = &spec.dead_letter_exchange {
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(dlx.as_str().into()),
        );
    }
    if spec.single_active_consumer {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    (options, args)
}

impl Link {
    pub(super) async fn declare_exchange(
        &self,
        spec: &ExchangeSpec,
    ) -> std::result::Result<(), lapin::Error> {
        self.topology_op(|ch| async move {
            ch.exchange_declare(
                spec.name.as_str(),
                exchange_kind(spec.kind),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
        })
        .await
    }

    pub(super) async fn declare_queue(
        &self,
        spec: &QueueSpec,
    ) -> std::result::Result<(), lapin::Error> {
        let (options, args) = queue_arguments(spec);
        self.topology_op(|ch| async move {
            ch.queue_declare(spec.name.as_str(), options, args)
                .await
                .map(drop)
        })
        .await
    }

    pub(super) async fn bind(
        &self,
        queue: &str,
        binding: &Binding,
    ) -> std::result::Result<(), lapin::Error> {
        self.topology_op(|ch| async move {
            ch.queue_bind(
                queue,
                binding.exchange.as_str(),
                binding.routing_key.as_str(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        })
        .await
    }

    /// Re-declares everything in the registry on a fresh link. Channel-level refusals (someone
    /// changed or deleted a declared object meanwhile) are logged and skipped; a connection
    /// failure aborts (the supervisor retries with a new connection).
    pub(super) async fn redeclare(
        &self,
        registry: (Vec<ExchangeSpec>, Vec<QueueSpec>),
    ) -> std::result::Result<(), lapin::Error> {
        let (exchanges, queues) = registry;
        let skip = |what: &str, name: &str, e: lapin::Error| match classify(&e) {
            Failure::Connection => Err(e),
            _ => {
                tracing::warn!(error = %e, what, name, "could not re-declare after reconnecting");
                Ok(())
            }
        };
        for exchange in &exchanges {
            if let Err(e) = self.declare_exchange(exchange).await {
                skip("exchange", &exchange.name, e)?;
            }
        }
        for queue in &queues {
            if let Err(e) = self.declare_queue(queue).await {
                skip("queue", &queue.name, e)?;
                continue;
            }
            for binding in &queue.bindings {
                if let Err(e) = self.bind(&queue.name, binding).await {
                    skip("binding", &queue.name, e)?;
                }
            }
        }
        Ok(())
    }
}

/// The topology operations of [`Bus`](crate::bus::Bus): checked, retried over reconnections,
/// and recorded in the registry.
impl Inner {
    pub(super) async fn declare_exchange(&self, spec: &ExchangeSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "the default exchange cannot be declared".into(),
            ));
        }
        self.retrying(|link| async move { link.declare_exchange(spec).await })
            .await?;
        self.registry()
            .exchanges
            .insert(spec.name.clone(), spec.clone());
        Ok(())
    }

    pub(super) async fn delete_exchange(&self, name: &str) -> Result<()> {
        let deleted = self
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.exchange_delete(name, ExchangeDeleteOptions::default())
                        .await
                })
                .await
            })
            .await;
        self.registry().exchanges.remove(name);
        match deleted {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn declare_queue(&self, spec: &QueueSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "queue name must not be empty".into(),
            ));
        }
        for binding in &spec.bindings {
            check_key(&binding.routing_key)?;
        }
        self.retrying(|link| async move { link.declare_queue(spec).await })
            .await?;
        {
            let mut stored = spec.clone();
            stored.bindings.clear();
            let mut registry = self.registry();
            registry
                .queues
                .entry(spec.name.clone())
                .or_insert((stored, 0));
        }
        for binding in &spec.bindings {
            self.bind(&spec.name, binding).await?;
        }
        Ok(())
    }

    pub(super) async fn delete_queue(&self, name: &str) -> Result<()> {
        let deleted = self
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.queue_delete(name, QueueDeleteOptions::default())
                        .await
                        .map(drop)
                })
                .await
            })
            .await;
        self.registry().queues.remove(name);
        match deleted {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A passive declaration: it creates nothing, and answers `404` for a missing queue.
    pub(super) async fn inspect_queue(&self, name: &str) -> Result<Option<QueueUse>> {
        check_name(name)?;
        let inspected = self
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    let passive = QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    ch.queue_declare(name, passive, FieldTable::default()).await
                })
                .await
            })
            .await;
        match inspected {
            Ok(queue) => Ok(Some(QueueUse {
                messages: queue.message_count(),
                consumers: queue.consumer_count(),
            })),
            Err(BusError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Inspects, then deletes. RabbitMQ's quorum queues refuse the conditional deletion
    /// (`if-empty`, `if-unused`: `540 NOT_IMPLEMENTED`, which closes the connection), so the
    /// check is a passive declaration just before an unconditional delete.
    pub(super) async fn retire_queue(&self, name: &str) -> Result<()> {
        match self.inspect_queue(name).await? {
            None => return Ok(()),
            Some(used) if !used.is_idle() => return Err(in_use(name, used)),
            Some(_) => {}
        }
        self.delete_queue(name).await
    }

    pub(super) async fn bind(&self, queue: &str, binding: &Binding) -> Result<()> {
        check_key(&binding.routing_key)?;
        if binding.exchange.is_empty() {
            return Err(BusError::InvalidArgument(
                "queues cannot be bound to the default exchange".into(),
            ));
        }
        self.retrying(|link| async move { link.bind(queue, binding).await })
            .await?;
        if let Some((spec, _)) = self.registry().queues.get_mut(queue) {
            if !spec.bindings.contains(binding) {
                spec.bindings.push(binding.clone());
            }
        }
        Ok(())
    }

    pub(super) async fn unbind(&self, queue: &str, binding: &Binding) -> Result<()> {
        let unbound = self
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.queue_unbind(
                        queue,
                        binding.exchange.as_str(),
                        binding.routing_key.as_str(),
                        FieldTable::default(),
                    )
                    .await
                })
                .await
            })
            .await;
        if let Some((spec, _)) = self.registry().queues.get_mut(queue) {
            spec.bindings.retain(|b| b != binding);
        }
        match unbound {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_queue_arguments() {
        let spec = QueueSpec::durable("q")
            .single_active_consumer()
            .delivery_limit(5)
            .dead_letter_exchange("dlx");
        let (options, args) = queue_arguments(&spec);
        assert!(options.durable && !options.exclusive && !options.auto_delete);
        let args = args.inner();
        assert_eq!(
            args.get("x-queue-type"),
            Some(&AMQPValue::LongString("quorum".into()))
        );
        assert_eq!(
            args.get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(5))
        );
        assert_eq!(
            args.get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("dlx".into()))
        );
        assert_eq!(
            args.get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
    }

    #[test]
    fn exclusive_queues_are_classic_without_limit() {
        let spec = QueueSpec::exclusive("gw").delivery_limit(5);
        let (options, args) = queue_arguments(&spec);
        assert!(!options.durable && options.exclusive && options.auto_delete);
        assert!(args.inner().get("x-queue-type").is_none());
        assert!(args.inner().get("x-delivery-limit").is_none());
    }
}
