//! Typed access to a call's `params` object. Every malformed value is `invalid_argument`
//! with a message naming the parameter; `null` counts as absent (the seed's `None`).

use sb_protocol::error::AgentApiError;
use serde_json::{Map, Value};

use super::invalid;

/// The `params` object of one call.
#[derive(Debug)]
pub(crate) struct Params<'a> {
    map: Option<&'a Map<String, Value>>,
}

impl<'a> Params<'a> {
    /// `params` must be an object; `null` (the wire default) is an empty object.
    pub(crate) fn new(value: &'a Value) -> Result<Self, AgentApiError> {
        match value {
            Value::Null => Ok(Self { map: None }),
            Value::Object(map) => Ok(Self { map: Some(map) }),
            _ => Err(invalid("params must be a JSON object")),
        }
    }

    /// The raw value, `None` when absent or `null`.
    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.and_then(|m| m.get(name)).filter(|v| !v.is_null())
    }

    /// Whether the key is present at all (even as `null`).
    pub(crate) fn has_key(&self, name: &str) -> bool {
        self.map.is_some_and(|m| m.contains_key(name))
    }

    /// An optional string.
    pub(crate) fn opt_str(&self, name: &str) -> Result<Option<&'a str>, AgentApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(invalid(format!("{name} must be a string"))),
        }
    }

    /// A required, non-empty string.
    pub(crate) fn req_str(&self, name: &str) -> Result<&'a str, AgentApiError> {
        match self.opt_str(name)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(invalid(format!("{name} is required"))),
        }
    }

    /// The first of `names` that is set, as a required string (parameters known under two
    /// names, e.g. the seed's `llm_model_uuid` and PROTOCOL_V1's `model_id`).
    pub(crate) fn req_str_any(&self, names: &[&str]) -> Result<&'a str, AgentApiError> {
        for name in names {
            if let Some(s) = self.opt_str(name)? {
                if !s.is_empty() {
                    return Ok(s);
                }
            }
        }
        Err(invalid(format!(
            "{} is required",
            names.first().copied().unwrap_or("id")
        )))
    }

    /// An optional integer.
    pub(crate) fn opt_i64(&self, name: &str) -> Result<Option<i64>, AgentApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| invalid(format!("{name} must be an integer"))),
        }
    }

    /// An optional boolean.
    pub(crate) fn opt_bool(&self, name: &str) -> Result<Option<bool>, AgentApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(format!("{name} must be a boolean"))),
        }
    }

    /// An optional list of strings (empty when absent).
    pub(crate) fn opt_str_list(&self, name: &str) -> Result<Vec<String>, AgentApiError> {
        str_list(self.get(name), name)
    }

    /// An optional object.
    pub(crate) fn opt_object(
        &self,
        name: &str,
    ) -> Result<Option<&'a Map<String, Value>>, AgentApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(_) => Err(invalid(format!("{name} must be an object"))),
        }
    }
}

/// A list of strings from an optional value (empty when absent).
pub(crate) fn str_list(value: Option<&Value>, name: &str) -> Result<Vec<String>, AgentApiError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| invalid(format!("{name} must be a list of strings")))
            })
            .collect(),
        Some(_) => Err(invalid(format!("{name} must be a list of strings"))),
    }
}

/// A page size: clamped to `[1, max]` (SPEC §8 step 6), `default` when absent; a value
/// that is not an integer is `invalid_argument`.
pub(crate) fn page_limit(
    p: &Params<'_>,
    name: &str,
    default: u64,
    max: u64,
) -> Result<i64, AgentApiError> {
    let clamped = sb_store::page::clamp_limit(p.opt_i64(name)?, default, max);
    Ok(i64::try_from(clamped).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params_are_typed_and_null_is_absent() {
        let v = json!({"s": "x", "e": "", "n": 5, "f": 1.5, "b": true, "z": null, "l": ["a"], "bad": [1]});
        let p = Params::new(&v).unwrap();
        assert_eq!(p.opt_str("s").unwrap(), Some("x"));
        assert_eq!(p.opt_str("z").unwrap(), None);
        assert!(p.has_key("z") && !p.has_key("nope"));
        assert_eq!(p.req_str("e").unwrap_err().message, "e is required");
        assert_eq!(p.opt_str("n").unwrap_err().message, "n must be a string");
        assert_eq!(p.opt_i64("n").unwrap(), Some(5));
        assert_eq!(p.opt_i64("f").unwrap_err().code, "invalid_argument");
        assert_eq!(p.opt_bool("b").unwrap(), Some(true));
        assert_eq!(p.opt_str_list("l").unwrap(), ["a"]);
        assert!(p.opt_str_list("bad").is_err());
        assert_eq!(p.req_str_any(&["missing", "s"]).unwrap(), "x");
        assert_eq!(
            p.req_str_any(&["m1", "m2"]).unwrap_err().message,
            "m1 is required"
        );
        assert!(Params::new(&json!([1])).is_err());
        assert!(Params::new(&Value::Null).unwrap().get("x").is_none());
    }

    #[test]
    fn page_limits_clamp() {
        let v = json!({"zero": 0, "neg": -4, "big": 1000, "ok": 7, "str": "7"});
        let p = Params::new(&v).unwrap();
        assert_eq!(page_limit(&p, "zero", 50, 100).unwrap(), 1);
        assert_eq!(page_limit(&p, "neg", 50, 100).unwrap(), 1);
        assert_eq!(page_limit(&p, "big", 50, 100).unwrap(), 100);
        assert_eq!(page_limit(&p, "ok", 50, 100).unwrap(), 7);
        assert_eq!(page_limit(&p, "absent", 50, 100).unwrap(), 50);
        assert!(page_limit(&p, "str", 50, 100).is_err());
    }
}
