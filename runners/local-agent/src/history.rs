//! The conversation's prior turns within a token budget, and the compaction checkpoint.
//!
//! The host never inlines history (seed AGENT_CONTEXT): the loop pages the transcript
//! backwards with `history_page`, newest first, and this module decides what of it goes to
//! the model. Budgets are in *estimated* tokens ([`estimate_tokens`]): the runner has no
//! tokenizer for an arbitrary model, so the estimate errs on the generous side for
//! non-Latin text, where the usual "4 characters per token" rule is 3–4 times too low (the
//! seed's RUN_STEERING_AND_CHECKPOINT notes it makes compaction trigger late).
//!
//! # Compaction checkpoint
//!
//! When the turns do not all fit, the oldest are dropped and summarised into a checkpoint
//! stored in conversation state under [`CHECKPOINT_KEY`] (seed RUN_STEERING_AND_CHECKPOINT
//! §2.3): `{schema_version, summary, covers_until, covers_until_seq, tokens_before,
//! created_at, conversation_id}`. `covers_until` is the transcript cursor of the newest
//! summarised turn; later runs page only the turns after it and put the summary in the
//! prompt instead, so a long conversation is summarised once, not at every run, and its
//! start is not forgotten when it falls off the page. A checkpoint of another conversation,
//! of another schema, or whose cursor the host no longer accepts is ignored (the loop then
//! pages from the newest turn as if there were none).
//!
//! The summary is extractive and deterministic (the first words of each dropped turn, the
//! newest lines kept within [`SUMMARY_MAX_CHARS`]): it costs no model call out of the run's
//! budget and cannot fail, and it is stable, so the prompt prefix does not drift between
//! runs (provider prompt caches stay warm).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The conversation-scope state key of the checkpoint (seed convention).
pub const CHECKPOINT_KEY: &str = "runner.compaction.checkpoint";
/// `schema_version` of the checkpoints this runner writes and reads.
pub const CHECKPOINT_SCHEMA: &str = "switchboard.local_agent.compaction_checkpoint.v1";
/// Longest summary kept in a checkpoint: about 500 tokens, a small share of any window.
pub const SUMMARY_MAX_CHARS: usize = 2_000;
/// Characters of one dropped turn kept in the summary.
pub const SUMMARY_LINE_CHARS: usize = 200;
/// Tokens a chat message costs besides its text (role and separators in chat templates).
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 4;

/// Estimated tokens of `text`: ASCII at 4 characters per token (English with BPE
/// vocabularies), every other character as one token (CJK runs at 1–2 characters per token;
/// counting one keeps the estimate from running short).
#[must_use]
pub fn estimate_tokens(text: &str) -> u64 {
    let (ascii, other) = text.chars().fold((0u64, 0u64), |(a, o), c| {
        if c.is_ascii() { (a + 1, o) } else { (a, o + 1) }
    });
    ascii.div_ceil(4) + other
}

/// Estimated tokens of one chat message with `content`.
#[must_use]
pub fn message_tokens(content: &str) -> u64 {
    estimate_tokens(content) + MESSAGE_OVERHEAD_TOKENS
}

/// Who said a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaker {
    /// The user.
    User,
    /// The agent.
    Assistant,
}

impl Speaker {
    /// The chat role.
    #[must_use]
    pub const fn role(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

/// One prior turn of the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// Who said it.
    pub speaker: Speaker,
    /// Its text.
    pub content: String,
    /// Its transcript cursor (opaque).
    pub cursor: Option<String>,
    /// Its transcript sequence number.
    pub seq: Option<i64>,
}

impl Turn {
    /// Estimated tokens as a chat message.
    #[must_use]
    pub fn tokens(&self) -> u64 {
        message_tokens(&self.content)
    }
}

/// The turn of a `history_page` item (a `TranscriptItem` as JSON), or `None` for what is
/// not a prior turn: items of the current event (its own user message is the run's input),
/// roles other than user and assistant, non-message items and empty text.
#[must_use]
pub fn turn_of(item: &Value, current_event_id: &str) -> Option<Turn> {
    if item.get("event_id").and_then(Value::as_str) == Some(current_event_id) {
        return None;
    }
    let item_type = item
        .get("item_type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    if item_type != "message" {
        return None;
    }
    let speaker = match item.get("role").and_then(Value::as_str)? {
        "user" => Speaker::User,
        "assistant" => Speaker::Assistant,
        _ => return None,
    };
    let content = item.get("content").and_then(Value::as_str)?.trim();
    if content.is_empty() {
        return None;
    }
    Some(Turn {
        speaker,
        content: content.to_owned(),
        cursor: item
            .get("cursor")
            .and_then(Value::as_str)
            .map(str::to_owned),
        seq: item.get("seq").and_then(Value::as_i64),
    })
}

/// The tokens history may use: what the window leaves after the answer's reserve and the
/// fixed part of the prompt (system prompt, knowledge, input, tool definitions), and never
/// more than half the window, so the tool loop's own messages (calls, results, further
/// answers) keep the other half.
#[must_use]
pub fn history_budget(window: u64, max_output: u64, fixed: u64) -> u64 {
    window
        .saturating_sub(max_output)
        .saturating_sub(fixed)
        .min(window / 2)
}

/// What [`trim_to_budget`] kept and dropped, each oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trimmed {
    /// The turns that go to the model.
    pub kept: Vec<Turn>,
    /// The older turns that do not fit (to be summarised).
    pub dropped: Vec<Turn>,
}

impl Trimmed {
    /// Estimated tokens of the kept turns.
    #[must_use]
    pub fn kept_tokens(&self) -> u64 {
        self.kept.iter().map(Turn::tokens).sum()
    }
}

/// Keeps the newest turns that fit in `budget` (a contiguous tail: a turn that does not
/// fit ends the history, older ones are not squeezed in around it, which would tear a
/// conversation apart). The kept part never starts with an assistant turn whose question
/// was dropped: strict chat templates (Mistral, Llama 2) refuse a conversation that does
/// not alternate starting with the user, and the answer alone is noise.
#[must_use]
pub fn trim_to_budget(newest_first: Vec<Turn>, budget: u64) -> Trimmed {
    let mut used = 0u64;
    let mut kept_newest_first = Vec::new();
    let mut rest = newest_first.into_iter();
    let mut dropped_newest_first = Vec::new();
    for turn in rest.by_ref() {
        let cost = turn.tokens();
        if used + cost > budget {
            dropped_newest_first.push(turn);
            break;
        }
        used += cost;
        kept_newest_first.push(turn);
    }
    dropped_newest_first.extend(rest);
    let mut kept: Vec<Turn> = kept_newest_first.into_iter().rev().collect();
    let mut dropped: Vec<Turn> = dropped_newest_first.into_iter().rev().collect();
    while kept
        .first()
        .is_some_and(|t| t.speaker == Speaker::Assistant)
    {
        dropped.push(kept.remove(0));
    }
    Trimmed { kept, dropped }
}

/// The compaction checkpoint (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// [`CHECKPOINT_SCHEMA`].
    pub schema_version: String,
    /// The summary lines, oldest first.
    pub summary: String,
    /// Cursor of the newest summarised turn.
    pub covers_until: String,
    /// Its transcript sequence number (diagnostics).
    #[serde(default)]
    pub covers_until_seq: Option<i64>,
    /// Estimated tokens of the history when it was compacted.
    pub tokens_before: u64,
    /// Epoch seconds.
    pub created_at: i64,
    /// The conversation it summarises.
    pub conversation_id: String,
}

impl Checkpoint {
    /// The checkpoint in a state value, if it is one of ours for `conversation_id`.
    #[must_use]
    pub fn read(value: Option<&Value>, conversation_id: &str) -> Option<Self> {
        let checkpoint: Self = serde_json::from_value(value?.clone()).ok()?;
        (checkpoint.schema_version == CHECKPOINT_SCHEMA
            && checkpoint.conversation_id == conversation_id
            && !checkpoint.covers_until.is_empty())
        .then_some(checkpoint)
    }

    /// The state value.
    #[must_use]
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// A new checkpoint covering `previous` and the `dropped` turns (oldest first), or `None`
/// when nothing was dropped or no dropped turn has a cursor to anchor it.
#[must_use]
pub fn compact(
    previous: Option<&Checkpoint>,
    dropped: &[Turn],
    conversation_id: &str,
    tokens_before: u64,
    now: i64,
) -> Option<Checkpoint> {
    let anchor = dropped.iter().rev().find(|t| t.cursor.is_some())?;
    Some(Checkpoint {
        schema_version: CHECKPOINT_SCHEMA.to_owned(),
        summary: summarize(previous.map(|c| c.summary.as_str()), dropped),
        covers_until: anchor.cursor.clone().unwrap_or_default(),
        covers_until_seq: anchor.seq,
        tokens_before,
        created_at: now,
        conversation_id: conversation_id.to_owned(),
    })
}

/// The previous summary's lines followed by one line per dropped turn (`user: …`), the
/// newest lines kept within [`SUMMARY_MAX_CHARS`].
#[must_use]
pub fn summarize(previous: Option<&str>, dropped: &[Turn]) -> String {
    let mut lines: Vec<String> = previous
        .into_iter()
        .flat_map(str::lines)
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    for turn in dropped {
        lines.push(format!(
            "{}: {}",
            turn.speaker.role(),
            clip(&turn.content, SUMMARY_LINE_CHARS)
        ));
    }
    let mut total = 0usize;
    let mut start = lines.len();
    for line in lines.iter().rev() {
        let cost = line.chars().count() + 1;
        if total + cost > SUMMARY_MAX_CHARS {
            break;
        }
        total += cost;
        start -= 1;
    }
    lines[start..].join("\n")
}

/// `text` with runs of whitespace collapsed, cut to `max` characters (`…` marks a cut).
fn clip(text: &str, max: usize) -> String {
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() <= max {
        return collapsed;
    }
    let mut cut: String = collapsed.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn turn(speaker: Speaker, content: &str, seq: i64) -> Turn {
        Turn {
            speaker,
            content: content.to_owned(),
            cursor: Some(format!("c{seq}")),
            seq: Some(seq),
        }
    }

    #[test]
    fn token_estimates_are_generous_for_non_latin_text() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        assert_eq!(estimate_tokens("年假多少天"), 5);
        assert_eq!(message_tokens("abcd"), 1 + MESSAGE_OVERHEAD_TOKENS);
    }

    #[test]
    fn only_prior_user_and_assistant_messages_are_turns() {
        let item = |role: &str, event: &str, content: Value| {
            json!({"transcript_id": "t", "event_id": event, "role": role, "item_type": "message",
                   "content": content, "cursor": "cur", "seq": 7})
        };
        let t = turn_of(&item("user", "e1", json!(" hello ")), "e9").unwrap();
        assert_eq!((t.speaker, t.content.as_str()), (Speaker::User, "hello"));
        assert_eq!((t.cursor.as_deref(), t.seq), (Some("cur"), Some(7)));
        assert!(turn_of(&item("assistant", "e1", json!("hi")), "e9").is_some());
        assert!(
            turn_of(&item("user", "e9", json!("now")), "e9").is_none(),
            "the current event"
        );
        assert!(turn_of(&item("system", "e1", json!("x")), "e9").is_none());
        assert!(turn_of(&item("user", "e1", json!("  ")), "e9").is_none());
        assert!(turn_of(&item("user", "e1", Value::Null), "e9").is_none());
        let mut other = item("user", "e1", json!("x"));
        other["item_type"] = json!("note");
        assert!(turn_of(&other, "e9").is_none());
    }

    #[test]
    fn the_budget_leaves_room_for_the_answer_the_prompt_and_the_loop() {
        assert_eq!(
            history_budget(8192, 1024, 500),
            4096,
            "at most half the window"
        );
        assert_eq!(history_budget(8192, 1024, 4000), 3168);
        assert_eq!(history_budget(1000, 900, 500), 0);
    }

    #[test]
    fn trimming_keeps_the_newest_contiguous_tail() {
        let turns = vec![
            turn(Speaker::Assistant, &"d".repeat(40), 4), // 14 tokens
            turn(Speaker::User, &"c".repeat(40), 3),
            turn(Speaker::Assistant, &"b".repeat(400), 2), // 104 tokens
            turn(Speaker::User, "a", 1),
        ];
        let t = trim_to_budget(turns.clone(), 30);
        assert_eq!(
            t.kept.iter().map(|t| t.seq).collect::<Vec<_>>(),
            [Some(3), Some(4)]
        );
        assert_eq!(
            t.dropped.iter().map(|t| t.seq).collect::<Vec<_>>(),
            [Some(1), Some(2)]
        );
        assert_eq!(t.kept_tokens(), 28);
        // Everything fits.
        let all = trim_to_budget(turns.clone(), 1_000);
        assert_eq!(all.kept.len(), 4);
        assert!(all.dropped.is_empty());
        // The small oldest turn is not squeezed in after the big one was dropped.
        let t = trim_to_budget(turns.clone(), 40);
        assert_eq!(t.kept.len(), 2);
        // An answer whose question did not fit is dropped with it.
        let t = trim_to_budget(turns, 15);
        assert!(t.kept.is_empty(), "{t:?}");
        assert_eq!(t.dropped.len(), 4);
    }

    #[test]
    fn checkpoints_are_read_only_when_they_are_ours() {
        let dropped = [
            turn(Speaker::User, "What is the leave policy?", 1),
            turn(Speaker::Assistant, "Annual leave is   25 days.", 2),
        ];
        let cp = compact(None, &dropped, "conv-1", 123, 1_700_000_000).unwrap();
        assert_eq!(cp.covers_until, "c2");
        assert_eq!(cp.covers_until_seq, Some(2));
        assert_eq!(
            cp.summary,
            "user: What is the leave policy?\nassistant: Annual leave is 25 days."
        );
        let value = cp.to_value();
        assert_eq!(value["schema_version"], CHECKPOINT_SCHEMA);
        assert_eq!(Checkpoint::read(Some(&value), "conv-1"), Some(cp.clone()));
        assert_eq!(
            Checkpoint::read(Some(&value), "conv-2"),
            None,
            "another conversation"
        );
        let mut other = value.clone();
        other["schema_version"] = json!("langbot.local_agent.compaction_checkpoint.v1");
        assert_eq!(Checkpoint::read(Some(&other), "conv-1"), None);
        assert_eq!(Checkpoint::read(Some(&json!("junk")), "conv-1"), None);
        assert_eq!(Checkpoint::read(None, "conv-1"), None);

        // The next compaction extends the previous summary.
        let later = [turn(Speaker::User, "And expenses?", 5)];
        let next = compact(Some(&cp), &later, "conv-1", 50, 1_700_000_100).unwrap();
        assert!(
            next.summary
                .starts_with("user: What is the leave policy?\n")
        );
        assert!(next.summary.ends_with("\nuser: And expenses?"));
        assert_eq!(next.covers_until, "c5");
        // Nothing dropped, or nothing to anchor on: no checkpoint.
        assert_eq!(compact(Some(&cp), &[], "conv-1", 0, 0), None);
        let mut anchorless = later[0].clone();
        anchorless.cursor = None;
        assert_eq!(compact(None, &[anchorless], "conv-1", 0, 0), None);
    }

    #[test]
    fn summaries_keep_the_newest_lines_within_their_cap() {
        let many: Vec<Turn> = (0..100)
            .map(|i| turn(Speaker::User, &format!("{i} {}", "x".repeat(300)), i))
            .collect();
        let summary = summarize(Some("old line"), &many);
        assert!(summary.chars().count() <= SUMMARY_MAX_CHARS);
        assert!(summary.lines().last().unwrap().starts_with("user: 99 "));
        assert!(!summary.contains("old line"), "the oldest lines go first");
        let line = summary.lines().last().unwrap();
        assert_eq!(line.chars().count(), "user: ".len() + SUMMARY_LINE_CHARS);
        assert!(line.ends_with('…'));
    }
}
