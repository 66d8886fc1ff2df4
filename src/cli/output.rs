//! How the gateway commands talk to the operator: JSON (`--json`) or a short table on
//! stdout, colours only when stdout is a terminal (and `NO_COLOR` is unset, the `console`
//! crate's rule), progress on stderr only when stderr is a terminal, and resources named by
//! name or by id.
//!
//! Keeping these rules in one module is what makes every command behave alike: a script
//! piping `--json` output never sees escape codes or spinner frames, and a person at a
//! terminal never has to copy an id that a name would have said.

use std::time::Duration;

use anyhow::Context as _;
use console::Style;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::Method;
use serde_json::Value;

use crate::client::GatewayClient;

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints `rows` under `headers` as aligned columns on stdout (no colours: tables are for
/// reading and for `grep`).
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        println!("{}", out.trim_end());
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// A cell of a table: the string, number or boolean at `key` of `item`, `-` when absent.
#[must_use]
pub fn cell(item: &Value, key: &str) -> String {
    match item.get(key) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The style of an item type in `runs tail` (plain when stdout is not a terminal):
/// deltas and messages plain, tool calls cyan, knowledge yellow, the run's end green or red.
#[must_use]
pub fn item_style(item_type: &str) -> Style {
    let style = Style::new().for_stdout();
    match item_type {
        "run.completed" => style.green().bold(),
        "run.failed" | "error" => style.red().bold(),
        t if t.starts_with("tool.") => style.cyan(),
        t if t.starts_with("knowledge.") || t.contains("citation") => style.yellow(),
        t if t.starts_with("run.") || t.starts_with("state.") => style.dim(),
        _ => style,
    }
}

/// A spinner on stderr with `message`, drawn only when stderr is a terminal (so logs and
/// pipes stay clean); finish it with [`ProgressBar::finish_and_clear`].
#[must_use]
pub fn spinner(message: impl Into<String>) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message.into());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A resource collection of the gateway that the CLI addresses by name or by id.
#[derive(Debug, Clone, Copy)]
pub struct Collection {
    /// What an item is called in messages ("model").
    pub what: &'static str,
    /// The list path (`/v1/models`), answering `{items: [...]}`.
    pub path: &'static str,
    /// The id field of an item (`model_id`).
    pub id_field: &'static str,
}

/// `/v1/models`.
pub const MODELS: Collection = Collection {
    what: "model",
    path: "/v1/models",
    id_field: "model_id",
};
/// `/v1/tools`.
pub const TOOLS: Collection = Collection {
    what: "tool",
    path: "/v1/tools",
    id_field: "tool_id",
};
/// `/v1/knowledge-bases`.
pub const KNOWLEDGE_BASES: Collection = Collection {
    what: "knowledge base",
    path: "/v1/knowledge-bases",
    id_field: "kb_id",
};
/// `/v1/agents`.
pub const AGENTS: Collection = Collection {
    what: "agent",
    path: "/v1/agents",
    id_field: "agent_id",
};

/// The item of `items` that `name_or_id` names: the one whose id is `name_or_id`, else the
/// one whose `name` is (names are unique per workspace). An error names what was looked for.
pub fn find<'a>(
    items: &'a [Value],
    collection: Collection,
    name_or_id: &str,
) -> anyhow::Result<&'a Value> {
    items
        .iter()
        .find(|i| i[collection.id_field].as_str() == Some(name_or_id))
        .or_else(|| {
            items
                .iter()
                .find(|i| i["name"].as_str() == Some(name_or_id))
        })
        .with_context(|| format!("no {} named or with id `{name_or_id}`", collection.what))
}

/// Every item of a paged list endpoint (`{items, next_cursor, has_more}`), following
/// `next_cursor` page by page, as one `{"items": [...]}`.
pub async fn list_all(client: &GatewayClient, path: &str) -> anyhow::Result<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        query.append_pair("limit", &LIST_PAGE.to_string());
        if let Some(cursor) = &cursor {
            query.append_pair("cursor", cursor);
        }
        let separator = if path.contains('?') { '&' } else { '?' };
        let page = client
            .json(
                Method::GET,
                &format!("{path}{separator}{}", query.finish()),
                None,
            )
            .await?;
        all.extend(page["items"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(next) if page["has_more"].as_bool() == Some(true) => {
                cursor = Some(next.to_owned())
            }
            _ => return Ok(serde_json::json!({ "items": all })),
        }
    }
}

/// Page size asked for by [`list_all`] (the gateway clamps it to `limits.page_size_max`).
const LIST_PAGE: u32 = 200;

/// The id of the item `name_or_id` names in `collection` (every page of the list).
pub async fn resolve(
    client: &GatewayClient,
    collection: Collection,
    name_or_id: &str,
) -> anyhow::Result<String> {
    let list = list_all(client, collection.path).await?;
    let items = list["items"].as_array().cloned().unwrap_or_default();
    let item = find(&items, collection, name_or_id)?;
    item[collection.id_field]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("the gateway listed a {} without an id", collection.what))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn find_by_id_first_then_by_name() {
        let items = vec![
            json!({"model_id": "id-1", "name": "gpt"}),
            // A name that looks like another item's id still finds that item by id first.
            json!({"model_id": "id-2", "name": "id-1"}),
        ];
        assert_eq!(find(&items, MODELS, "id-2").unwrap()["name"], "id-1");
        assert_eq!(find(&items, MODELS, "gpt").unwrap()["model_id"], "id-1");
        assert_eq!(find(&items, MODELS, "id-1").unwrap()["name"], "gpt");
        let err = find(&items, MODELS, "nope").unwrap_err().to_string();
        assert!(err.contains("no model named or with id `nope`"), "{err}");
    }

    #[test]
    fn cells_render_scalars_and_absent_values() {
        let item = json!({"s": "x", "n": 3, "b": true, "z": null});
        assert_eq!(
            ["s", "n", "b", "z", "missing"].map(|k| cell(&item, k)),
            ["x", "3", "true", "-", "-"]
        );
    }

    #[test]
    fn styles_are_plain_off_a_terminal() {
        // Tests run with stdout captured: no escape codes.
        console::set_colors_enabled(false);
        assert_eq!(
            item_style("run.failed").apply_to("x").to_string(),
            "x",
            "no colour when stdout is not a terminal"
        );
    }
}
