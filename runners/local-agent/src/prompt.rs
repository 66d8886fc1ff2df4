//! Message assembly: the system prompt, knowledge context, history and input as the
//! OpenAI-compatible chat messages the host's model actions take.
//!
//! Everything here is pure. The prompt is one system message (prompt, then knowledge, then
//! the summary of compacted history): several system messages, or one in the middle of a
//! conversation, are refused by the chat templates of several local models.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::history::{Turn, message_tokens};

/// Placeholder values for `{{name}}` in the system prompt: the agent's `prompt_variables`,
/// over the built-in ones (`actor_name`, `actor_id`, `conversation_id`, `bot_id`,
/// `workspace_id`, `date`), which a variable of the same name overrides.
#[must_use]
pub fn variables(
    configured: &BTreeMap<String, String>,
    builtin: impl IntoIterator<Item = (&'static str, Option<String>)>,
) -> BTreeMap<String, String> {
    let mut vars: BTreeMap<String, String> = builtin
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v)))
        .collect();
    vars.extend(configured.iter().map(|(k, v)| (k.clone(), v.clone())));
    vars
}

/// `template` with every `{{ name }}` whose name is in `vars` replaced by its value. Unknown
/// placeholders stay as written (a prompt about templates may contain braces of its own),
/// and values are not expanded again.
#[must_use]
pub fn render(template: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) => {
                let name = after[..end].trim();
                match vars.get(name) {
                    Some(value) => out.push_str(value),
                    None => out.push_str(&rest[start..start + 2 + end + 2]),
                }
                rest = &after[end + 2..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// `YYYY-MM-DD` (UTC) of an epoch second (Howard Hinnant's `civil_from_days`), for the
/// `date` variable.
#[must_use]
pub fn utc_date(epoch_secs: i64) -> String {
    let z = epoch_secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// One knowledge chunk given to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    /// The knowledge base it came from.
    pub kb_id: String,
    /// Its document.
    pub document_id: String,
    /// The document's title.
    pub title: String,
    /// Position in the document.
    pub chunk_index: i64,
    /// The text.
    pub content: String,
    /// Relevance (the search's, or the reranker's once reranked).
    pub score: f64,
}

impl Chunk {
    /// A `retrieve_knowledge` result of knowledge base `kb_id`; `None` without content.
    #[must_use]
    pub fn from_hit(kb_id: &str, hit: &Value) -> Option<Self> {
        let content = hit.get("content")?.as_str()?.trim();
        if content.is_empty() {
            return None;
        }
        Some(Self {
            kb_id: kb_id.to_owned(),
            document_id: text_of(hit, "document_id"),
            title: text_of(hit, "title"),
            chunk_index: hit.get("chunk_index").and_then(Value::as_i64).unwrap_or(0),
            content: content.to_owned(),
            score: hit.get("score").and_then(Value::as_f64).unwrap_or(0.0),
        })
    }
}

fn text_of(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// The chunks of several knowledge bases as one list, best score first (earlier knowledge
/// bases first among equals; scores of different bases are on the same full-text scale),
/// without repeats of the same chunk, cut to `top_k`.
#[must_use]
pub fn merge_chunks(per_kb: Vec<Vec<Chunk>>, top_k: usize) -> Vec<Chunk> {
    let mut all: Vec<Chunk> = Vec::new();
    for chunk in per_kb.into_iter().flatten() {
        let repeat = all.iter().any(|c| {
            c.document_id == chunk.document_id
                && c.chunk_index == chunk.chunk_index
                && c.content == chunk.content
        });
        if !repeat {
            all.push(chunk);
        }
    }
    all.sort_by(|a, b| b.score.total_cmp(&a.score));
    all.truncate(top_k);
    all
}

/// The chunks in the order of an `invoke_rerank` answer (`results: [{index,
/// relevance_score}]`, best first), cut to `top_k`. Indices the answer does not name are
/// dropped; an answer without usable results leaves the order as it was.
#[must_use]
pub fn apply_rerank(chunks: Vec<Chunk>, answer: &Value, top_k: usize) -> Vec<Chunk> {
    let ranked: Vec<(usize, f64)> = answer
        .get("results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let index = usize::try_from(r.get("index")?.as_u64()?).ok()?;
            let score = r.get("relevance_score").and_then(Value::as_f64)?;
            Some((index, score))
        })
        .filter(|(i, _)| *i < chunks.len())
        .collect();
    if ranked.is_empty() {
        let mut chunks = chunks;
        chunks.truncate(top_k);
        return chunks;
    }
    let mut slots: Vec<Option<Chunk>> = chunks.into_iter().map(Some).collect();
    let mut out = Vec::new();
    for (index, score) in ranked {
        if let Some(mut chunk) = slots[index].take() {
            chunk.score = score;
            out.push(chunk);
        }
        if out.len() == top_k {
            break;
        }
    }
    out
}

/// The knowledge part of the system message: numbered excerpts the model is asked to cite
/// as `[n]`.
#[must_use]
pub fn knowledge_block(chunks: &[Chunk]) -> Option<String> {
    if chunks.is_empty() {
        return None;
    }
    let mut text = String::from(
        "Knowledge base excerpts relevant to the user's message follow. Use them when they \
         answer the question and cite them as [n]; if they do not, say what you do not know \
         rather than guessing.",
    );
    for (i, chunk) in chunks.iter().enumerate() {
        let title = if chunk.title.is_empty() {
            "untitled"
        } else {
            &chunk.title
        };
        text.push_str(&format!("\n\n[{}] {title}\n{}", i + 1, chunk.content));
    }
    Some(text)
}

/// The summary part of the system message (compacted history, see `history`).
#[must_use]
pub fn summary_block(summary: &str) -> Option<String> {
    let summary = summary.trim();
    (!summary.is_empty()).then(|| {
        format!("Summary of the earlier part of this conversation, oldest first:\n{summary}")
    })
}

/// The one system message: the non-empty parts joined by blank lines, or `None`.
#[must_use]
pub fn system_message(parts: &[Option<String>]) -> Option<Value> {
    let text: Vec<&str> = parts
        .iter()
        .flatten()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    (!text.is_empty()).then(|| json!({"role": "system", "content": text.join("\n\n")}))
}

/// A user message.
#[must_use]
pub fn user_message(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// The messages of the first round: system, the kept history (oldest first), the input.
#[must_use]
pub fn assemble(system: Option<Value>, history: &[Turn], input: &str) -> Vec<Value> {
    let mut messages: Vec<Value> = system.into_iter().collect();
    messages.extend(
        history
            .iter()
            .map(|t| json!({"role": t.speaker.role(), "content": t.content})),
    );
    messages.push(user_message(input));
    messages
}

/// Estimated tokens of a list of messages (content text, tool calls' arguments).
#[must_use]
pub fn messages_tokens(messages: &[Value]) -> u64 {
    messages
        .iter()
        .map(|m| {
            let content = m.get("content").and_then(Value::as_str).unwrap_or("");
            let calls = m
                .get("tool_calls")
                .map(Value::to_string)
                .unwrap_or_default();
            message_tokens(content) + crate::history::estimate_tokens(&calls)
        })
        .sum()
}

/// A tool as the model is told about it (`funcs` of `invoke_llm_stream`).
#[must_use]
pub fn func(name: &str, description: &str, parameters: Option<&Value>) -> Value {
    let parameters = match parameters {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    json!({"name": name, "description": description, "parameters": parameters})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Speaker;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn placeholders_are_replaced_once_and_unknown_ones_kept() {
        let v = vars(&[("name", "Ada"), ("loop", "{{name}}")]);
        assert_eq!(render("Hi {{name}}, {{ name }}!", &v), "Hi Ada, Ada!");
        assert_eq!(
            render("{{loop}}", &v),
            "{{name}}",
            "values are not expanded again"
        );
        assert_eq!(render("{{other}} and {{name", &v), "{{other}} and {{name");
        assert_eq!(render("no placeholders", &v), "no placeholders");
        assert_eq!(render("{{}}{{name}}", &v), "{{}}Ada");
    }

    #[test]
    fn configured_variables_override_builtin_ones() {
        let v = variables(
            &vars(&[("actor_name", "Boss")]),
            [
                ("actor_name", Some("Ada".to_owned())),
                ("bot_id", None),
                ("date", Some("2026-01-01".to_owned())),
            ],
        );
        assert_eq!(v, vars(&[("actor_name", "Boss"), ("date", "2026-01-01")]));
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(utc_date(1_767_225_599), "2025-12-31");
        assert_eq!(utc_date(-86_400), "1969-12-31");
    }

    fn chunk(kb: &str, doc: &str, index: i64, score: f64) -> Chunk {
        Chunk {
            kb_id: kb.into(),
            document_id: doc.into(),
            title: doc.into(),
            chunk_index: index,
            content: format!("{doc}#{index}"),
            score,
        }
    }

    #[test]
    fn hits_become_chunks() {
        let hit = json!({"content": " text ", "score": 0.5, "document_id": "d1", "title": "T",
                         "chunk_index": 2});
        let c = Chunk::from_hit("kb", &hit).unwrap();
        assert_eq!(
            (c.content.as_str(), c.title.as_str(), c.chunk_index),
            ("text", "T", 2)
        );
        assert!(Chunk::from_hit("kb", &json!({"content": ""})).is_none());
        assert!(Chunk::from_hit("kb", &json!({"score": 1})).is_none());
    }

    #[test]
    fn chunks_merge_by_score_without_repeats() {
        let merged = merge_chunks(
            vec![
                vec![chunk("a", "d1", 0, 0.2), chunk("a", "d2", 0, 0.9)],
                vec![chunk("b", "d1", 0, 0.2), chunk("b", "d3", 1, 0.5)],
            ],
            3,
        );
        let ids: Vec<&str> = merged.iter().map(|c| c.content.as_str()).collect();
        assert_eq!(ids, ["d2#0", "d3#1", "d1#0"]);
        assert_eq!(merged[2].kb_id, "a", "the first base wins a tie");
    }

    #[test]
    fn reranking_reorders_and_cuts() {
        let chunks = vec![
            chunk("a", "d1", 0, 0.9),
            chunk("a", "d2", 0, 0.8),
            chunk("a", "d3", 0, 0.7),
        ];
        let answer = json!({"results": [
            {"index": 2, "relevance_score": 0.99}, {"index": 9, "relevance_score": 0.5},
            {"index": 0, "relevance_score": 0.4}, {"index": 2, "relevance_score": 0.1}]});
        let out = apply_rerank(chunks.clone(), &answer, 5);
        let ids: Vec<&str> = out.iter().map(|c| c.document_id.as_str()).collect();
        assert_eq!(ids, ["d3", "d1"]);
        assert_eq!(out[0].score, 0.99);
        assert_eq!(apply_rerank(chunks.clone(), &answer, 1).len(), 1);
        assert_eq!(
            apply_rerank(chunks, &json!({}), 2).len(),
            2,
            "unusable answer: order kept"
        );
    }

    #[test]
    fn one_system_message_then_history_then_input() {
        let knowledge = knowledge_block(&[chunk("a", "d1", 0, 1.0)]);
        assert!(knowledge.as_deref().unwrap().ends_with("[1] d1\nd1#0"));
        assert_eq!(knowledge_block(&[]), None);
        let system = system_message(&[
            Some("Be brief.".into()),
            None,
            knowledge,
            summary_block("user: hi"),
            Some("  ".into()),
        ])
        .unwrap();
        let text = system["content"].as_str().unwrap();
        assert!(text.starts_with("Be brief.\n\nKnowledge base excerpts"));
        assert!(text.ends_with("oldest first:\nuser: hi"));
        assert_eq!(system_message(&[None, Some(" ".into())]), None);
        assert_eq!(summary_block(" "), None);

        let history = [
            Turn {
                speaker: Speaker::User,
                content: "q1".into(),
                cursor: None,
                seq: None,
            },
            Turn {
                speaker: Speaker::Assistant,
                content: "a1".into(),
                cursor: None,
                seq: None,
            },
        ];
        let messages = assemble(Some(system), &history, "q2");
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(messages[3]["content"], "q2");
        assert_eq!(assemble(None, &[], "x"), vec![user_message("x")]);
        assert!(messages_tokens(&messages) > messages_tokens(&messages[3..]));
    }

    #[test]
    fn funcs_always_have_an_object_schema() {
        let f = func(
            "lookup",
            "Looks up",
            Some(&json!({"type": "object", "required": ["q"]})),
        );
        assert_eq!(f["parameters"]["required"][0], "q");
        assert_eq!(
            func("t", "", Some(&json!("junk")))["parameters"]["type"],
            "object"
        );
        assert_eq!(func("t", "", None)["name"], "t");
    }
}
