//! Declarations: exchanges, queues and bindings, with the registry that lets the link
//! re-declare them after a reconnection.
//!
//! Every declaration goes through the link's topology channel one at a time (see "Shape" in
//! the parent module), and every successful one is recorded in the `Declarations`
//! (queues with their *current* bindings), which [`Link::redeclare`] replays on a fresh
//! connection. The mapping of a [`QueueSpec`] onto RabbitMQ arguments
//! ([`queue_arguments`]) lives here too.

use amqprs::channel::{
    ExchangeDeclareArguments, ExchangeDeleteArguments, QueueBindArguments, QueueDeclareArguments,
    QueueDeleteArguments, QueueUnbindArguments,
};
use amqprs::{FieldTable, FieldValue};

use super::failure::{AmqpError, Failure, classify};
use super::link::{Inner, Link};
use super::properties::field_name;
use crate::bus::{
    Binding, BusError, ExchangeSpec, QueueKind, QueueSpec, QueueType, QueueUse, Result, check_key,
    check_name, in_use,
};

/// The declaration of a queue spec: its flags and RabbitMQ arguments.
fn queue_arguments(spec: &QueueSpec) -> QueueDeclareArguments {
    let mut args = FieldTable::new();
    if spec.effective_queue_type() == QueueType::Quorum {
        args.insert(field_name("x-queue-type"), FieldValue::from("quorum"));
    }
    if let Some(limit) = spec.effective_delivery_limit() {
        args.insert(
            field_name("x-delivery-limit"),
            FieldValue::l(i64::from(limit)),
        );
    }
    if let Some(dlx) = &spec.dead_letter_exchange {
        args.insert(
            field_name("x-dead-letter-exchange"),
            FieldValue::from(dlx.as_str()),
        );
    }
    if spec.single_active_consumer {
        args.insert(field_name("x-single-active-consumer"), FieldValue::t(true));
    }
    let exclusive = spec.kind == QueueKind::Exclusive;
    QueueDeclareArguments::new(&spec.name)
        .durable(!exclusive)
        .exclusive(exclusive)
        .auto_delete(exclusive)
        .arguments(args)
        .finish()
}

/// A passive declaration of queue `name`: it creates nothing, answers its counts, and `404`
/// for a missing queue.
pub(super) fn passive_queue(name: &str) -> QueueDeclareArguments {
    QueueDeclareArguments::new(name).passive(true).finish()
}

impl Link {
    pub(super) async fn declare_exchange(
        &self,
        spec: &ExchangeSpec,
    ) -> std::result::Result<(), AmqpError> {
        self.topology_op(|ch| async move {
            let arguments = ExchangeDeclareArguments::new(&spec.name, spec.kind.as_str())
                .durable(true)
                .finish();
            ch.call(ch.channel.exchange_declare(arguments)).await
        })
        .await
    }

    pub(super) async fn declare_queue(
        &self,
        spec: &QueueSpec,
    ) -> std::result::Result<(), AmqpError> {
        self.topology_op(|ch| async move {
            ch.call(ch.channel.queue_declare(queue_arguments(spec)))
                .await
                .map(drop)
        })
        .await
    }

    pub(super) async fn bind(
        &self,
        queue: &str,
        binding: &Binding,
    ) -> std::result::Result<(), AmqpError> {
        self.topology_op(|ch| async move {
            let arguments = QueueBindArguments::new(queue, &binding.exchange, &binding.routing_key);
            ch.call(ch.channel.queue_bind(arguments)).await
        })
        .await
    }

    /// Re-declares everything in the registry on a fresh link. Channel-level refusals (someone
    /// changed or deleted a declared object meanwhile) are logged and skipped; a connection
    /// failure aborts (the supervisor retries with a new connection).
    pub(super) async fn redeclare(
        &self,
        registry: (Vec<ExchangeSpec>, Vec<QueueSpec>),
    ) -> std::result::Result<(), AmqpError> {
        let (exchanges, queues) = registry;
        let skip = |what: &str, name: &str, e: AmqpError| match classify(&e) {
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
                    ch.call(
                        ch.channel
                            .exchange_delete(ExchangeDeleteArguments::new(name)),
                    )
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
                    ch.call(ch.channel.queue_delete(QueueDeleteArguments::new(name)))
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
                    ch.call(ch.channel.queue_declare(passive_queue(name))).await
                })
                .await
            })
            .await;
        match inspected {
            Ok(Some((_, messages, consumers))) => Ok(Some(QueueUse {
                messages,
                consumers,
            })),
            Ok(None) => Err(BusError::Internal(
                "the broker did not answer a passive declaration".into(),
            )),
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
                    let arguments =
                        QueueUnbindArguments::new(queue, &binding.exchange, &binding.routing_key);
                    ch.call(ch.channel.queue_unbind(arguments)).await
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
        let declared = format!("{:?}", queue_arguments(&spec));
        for part in [
            "durable: true",
            "exclusive: false",
            "auto_delete: false",
            "x-queue-type",
            "quorum",
            "x-delivery-limit",
            "x-dead-letter-exchange",
            "dlx",
            "x-single-active-consumer",
        ] {
            assert!(declared.contains(part), "{part} in {declared}");
        }
    }

    #[test]
    fn exclusive_queues_are_classic_without_limit() {
        let spec = QueueSpec::exclusive("gw").delivery_limit(5);
        let declared = format!("{:?}", queue_arguments(&spec));
        for part in ["durable: false", "exclusive: true", "auto_delete: true"] {
            assert!(declared.contains(part), "{part} in {declared}");
        }
        assert!(!declared.contains("x-queue-type"), "{declared}");
        assert!(!declared.contains("x-delivery-limit"), "{declared}");
    }
}
