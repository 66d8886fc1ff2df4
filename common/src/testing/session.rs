//! Session-store conformance tests: one function per point of the
//! [`SessionStore`] contract. Instantiate them with
//! [`session_suite!`](crate::session_suite).
//!
//! TTL tests use short real TTLs (hundreds of milliseconds) so they mean the same on Redis
//! and in memory; the memory backend additionally has paused-time tests of its own.

use std::sync::Arc;
use std::time::Duration;

use sb_protocol::ids::RunId;
use serde_json::json;

use super::SessionFixture;
use crate::session::{
    EndedSession, PullMode, PushOutcome, RunBegin, STEERING_CAP, SessionError, SessionStore,
    cancel_flag_key, run_handed_off_key, run_lease_key,
};

/// A TTL that expires during a test. Generous, so a loaded CI machine (the whole workspace's
/// tests in parallel on two cores) still makes the calls that must happen before it expires.
const SHORT: Duration = Duration::from_millis(1000);
const LONG: Duration = Duration::from_secs(60);
/// Longer than [`SHORT`] plus clock and scheduling slack.
const PAST_SHORT: Duration = Duration::from_millis(1800);

/// Runs `n` copies of `f` concurrently (on the multi-threaded test runtime) and collects the
/// results.
async fn concurrently<T, F, Fut>(store: &Arc<dyn SessionStore>, n: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Arc<dyn SessionStore>, usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let fut = f(store.clone(), i);
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                fut.await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for task in tasks {
        out.push(task.await.expect("task panicked"));
    }
    out
}

/// Sessions are stored, replaced, and read back as JSON.
pub async fn session_put_get_replace(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    assert_eq!(s.get_session(&run).await.unwrap(), None);
    let v1 = json!({"plugin": "p1", "apis": ["model.invoke"], "n": 1, "nested": {"ok": true}});
    s.put_session(&run, &v1, LONG).await.unwrap();
    assert_eq!(s.get_session(&run).await.unwrap(), Some(v1));
    let v2 = json!({"plugin": "p1", "n": 2});
    s.put_session(&run, &v2, LONG).await.unwrap();
    assert_eq!(s.get_session(&run).await.unwrap(), Some(v2));
    assert_eq!(
        s.get_session(&RunId::new()).await.unwrap(),
        None,
        "other runs are not visible"
    );
}

/// A session vanishes after its TTL; `touch_session` extends it.
pub async fn session_ttl_expires_and_touch_extends(fx: &SessionFixture) {
    let s = &fx.store;
    let (short, touched) = (RunId::new(), RunId::new());
    s.put_session(&short, &json!(1), SHORT).await.unwrap();
    s.put_session(&touched, &json!(2), SHORT).await.unwrap();
    assert!(s.touch_session(&touched, LONG).await.unwrap());
    assert!(
        !s.touch_session(&RunId::new(), LONG).await.unwrap(),
        "no session to touch"
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(s.get_session(&short).await.unwrap(), None);
    assert_eq!(s.get_session(&touched).await.unwrap(), Some(json!(2)));
    assert!(!s.touch_session(&short, LONG).await.unwrap());
}

/// `end_session` removes the session and its steering list and returns both, once.
pub async fn end_session_returns_the_steering_once(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    s.put_session(&run, &json!({"run": "x"}), LONG)
        .await
        .unwrap();
    for i in 0..3 {
        assert_eq!(
            s.steering_push(&run, &json!({"i": i}), STEERING_CAP)
                .await
                .unwrap(),
            PushOutcome::Accepted
        );
    }
    assert_eq!(
        s.steering_pull(&run, 1, PullMode::One).await.unwrap(),
        [json!({"i": 0})]
    );
    let ended = s
        .end_session(&run)
        .await
        .unwrap()
        .expect("the first end finds the session");
    assert_eq!(ended.steering, [json!({"i": 1}), json!({"i": 2})]);
    assert_eq!(s.end_session(&run).await.unwrap(), None);
    assert_eq!(s.get_session(&run).await.unwrap(), None);
    assert_eq!(s.steering_len(&run).await.unwrap(), 0);
    assert_eq!(
        s.steering_push(&run, &json!("late"), STEERING_CAP)
            .await
            .unwrap(),
        PushOutcome::NoSession
    );
    // A session without steering items ends with an empty list.
    let quiet = RunId::new();
    s.put_session(&quiet, &json!(null), LONG).await.unwrap();
    assert_eq!(
        s.end_session(&quiet).await.unwrap().unwrap().steering,
        Vec::<serde_json::Value>::new()
    );
}

/// Among concurrent `end_session` calls exactly one wins.
pub async fn end_session_exactly_once_under_concurrency(fx: &SessionFixture) {
    for _ in 0..5 {
        let run = RunId::new();
        fx.store
            .put_session(&run, &json!({"r": 1}), LONG)
            .await
            .unwrap();
        fx.store
            .steering_push(&run, &json!("s"), STEERING_CAP)
            .await
            .unwrap();
        let results = concurrently(&fx.store, 20, move |s, _| async move {
            s.end_session(&run).await.unwrap()
        })
        .await;
        let winners: Vec<_> = results.into_iter().flatten().collect();
        assert_eq!(winners.len(), 1, "exactly one caller ends the run");
        assert_eq!(winners[0].steering, [json!("s")]);
    }
}

/// Acquire is exclusive and re-entrant; renew and release only work for the holder.
pub async fn lease_acquire_renew_release(fx: &SessionFixture) {
    let s = &fx.store;
    assert_eq!(s.lease_holder("run-1").await.unwrap(), None);
    assert!(s.acquire_lease("run-1", "w1", LONG).await.unwrap());
    assert!(!s.acquire_lease("run-1", "w2", LONG).await.unwrap());
    assert!(
        s.acquire_lease("run-1", "w1", LONG).await.unwrap(),
        "re-acquire by the holder"
    );
    assert_eq!(
        s.lease_holder("run-1").await.unwrap().as_deref(),
        Some("w1")
    );
    s.renew_lease("run-1", "w1", LONG).await.unwrap();
    let err = s.renew_lease("run-1", "w2", LONG).await.unwrap_err();
    assert!(
        matches!(&err, SessionError::LeaseLost { key } if key == "run-1"),
        "{err:?}"
    );
    assert!(!s.release_lease("run-1", "w2").await.unwrap());
    assert_eq!(
        s.lease_holder("run-1").await.unwrap().as_deref(),
        Some("w1")
    );
    assert!(s.release_lease("run-1", "w1").await.unwrap());
    assert!(!s.release_lease("run-1", "w1").await.unwrap());
    assert!(matches!(
        s.renew_lease("run-1", "w1", LONG).await,
        Err(SessionError::LeaseLost { .. })
    ));
    assert!(s.acquire_lease("run-1", "w2", LONG).await.unwrap());
    assert!(
        s.acquire_lease("run-2", "w1", LONG).await.unwrap(),
        "leases are independent"
    );
}

/// `acquire_lease_and_get` takes the lease as `acquire_lease` does and reads the key with
/// it, taken or not.
pub async fn lease_acquire_and_get_reads_the_key(fx: &SessionFixture) {
    let s = &fx.store;
    assert_eq!(
        s.acquire_lease_and_get("route-1", "o1", LONG, "epoch")
            .await
            .unwrap(),
        (true, None)
    );
    s.set_ex("epoch", b"e1", LONG).await.unwrap();
    assert_eq!(
        s.acquire_lease_and_get("route-1", "o2", LONG, "epoch")
            .await
            .unwrap(),
        (false, Some(b"e1".to_vec()))
    );
    assert_eq!(
        s.acquire_lease_and_get("route-1", "o1", LONG, "epoch")
            .await
            .unwrap(),
        (true, Some(b"e1".to_vec())),
        "re-acquire by the holder"
    );
    assert_eq!(
        s.lease_holder("route-1").await.unwrap().as_deref(),
        Some("o1")
    );
    assert!(s.release_lease("route-1", "o1").await.unwrap());
}

/// `put_session_and_add` writes the session and adds the member to the set, with its TTL.
pub async fn put_session_and_add_writes_both(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    s.put_session_and_add(
        &run,
        &json!({"run": 1}),
        LONG,
        "active:c1",
        &run.to_string(),
        Some(SHORT),
    )
    .await
    .unwrap();
    assert_eq!(s.get_session(&run).await.unwrap(), Some(json!({"run": 1})));
    assert_eq!(s.set_members("active:c1").await.unwrap(), [run.to_string()]);
    tokio::time::sleep(PAST_SHORT).await;
    assert!(s.set_members("active:c1").await.unwrap().is_empty());
    assert_eq!(s.get_session(&run).await.unwrap(), Some(json!({"run": 1})));
}

/// An expired lease is free: another holder takes it and the old one sees `LeaseLost`.
pub async fn lease_expiry_lets_another_holder_steal(fx: &SessionFixture) {
    let s = &fx.store;
    assert!(s.acquire_lease("l", "w1", SHORT).await.unwrap());
    // Renewal keeps it alive past the original TTL.
    s.renew_lease("l", "w1", Duration::from_secs(4))
        .await
        .unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        !s.acquire_lease("l", "w2", SHORT).await.unwrap(),
        "renewed lease still held"
    );
    s.renew_lease("l", "w1", SHORT).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(s.lease_holder("l").await.unwrap(), None);
    assert!(matches!(
        s.renew_lease("l", "w1", SHORT).await,
        Err(SessionError::LeaseLost { .. })
    ));
    assert!(s.acquire_lease("l", "w2", LONG).await.unwrap());
    assert!(matches!(
        s.renew_lease("l", "w1", LONG).await,
        Err(SessionError::LeaseLost { .. })
    ));
    assert!(!s.release_lease("l", "w1").await.unwrap());
    assert_eq!(s.lease_holder("l").await.unwrap().as_deref(), Some("w2"));
}

/// Concurrent acquirers: exactly one wins.
pub async fn lease_acquire_race_has_one_winner(fx: &SessionFixture) {
    let results = concurrently(&fx.store, 30, |s, i| async move {
        s.acquire_lease("contended", &format!("w{i}"), LONG)
            .await
            .unwrap()
    })
    .await;
    assert_eq!(results.iter().filter(|won| **won).count(), 1);
}

/// `begin_run` takes the run lease like `acquire_lease` (exclusive, re-entrant, with a TTL)
/// and reads the cancel flag and the session only for the holder; another holder is named,
/// nothing is read.
pub async fn begin_run_takes_the_lease_and_reads_flag_and_session(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    let lease = run_lease_key(&run);
    let leased = |flag: Option<&[u8]>| RunBegin::Leased {
        cancel_flag: flag.map(<[u8]>::to_vec),
        session: Some(json!({"plugin": "p"})),
    };
    assert_eq!(
        s.begin_run(&run, "w1", LONG).await.unwrap(),
        RunBegin::Leased {
            cancel_flag: None,
            session: None
        },
        "no session yet"
    );
    s.put_session(&run, &json!({"plugin": "p"}), LONG)
        .await
        .unwrap();
    assert_eq!(s.begin_run(&run, "w1", LONG).await.unwrap(), leased(None));
    assert_eq!(s.lease_holder(&lease).await.unwrap().as_deref(), Some("w1"));
    s.set_ex(&cancel_flag_key(&run), b"user", LONG)
        .await
        .unwrap();
    assert_eq!(
        s.begin_run(&run, "w2", LONG).await.unwrap(),
        RunBegin::HeldBy("w1".into())
    );
    assert_eq!(
        s.begin_run(&run, "w1", SHORT).await.unwrap(),
        leased(Some(b"user")),
        "re-entrant for the holder, with the flag"
    );
    s.renew_lease(&lease, "w1", SHORT).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        s.begin_run(&run, "w2", LONG).await.unwrap(),
        leased(Some(b"user")),
        "the TTL given to begin_run lapsed"
    );
    assert!(matches!(
        s.renew_lease(&lease, "w1", LONG).await,
        Err(SessionError::LeaseLost { .. })
    ));
    assert!(s.release_lease(&lease, "w2").await.unwrap());
    assert!(matches!(
        s.begin_run(&run, "w", Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
}

/// Concurrent `begin_run` calls: exactly one takes the lease, the others name it.
pub async fn begin_run_race_has_one_winner(fx: &SessionFixture) {
    let run = RunId::new();
    let results = concurrently(&fx.store, 30, move |s, i| async move {
        (
            format!("w{i}"),
            s.begin_run(&run, &format!("w{i}"), LONG).await.unwrap(),
        )
    })
    .await;
    let winners: Vec<&String> = results
        .iter()
        .filter(|(_, begin)| matches!(begin, RunBegin::Leased { .. }))
        .map(|(holder, _)| holder)
        .collect();
    assert_eq!(winners.len(), 1);
    for (_, begin) in &results {
        if let RunBegin::HeldBy(holder) = begin {
            assert_eq!(holder, winners[0]);
        }
    }
}

/// `end_run` ends the session (returning it with its unpulled steering items), deletes the
/// cancel flag, sets the hand-off marker with its TTL and releases the lease of its holder
/// only.
pub async fn end_run_ends_the_session_and_hands_the_run_off(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    s.put_session(&run, &json!({"run": "x"}), LONG)
        .await
        .unwrap();
    for i in 0..2 {
        s.steering_push(&run, &json!(i), STEERING_CAP)
            .await
            .unwrap();
    }
    s.set_ex(&cancel_flag_key(&run), b"user", LONG)
        .await
        .unwrap();
    s.begin_run(&run, "w1", LONG).await.unwrap();
    let end = s.end_run(&run, "w1", SHORT).await.unwrap();
    let ended = end.ended.expect("the session was there");
    assert_eq!(ended.steering, [json!(0), json!(1)]);
    assert!(end.lease_released);
    assert_eq!(s.get_session(&run).await.unwrap(), None);
    assert_eq!(s.steering_len(&run).await.unwrap(), 0);
    assert_eq!(s.get(&cancel_flag_key(&run)).await.unwrap(), None);
    assert_eq!(s.lease_holder(&run_lease_key(&run)).await.unwrap(), None);
    let marker = run_handed_off_key(&run);
    assert_eq!(s.get(&marker).await.unwrap().as_deref(), Some(&b"w1"[..]));
    // Again: nothing left to end or release; the marker is set again.
    let again = s.end_run(&run, "w1", LONG).await.unwrap();
    assert_eq!(again.ended, None);
    assert!(!again.lease_released);
    assert_eq!(s.get(&marker).await.unwrap().as_deref(), Some(&b"w1"[..]));

    // A lease another holder took is left alone; the rest still happens.
    let taken = RunId::new();
    s.put_session(&taken, &json!(1), LONG).await.unwrap();
    assert_eq!(
        s.begin_run(&taken, "w2", LONG).await.unwrap(),
        RunBegin::Leased {
            cancel_flag: None,
            session: Some(json!(1))
        }
    );
    let end = s.end_run(&taken, "w1", SHORT).await.unwrap();
    assert!(!end.lease_released);
    assert_eq!(end.ended, Some(EndedSession { steering: vec![] }));
    assert_eq!(
        s.lease_holder(&run_lease_key(&taken))
            .await
            .unwrap()
            .as_deref(),
        Some("w2")
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        s.get(&run_handed_off_key(&taken)).await.unwrap(),
        None,
        "the marker expires with its TTL"
    );
    assert!(matches!(
        s.end_run(&run, "w1", Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
}

/// Among concurrent `end_run` and `end_session` callers exactly one receives the session,
/// and the lease is released once.
pub async fn end_run_exactly_once_under_concurrency(fx: &SessionFixture) {
    for _ in 0..5 {
        let run = RunId::new();
        fx.store
            .put_session(&run, &json!({"r": 1}), LONG)
            .await
            .unwrap();
        fx.store.begin_run(&run, "w", LONG).await.unwrap();
        let results = concurrently(&fx.store, 20, move |s, i| async move {
            if i % 2 == 0 {
                let end = s.end_run(&run, "w", LONG).await.unwrap();
                (end.ended, end.lease_released)
            } else {
                (s.end_session(&run).await.unwrap(), false)
            }
        })
        .await;
        assert_eq!(results.iter().filter(|(e, _)| e.is_some()).count(), 1);
        assert_eq!(results.iter().filter(|(_, r)| *r).count(), 1);
    }
}

/// The steering list holds at most `cap` items and returns them in push order.
pub async fn steering_cap_and_fifo(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    s.put_session(&run, &json!({}), LONG).await.unwrap();
    for i in 0..STEERING_CAP {
        assert_eq!(
            s.steering_push(&run, &json!(i), STEERING_CAP)
                .await
                .unwrap(),
            PushOutcome::Accepted
        );
    }
    assert_eq!(
        s.steering_push(&run, &json!("overflow"), STEERING_CAP)
            .await
            .unwrap(),
        PushOutcome::Full
    );
    assert_eq!(s.steering_len(&run).await.unwrap(), STEERING_CAP);
    let first = s.steering_pull(&run, 10, PullMode::All).await.unwrap();
    assert_eq!(first, (0..10).map(|i| json!(i)).collect::<Vec<_>>());
    // Room again after a pull.
    assert!(
        s.steering_push(&run, &json!("late"), STEERING_CAP)
            .await
            .unwrap()
            .is_accepted()
    );
    let rest = s
        .steering_pull(&run, STEERING_CAP, PullMode::All)
        .await
        .unwrap();
    let mut expected: Vec<_> = (10..STEERING_CAP).map(|i| json!(i)).collect();
    expected.push(json!("late"));
    assert_eq!(rest, expected);
    assert!(
        s.steering_pull(&run, STEERING_CAP, PullMode::All)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(s.steering_len(&run).await.unwrap(), 0);
}

/// `One` takes a single item, `All` up to `max`.
pub async fn steering_pull_modes(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    s.put_session(&run, &json!({}), LONG).await.unwrap();
    assert!(
        s.steering_pull(&run, 10, PullMode::One)
            .await
            .unwrap()
            .is_empty()
    );
    for text in ["a", "b", "c", "d"] {
        s.steering_push(&run, &json!({"text": text}), STEERING_CAP)
            .await
            .unwrap();
    }
    assert_eq!(
        s.steering_pull(&run, 100, PullMode::One).await.unwrap(),
        [json!({"text": "a"})]
    );
    assert_eq!(
        s.steering_pull(&run, 2, PullMode::All).await.unwrap(),
        [json!({"text": "b"}), json!({"text": "c"})]
    );
    assert_eq!(
        s.steering_pull(&run, 0, PullMode::All).await.unwrap(),
        Vec::<serde_json::Value>::new()
    );
    assert_eq!(
        s.steering_pull(&run, 100, PullMode::All).await.unwrap(),
        [json!({"text": "d"})]
    );
}

/// Concurrent pushes never overfill the list.
pub async fn steering_concurrent_pushes_respect_cap(fx: &SessionFixture) {
    let run = RunId::new();
    fx.store.put_session(&run, &json!({}), LONG).await.unwrap();
    let results = concurrently(&fx.store, 50, move |s, i| async move {
        s.steering_push(&run, &json!(i), 30).await.unwrap()
    })
    .await;
    assert_eq!(results.iter().filter(|r| r.is_accepted()).count(), 30);
    assert_eq!(
        results.iter().filter(|r| **r == PushOutcome::Full).count(),
        20
    );
    let items = fx
        .store
        .steering_pull(&run, 100, PullMode::All)
        .await
        .unwrap();
    assert_eq!(items.len(), 30);
    let mut seen: Vec<u64> = items.iter().map(|v| v.as_u64().unwrap()).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 30, "no item duplicated");
}

/// Pushing needs a live session, and the list dies with it.
pub async fn steering_requires_a_session(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    assert_eq!(
        s.steering_push(&run, &json!(1), STEERING_CAP)
            .await
            .unwrap(),
        PushOutcome::NoSession
    );
    s.put_session(&run, &json!({}), SHORT).await.unwrap();
    assert!(
        s.steering_push(&run, &json!(1), STEERING_CAP)
            .await
            .unwrap()
            .is_accepted()
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        s.steering_len(&run).await.unwrap(),
        0,
        "the list expires with the session"
    );
    assert_eq!(
        s.steering_push(&run, &json!(2), STEERING_CAP)
            .await
            .unwrap(),
        PushOutcome::NoSession
    );
}

/// 50 tasks × 20 increments lose nothing.
pub async fn counters_are_atomic_under_concurrency(fx: &SessionFixture) {
    concurrently(&fx.store, 50, |s, _| async move {
        for _ in 0..20 {
            s.counter_incr("hits", 1, None).await.unwrap();
        }
    })
    .await;
    assert_eq!(fx.store.counter_get("hits").await.unwrap(), 1000);
    assert_eq!(fx.store.counter_incr("hits", -1000, None).await.unwrap(), 0);
    assert_eq!(fx.store.counter_get("never").await.unwrap(), 0);
}

/// The TTL of a counter starts with its first increment and is not pushed back.
pub async fn counter_ttl_is_set_once(fx: &SessionFixture) {
    let s = &fx.store;
    // First TTL ends at t = 1.0 s; a TTL reset by the second increment would end at ≈ 1.4 s.
    assert_eq!(s.counter_incr("c", 5, Some(SHORT)).await.unwrap(), 5);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.counter_incr("c", 1, Some(SHORT)).await.unwrap(), 6);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        s.counter_get("c").await.unwrap(),
        0,
        "expired with the first TTL"
    );
    assert_eq!(s.counter_incr("c", 2, Some(LONG)).await.unwrap(), 2);
}

/// A budget never exceeds its limit and refuses everything once exhausted.
pub async fn budget_stays_exhausted(fx: &SessionFixture) {
    let s = &fx.store;
    assert_eq!(
        s.counter_try_add("chars", 60, 100, Some(LONG))
            .await
            .unwrap(),
        60
    );
    assert_eq!(
        s.counter_try_add("chars", 40, 100, Some(LONG))
            .await
            .unwrap(),
        100,
        "exactly at the limit"
    );
    assert_eq!(
        s.counter_try_add("chars", 0, 100, Some(LONG))
            .await
            .unwrap(),
        100
    );
    let err = s
        .counter_try_add("chars", 1, 100, Some(LONG))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, SessionError::Exhausted { key, used: 100, limit: 100 } if key == "chars"),
        "{err:?}"
    );

    assert_eq!(s.counter_try_add("tools", 6, 10, None).await.unwrap(), 6);
    let err = s.counter_try_add("tools", 5, 10, None).await.unwrap_err();
    assert!(
        matches!(
            err,
            SessionError::Exhausted {
                used: 6,
                limit: 10,
                ..
            }
        ),
        "{err:?}"
    );
    // 1 would fit, but the budget is exhausted for good.
    assert!(matches!(
        s.counter_try_add("tools", 1, 10, None).await,
        Err(SessionError::Exhausted { .. })
    ));
    assert!(matches!(
        s.counter_try_add("tools", 0, 10, None).await,
        Err(SessionError::Exhausted { .. })
    ));
    assert_eq!(
        s.counter_get("tools").await.unwrap(),
        6,
        "failed adds change nothing"
    );
}

/// 50 concurrent single-unit adds against a limit of 16: exactly 16 succeed.
pub async fn budget_is_atomic_under_concurrency(fx: &SessionFixture) {
    let results = concurrently(&fx.store, 50, |s, _| async move {
        s.counter_try_add("model_calls", 1, 16, Some(LONG)).await
    })
    .await;
    let ok: Vec<i64> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    assert_eq!(ok.len(), 16);
    let mut sorted = ok.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (1..=16).collect::<Vec<_>>(),
        "every success saw a distinct value"
    );
    assert!(
        results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .all(|e| matches!(e, SessionError::Exhausted { .. }))
    );
    assert_eq!(fx.store.counter_get("model_calls").await.unwrap(), 16);
}

/// `max_per_window` hits pass, the next is refused, and a new window starts afresh.
pub async fn rate_limit_fixed_window(fx: &SessionFixture) {
    let s = &fx.store;
    for i in 0..3 {
        assert!(
            s.rate_limit_hit("api", 3, SHORT).await.unwrap(),
            "hit {i} allowed"
        );
    }
    assert!(!s.rate_limit_hit("api", 3, SHORT).await.unwrap());
    assert!(!s.rate_limit_hit("api", 3, SHORT).await.unwrap());
    assert!(
        s.rate_limit_hit("other", 3, SHORT).await.unwrap(),
        "keys are independent"
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        s.rate_limit_hit("api", 3, SHORT).await.unwrap(),
        "new window"
    );
    let allowed = concurrently(&fx.store, 40, |s, _| async move {
        s.rate_limit_hit("burst", 10, LONG).await.unwrap()
    })
    .await;
    assert_eq!(allowed.iter().filter(|a| **a).count(), 10);
}

/// `set_nx_ex` sets only if absent, atomically.
pub async fn set_nx_ex_has_one_winner(fx: &SessionFixture) {
    let s = &fx.store;
    assert!(s.set_nx_ex("idem", b"first", LONG).await.unwrap());
    assert!(!s.set_nx_ex("idem", b"second", LONG).await.unwrap());
    assert_eq!(s.get("idem").await.unwrap().as_deref(), Some(&b"first"[..]));
    assert!(s.del("idem").await.unwrap());
    assert!(!s.del("idem").await.unwrap());
    let results = concurrently(&fx.store, 30, |s, i| async move {
        s.set_nx_ex("race", format!("{i}").as_bytes(), LONG)
            .await
            .unwrap()
    })
    .await;
    assert_eq!(results.iter().filter(|won| **won).count(), 1);
    let winner = results.iter().position(|won| *won).unwrap();
    assert_eq!(
        s.get("race").await.unwrap(),
        Some(winner.to_string().into_bytes())
    );
}

/// Plain keys: `set_ex` overwrites, values are bytes, TTLs expire.
pub async fn plain_keys_expire(fx: &SessionFixture) {
    let s = &fx.store;
    assert_eq!(s.get("k").await.unwrap(), None);
    s.set_ex("k", &[0, 159, 146, 150, 255], LONG).await.unwrap();
    assert_eq!(
        s.get("k").await.unwrap(),
        Some(vec![0, 159, 146, 150, 255]),
        "binary safe"
    );
    s.set_ex("k", b"v2", SHORT).await.unwrap();
    assert_eq!(s.get("k").await.unwrap(), Some(b"v2".to_vec()));
    s.set_nx_ex("n", b"x", SHORT).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(s.get("k").await.unwrap(), None);
    assert!(
        s.set_nx_ex("n", b"y", LONG).await.unwrap(),
        "expired key is absent for set_nx_ex"
    );
}

/// Set membership.
pub async fn sets_add_remove_members(fx: &SessionFixture) {
    let s = &fx.store;
    assert!(s.set_members("active").await.unwrap().is_empty());
    assert!(s.set_add("active", "run-b", Some(LONG)).await.unwrap());
    assert!(s.set_add("active", "run-a", None).await.unwrap());
    assert!(!s.set_add("active", "run-a", None).await.unwrap());
    assert_eq!(s.set_members("active").await.unwrap(), ["run-a", "run-b"]);
    assert!(s.set_remove("active", "run-b").await.unwrap());
    assert!(!s.set_remove("active", "run-b").await.unwrap());
    assert!(s.set_remove("active", "run-a").await.unwrap());
    assert!(s.set_members("active").await.unwrap().is_empty());
    s.set_add("short", "x", Some(SHORT)).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert!(s.set_members("short").await.unwrap().is_empty());
}

/// `set_remove_then_members` removes from one set and reads another (or the same) right
/// after.
pub async fn set_remove_then_members_reads_after_the_removal(fx: &SessionFixture) {
    let s = &fx.store;
    s.set_add("active", "run-a", Some(LONG)).await.unwrap();
    s.set_add("parked", "2-e", None).await.unwrap();
    s.set_add("parked", "1-e", None).await.unwrap();
    assert_eq!(
        s.set_remove_then_members("active", "run-a", "parked")
            .await
            .unwrap(),
        (true, vec!["1-e".to_owned(), "2-e".to_owned()])
    );
    assert!(s.set_members("active").await.unwrap().is_empty());
    assert_eq!(
        s.set_remove_then_members("active", "run-a", "nothing")
            .await
            .unwrap(),
        (false, Vec::new())
    );
    assert_eq!(
        s.set_remove_then_members("parked", "1-e", "parked")
            .await
            .unwrap(),
        (true, vec!["2-e".to_owned()]),
        "the read sees the removal"
    );
}

/// Inputs every backend refuses the same way.
pub async fn invalid_arguments_are_rejected(fx: &SessionFixture) {
    let s = &fx.store;
    let run = RunId::new();
    assert!(matches!(
        s.counter_try_add("b", -1, 10, None).await,
        Err(SessionError::InvalidArgument(_))
    ));
    assert!(matches!(
        s.put_session(&run, &json!(1), Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
    assert!(matches!(
        s.acquire_lease("l", "w", Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
    assert!(matches!(
        s.rate_limit_hit("r", 1, Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
    assert!(matches!(
        s.set_ex("k", b"v", Duration::ZERO).await,
        Err(SessionError::InvalidArgument(_))
    ));
    s.ping().await.unwrap();
}
