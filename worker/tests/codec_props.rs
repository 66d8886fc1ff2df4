//! Property tests of the runner codec (`sb_worker::runner::codec`), the JSON-lines wire
//! between the worker and runner processes (issue 15 item 3): on arbitrary bytes the line
//! reader agrees with a plain model and never holds more than its cap, the decoder never
//! panics and never refuses a call line, and every message either side writes reads back
//! unchanged through the real read path (the SDK writes `serde_json::to_vec(msg)` plus `\n`,
//! exactly what the round trip below writes).

use proptest::prelude::*;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::ids::RunId;
use sb_protocol::wire::{ApiCallId, ApiResult, HostToRunner, LogLevel, RunnerToHost};
use sb_worker::runner::codec::{
    FrameError, LineReader, MessageReader, RawLine, RunnerLine, decode_runner_line,
    encode_host_message,
};
use serde_json::{Map, Number, Value};
use tokio::io::BufReader;

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
        .block_on(future)
}

/// What [`LineReader`] must return: the input split at `\n` (a final unterminated part is a
/// line too), each part longer than `cap` reported as too long with its first `cap` bytes.
fn model_lines(input: &[u8], cap: usize) -> Vec<RawLine> {
    let mut parts: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
    if parts.last().is_some_and(|p| p.is_empty()) {
        parts.pop();
    }
    parts
        .into_iter()
        .map(|part| {
            if part.len() > cap {
                RawLine::TooLong {
                    prefix: part[..cap].to_vec(),
                }
            } else {
                RawLine::Line(part.to_vec())
            }
        })
        .collect()
}

/// Bytes with many newlines, so lines of every length around the cap occur.
fn wire_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![3 => any::<u8>(), 1 => Just(b'\n')], 0..300)
}

/// JSON values without floats (a float's text need not read back to the same bits).
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn call_id() -> impl Strategy<Value = ApiCallId> {
    prop_oneof![
        any::<String>().prop_map(ApiCallId::Text),
        any::<i64>().prop_map(|n| ApiCallId::Int(Number::from(n))),
        any::<u64>().prop_map(|n| ApiCallId::Int(Number::from(n))),
    ]
}

fn log_level() -> impl Strategy<Value = LogLevel> {
    prop_oneof![
        Just(LogLevel::Trace),
        Just(LogLevel::Debug),
        Just(LogLevel::Info),
        Just(LogLevel::Warn),
        Just(LogLevel::Error),
    ]
}

fn runner_message() -> impl Strategy<Value = RunnerToHost> {
    prop_oneof![
        (any::<String>(), json_value())
            .prop_map(|(run_id, result)| RunnerToHost::Result { run_id, result }),
        any::<String>().prop_map(|run_id| RunnerToHost::Done { run_id }),
        (call_id(), any::<String>(), any::<String>(), json_value()).prop_map(
            |(id, run_id, action, params)| RunnerToHost::Api {
                id,
                run_id,
                action,
                params,
            }
        ),
        (
            log_level(),
            any::<String>(),
            proptest::option::of(any::<String>())
        )
            .prop_map(|(level, message, run_id)| RunnerToHost::Log {
                level,
                message,
                run_id,
            }),
    ]
}

fn host_message() -> impl Strategy<Value = HostToRunner> {
    // `data: Some(null)` is written as `null`, which reads back as absent: not generated.
    let data = proptest::option::of(json_value().prop_filter("not null", |v| !v.is_null()));
    prop_oneof![
        any::<String>().prop_map(|reason| HostToRunner::Cancel {
            run_id: RunId::new(),
            reason
        }),
        (call_id(), json_value()).prop_map(|(id, data)| HostToRunner::ApiChunk { id, data }),
        (
            proptest::option::of(call_id()),
            any::<bool>(),
            data,
            proptest::option::of(any::<String>())
        )
            .prop_map(|(id, ok, data, error)| HostToRunner::ApiResult(ApiResult {
                id,
                ok,
                data,
                error: error.map(|message| AgentApiError::new(ErrorCode::NotFound, message)),
            })),
        Just(HostToRunner::Shutdown {}),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn line_reader_agrees_with_the_model(input in wire_bytes(), cap in 1usize..40, read_buf in 1usize..24) {
        let got = block_on(async {
            let mut lines = LineReader::new(BufReader::with_capacity(read_buf, input.as_slice()), cap);
            let mut got = Vec::new();
            while let Some(line) = lines.next_line().await.unwrap() {
                got.push(line);
            }
            got
        });
        prop_assert_eq!(got, model_lines(&input, cap));
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(line in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_runner_line(&line);
    }

    #[test]
    fn a_call_line_is_always_answered_never_a_protocol_error(
        fields in prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..6),
    ) {
        let mut map: Map<String, Value> = fields.into_iter().collect();
        map.insert("op".into(), Value::from("api"));
        let line = serde_json::to_vec(&Value::Object(map)).unwrap();
        let decoded = decode_runner_line(&line);
        prop_assert!(decoded.is_ok(), "{decoded:?}");
    }

    #[test]
    fn bad_lines_are_recoverable_and_name_their_run(
        op in prop_oneof![Just("result"), Just("done"), Just("log"), Just("run"), Just(""), Just("x")],
        run_id in "[a-z0-9-]{1,12}",
        junk in json_value(),
    ) {
        let line = serde_json::to_vec(&serde_json::json!({"op": op, "run_id": run_id, "result": junk, "level": 5})).unwrap();
        match decode_runner_line(&line) {
            Ok(_) => {}
            Err(error) => {
                prop_assert!(error.is_recoverable());
                prop_assert_eq!(error.run_id_hint(), Some(run_id.as_str()));
            }
        }
    }

    #[test]
    fn runner_messages_read_back_unchanged(
        messages in prop::collection::vec(runner_message(), 1..8),
        long_at in any::<prop::sample::Index>(),
    ) {
        // Written as the SDK writes them, with one over-long line in between.
        const CAP: usize = 64 * 1024;
        let at = long_at.index(messages.len() + 1);
        let mut wire = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if i == at {
                wire.extend(std::iter::repeat_n(b'x', CAP + 10));
                wire.push(b'\n');
            }
            wire.extend(serde_json::to_vec(message).unwrap());
            wire.push(b'\n');
        }
        let read = block_on(async {
            let mut reader = MessageReader::new(wire.as_slice(), CAP);
            let mut read = Vec::new();
            loop {
                match reader.read_message().await {
                    Ok(Some(line)) => read.push(Ok(line)),
                    Ok(None) => break,
                    Err(FrameError::TooLong { limit }) => read.push(Err(limit)),
                    Err(other) => panic!("unexpected frame error: {other}"),
                }
            }
            read
        });
        let mut expected: Vec<Result<RunnerLine, usize>> =
            messages.iter().cloned().map(|m| Ok(RunnerLine::Message(m))).collect();
        if at < messages.len() {
            expected.insert(at, Err(CAP));
        }
        prop_assert_eq!(read, expected);
    }

    #[test]
    fn host_messages_are_one_line_and_read_back_unchanged(message in host_message()) {
        let line = encode_host_message(&message);
        prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        prop_assert_eq!(line.last(), Some(&b'\n'));
        // What the SDK's reader does with it.
        let read: HostToRunner = serde_json::from_slice(&line).unwrap();
        prop_assert_eq!(read, message);
    }
}
