//! The schedule routes (`/v1/schedules`): the real router on in-memory SQLite, the memory
//! bus and the memory session store.

use axum::http::StatusCode;
use chrono::Utc;
use sb_gateway::GatewayOptions;
use sb_protocol::ids::EventId;
use sb_rules::schedules::plan_firing;
use serde_json::{Value, json};

mod support;

use support::Harness;

async fn harness() -> Harness {
    Harness::start(GatewayOptions::default()).await
}

impl Harness {
    async fn create(&self, body: &Value) -> Value {
        let (status, created) = self.call("POST", "/v1/schedules", Some(body)).await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        created
    }
}

fn good_morning() -> Value {
    json!({
        "event_type": "message.received",
        "source": "scheduler",
        "conversation_id": "daily",
        "actor": {"actor_type": "user", "actor_id": "u-1"},
        "input": {"text": "good morning"}
    })
}

#[tokio::test]
async fn schedules_create_read_list_and_delete() {
    let h = harness().await;
    let before = Utc::now().timestamp();
    let created = h
        .create(&json!({
            "name": "standup", "kind": "interval", "spec": "15m", "event": good_morning()
        }))
        .await;
    let id = created["schedule_id"]
        .as_str()
        .expect("schedule_id")
        .to_owned();
    assert_eq!(created["name"], "standup");
    assert_eq!(created["kind"], "interval");
    assert_eq!(created["spec"], "15m");
    assert_eq!(created["enabled"], true);
    assert_eq!(created["event"], good_morning());
    assert_eq!(created["last_fired_at"], Value::Null);
    let next = created["next_fire_at"].as_i64().expect("next_fire_at");
    assert!((before + 900..=Utc::now().timestamp() + 900).contains(&next));

    let (status, read) = h.call("GET", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{read}");
    assert_eq!(read, created);

    let second = h
        .create(&json!({
            "kind": "cron", "spec": "0 9 * * 1-5", "event": good_morning(), "enabled": false
        }))
        .await;
    assert_eq!(second["enabled"], false);
    assert_eq!(second["name"], Value::Null);

    let (status, page) = h.call("GET", "/v1/schedules?limit=1", None).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["schedule_id"], id.as_str());
    assert_eq!(page["has_more"], true);
    let cursor = page["next_cursor"].as_str().unwrap();
    let (_, rest) = h
        .call(
            "GET",
            &format!("/v1/schedules?limit=1&cursor={cursor}"),
            None,
        )
        .await;
    assert_eq!(rest["items"][0]["schedule_id"], second["schedule_id"]);
    assert_eq!(rest["has_more"], false);

    let (status, _) = h.call("DELETE", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, gone) = h.call("GET", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{gone}");
    assert_eq!(gone["code"], "not_found");
    let (status, _) = h.call("DELETE", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = h.call("GET", "/v1/schedules/not-an-id", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn schedules_are_scoped_to_the_key_workspace() {
    let h = harness().await;
    let other_key = h.api_key("ws-other").await;
    let created = h
        .create(&json!({"kind": "interval", "spec": "1h", "event": good_morning()}))
        .await;
    let uri = format!("/v1/schedules/{}", created["schedule_id"].as_str().unwrap());
    let (status, _) = h.call_as(&other_key, "GET", &uri, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = h.call_as(&other_key, "DELETE", &uri, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, page) = h.call_as(&other_key, "GET", "/v1/schedules", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["items"], json!([]));
    // Still there for its owner.
    let (status, _) = h.call("GET", &uri, None).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn invalid_schedules_are_refused_naming_the_field() {
    let h = harness().await;
    let mut no_input = good_morning();
    no_input.as_object_mut().unwrap().remove("input");
    let mut bad_conversation = good_morning();
    bad_conversation["conversation_id"] = json!("a\u{1}b");
    let mut typo = good_morning();
    typo["conversaton_id"] = json!("x");
    let mut client_id = good_morning();
    client_id["event_id"] = json!("e-1");
    let mut client_time = good_morning();
    client_time["event_time"] = json!(1_700_000_000);
    let cases = [
        (
            json!({"kind": "weekly", "spec": "1h", "event": good_morning()}),
            "`kind`",
        ),
        (
            json!({"kind": "interval", "spec": "soon", "event": good_morning()}),
            "`spec`",
        ),
        (
            json!({"kind": "cron", "spec": "* * *", "event": good_morning()}),
            "`spec`",
        ),
        (
            json!({"kind": "once", "spec": "tomorrow", "event": good_morning()}),
            "`spec`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": "hello"}),
            "`event`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": no_input}),
            "`event.input`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": bad_conversation}),
            "`event.conversation_id`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": typo}),
            "`event`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": client_id}),
            "`event.event_id`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": client_time}),
            "`event.event_time`",
        ),
        (
            json!({"kind": "interval", "spec": "1h", "event": good_morning(), "every": 1}),
            "every",
        ),
    ];
    for (body, field) in cases {
        let (status, error) = h.call("POST", "/v1/schedules", Some(&body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {error}");
        assert_eq!(error["code"], "invalid_argument", "{body}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(field),
            "{body}: {message} should name {field}"
        );
    }
    let (_, page) = h.call("GET", "/v1/schedules", None).await;
    assert_eq!(page["items"], json!([]), "nothing was created");
}

/// What a schedule created through the API fires reads back like the same body ingested by
/// `POST /v1/events`, with the firing's key, and is announced on the events exchange.
#[tokio::test]
async fn a_firing_ingests_the_normalized_event() {
    let h = harness().await;
    let created = h
        .create(&json!({"kind": "once", "spec": "2020-01-01T00:00:00Z", "event": good_morning()}))
        .await;
    let due = h.stores.schedules.due(Utc::now(), 10).await.unwrap();
    assert_eq!(due.len(), 1);
    let firing = plan_firing(&due[0], Utc::now(), EventId::new(), h.state.topology()).unwrap();
    let (event, was_created) = h.stores.schedules.fire(firing).await.unwrap().unwrap();
    assert!(was_created);

    let (status, read) = h
        .call("GET", &format!("/v1/events/{}", event.id), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{read}");
    assert_eq!(read["status"], "received");
    assert_eq!(read["event_type"], "message.received");
    assert_eq!(read["source"], "scheduler");
    assert_eq!(read["conversation_id"], "daily");
    assert_eq!(read["actor_id"], "u-1");
    assert_eq!(read["input_summary"], "good morning");
    assert_eq!(read["metadata"]["schedule_id"], created["schedule_id"]);
    let key = read["idempotency_key"].as_str().unwrap();
    assert!(key.starts_with(&format!(
        "schedule:{}:2020-01-01T00:00:00",
        created["schedule_id"].as_str().unwrap()
    )));

    let claimed = h
        .stores
        .outbox
        .claim(10, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].exchange, h.state.topology().events_exchange());

    let (_, read) = h
        .call(
            "GET",
            &format!("/v1/schedules/{}", created["schedule_id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(read["enabled"], false);
    assert_eq!(read["next_fire_at"], Value::Null);
    assert_eq!(read["last_fired_at"], 1_577_836_800);
}
