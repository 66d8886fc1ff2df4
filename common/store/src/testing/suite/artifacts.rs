//! Artifact store contract tests: verified content, ranged reads and the cap, expiry and
//! external content.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sha2::{Digest, Sha256};

use super::{assert_code, ws};
use crate::artifacts::{ArtifactContent, ArtifactScope, NewArtifact};
use crate::testing::TestDb;

fn inline(bytes: &[u8]) -> NewArtifact {
    let mut a = NewArtifact::inline(
        ws(),
        "file",
        "runner",
        ArtifactScope::Conversation,
        bytes.to_vec(),
    );
    a.conversation_id = Some("c1".into());
    a.mime_type = Some("text/plain".into());
    a.name = Some("a.txt".into());
    a
}

/// Declared sha256/size are verified; absent ones are computed.
pub async fn artifact_put_verifies_sha_and_size(db: &TestDb) {
    let bytes = b"hello artifact";
    let sha = hex::encode(Sha256::digest(bytes));
    let rec = db.stores.artifacts.put(inline(bytes)).await.unwrap();
    assert_eq!(rec.sha256.as_deref(), Some(sha.as_str()));
    assert_eq!(rec.size_bytes, Some(bytes.len() as i64));
    assert_eq!(rec.storage_type, "inline");
    assert_eq!(rec.scope, ArtifactScope::Conversation);
    assert_eq!(db.stores.artifacts.metadata(&rec.id).await.unwrap(), rec);

    let mut ok = inline(bytes);
    ok.declared_sha256 = Some(sha.to_uppercase());
    ok.declared_size = Some(bytes.len() as i64);
    ok.id = Some("declared-ok".into());
    assert_eq!(
        db.stores.artifacts.put(ok).await.unwrap().sha256.as_deref(),
        Some(sha.as_str())
    );

    let mut wrong_sha = inline(bytes);
    wrong_sha.id = Some("wrong-sha".into());
    wrong_sha.declared_sha256 = Some(hex::encode(Sha256::digest(b"other")));
    assert_code(
        db.stores.artifacts.put(wrong_sha).await,
        ErrorCode::InvalidArgument,
    );
    assert_code(
        db.stores.artifacts.metadata("wrong-sha").await,
        ErrorCode::NotFound,
    );

    let mut wrong_size = inline(bytes);
    wrong_size.id = Some("wrong-size".into());
    wrong_size.declared_size = Some(3);
    assert_code(
        db.stores.artifacts.put(wrong_size).await,
        ErrorCode::InvalidArgument,
    );
    assert_code(
        db.stores.artifacts.metadata("wrong-size").await,
        ErrorCode::NotFound,
    );

    let mut malformed = inline(bytes);
    malformed.declared_sha256 = Some("xyz".into());
    assert_code(
        db.stores.artifacts.put(malformed).await,
        ErrorCode::InvalidArgument,
    );

    let mut dup = inline(bytes);
    dup.id = Some("declared-ok".into());
    assert_code(db.stores.artifacts.put(dup).await, ErrorCode::Conflict);

    let too_big = inline(&vec![0u8; crate::testing::SUITE_MAX_ARTIFACT_BYTES + 1]);
    assert_code(
        db.stores.artifacts.put(too_big).await,
        ErrorCode::PayloadTooLarge,
    );
    assert_code(
        db.stores.artifacts.metadata("missing").await,
        ErrorCode::NotFound,
    );
}

/// Ranged reads with default and capped limits, `has_more`, and argument checks.
pub async fn artifact_range_reads_and_cap(db: &TestDb) {
    let bytes: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let rec = db.stores.artifacts.put(inline(&bytes)).await.unwrap();
    let read = |offset: i64, limit: Option<i64>| {
        let stores = db.stores.clone();
        let id = rec.id.clone();
        async move { stores.artifacts.read(&id, offset, limit).await }
    };
    let all = read(0, None).await.unwrap();
    assert_eq!(all.content.as_deref(), Some(bytes.as_slice()));
    assert!(!all.has_more);
    assert_eq!(all.artifact.id, rec.id);
    let head = read(0, Some(1000)).await.unwrap();
    assert_eq!(head.content.as_deref(), Some(&bytes[..1000]));
    assert!(head.has_more);
    let mid = read(1000, Some(1000)).await.unwrap();
    assert_eq!(mid.content.as_deref(), Some(&bytes[1000..2000]));
    assert_eq!(mid.offset, 1000);
    assert!(mid.has_more);
    let tail = read(2500, Some(1000)).await.unwrap();
    assert_eq!(tail.content.as_deref(), Some(&bytes[2500..]));
    assert!(!tail.has_more);
    let exact_end = read(2000, Some(1000)).await.unwrap();
    assert_eq!(exact_end.content.as_deref(), Some(&bytes[2000..]));
    assert!(!exact_end.has_more);
    for past in [3000, 5000, i64::MAX] {
        let r = read(past, None).await.unwrap();
        assert_eq!(r.content.as_deref(), Some(&[][..]));
        assert!(!r.has_more);
    }
    assert_code(read(-1, None).await, ErrorCode::InvalidArgument);
    assert_code(read(0, Some(0)).await, ErrorCode::InvalidArgument);
    assert_code(read(0, Some(-3)).await, ErrorCode::InvalidArgument);
    assert_code(
        db.stores.artifacts.read("missing", 0, None).await,
        ErrorCode::NotFound,
    );

    // Default 1 MiB and the 10 MiB cap.
    let big: Vec<u8> = (0..11 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let big_rec = db.stores.artifacts.put(inline(&big)).await.unwrap();
    let default = db
        .stores
        .artifacts
        .read(&big_rec.id, 0, None)
        .await
        .unwrap();
    assert_eq!(default.content.as_ref().map(Vec::len), Some(1024 * 1024));
    assert!(default.has_more);
    let capped = db
        .stores
        .artifacts
        .read(&big_rec.id, 5, Some(100 * 1024 * 1024))
        .await
        .unwrap();
    let capped_bytes = capped.content.unwrap();
    assert_eq!(capped_bytes.len(), 10 * 1024 * 1024);
    assert_eq!(capped_bytes[..], big[5..5 + 10 * 1024 * 1024]);
    assert!(capped.has_more);
}

/// Expired artifacts are missing everywhere; cleanup deletes only expired ones; external
/// content reads return the reference.
pub async fn artifact_expiry_and_external_content(db: &TestDb) {
    let mut expired = inline(b"old");
    expired.id = Some("expired".into());
    expired.expires_at = Some(Utc::now() - TimeDelta::seconds(1));
    db.stores.artifacts.put(expired).await.unwrap();
    let mut live = inline(b"new");
    live.id = Some("live".into());
    live.expires_at = Some(Utc::now() + TimeDelta::hours(1));
    let live_rec = db.stores.artifacts.put(live).await.unwrap();
    assert!(live_rec.expires_at.is_some());

    assert_code(
        db.stores.artifacts.metadata("expired").await,
        ErrorCode::NotFound,
    );
    assert_code(
        db.stores.artifacts.read("expired", 0, None).await,
        ErrorCode::NotFound,
    );
    assert_eq!(
        db.stores
            .artifacts
            .delete_expired(Utc::now(), 10)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        db.stores
            .artifacts
            .delete_expired(Utc::now(), 10)
            .await
            .unwrap(),
        0
    );
    assert!(db.stores.artifacts.metadata("live").await.is_ok());
    // The live one expires later.
    assert_eq!(
        db.stores
            .artifacts
            .delete_expired(Utc::now() + TimeDelta::hours(2), 10)
            .await
            .unwrap(),
        1
    );

    let mut url = inline(b"");
    url.content = ArtifactContent::Url("https://example.com/x.png".into());
    url.declared_size = Some(1234);
    let url_rec = db.stores.artifacts.put(url).await.unwrap();
    assert_eq!(url_rec.storage_type, "url");
    assert_eq!(url_rec.size_bytes, Some(1234));
    assert_eq!(url_rec.sha256, None);
    let read = db
        .stores
        .artifacts
        .read(&url_rec.id, 0, None)
        .await
        .unwrap();
    assert_eq!(read.content, None);
    assert_eq!(read.file_key.as_deref(), Some("https://example.com/x.png"));
    assert!(!read.has_more);
    let mut meta_only = inline(b"");
    meta_only.content = ArtifactContent::MetadataOnly;
    let rec = db.stores.artifacts.put(meta_only).await.unwrap();
    let read = db.stores.artifacts.read(&rec.id, 0, None).await.unwrap();
    assert_eq!((read.content, read.file_key), (None, None));
}
