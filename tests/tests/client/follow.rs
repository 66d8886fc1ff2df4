//! [`RunFollower`] against the stand-in gateway: dropped, aborted and replayed streams,
//! polling, re-posts with the same idempotency key, retryable statuses, dead gateways,
//! stalls and error frames.

use std::time::Duration;

use sb_protocol::result::AgentRunResult;
use sb_tests::stand_in_gateway::{Script, TestGateway};
use switchboard::client::{FollowError, FollowOptions, GatewayClient, NewEvent, RunFollower};
use tokio::time::Instant;

fn options() -> FollowOptions {
    FollowOptions {
        deadline: Some(Instant::now() + Duration::from_secs(20)),
        idle_timeout: Duration::from_secs(5),
        max_attempts: 4,
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        poll_initial: Duration::from_millis(1),
        poll_max: Duration::from_millis(5),
    }
}

async fn collect(follower: &mut RunFollower<'_>) -> Result<Vec<AgentRunResult>, FollowError> {
    let mut items = Vec::new();
    while let Some(item) = follower.next().await? {
        items.push(item);
    }
    Ok(items)
}

fn types(items: &[AgentRunResult]) -> Vec<(u64, &str)> {
    items
        .iter()
        .map(|i| (i.sequence.unwrap_or(0), i.result_type.as_str()))
        .collect()
}

const ECHO_TWO_WORDS: [(u64, &str); 4] = [
    (1, "message.delta"),
    (2, "message.delta"),
    (3, "message.completed"),
    (4, "run.completed"),
];

#[tokio::test]
async fn streams_the_post_answer_with_auth_and_idempotency_key() {
    let gw = TestGateway::start(Script::default()).await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(
        NewEvent::message("c1", "u1", "hello world"),
        "key-1".into(),
        options(),
    );
    let items = collect(&mut f).await.unwrap();
    assert_eq!(types(&items), ECHO_TWO_WORDS);
    assert!(f.run_id().is_some());
    let stats = gw.stats();
    assert_eq!(
        (stats.posts, stats.stream_posts, stats.run_streams),
        (1, 1, 0)
    );
    assert_eq!(stats.idempotency_keys, vec!["key-1".to_owned()]);
}

#[tokio::test]
async fn missing_key_is_an_api_error() {
    let gw = TestGateway::start(Script::default()).await;
    let client = GatewayClient::new(&gw.url(), None).unwrap();
    let mut f = client.follow(NewEvent::message("c1", "u1", "hi"), "k".into(), options());
    let err = f.next().await.unwrap_err();
    assert_eq!(err.code(), "unauthorized");
    assert_eq!(gw.stats().posts, 1, "a 401 is not retried");
}

#[tokio::test]
async fn resumes_a_dropped_post_stream_from_the_run_stream() {
    // Clean end of the body, aborted connection, and a server that replays from the
    // start despite `after_sequence` (the follower must drop what it already yielded).
    for (abort, ignore_resume) in [(false, false), (true, false), (false, true)] {
        let gw = TestGateway::start(Script {
            drop_after: vec![2],
            abort_connection: abort,
            ignore_resume,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(
            NewEvent::message("c", "u", "hello world"),
            "k".into(),
            options(),
        );
        let items = collect(&mut f).await.unwrap();
        assert_eq!(types(&items), ECHO_TWO_WORDS, "abort={abort}");
        let stats = gw.stats();
        assert_eq!((stats.posts, stats.run_streams), (1, 1), "abort={abort}");
        assert_eq!(stats.last_event_ids, vec![Some("2".to_owned())]);
        assert_eq!(stats.after_sequences, vec![2]);
        assert_eq!(f.reconnects(), 1);
    }
}

#[tokio::test]
async fn polls_the_event_when_the_stream_drops_before_any_frame() {
    let gw = TestGateway::start(Script {
        drop_after: vec![0],
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(
        NewEvent::message("c", "u", "hello world"),
        "k".into(),
        options(),
    );
    let items = collect(&mut f).await.unwrap();
    assert_eq!(types(&items), ECHO_TWO_WORDS);
    let stats = gw.stats();
    assert_eq!((stats.posts, stats.polls, stats.run_streams), (1, 1, 1));
    assert_eq!(stats.after_sequences, vec![0]);
}

#[tokio::test]
async fn polls_the_event_when_the_gateway_stops_waiting_for_the_route() {
    let gw = TestGateway::start(Script {
        route_timeout: true,
        polls_before_run: 2,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(
        NewEvent::message("c", "u", "hello world"),
        "k".into(),
        options(),
    );
    assert_eq!(types(&collect(&mut f).await.unwrap()), ECHO_TWO_WORDS);
    let stats = gw.stats();
    assert_eq!((stats.posts, stats.polls, stats.run_streams), (1, 3, 1));
    assert_eq!(f.reconnects(), 0, "not a failure");
}

#[tokio::test]
async fn reposts_when_the_stream_drops_before_any_frame_without_event_id() {
    // First POST stream dies at once and does not name the event; the second (same
    // key) streams from the start, drops at 3 and is resumed from the run stream.
    let gw = TestGateway::start(Script {
        drop_after: vec![0, 3],
        event_id_header: false,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(
        NewEvent::message("c", "u", "hello world"),
        "same".into(),
        options(),
    );
    let items = collect(&mut f).await.unwrap();
    assert_eq!(types(&items), ECHO_TWO_WORDS);
    let stats = gw.stats();
    assert_eq!(stats.posts, 2);
    assert_eq!(
        stats.events_created, 1,
        "the idempotency key dedupes the re-post"
    );
    assert_eq!(stats.after_sequences, vec![3]);
}

#[tokio::test]
async fn falls_back_to_polling_when_the_post_is_not_streamed() {
    let gw = TestGateway::start(Script {
        stream_on_post: false,
        polls_before_run: 3,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(
        NewEvent::message("c", "u", "hello world"),
        "k".into(),
        options(),
    );
    let items = collect(&mut f).await.unwrap();
    assert_eq!(types(&items), ECHO_TWO_WORDS);
    let stats = gw.stats();
    assert_eq!(stats.polls, 4);
    assert_eq!(
        (stats.run_streams, stats.after_sequences.clone()),
        (1, vec![0])
    );
    assert!(f.event_id().is_some());
}

#[tokio::test]
async fn unrouted_and_rejected_events_end_with_the_reason() {
    for (status, stream_on_post) in [("unrouted", false), ("rejected", false), ("unrouted", true)] {
        let gw = TestGateway::start(Script {
            stream_on_post,
            event_status: status,
            ..Script::default()
        })
        .await;
        let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
        let mut f = client.follow(NewEvent::message("c", "u", "x"), "k".into(), options());
        let err = f.next().await.unwrap_err();
        assert_eq!(err.code(), format!("event.{status}"));
        assert!(err.to_string().contains("no binding matched"), "{err}");
    }
}

#[tokio::test]
async fn retryable_statuses_are_retried_then_reported() {
    let gw = TestGateway::start(Script {
        post_failures: 2,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
    assert_eq!(collect(&mut f).await.unwrap().len(), 3);
    assert_eq!(gw.stats().posts, 3);

    let gw = TestGateway::start(Script {
        post_failures: 100,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
    let err = f.next().await.unwrap_err();
    assert_eq!(err.code(), "unavailable");
    assert_eq!(gw.stats().posts, 4, "max_attempts");
}

#[tokio::test]
async fn a_dead_gateway_is_lost_and_a_silent_run_times_out() {
    let client = GatewayClient::new(&TestGateway::dead_url().await, Some("k1")).unwrap();
    let mut f = client.follow(NewEvent::message("c", "u", "hi"), "k".into(), options());
    let err = f.next().await.unwrap_err();
    assert!(
        matches!(err, FollowError::Lost { attempts: 4, .. }),
        "{err}"
    );

    let gw = TestGateway::start(Script {
        stall_after: Some(1),
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut opts = options();
    opts.deadline = Some(Instant::now() + Duration::from_millis(300));
    let mut f = client.follow(NewEvent::message("c", "u", "hello world"), "k".into(), opts);
    assert!(f.next().await.unwrap().is_some());
    assert!(matches!(f.next().await, Err(FollowError::TimedOut)));
}

#[tokio::test]
async fn error_frames_end_the_follow() {
    let gw = TestGateway::start(Script {
        error_frame: true,
        ..Script::default()
    })
    .await;
    let client = GatewayClient::new(&gw.url(), Some("k1")).unwrap();
    let mut f = client.follow(NewEvent::message("c", "u", "x"), "k".into(), options());
    let err = f.next().await.unwrap_err();
    assert_eq!(err.code(), "internal");
}
