//! Knowledge base retrieval: user text to a stemmed, any-term full-text query with one
//! ranking contract on both backends (see [`crate::ResourceRegistry`]).
//!
//! Users (and models) ask in their own words — "when will my refund arrive?" — not in the
//! words of the document ("Refunds are issued within five days"), so an all-words,
//! exact-word match (the transcript's rules) misses most real questions. Here:
//!
//! 1. **Terms.** The text is split into words at every character that is not a letter or a
//!    digit (the split FTS5's `unicode61` and Postgres' parser make for ordinary words),
//!    lower-cased, English stop words dropped ([`STOP_WORDS`], Postgres' `english` list, so
//!    both backends ignore the same words), duplicates dropped, at most
//!    [`MAX_QUERY_TERMS`] kept. Query syntax (quotes, `OR`, `-`, `*`, `:`) is not
//!    interpreted: every word is just a word, so no text is a syntax error.
//! 2. **Match.** A chunk matches when it contains **any** term after stemming: the index is
//!    stemmed (Postgres `english`, FTS5 `porter`, see the `m…_000012` migration) and each
//!    term is stemmed the same way by the backend, so `refund` finds "refunds" and
//!    `configuring` finds "configured".
//! 3. **Rank.** Chunks containing more of the query's terms come first (`matched`); among
//!    those, the backend's relevance (`relevance`: `-bm25` on FTS5, `ts_rank_cd` with
//!    length normalisation on Postgres, both ≥ 0, higher is better); then earlier chunks.
//!    Counting terms first makes the order the same in kind on both backends, whose
//!    relevance formulas differ: a chunk that answers the whole question beats one that
//!    repeats one of its words.
//! 4. **Score.** A hit's score is `matched + relevance / (1 + relevance)`: its integer part
//!    is the number of query terms the chunk contains, its fraction the relevance, so scores
//!    fall in the order of the hits.

use sea_orm::{DbBackend, Statement, Value as SqlValue};

use crate::error::{Result, StoreError};
use crate::resources::KbSearch;

/// Most distinct terms of one query; words after these are ignored. A question is far
/// shorter; this bounds the work of a pasted paragraph (one sub-query per term on SQLite).
pub(crate) const MAX_QUERY_TERMS: usize = 32;

/// English stop words: Postgres' `english` stop list (`tsearch_data/english.stop`, the
/// Snowball list). Postgres drops them from the index and from queries by itself; FTS5
/// indexes them, so the query side drops them for both, and a question's "how", "do" and
/// "I" match nothing anywhere.
#[rustfmt::skip] // a word list, kept as dense as the file it comes from
pub(crate) const STOP_WORDS: [&str; 127] = [
    "i", "me", "my", "myself", "we", "our", "ours", "ourselves", "you", "your", "yours",
    "yourself", "yourselves", "he", "him", "his", "himself", "she", "her", "hers", "herself",
    "it", "its", "itself", "they", "them", "their", "theirs", "themselves", "what", "which",
    "who", "whom", "this", "that", "these", "those", "am", "is", "are", "was", "were", "be",
    "been", "being", "have", "has", "had", "having", "do", "does", "did", "doing", "a", "an",
    "the", "and", "but", "if", "or", "because", "as", "until", "while", "of", "at", "by",
    "for", "with", "about", "against", "between", "into", "through", "during", "before",
    "after", "above", "below", "to", "from", "up", "down", "in", "out", "on", "off", "over",
    "under", "again", "further", "then", "once", "here", "there", "when", "where", "why",
    "how", "all", "any", "both", "each", "few", "more", "most", "other", "some", "such", "no",
    "nor", "not", "only", "own", "same", "so", "than", "too", "very", "s", "t", "can", "will",
    "just", "don", "should", "now",
];

/// The search terms of user `input`, in order of first appearance (see the module docs).
pub(crate) fn query_terms(input: &str) -> Vec<String> {
    let mut terms: Vec<String> = Vec::new();
    for word in input.split(|c: char| !c.is_alphanumeric()) {
        if word.is_empty() {
            continue;
        }
        let word = word.to_lowercase();
        if STOP_WORDS.contains(&word.as_str()) || terms.contains(&word) {
            continue;
        }
        terms.push(word);
        if terms.len() == MAX_QUERY_TERMS {
            break;
        }
    }
    terms
}

/// `term` as an FTS5 string literal: the tokenizer (and its stemmer) sees it as text, never
/// as query syntax. Terms hold only letters and digits; quotes are doubled all the same.
fn fts5_literal(term: &str) -> String {
    format!("\"{}\"", term.replace('"', "\"\""))
}

/// Collects bound values and writes their placeholders: `$n` on Postgres (which may repeat
/// one), `?` on SQLite (positional: values in the order their marks appear in the text).
struct Binds {
    backend: DbBackend,
    values: Vec<SqlValue>,
}

impl Binds {
    fn push(&mut self, value: impl Into<SqlValue>) -> String {
        self.values.push(value.into());
        match self.backend {
            DbBackend::Postgres => format!("${}", self.values.len()),
            _ => "?".to_owned(),
        }
    }
}

/// The statement answering `search` for `terms` (non-empty) with at most `top_k` rows of
/// `content, matched, relevance, document_id, title, chunk_index`, in rank order.
pub(crate) fn statement(
    backend: DbBackend,
    search: &KbSearch,
    terms: &[String],
    top_k: u64,
) -> Result<Statement> {
    let mut binds = Binds {
        backend,
        values: Vec::new(),
    };
    let (select, from_where) = match backend {
        DbBackend::Postgres => {
            let queries: Vec<String> = terms
                .iter()
                .map(|term| format!("plainto_tsquery('english', {})", binds.push(term.clone())))
                .collect();
            let any = queries.join(" || ");
            let matched = queries
                .iter()
                .map(|q| format!("(c.\"content_tsv\" @@ {q})::int"))
                .collect::<Vec<_>>()
                .join(" + ");
            (
                format!(
                    "({matched})::bigint AS matched, \
                     ts_rank_cd(c.\"content_tsv\", {any}, 1)::float8 AS relevance"
                ),
                format!(
                    "FROM \"kb_chunks\" c JOIN \"kb_documents\" d ON d.\"id\" = c.\"document_id\" \
                     WHERE c.\"content_tsv\" @@ ({any})"
                ),
            )
        }
        DbBackend::Sqlite => {
            // Values bind in text order: the per-term sub-queries of the select list first.
            let matched = terms
                .iter()
                .map(|term| {
                    format!(
                        "(c.\"seq\" IN (SELECT \"rowid\" FROM \"kb_chunks_fts\" \
                         WHERE \"kb_chunks_fts\" MATCH {}))",
                        binds.push(fts5_literal(term))
                    )
                })
                .collect::<Vec<_>>()
                .join(" + ");
            let any = terms
                .iter()
                .map(|term| fts5_literal(term))
                .collect::<Vec<_>>()
                .join(" OR ");
            (
                format!(
                    "({matched}) AS matched, CAST(-bm25(f.\"kb_chunks_fts\") AS REAL) AS relevance"
                ),
                format!(
                    "FROM \"kb_chunks_fts\" f JOIN \"kb_chunks\" c ON c.\"seq\" = f.\"rowid\" \
                     JOIN \"kb_documents\" d ON d.\"id\" = c.\"document_id\" \
                     WHERE f.\"kb_chunks_fts\" MATCH {}",
                    binds.push(any)
                ),
            )
        }
        other => {
            return Err(StoreError::invalid(format!(
                "full-text search is not supported on {other:?}"
            )));
        }
    };
    let mut sql = format!(
        "SELECT c.\"content\" AS content, {select}, c.\"document_id\" AS document_id, \
         d.\"name\" AS title, c.\"chunk_index\" AS chunk_index {from_where}"
    );
    sql.push_str(&format!(
        " AND c.\"workspace_id\" = {}",
        binds.push(search.workspace_id.as_str().to_owned())
    ));
    sql.push_str(&format!(" AND c.\"kb_id\" = {}", binds.push(search.kb_id)));
    if !search.document_ids.is_empty() {
        let marks: Vec<String> = search
            .document_ids
            .iter()
            .map(|id| binds.push(*id))
            .collect();
        sql.push_str(&format!(" AND c.\"document_id\" IN ({})", marks.join(", ")));
    }
    sql.push_str(&format!(
        " ORDER BY matched DESC, relevance DESC, c.\"seq\" ASC LIMIT {}",
        binds.push(i64::try_from(top_k).unwrap_or(i64::MAX))
    ));
    Ok(Statement::from_sql_and_values(backend, sql, binds.values))
}

/// The score of a hit (see the module docs): `matched` in the integer part, the relevance
/// (≥ 0) squashed into the fraction.
pub(crate) fn score(matched: i64, relevance: f64) -> f64 {
    let relevance = if relevance.is_finite() {
        relevance.max(0.0)
    } else {
        0.0
    };
    #[allow(clippy::cast_precision_loss)] // a count of at most MAX_QUERY_TERMS
    let matched = matched.max(0) as f64;
    matched + relevance / (1.0 + relevance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_are_words_without_stop_words_or_repeats() {
        assert_eq!(
            query_terms("How do I get a REFUND for my refund?"),
            vec!["get", "refund"]
        );
        assert_eq!(
            query_terms("e-mail: \"reset\" OR -password*"),
            vec!["e", "mail", "reset", "password"]
        );
        assert_eq!(
            query_terms("Ünïcode façade 42"),
            vec!["ünïcode", "façade", "42"]
        );
        assert!(query_terms("how do I").is_empty());
        assert!(query_terms("\"*( OR").is_empty());
        assert!(query_terms("").is_empty());
        let many: String = (0..100).map(|i| format!("w{i} ")).collect();
        assert_eq!(query_terms(&many).len(), MAX_QUERY_TERMS);
    }

    #[test]
    fn every_stop_word_is_a_lower_case_word() {
        for word in STOP_WORDS {
            assert_eq!(query_terms(word), Vec::<String>::new(), "{word}");
            assert!(word.chars().all(|c| c.is_ascii_lowercase()), "{word}");
        }
    }

    #[test]
    fn literals_are_quoted() {
        assert_eq!(fts5_literal("refund"), "\"refund\"");
        assert_eq!(fts5_literal("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn scores_order_like_the_ranking() {
        assert!(score(2, 0.0) > score(1, 1e6));
        assert!(score(1, 3.0) > score(1, 2.0));
        assert_eq!(score(1, 0.0), 1.0);
        assert!(score(1, 1e300) <= 2.0);
        assert_eq!(score(0, f64::NAN), 0.0);
        assert_eq!(score(1, -5.0), 1.0);
    }
}
