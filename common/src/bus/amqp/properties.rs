//! What our messages carry besides the body: the properties every publish sets (delivery
//! mode, the publish-time header) and the header values read back at consume time.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use crate::bus::PublishOptions;

/// The header carrying the publish time in epoch milliseconds, read at consume time for
/// `sb_queue_lag_seconds`. The name is that of RabbitMQ's own `rabbitmq_message_timestamp`
/// plugin, so a broker with the plugin enabled and our publishers agree on it (the AMQP
/// `timestamp` property has only whole seconds).
pub(super) const PUBLISHED_AT_HEADER: &str = "timestamp_in_ms";

/// Properties of a message we publish: persistent (delivery mode 2) or not as `options`
/// says, stamped with the publish time in [`PUBLISHED_AT_HEADER`].
pub(super) fn properties(options: PublishOptions) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        PUBLISHED_AT_HEADER.into(),
        AMQPValue::LongLongInt(epoch_ms()),
    );
    BasicProperties::default()
        .with_delivery_mode(if options.persistent { 2 } else { 1 })
        .with_headers(headers)
}

/// Now, in milliseconds since the Unix epoch (0 for a clock before it).
pub(super) fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A count carried in a header (`x-delivery-count`, an `x-death` entry's `count`), whatever
/// integer type the broker chose; `None` for anything else or a negative value.
pub(super) fn header_count(value: &AMQPValue) -> Option<u32> {
    let n: i64 = match value {
        AMQPValue::ShortShortInt(v) => (*v).into(),
        AMQPValue::ShortShortUInt(v) => (*v).into(),
        AMQPValue::ShortInt(v) => (*v).into(),
        AMQPValue::ShortUInt(v) => (*v).into(),
        AMQPValue::LongInt(v) => (*v).into(),
        AMQPValue::LongUInt(v) => (*v).into(),
        AMQPValue::LongLongInt(v) => *v,
        _ => return None,
    };
    u32::try_from(n).ok()
}

/// A text carried in a header (long or short string).
pub(super) fn header_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_count_header_values() {
        assert_eq!(header_count(&AMQPValue::LongLongInt(3)), Some(3));
        assert_eq!(header_count(&AMQPValue::LongInt(2)), Some(2));
        assert_eq!(header_count(&AMQPValue::LongLongInt(-1)), None);
        assert_eq!(header_count(&AMQPValue::Boolean(true)), None);
    }
}
