//! Helpers of the configuration tests: a loader without file or environment, and assertions
//! that a value is rejected by validation or refused at load time, naming its key.

pub(super) use super::{ConfigError, ConfigLoader, ConfigProblem, OverrideValue};

pub(super) fn loader() -> ConfigLoader {
    ConfigLoader::new().without_file()
}

pub(super) fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Loads with one override and returns the problems of the validation error.
pub(super) fn rejected(key: &str, value: impl Into<OverrideValue>) -> Vec<ConfigProblem> {
    match loader().set(key, value).load() {
        Ok(_) => panic!("{key} should have been rejected"),
        Err(e) => match e {
            ConfigError::Invalid(problems) => problems,
            other => panic!("{key}: expected a validation error, got {other}"),
        },
    }
}

pub(super) fn assert_rejected(key: &str, value: impl Into<OverrideValue>) {
    let problems = rejected(key, value);
    assert!(
        problems.iter().any(|p| p.key == key),
        "expected a problem for {key}, got {problems:?}"
    );
}

/// Loads with overrides expecting a type/parse error at load time naming the key.
pub(super) fn assert_load_error(key: &str, value: &str) {
    match loader().set(key, value).load() {
        Err(ConfigError::Load(e)) => {
            let msg = e.to_string();
            eprintln!("{key}={value}: {msg}");
            let leaf = key.rsplit('.').next().unwrap();
            assert!(msg.contains(leaf), "error for {key} should name it: {msg}");
        }
        other => panic!("{key}={value}: expected a load error, got {other:?}"),
    }
}
