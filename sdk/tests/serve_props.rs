//! Property test of the SDK's side of the runner wire (issue 15 item 3): whatever bytes the
//! host writes to a runner built on the SDK (junk, truncated JSON, runs with broken contexts,
//! cancels and API answers for nothing, NUL and control characters), the serve loop neither
//! panics nor hangs, and everything it writes back is whole lines of well-formed
//! `RunnerToHost` messages, which the worker's decoder reads as messages.

use std::io::{self, Cursor, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use sb_runner::sb_protocol::wire::RunnerToHost;
use sb_runner::{Emitter, Run, RunError, Runner, ServeOptions, serve_with};

/// Echoes the input text back, the way the simplest runner does.
struct Echo;

impl Runner for Echo {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        out.delta(run.input_text())?;
        out.completed_text(run.input_text())?;
        out.run_completed()?;
        Ok(())
    }
}

/// The runner's stdout, kept for inspection.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Host lines: junk bytes, or mutations of real host messages.
fn host_line() -> impl Strategy<Value = Vec<u8>> {
    let run_id = "0190b8d2-0000-7000-8000-00000000000[0-9]";
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..80),
        (run_id, "[ -~\u{0}\u{1}]{0,12}").prop_map(|(id, text)| {
            serde_json::to_vec(&serde_json::json!({"op": "run", "run_id": id, "runner": "plugin:t/t/t", "context": {"input": {"text": text}}})).unwrap()
        }),
        (run_id, any::<String>()).prop_map(|(id, reason)| {
            serde_json::to_vec(&serde_json::json!({"op": "cancel", "run_id": id, "reason": reason})).unwrap()
        }),
        any::<String>().prop_map(|id| {
            serde_json::to_vec(&serde_json::json!({"op": "api_result", "id": id, "ok": true, "data": null})).unwrap()
        }),
        Just(br#"{"op": "api_chunk", "id": 1, "data": {}}"#.to_vec()),
        Just(br#"{"op": "run", "run_id": 5}"#.to_vec()),
        Just(br#"{"op": "shutdown"}"#.to_vec()),
        Just(br#"{"op":"#.to_vec()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_host_input_gets_well_formed_lines_back(lines in prop::collection::vec(host_line(), 0..12)) {
        let mut input = Vec::new();
        for line in &lines {
            // A line never holds a newline of its own: that is the framing.
            input.extend(line.iter().copied().filter(|&b| b != b'\n'));
            input.push(b'\n');
        }
        let output = Captured::default();
        let config = ServeOptions {
            eof_grace: Duration::from_secs(5),
            cancel_grace: Duration::from_secs(1),
        };
        let served = serve_with(Echo, Cursor::new(input), output.clone(), config);
        prop_assert!(served.is_ok(), "{served:?}");
        let written = output.0.lock().unwrap().clone();
        prop_assert!(written.is_empty() || written.ends_with(b"\n"), "whole lines only");
        for line in written.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let parsed = serde_json::from_slice::<RunnerToHost>(line);
            prop_assert!(parsed.is_ok(), "{:?}: {parsed:?}", String::from_utf8_lossy(line));
        }
    }
}
