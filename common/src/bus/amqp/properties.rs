//! What our messages carry besides the body: the properties every publish sets (delivery
//! mode, the publish-time header) and the header values read back at consume time.

use std::sync::LazyLock;

use amqprs::{BasicProperties, FieldName, FieldTable, FieldValue};

use crate::bus::PublishOptions;

/// The header carrying the publish time in epoch milliseconds, read at consume time for
/// `sb_queue_lag_seconds`. The name is that of RabbitMQ's own `rabbitmq_message_timestamp`
/// plugin, so a broker with the plugin enabled and our publishers agree on it (the AMQP
/// `timestamp` property has only whole seconds).
pub(super) const PUBLISHED_AT_HEADER: &str = "timestamp_in_ms";

/// Properties of a message we publish: persistent (delivery mode 2) or not as `options`
/// says, stamped with the publish time in [`PUBLISHED_AT_HEADER`].
pub(super) fn properties(options: PublishOptions) -> BasicProperties {
    let mut headers = FieldTable::new();
    headers.insert(PUBLISHED_AT.clone(), FieldValue::l(epoch_ms()));
    BasicProperties::default()
        .with_delivery_mode(if options.persistent { 2 } else { 1 })
        .with_headers(headers)
        .finish()
}

/// A header or argument name (all ours are short ASCII constants).
pub(super) fn field_name(name: &str) -> FieldName {
    name.try_into().expect("a field name of at most 255 bytes")
}

/// [`PUBLISHED_AT_HEADER`] and RabbitMQ's count of a quorum queue's returns, as names the
/// header lookup of every delivery takes without making them again.
pub(super) static PUBLISHED_AT: LazyLock<FieldName> =
    LazyLock::new(|| field_name(PUBLISHED_AT_HEADER));
pub(super) static DELIVERY_COUNT: LazyLock<FieldName> =
    LazyLock::new(|| field_name("x-delivery-count"));

/// The header `name` of `properties`, if set.
pub(super) fn header<'p>(
    properties: &'p BasicProperties,
    name: &FieldName,
) -> Option<&'p FieldValue> {
    properties.headers()?.get(name)
}

/// Now, in milliseconds since the Unix epoch (0 for a clock before it).
pub(super) fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A count carried in a header (`x-delivery-count`, an `x-death` entry's `count`), whatever
/// integer type the broker chose; `None` for anything else or a negative value.
pub(super) fn header_count(value: &FieldValue) -> Option<u32> {
    let n: i64 = match value {
        FieldValue::b(v) => (*v).into(),
        FieldValue::B(v) => (*v).into(),
        FieldValue::s(v) => (*v).into(),
        FieldValue::u(v) => (*v).into(),
        FieldValue::I(v) => (*v).into(),
        FieldValue::i(v) => (*v).into(),
        FieldValue::l(v) => *v,
        _ => return None,
    };
    u32::try_from(n).ok()
}

/// A text carried in a header (a long string, or bytes).
pub(super) fn header_text(value: &FieldValue) -> Option<String> {
    match value {
        FieldValue::S(text) => Some(AsRef::<String>::as_ref(text).clone()),
        FieldValue::x(bytes) => {
            Some(String::from_utf8_lossy(&Vec::<u8>::from(bytes.clone())).into_owned())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_count_header_values() {
        assert_eq!(header_count(&FieldValue::l(3)), Some(3));
        assert_eq!(header_count(&FieldValue::I(2)), Some(2));
        assert_eq!(header_count(&FieldValue::l(-1)), None);
        assert_eq!(header_count(&FieldValue::t(true)), None);
    }

    #[test]
    fn our_properties_carry_the_publish_time() {
        let published = properties(PublishOptions::default());
        assert_eq!(published.delivery_mode(), Some(2));
        assert!(matches!(
            header(&published, &PUBLISHED_AT),
            Some(FieldValue::l(ms)) if *ms > 0
        ));
    }
}
