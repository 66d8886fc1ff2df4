//! Knowledge search contract tests: matching the way users ask, and the ranking contract
//! shared by every backend.

use serde_json::json;

use super::ws;
use crate::testing::TestDb;
use crate::*;

/// A small help-centre corpus, one chunk per document (see [`kb_titles`]).
const KB_CORPUS: [(&str, &str); 5] = [
    (
        "returns",
        "To return an item, open your orders page and choose Return. Refunds are issued \
         to the original payment method within five business days.",
    ),
    (
        "shipping",
        "Orders ship within two business days. Shipping is free for orders over fifty \
         dollars; express delivery costs extra.",
    ),
    (
        "passwords",
        "Forgot your password? Use the reset link on the sign-in page. Each reset link \
         expires after one hour.",
    ),
    (
        "accounts",
        "You can delete your account from the settings page. Deleting an account removes \
         every saved address.",
    ),
    (
        "newsletter",
        "Every newsletter ends with an unsubscribe link. The link works on any device, \
         and the link never expires.",
    ),
];

async fn kb_with(db: &TestDb, docs: &[(&str, &str)]) -> uuid::Uuid {
    let r = &db.stores.resources;
    let kb = r.create_kb(&ws(), "help", None).await.unwrap();
    for (title, text) in docs {
        let stored = r
            .add_document(NewKbDocument {
                workspace_id: ws(),
                kb_id: kb.kb_id,
                title: (*title).to_owned(),
                text: (*text).to_owned(),
                artifact_id: None,
                metadata: json!({}),
            })
            .await
            .unwrap();
        assert_eq!(stored.chunks, 1);
    }
    kb.kb_id
}

async fn kb_hits(db: &TestDb, kb_id: uuid::Uuid, query: &str, top_k: u64) -> Vec<KbHit> {
    let hits = db
        .stores
        .resources
        .search_kb(KbSearch {
            workspace_id: ws(),
            kb_id,
            query: query.to_owned(),
            top_k,
            document_ids: Vec::new(),
        })
        .await
        .unwrap();
    assert!(
        hits.windows(2).all(|w| w[0].score >= w[1].score),
        "scores fall in rank order: {hits:?}"
    );
    hits
}

/// The titles of the hits for `query`, best first.
async fn kb_titles(db: &TestDb, kb_id: uuid::Uuid, query: &str) -> Vec<String> {
    kb_hits(db, kb_id, query, 10)
        .await
        .into_iter()
        .map(|h| h.title)
        .collect()
}

/// Knowledge search matches questions in the user's words: any query word counts, words
/// are stemmed (plural/singular, verb forms), case and stop words do not matter, and no
/// text is a syntax error.
pub async fn kb_search_matches_the_way_users_ask(db: &TestDb) {
    let kb = kb_with(db, &KB_CORPUS).await;
    // Paraphrased questions: the chunk shares only some (stemmed) words with them.
    assert_eq!(
        kb_titles(db, kb, "When will my refund arrive?").await,
        ["returns"]
    );
    assert_eq!(
        kb_titles(db, kb, "I forgot the password I use to sign in").await,
        ["passwords"]
    );
    assert_eq!(
        kb_titles(db, kb, "how long until my delivery gets here").await,
        ["shipping"]
    );
    // Plural and singular, verb forms, either way round.
    assert_eq!(kb_titles(db, kb, "password resets").await, ["passwords"]);
    assert_eq!(kb_titles(db, kb, "deleting accounts").await, ["accounts"]);
    assert_eq!(kb_titles(db, kb, "saved addresses").await, ["accounts"]);
    assert_eq!(kb_titles(db, kb, "returning items").await, ["returns"]);
    assert_eq!(kb_titles(db, kb, "shipping cost").await, ["shipping"]);
    // Partial: words the corpus does not have do not spoil the ones it has.
    assert_eq!(
        kb_titles(db, kb, "express shipping to Canada").await,
        ["shipping"]
    );
    assert_eq!(kb_titles(db, kb, "PASSWORD").await, ["passwords"]);
    // Nothing to match: stop words only, unknown words, query syntax, empty text.
    for query in ["how do I", "quantum chromodynamics", "\"*( OR -", "", "  "] {
        assert!(kb_titles(db, kb, query).await.is_empty(), "{query:?}");
    }
    // Filters and limits still apply.
    let one = kb_hits(db, kb, "link", 1).await;
    assert_eq!(one.len(), 1);
    assert_eq!(one, kb_hits(db, kb, "link", 10).await[..1]);
}

/// The ranking contract, the same on every backend: chunks containing more of the
/// query's words first; then relevance; then earlier chunks. A hit's score has the number
/// of matched words as its integer part.
pub async fn kb_search_ranks_coverage_then_relevance(db: &TestDb) {
    let mut docs = KB_CORPUS.to_vec();
    docs.push(("gift-a", "Gift cards never expire."));
    docs.push(("gift-b", "Gift cards never expire."));
    let kb = kb_with(db, &docs).await;
    // "link" is three times in the newsletter, but only the password page has both words.
    let hits = kb_hits(db, kb, "reset link", 10).await;
    let titles: Vec<&str> = hits.iter().map(|h| h.title.as_str()).collect();
    assert_eq!(titles, ["passwords", "newsletter"], "{hits:?}");
    assert_eq!(hits[0].score.floor(), 2.0, "{hits:?}");
    assert_eq!(hits[1].score.floor(), 1.0, "{hits:?}");
    let hits = kb_hits(db, kb, "never expires: gift card links", 10).await;
    let titles: Vec<&str> = hits.iter().map(|h| h.title.as_str()).collect();
    // gift-a and gift-b match gift, card, never, expire (4); the newsletter never,
    // expire, link (3); the password page expire, link (2). Equal chunks: earlier first.
    assert_eq!(
        titles,
        ["gift-a", "gift-b", "newsletter", "passwords"],
        "{hits:?}"
    );
    assert_eq!(hits[0].score, hits[1].score);
    assert_eq!(
        hits.iter().map(|h| h.score.floor()).collect::<Vec<_>>(),
        [4.0, 4.0, 3.0, 2.0]
    );
    // A document filter narrows the same ranking.
    let gift_b = hits[1].document_id;
    let only = db
        .stores
        .resources
        .search_kb(KbSearch {
            workspace_id: ws(),
            kb_id: kb,
            query: "gift cards".into(),
            top_k: 10,
            document_ids: vec![gift_b],
        })
        .await
        .unwrap();
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].title, "gift-b");
}
