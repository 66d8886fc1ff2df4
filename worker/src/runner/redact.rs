//! Redaction of runner output copied into the worker's logs (SPEC §11 "Secrets", §14).
//!
//! A runner's stderr is plugin text: whatever it prints — a failed connection string, a
//! dumped request, an exception with its locals — lands in the operator's log pipeline,
//! which has wider readership than the secrets it may carry. [`redact`] recognises
//! secrets by their *structure* rather than by a word list over whitespace-split words,
//! so quoting, JSON and URLs do not hide them. Rules, in the order they apply:
//!
//! 1. **URL credentials**, any scheme: `postgres://app:s3cret@db/ledger` →
//!    `postgres://app:****@db/ledger` (the user and host stay, for diagnosis; the same
//!    shape `SecretUrl` prints for configured URLs).
//! 2. **Secret fields**: a `key=value`, `key: value` or JSON `"key": "value"` pair (also
//!    single-quoted, or JSON escaped inside a JSON string) whose key names a secret
//!    (`token`, `secret`, `password`, `passwd`, `passphrase`, `api_key`/`apiKey`/`x-api-key`,
//!    `authorization`, `auth`, `credential(s)`, `cookie`, `access_key`, `private_key`, …,
//!    case-insensitive) has its value replaced; an `Authorization`-style scheme word
//!    (`Bearer`, `Basic`, `Token`, `Digest`) is kept. Keys are judged by their words, so
//!    `access_token` is a secret but `prompt_tokens`, `max_tokens` or `tokenizer` are not.
//! 3. **Authorization schemes** anywhere: `Bearer <token>`, `Basic <base64>`.
//! 4. **Known key shapes**: `sk-…`/`sk_…` (OpenAI, Anthropic, Stripe), `sb_…` (our API
//!    keys), `ghp_…` and the other GitHub tokens, `glpat-…`, `xox[abprs]-…` (Slack),
//!    `AKIA…`/`ASIA…` (AWS), `AIza…` (Google), `hf_…`, and JWTs (`eyJ….….…`).
//! 5. **Long base64 runs** (inline images, encoded payloads): replaced by a length marker.
//!
//! Redaction errs on the side of hiding: a non-secret value under a secret-looking key is
//! lost from the log, never the reverse. It is a last line of defence for text the host
//! does not control; runners must still not print secrets.

use std::sync::LazyLock;

use regex::{Captures, Regex};

/// What replaces a secret value.
pub const MASK: &str = "[redacted]";

/// What replaces the password of a URL.
pub const URL_PASSWORD_MASK: &str = "****";

/// `scheme://user:password@` — the password runs to the *last* `@` of the authority, so a
/// raw `@` inside it is covered too.
static URL_CREDENTIALS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s:/?#@'"<>]*):(?P<password>[^\s/?#'"<>]+)@"#,
    )
    .expect("URL credentials pattern")
});

/// A key that *may* name a secret (checked word by word in [`is_secret_key`]), optionally
/// quoted (also `\"…\"` inside a JSON string), a `:` or `=`, an optional authorization
/// scheme word, and the value: a quoted string or a run up to a delimiter.
static SECRET_FIELD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r#"(?P<open>\\?["']?)"#,
        r"(?P<key>[A-Za-z0-9_.\-]*?(?i:token|secret|passw|passphrase|api[_.\-]?key|authori[sz]ation|auth|credential|cookie|(?:access|private|signing|encryption|master)[_.\-]?key)[A-Za-z0-9_.\-]*)",
        r#"(?P<close>\\?["']?)"#,
        r"(?P<sep>\s*[:=]\s*)",
        r"(?P<scheme>(?i:bearer|basic|token|digest)\s+)?",
        r#"(?P<value>\\"(?:[^"\\]|\\[^"])*\\"|"(?:[^"\\]|\\.)*"|'[^']*'|[^\s,;&}\])"'\\]+)"#,
    ))
    .expect("secret field pattern")
});

/// `Bearer <token>` / `Basic <credentials>` outside a recognised field.
static AUTH_SCHEME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(?P<scheme>bearer|basic)(?P<space>\s+)(?P<credential>[A-Za-z0-9\-._~+/]+=*)")
        .expect("authorization scheme pattern")
});

/// Credentials recognisable by their shape alone.
static KEY_SHAPES: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"\b(?:",
        // OpenAI / Anthropic (`sk-`, `sk-proj-`, `sk-ant-`), Stripe (`sk_live_`, `sk_test_`).
        r"sk[-_][A-Za-z0-9_\-]{16,}",
        // Our own API keys: `sb_` + 43 characters of base64url.
        r"|sb_[A-Za-z0-9_\-]{40,}",
        // GitHub personal, OAuth, user-to-server, server-to-server and refresh tokens.
        r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}",
        // GitLab personal access tokens.
        r"|glpat-[A-Za-z0-9_\-]{20,}",
        // Slack bot, user, app, refresh and legacy tokens.
        r"|xox[abprs]-[A-Za-z0-9\-]{10,}",
        // AWS access key ids (long-term and temporary).
        r"|(?:AKIA|ASIA)[0-9A-Z]{16}\b",
        // Google API keys.
        r"|AIza[0-9A-Za-z_\-]{35}",
        // Hugging Face tokens.
        r"|hf_[A-Za-z0-9]{30,}",
        // JWTs: base64url header `{"…`, payload, signature (empty for `alg: none`).
        r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*",
        r")",
    ))
    .expect("key shapes pattern")
});

/// Words that make a key a secret when one ends a word of the key (`db_password`,
/// `apiToken`, `x-auth`), so that `tokens`, `tokenizer` or `author` do not.
const SECRET_WORDS: &[&str] = &[
    "token",
    "secret",
    "secrets",
    "password",
    "passwd",
    "passphrase",
    "apikey",
    "authorization",
    "authorisation",
    "auth",
    "credential",
    "credentials",
    "cookie",
    "accesskey",
    "privatekey",
];

/// Words that make a following `key` word a secret (`api_key`, `X-Api-Key`,
/// `AWS_SECRET_ACCESS_KEY`, `signingKey`).
const KEY_QUALIFIERS: &[&str] = &[
    "api",
    "access",
    "private",
    "secret",
    "signing",
    "encryption",
    "master",
];

/// Redacts secrets and blobs from one log line (see the module docs for the rules).
#[must_use]
pub fn redact(line: &str) -> String {
    let line = URL_CREDENTIALS.replace_all(line, |caps: &Captures<'_>| {
        format!("{}{}:{URL_PASSWORD_MASK}@", &caps["scheme"], &caps["user"])
    });
    let line = redact_fields(&line);
    let line = AUTH_SCHEME.replace_all(&line, |caps: &Captures<'_>| {
        let credential = &caps["credential"];
        if caps["scheme"].eq_ignore_ascii_case("basic") && credential.len() < 8 {
            // "basic usage", "basic auth": a word, not base64 credentials.
            return caps[0].to_owned();
        }
        format!("{}{}{MASK}", &caps["scheme"], &caps["space"])
    });
    let line = KEY_SHAPES.replace_all(&line, MASK);
    redact_base64_runs(&line)
}

/// Rule 2. A pair whose key turns out not to be a secret is kept, but its value is
/// searched again: `tokens_url=https://h/cb?access_token=…` still loses the token.
fn redact_fields(text: &str) -> String {
    SECRET_FIELD
        .replace_all(text, |caps: &Captures<'_>| {
            let (open, key, close) = (&caps["open"], &caps["key"], &caps["close"]);
            let sep = &caps["sep"];
            let scheme = caps.name("scheme").map_or("", |m| m.as_str());
            let value = &caps["value"];
            if !is_secret_key(key) {
                return format!("{open}{key}{close}{sep}{scheme}{}", redact_fields(value));
            }
            // Keep the quoting, so JSON stays JSON.
            let masked = if value.len() >= 4 && value.starts_with("\\\"") && value.ends_with("\\\"")
            {
                format!("\\\"{MASK}\\\"")
            } else if value.len() >= 2 && (value.starts_with('"') || value.starts_with('\'')) {
                let quote = &value[..1];
                format!("{quote}{MASK}{quote}")
            } else {
                MASK.to_owned()
            };
            format!("{open}{key}{close}{sep}{scheme}{masked}")
        })
        .into_owned()
}

/// Whether a field key names a secret: one of its words (split at `_`, `-`, `.` and
/// camelCase humps, lower-cased) ends with a secret word (`token`, `password`, `auth`,
/// `credentials`, …), or is `key` after a qualifier (`api`, `access`, `private`, …).
#[must_use]
pub fn is_secret_key(key: &str) -> bool {
    let words = key_words(key);
    words
        .iter()
        .any(|w| SECRET_WORDS.iter().any(|s| w.ends_with(s)))
        || words
            .windows(2)
            .any(|pair| pair[1] == "key" && KEY_QUALIFIERS.iter().any(|q| pair[0].ends_with(q)))
}

/// `X-Api-Key` → `x`, `api`, `key`; `accessToken` → `access`, `token`; `APIKey` → `apikey`.
fn key_words(key: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut previous_lower = false;
    for c in key.chars() {
        if !c.is_ascii_alphanumeric() {
            if !current.is_empty() {
                words.push(std::mem::take(&mut current));
            }
            previous_lower = false;
            continue;
        }
        if c.is_ascii_uppercase() && previous_lower && !current.is_empty() {
            words.push(std::mem::take(&mut current));
        }
        previous_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
        current.push(c.to_ascii_lowercase());
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}

/// Rule 5: replaces runs of 64+ base64 characters (with at least one digit and mixed case,
/// so prose and paths survive) by a length marker.
fn redact_base64_runs(text: &str) -> String {
    const MIN_RUN: usize = 64;
    let bytes = text.as_bytes();
    // `=` only as trailing padding, so `key=<blob>` keeps its key.
    let is_b64 = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'-' | b'_');
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if is_b64(bytes[i]) {
            let start = i;
            while i < bytes.len() && is_b64(bytes[i]) {
                i += 1;
            }
            while i < bytes.len() && bytes[i] == b'=' && i - start >= MIN_RUN {
                i += 1;
            }
            let run = &text[start..i];
            let looks_encoded = run.len() >= MIN_RUN
                && run.bytes().any(|b| b.is_ascii_digit())
                && run.bytes().any(|b| b.is_ascii_uppercase())
                && run.bytes().any(|b| b.is_ascii_lowercase());
            if looks_encoded {
                out.push_str(&format!("[redacted {} chars]", run.len()));
            } else {
                out.push_str(run);
            }
        } else {
            // Copy one (possibly multi-byte) character.
            let ch = text[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(input, expected)` rows of one rule.
    fn check(rows: &[(&str, &str)]) {
        for (input, expected) in rows {
            assert_eq!(redact(input), *expected, "input: {input}");
        }
    }

    #[test]
    fn url_credentials_lose_their_password() {
        check(&[
            (
                "cannot connect to postgres://app:s3cr3t@db:5432/ledger",
                "cannot connect to postgres://app:****@db:5432/ledger",
            ),
            (
                "redis://:hunter2@localhost:6379/0 refused",
                "redis://:****@localhost:6379/0 refused",
            ),
            (
                "amqp://guest:p@ss@rabbit:5672/%2f",
                "amqp://guest:****@rabbit:5672/%2f",
            ),
            (
                "engine=mysql+pymysql://root:toor@127.0.0.1/app",
                "engine=mysql+pymysql://root:****@127.0.0.1/app",
            ),
            (
                "DATABASE_URL='postgresql://u:pw@h/db'",
                "DATABASE_URL='postgresql://u:****@h/db'",
            ),
            // No credentials: unchanged.
            (
                "GET https://example.com:8443/a@b ok",
                "GET https://example.com:8443/a@b ok",
            ),
            (
                "ssh://git@github.com/acme/repo",
                "ssh://git@github.com/acme/repo",
            ),
        ]);
    }

    #[test]
    fn secret_fields_lose_their_value_whatever_the_quoting() {
        check(&[
            (r#""token": "abc""#, r#""token": "[redacted]""#),
            (
                r#"{"access_token":"abc","expires_in":3600}"#,
                r#"{"access_token":"[redacted]","expires_in":3600}"#,
            ),
            (
                r#"{"password": "with \"quotes\" inside", "user": "bob"}"#,
                r#"{"password": "[redacted]", "user": "bob"}"#,
            ),
            (
                r#"payload="{\"api_key\": \"abc\", \"n\": 1}""#,
                r#"payload="{\"api_key\": \"[redacted]\", \"n\": 1}""#,
            ),
            ("password=hunter2 user=bob", "password=[redacted] user=bob"),
            ("PASSWORD = 'hunter 2'", "PASSWORD = '[redacted]'"),
            ("passwd:hunter2", "passwd:[redacted]"),
            ("client_secret: abc123", "client_secret: [redacted]"),
            ("apiKey=xyz", "apiKey=[redacted]"),
            ("X-Api-Key: xyz", "X-Api-Key: [redacted]"),
            (
                "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG",
                "AWS_SECRET_ACCESS_KEY=[redacted]",
            ),
            ("private_key=abc; next", "private_key=[redacted]; next"),
            ("credentials=user:pw", "credentials=[redacted]"),
            ("GITHUB_TOKEN=abc123", "GITHUB_TOKEN=[redacted]"),
            (
                "Cookie: sid=abc; theme=dark",
                "Cookie: [redacted]; theme=dark",
            ),
            (
                "GET /cb?code=1&access_token=abc&state=2",
                "GET /cb?code=1&access_token=[redacted]&state=2",
            ),
            (
                "tokens_url=https://h/cb?refresh_token=abc",
                "tokens_url=https://h/cb?refresh_token=[redacted]",
            ),
        ]);
    }

    #[test]
    fn authorization_values_keep_their_scheme() {
        check(&[
            (
                "Authorization: Bearer abc.def",
                "Authorization: Bearer [redacted]",
            ),
            (
                "authorization: token ghx123",
                "authorization: token [redacted]",
            ),
            (
                r#"{"Authorization": "Basic dXNlcjpwdw=="}"#,
                r#"{"Authorization": "[redacted]"}"#,
            ),
            ("using bearer xyz now", "using bearer [redacted] now"),
            ("header Basic dXNlcjpwYXNz", "header Basic [redacted]"),
            ("basic usage of the api", "basic usage of the api"),
        ]);
    }

    #[test]
    fn known_key_shapes_are_redacted_anywhere() {
        let sb_key = format!("sb_{}", "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9nP2r");
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk";
        check(&[
            ("key sk-abcdefghijklmnopqrstuvwxyz", "key [redacted]"),
            ("sk-proj-AbC123dEf456GhI789jKl0", "[redacted]"),
            (
                "stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc.",
                "stripe [redacted].",
            ),
            (&format!("using {sb_key} now"), "using [redacted] now"),
            ("ghp_0123456789abcdefghijABCDEFGHIJ012345", "[redacted]"),
            (
                "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
                "[redacted]",
            ),
            ("slack xoxb-123456789012-abcdefABCDEF", "slack [redacted]"),
            ("xoxp-1234-5678-abcd", "[redacted]"),
            ("id=AKIAIOSFODNN7EXAMPLE,", "id=[redacted],"),
            (&format!("jwt {jwt} end"), "jwt [redacted] end"),
            ("AIzaSyA-1234567890abcdefghijklmnopqrstu", "[redacted]"),
            // Look-alikes that are not keys.
            (
                "target sb_worker::runner::stderr",
                "target sb_worker::runner::stderr",
            ),
            ("task-1 ask-me", "task-1 ask-me"),
        ]);
    }

    #[test]
    fn long_base64_runs_become_a_length_marker() {
        let blob = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";
        assert_eq!(
            redact(&format!("img={blob}!")),
            format!("img=[redacted {} chars]!", blob.len())
        );
    }

    #[test]
    fn ordinary_lines_are_unchanged() {
        check(&[
            (
                "traceback in /usr/lib/python3/site-packages/some_module/with/a/long/path/file.py line 3",
                "traceback in /usr/lib/python3/site-packages/some_module/with/a/long/path/file.py line 3",
            ),
            (
                "usage: prompt_tokens=12 completion_tokens: 40 max_tokens=100",
                "usage: prompt_tokens=12 completion_tokens: 40 max_tokens=100",
            ),
            (
                "author: alice, tokenizer=cl100k",
                "author: alice, tokenizer=cl100k",
            ),
            (
                "key=value passwords_checked=3",
                "key=value passwords_checked=3",
            ),
            ("ünïcödé ✓ token", "ünïcödé ✓ token"),
        ]);
    }

    #[test]
    fn key_words_split_at_separators_and_humps() {
        assert_eq!(key_words("X-Api-Key"), ["x", "api", "key"]);
        assert_eq!(key_words("accessToken"), ["access", "token"]);
        assert_eq!(key_words("APIKey"), ["apikey"]);
        assert_eq!(key_words("db.password_2"), ["db", "password", "2"]);
        for secret in [
            "apiToken",
            "x-auth",
            "SIGNING_KEY",
            "mysecret",
            "Authorization",
        ] {
            assert!(is_secret_key(secret), "{secret}");
        }
        for plain in [
            "tokens",
            "tokenizer",
            "author",
            "key",
            "monkey",
            "max_tokens",
        ] {
            assert!(!is_secret_key(plain), "{plain}");
        }
    }
}
