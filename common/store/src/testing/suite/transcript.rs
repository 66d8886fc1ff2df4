//! Transcript contract tests: truncation, paging both ways, full-text search (ranking,
//! hostile queries) and retention.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::RunId;
use serde_json::json;

use super::{assert_code, message, other_ws, ws};
use crate::testing::TestDb;
use crate::*;

/// Content is cut at 4000 chars; `content_json` keeps everything.
pub async fn transcript_append_truncates_and_roundtrips(db: &TestDb) {
    let long = "y".repeat(4001);
    let mut item = NewTranscriptItem::message(ws(), "c1", "ev-1", "assistant", long.clone());
    item.id = Some("t-1".into());
    item.thread_id = Some("th".into());
    item.bot_id = Some("bot".into());
    item.run_id = Some(RunId::new());
    item.runner_id = Some("plugin:a/b/c".into());
    item.content_json = Some(json!({"role": "assistant", "content": long}));
    item.artifact_refs = Some(json!([{"artifact_id": "a1"}]));
    item.metadata = json!({"run_id": "r"});
    let rec = db.stores.transcript.append(item.clone()).await.unwrap();
    assert_eq!(rec.id, "t-1");
    let content = rec.content.clone().unwrap();
    assert_eq!(content.chars().count(), 4000);
    assert_eq!(content, format!("{}...", "y".repeat(3997)));
    assert_eq!(rec.content_json, item.content_json);
    assert_eq!(rec.artifact_refs, item.artifact_refs);
    assert_eq!(rec.metadata, json!({"run_id": "r"}));
    assert_eq!(rec.run_id, item.run_id);
    assert_eq!(rec.thread_id.as_deref(), Some("th"));

    let exact = "z".repeat(4000);
    let rec2 = db
        .stores
        .transcript
        .append(NewTranscriptItem::message(
            ws(),
            "c1",
            "ev-2",
            "user",
            exact.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(rec2.content.as_deref(), Some(exact.as_str()));
    assert_eq!(rec2.metadata, json!({}));
    assert!(rec2.seq > rec.seq);
    assert_code(db.stores.transcript.append(item).await, ErrorCode::Conflict);
    let empty_conv = NewTranscriptItem::message(ws(), "", "e", "user", "x");
    assert_code(
        db.stores.transcript.append(empty_conv).await,
        ErrorCode::InvalidArgument,
    );
}

/// Backward / forward paging, ranges, thread filter, latest cursor, bad cursors.
pub async fn transcript_pages_in_both_directions(db: &TestDb) {
    let mut seqs = Vec::new();
    for i in 0..5 {
        let mut item =
            NewTranscriptItem::message(ws(), "c1", format!("e{i}"), "user", format!("m{i}"));
        item.thread_id = (i == 4).then(|| "t".to_owned());
        seqs.push(db.stores.transcript.append(item).await.unwrap());
    }
    db.stores
        .transcript
        .append(NewTranscriptItem::message(ws(), "c2", "x", "user", "other"))
        .await
        .unwrap();
    let seq = |page: &Page<TranscriptRecord>| page.items.iter().map(|r| r.seq).collect::<Vec<_>>();

    let mut q = TranscriptQuery::new(ws(), "c1");
    q.limit = Some(2);
    let p1 = db.stores.transcript.page(q.clone()).await.unwrap();
    assert_eq!(seq(&p1), vec![seqs[4].seq, seqs[3].seq]);
    assert!(p1.has_more);
    q.before_cursor = p1.next_cursor.clone();
    let p2 = db.stores.transcript.page(q.clone()).await.unwrap();
    assert_eq!(seq(&p2), vec![seqs[2].seq, seqs[1].seq]);
    q.before_cursor = p2.next_cursor.clone();
    let p3 = db.stores.transcript.page(q.clone()).await.unwrap();
    assert_eq!(seq(&p3), vec![seqs[0].seq]);
    assert!(!p3.has_more && p3.next_cursor.is_none());

    // Forward: from the start without a cursor, after a cursor with one.
    let mut f = TranscriptQuery::new(ws(), "c1");
    f.direction = Direction::Forward;
    f.limit = Some(2);
    let fp = db.stores.transcript.page(f.clone()).await.unwrap();
    assert_eq!(seq(&fp), vec![seqs[0].seq, seqs[1].seq]);
    f.after_cursor = fp.next_cursor.clone();
    f.limit = None;
    let fp2 = db.stores.transcript.page(f.clone()).await.unwrap();
    assert_eq!(seq(&fp2), vec![seqs[2].seq, seqs[3].seq, seqs[4].seq]);
    assert!(!fp2.has_more);
    // Both cursors bound a range.
    f.after_cursor = Some(seqs[0].cursor.clone());
    f.before_cursor = Some(seqs[3].cursor.clone());
    assert_eq!(
        seq(&db.stores.transcript.page(f).await.unwrap()),
        vec![seqs[1].seq, seqs[2].seq]
    );

    // Strict thread.
    let mut t = TranscriptQuery::new(ws(), "c1");
    t.thread = ThreadFilter::Exactly(None);
    assert_eq!(
        db.stores
            .transcript
            .page(t.clone())
            .await
            .unwrap()
            .items
            .len(),
        4
    );
    t.thread = ThreadFilter::Exactly(Some("t".into()));
    assert_eq!(
        seq(&db.stores.transcript.page(t).await.unwrap()),
        vec![seqs[4].seq]
    );

    // Limit clamp, latest cursor, other workspace.
    let mut l = TranscriptQuery::new(ws(), "c1");
    l.limit = Some(0);
    assert_eq!(db.stores.transcript.page(l).await.unwrap().items.len(), 1);
    assert_eq!(
        db.stores
            .transcript
            .latest_cursor(&ws(), "c1")
            .await
            .unwrap(),
        Some(seqs[4].cursor.clone())
    );
    assert_eq!(
        db.stores
            .transcript
            .latest_cursor(&ws(), "none")
            .await
            .unwrap(),
        None
    );
    assert!(
        db.stores
            .transcript
            .page(TranscriptQuery::new(other_ws(), "c1"))
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Bad and foreign cursors.
    let (event, _) = db
        .stores
        .events
        .append(message("c1", "x"), vec![])
        .await
        .unwrap();
    for bad in ["nope".to_owned(), "1".to_owned(), event.cursor] {
        let mut b = TranscriptQuery::new(ws(), "c1");
        b.before_cursor = Some(bad);
        assert_code(
            db.stores.transcript.page(b).await,
            ErrorCode::InvalidArgument,
        );
    }
}

async fn seed_search(db: &TestDb) -> Vec<TranscriptRecord> {
    let texts = [
        ("user", "The quick brown fox jumps over the lazy dog"),
        ("assistant", "Quick answer: quick thinking wins, quick!"),
        ("user", "a lazy afternoon with a brown cat"),
        ("assistant", "nothing relevant here"),
    ];
    let mut out = Vec::new();
    for (role, text) in texts {
        out.push(
            db.stores
                .transcript
                .append(NewTranscriptItem::message(ws(), "c1", "e", role, text))
                .await
                .unwrap(),
        );
    }
    db.stores
        .transcript
        .append(NewTranscriptItem::message(
            ws(),
            "c2",
            "e",
            "user",
            "quick fox elsewhere",
        ))
        .await
        .unwrap();
    out
}

async fn search(db: &TestDb, query: &str) -> Vec<String> {
    db.stores
        .transcript
        .search(TranscriptSearch::new(ws(), "c1", query))
        .await
        .unwrap_or_else(|e| panic!("search {query:?} failed: {e}"))
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// Whole words, case-insensitive, best match first, phrases, OR, exclusion, filters.
pub async fn transcript_search_matches_and_ranks(db: &TestDb) {
    let items = seed_search(db).await;
    let id = |i: usize| items[i].id.clone();
    assert_eq!(
        search(db, "quick").await,
        vec![id(1), id(0)],
        "more matches rank first"
    );
    assert_eq!(search(db, "QUICK").await, vec![id(1), id(0)]);
    assert_eq!(search(db, "brown lazy").await.len(), 2);
    let phrase = search(db, "\"brown fox\"").await;
    assert_eq!(phrase, vec![id(0)]);
    let mut either = search(db, "cat or fox").await;
    either.sort();
    let mut expected = vec![id(0), id(2)];
    expected.sort();
    assert_eq!(either, expected);
    assert_eq!(search(db, "lazy -cat").await, vec![id(0)]);
    assert!(search(db, "qui").await.is_empty(), "whole words only");
    assert!(
        search(db, "elsewhere").await.is_empty(),
        "other conversations are not searched"
    );

    let mut s = TranscriptSearch::new(ws(), "c1", "quick");
    s.roles = vec!["user".into()];
    let hits = db.stores.transcript.search(s).await.unwrap();
    assert_eq!(
        hits.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        vec![id(0)]
    );
    let mut s = TranscriptSearch::new(ws(), "c1", "quick");
    s.top_k = Some(1);
    assert_eq!(db.stores.transcript.search(s).await.unwrap().len(), 1);
    let mut s = TranscriptSearch::new(ws(), "c1", "quick");
    s.item_types = vec!["tool_call".into()];
    assert!(db.stores.transcript.search(s).await.unwrap().is_empty());
    let mut s = TranscriptSearch::new(other_ws(), "c1", "quick");
    s.top_k = Some(1000);
    assert!(db.stores.transcript.search(s).await.unwrap().is_empty());
}

/// No user text produces a SQL or FTS syntax error.
pub async fn transcript_search_survives_hostile_queries(db: &TestDb) {
    let items = seed_search(db).await;
    for query in [
        "\"",
        "\"\"",
        "*",
        "quick*",
        "OR",
        "AND",
        "NOT",
        "NEAR",
        "NEAR(quick fox)",
        "(",
        ")",
        "()",
        "'",
        "';",
        "'; drop table transcript; --",
        "' OR 1=1 --",
        "-",
        "--",
        "- -",
        "\\",
        "%",
        "_",
        "^quick",
        "content:quick",
        "{quick}",
        "[quick]",
        "quick AND",
        "quick OR",
        "OR quick",
        "-quick",
        "\"unterminated quick",
        "quick\"",
        "a\"b\"c",
        "!@#$%^&*()",
        "\u{0}",
        "💥",
        "日本語",
        "   ",
        "",
    ] {
        search(db, query).await;
    }
    // Still works afterwards, and still contains what it contained.
    assert_eq!(
        search(db, "quick").await,
        vec![items[1].id.clone(), items[0].id.clone()]
    );
    assert_eq!(
        search(db, "'; drop table transcript; --").await,
        Vec::<String>::new()
    );
}

/// Retention deletes items and search forgets them.
pub async fn transcript_delete_older_than_updates_search(db: &TestDb) {
    seed_search(db).await;
    assert_eq!(search(db, "quick").await.len(), 2);
    let cutoff = Utc::now() + TimeDelta::seconds(5);
    assert_eq!(
        db.stores
            .transcript
            .delete_older_than(cutoff, 3)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        db.stores
            .transcript
            .delete_older_than(cutoff, 10)
            .await
            .unwrap(),
        2
    );
    assert!(search(db, "quick").await.is_empty());
    // New items after deletion are searchable (the index stayed consistent).
    db.stores
        .transcript
        .append(NewTranscriptItem::message(
            ws(),
            "c1",
            "e",
            "user",
            "quick again",
        ))
        .await
        .unwrap();
    assert_eq!(search(db, "quick").await.len(), 1);
}
