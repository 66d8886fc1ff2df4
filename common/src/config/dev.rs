//! `[dev]`: the model `switchboard dev` bootstraps in workspace `default` (ignored by the
//! role commands).

use std::num::NonZeroU32;

use serde::Deserialize;
use url::Url;

use super::problems::Problems;

/// What `switchboard dev` bootstraps in workspace `default`: with a model (`model_url` and
/// `model`), that OpenAI-compatible model is registered (as the model named `default`,
/// updated in place when these settings change) and the default agent is the local-agent
/// runner bound to it; without one, the default agent is the echo runner. The role commands
/// (`gateway`, `orchestrator`, `worker`) never bootstrap, so they ignore this section: a
/// cluster registers its models and agents through the API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevConfig {
    /// OpenAI-compatible base URL of the model, up to and including the version path:
    /// `http://127.0.0.1:11434/v1` (Ollama), `http://127.0.0.1:8000/v1` (vLLM),
    /// `https://api.openai.com/v1`. `dev` lets models reach loopback; any other private
    /// address needs an `egress.allow` entry.
    pub model_url: Option<String>,
    /// The model's name at that server (`llama3.2`, `gpt-4o-mini`). Required with
    /// `model_url`.
    pub model: Option<String>,
    /// Environment variable holding the server's API key, sent as a bearer token (none for
    /// a local Ollama). `dev` adds it to `secrets.allow`; it may not be a `SWITCHBOARD*`
    /// variable.
    pub model_key_env: Option<String>,
    /// The model's context window in tokens; unset, the local agent assumes 8192 (what
    /// small local models are served with), which only makes it keep less history than
    /// a larger window would allow.
    pub model_context_window: Option<NonZeroU32>,
}

impl DevConfig {
    /// The model to bootstrap, when `model_url` and `model` are both set (validation
    /// refuses one without the other).
    #[must_use]
    pub fn default_model(&self) -> Option<DevModel> {
        let url = self.model_url.as_deref()?.trim();
        let model = self.model.as_deref()?.trim();
        Some(DevModel {
            base_url: url.to_owned(),
            model: model.to_owned(),
            api_key_env: self.model_key_env.clone(),
            context_window: self.model_context_window,
        })
    }
}

/// The model `switchboard dev` registers ([`DevConfig::default_model`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevModel {
    /// OpenAI-compatible base URL.
    pub base_url: String,
    /// Model name at that server.
    pub model: String,
    /// Environment variable of the API key.
    pub api_key_env: Option<String>,
    /// Context window in tokens.
    pub context_window: Option<NonZeroU32>,
}

impl DevConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let d = self;
        let url = d
            .model_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty());
        let model = d.model.as_deref().map(str::trim).filter(|m| !m.is_empty());
        match (url, model) {
            (Some(_), None) => p.push("dev.model", "required with dev.model_url (--model NAME)"),
            (None, Some(_)) => p.push("dev.model_url", "required with dev.model (--model-url URL)"),
            _ => {}
        }
        if d.model_url.is_some() && url.is_none() {
            p.push("dev.model_url", "expected a URL, got an empty value");
        }
        if d.model.is_some() && model.is_none() {
            p.push("dev.model", "expected a model name, got an empty value");
        }
        if let Some(url) = url {
            match Url::parse(url) {
                Err(e) => p.push("dev.model_url", format!("expected a URL ({e})")),
                Ok(u) if !matches!(u.scheme(), "http" | "https") => p.push(
                    "dev.model_url",
                    format!("expected an http or https URL, got `{}`", u.scheme()),
                ),
                Ok(u) if !u.username().is_empty() || u.password().is_some() => p.push(
                    "dev.model_url",
                    "expected no credentials in the URL (name the key's variable in dev.model_key_env)",
                ),
                Ok(u) if u.host_str().is_none_or(str::is_empty) => {
                    p.push("dev.model_url", "expected a host");
                }
                Ok(_) => {}
            }
        }
        if let Some(name) = &d.model_key_env
            && let Err(e) = crate::secrets::check_allowable(name)
        {
            p.push("dev.model_key_env", e.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use std::num::NonZeroU32;

    use super::super::ConfigError;

    #[test]
    fn the_dev_model_comes_from_file_environment_and_cli() {
        assert_eq!(loader().load().unwrap().dev.default_model(), None);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dev.toml");
        std::fs::write(
            &file,
            r#"
            [dev]
            model_url = "http://127.0.0.1:11434/v1"
            model = "llama3.2"
            model_context_window = 131072
            "#,
        )
        .unwrap();
        let c = loader().file(&file).load().unwrap();
        let model = c.dev.default_model().unwrap();
        assert_eq!(model.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(model.model, "llama3.2");
        assert_eq!(model.api_key_env, None);
        assert_eq!(model.context_window.map(NonZeroU32::get), Some(131_072));

        let vars = env(&[
            ("SWITCHBOARD__DEV__MODEL", "qwen2.5"),
            ("SWITCHBOARD__DEV__MODEL_KEY_ENV", "OPENAI_API_KEY"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        let model = c.dev.default_model().unwrap();
        assert_eq!(model.model, "qwen2.5", "environment over file");
        assert_eq!(model.api_key_env.as_deref(), Some("OPENAI_API_KEY"));
        let c = loader()
            .file(&file)
            .env(vars)
            .set("dev.model", "gpt-4o-mini")
            .load()
            .unwrap();
        assert_eq!(
            c.dev.default_model().unwrap().model,
            "gpt-4o-mini",
            "CLI over environment"
        );
    }

    #[test]
    fn rejects_a_dev_model_url_without_a_model_and_the_reverse() {
        let problems = rejected("dev.model_url", "http://127.0.0.1:11434/v1");
        assert!(
            problems.iter().any(|p| p.key == "dev.model"),
            "{problems:?}"
        );
        let problems = rejected("dev.model", "llama3.2");
        assert!(
            problems.iter().any(|p| p.key == "dev.model_url"),
            "{problems:?}"
        );
    }

    #[test]
    fn rejects_unusable_dev_model_urls() {
        for url in [
            "not a url",
            "ftp://models.example/v1",
            "http://user:secret@127.0.0.1:11434/v1",
            " ",
        ] {
            let problems = match loader()
                .set("dev.model_url", url)
                .set("dev.model", "m")
                .load()
            {
                Err(ConfigError::Invalid(problems)) => problems,
                other => panic!("{url}: expected a validation error, got {other:?}"),
            };
            assert!(
                problems.iter().any(|p| p.key == "dev.model_url"),
                "{url}: {problems:?}"
            );
            assert!(
                problems.iter().all(|p| !p.reason.contains("secret")),
                "credentials are not echoed: {problems:?}"
            );
        }
    }

    #[test]
    fn rejects_a_host_variable_as_the_dev_model_key() {
        assert_rejected("dev.model_key_env", "SWITCHBOARD__DATABASE__URL");
        assert_rejected("dev.model_key_env", "NOT-A-NAME");
    }

    #[test]
    fn rejects_a_zero_dev_context_window() {
        assert_load_error("dev.model_context_window", "0");
    }
}
