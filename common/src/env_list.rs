//! Configuration lists that may arrive as one comma-separated string.
//!
//! A list in a TOML file is a list, but an environment variable is one string
//! (`SWITCHBOARD__WORKER__POOLS=default,gpu`), so every list-valued setting accepts both:
//! `#[serde(deserialize_with = "crate::env_list::deserialize")]`. It sits apart from
//! [`crate::config`] because the sections that use it live in several modules (the worker's
//! in `config`, `secrets.allow` in [`crate::secrets`], `egress.allow` in [`crate::egress`]).

use std::fmt;

use serde::Deserializer;

/// Accepts a list, or one comma-separated string (how lists arrive from environment
/// variables). Empty items are dropped.
pub(crate) fn deserialize<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: From<String>,
{
    struct Visitor<T>(std::marker::PhantomData<T>);

    impl<'de, T: From<String>> serde::de::Visitor<'de> for Visitor<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of strings or a comma-separated string")
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| T::from(s.to_owned()))
                .collect())
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(item) = seq.next_element::<String>()? {
                out.push(T::from(item));
            }
            Ok(out)
        }
    }

    deserializer.deserialize_any(Visitor(std::marker::PhantomData))
}
