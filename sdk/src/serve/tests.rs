//! The serve loop over in-memory pipes: a fake host writes lines into the runner's "stdin"
//! and reads the lines it writes to "stdout".

use std::io::{self, Read, Write};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use sb_protocol::ids::RunId;
use serde_json::{Value, json};

use super::*;

/// The runner's stdin: bytes pushed by the fake host. Dropping the sender is end of input.
struct PipeReader {
    rx: Receiver<Vec<u8>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for PipeReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.buf.len() {
            match self.rx.recv() {
                Ok(bytes) => {
                    self.buf = bytes;
                    self.pos = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The runner's stdout: split into lines, each parsed (a line that is not one JSON object
/// fails the test: that is the framing guarantee under test).
struct LineSink {
    partial: Vec<u8>,
    tx: Sender<Value>,
}

impl Write for LineSink {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.partial.extend_from_slice(data);
        while let Some(pos) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=pos).collect();
            let value: Value = serde_json::from_slice(&line).expect("runner wrote a non-JSON line");
            assert!(value.is_object());
            let _ = self.tx.send(value);
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct FakeHost {
    stdin: Option<Sender<Vec<u8>>>,
    stdout: Receiver<Value>,
    serve: Option<JoinHandle<io::Result<()>>>,
}

impl FakeHost {
    fn start<R: Runner>(runner: R) -> Self {
        Self::start_with(runner, ServeOptions::default())
    }

    fn start_with<R: Runner>(runner: R, config: ServeOptions) -> Self {
        let (in_tx, in_rx) = mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel();
        let reader = io::BufReader::new(PipeReader {
            rx: in_rx,
            buf: Vec::new(),
            pos: 0,
        });
        let writer = LineSink {
            partial: Vec::new(),
            tx: out_tx,
        };
        let serve = std::thread::spawn(move || serve_with(runner, reader, writer, config));
        Self {
            stdin: Some(in_tx),
            stdout: out_rx,
            serve: Some(serve),
        }
    }

    fn send(&self, msg: Value) {
        let mut line = serde_json::to_vec(&msg).unwrap();
        line.push(b'\n');
        self.stdin.as_ref().unwrap().send(line).unwrap();
    }

    fn run(&self, run_id: RunId, text: &str) {
        self.run_with(run_id, text, None);
    }

    fn run_with(&self, run_id: RunId, text: &str, deadline_at: Option<f64>) {
        self.send(json!({"op": "run", "run_id": run_id, "runner": "plugin:t/t/t", "context": context(run_id, text, deadline_at)}));
    }

    fn next(&self) -> Value {
        self.stdout
            .recv_timeout(Duration::from_secs(10))
            .expect("runner wrote nothing")
    }

    /// Lines until (and including) the `done` of `run_id`; other runs' lines are kept aside.
    fn until_done(&self, run_id: RunId) -> Vec<Value> {
        let id = run_id.to_string();
        let mut got = Vec::new();
        loop {
            let msg = self.next();
            let done = msg["op"] == "done" && msg["run_id"] == id.as_str();
            got.push(msg);
            if done {
                return got;
            }
        }
    }

    fn close_input(&mut self) {
        self.stdin = None;
    }

    fn join(&mut self) -> io::Result<()> {
        let handle = self.serve.take().unwrap();
        for _ in 0..500 {
            if handle.is_finished() {
                return handle.join().unwrap();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("serve did not return");
    }
}

fn context(run_id: RunId, text: &str, deadline_at: Option<f64>) -> Value {
    json!({
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api"},
        "event": {"event_id": "e1", "event_type": "message.received", "source": "api"},
        "input": {"text": text},
        "delivery": {"surface": "api"},
        "resources": {},
        "context": {"inline_policy": {"mode": "current_event"}, "available_apis": {}},
        "runtime": {"trace_id": run_id, "deadline_at": deadline_at},
    })
}

fn results(lines: &[Value]) -> Vec<&Value> {
    lines
        .iter()
        .filter(|l| l["op"] == "result")
        .map(|l| &l["result"])
        .collect()
}

/// Echoes words as deltas, then completes; behaviour switches on the input text.
struct Scripted;

impl Runner for Scripted {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        match run.input_text() {
            "panic" => panic!("boom"),
            "err" => Err(RunError::new("runner.custom", "it broke")),
            "wait" => {
                // Stays in the run until cancelled (returns Ok without a terminal).
                let _ = run.cancelled_within(Duration::from_secs(30));
                Ok(())
            }
            "version" => {
                let v = run.api().get_host_version()?;
                out.completed_text(v["version"].as_str().unwrap_or("?"))?;
                out.run_completed()?;
                Ok(())
            }
            "stream" => {
                let mut chunks = Vec::new();
                let fin = run
                    .api()
                    .call_stream("invoke_llm_stream", json!({"m": 1}), |c| chunks.push(c))?;
                out.completed_text(format!("{chunks:?}|{fin}"))?;
                out.run_completed()?;
                Ok(())
            }
            "blocked_call" => {
                // Waits on an answer that never comes; cancel must unblock it.
                run.api().call("history_page", json!({}))?;
                Ok(())
            }
            "after_terminal" => {
                out.run_completed()?;
                assert!(matches!(out.delta("late"), Err(EmitError::Finished)));
                Ok(())
            }
            text => {
                let words: Vec<&str> = text.split_whitespace().collect();
                for w in &words {
                    out.delta(*w)?;
                }
                out.completed_text(text)?;
                out.run_completed()?;
                Ok(())
            }
        }
    }
}

#[test]
fn a_run_streams_numbered_results_then_done() {
    let mut host = FakeHost::start(Scripted);
    let run_id = RunId::new();
    host.run(run_id, "a b c");
    let lines = host.until_done(run_id);
    let res = results(&lines);
    assert_eq!(res.len(), 5);
    for (i, r) in res.iter().enumerate() {
        assert_eq!(r["sequence"], json!(i + 1));
        assert_eq!(r["run_id"], json!(run_id.to_string()));
    }
    assert_eq!(res[0]["type"], "message.delta");
    assert_eq!(res[0]["data"]["chunk"]["content"], "a");
    assert_eq!(res[0]["data"]["chunk"]["role"], "assistant");
    assert_eq!(res[3]["type"], "message.completed");
    assert_eq!(res[3]["data"]["message"]["content"], "a b c");
    assert_eq!(res[4]["type"], "run.completed");
    assert_eq!(res[4]["data"]["finish_reason"], "stop");
    host.close_input();
    host.join().unwrap();
}

#[test]
fn many_concurrent_runs_keep_their_own_order() {
    let mut host = FakeHost::start(Scripted);
    let ids: Vec<RunId> = (0..20).map(|_| RunId::new()).collect();
    let text = "one two three four five six seven eight nine ten";
    for id in &ids {
        host.run(*id, text);
    }
    let mut per_run: HashMap<String, Vec<Value>> = HashMap::new();
    let mut done = 0;
    while done < ids.len() {
        let msg = host.next();
        let run = msg["run_id"].as_str().unwrap().to_owned();
        if msg["op"] == "done" {
            done += 1;
        } else {
            per_run.entry(run).or_default().push(msg["result"].clone());
        }
    }
    for id in &ids {
        let res = &per_run[&id.to_string()];
        assert_eq!(res.len(), 12);
        let seqs: Vec<u64> = res
            .iter()
            .map(|r| r["sequence"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (1..=12).collect::<Vec<_>>());
    }
    host.close_input();
    host.join().unwrap();
}

#[test]
fn errors_and_panics_become_run_failed() {
    let mut host = FakeHost::start(Scripted);
    let (a, b) = (RunId::new(), RunId::new());
    host.run(a, "err");
    let lines = host.until_done(a);
    let res = results(&lines);
    assert_eq!(res.len(), 1);
    assert_eq!(res[0]["type"], "run.failed");
    assert_eq!(
        res[0]["data"],
        json!({"code": "runner.custom", "error": "it broke", "retryable": false})
    );

    host.run(b, "panic");
    let lines = host.until_done(b);
    let res = results(&lines);
    assert_eq!(res[0]["type"], "run.failed");
    assert_eq!(res[0]["data"]["code"], "runner.error");
    assert!(res[0]["data"]["error"].as_str().unwrap().contains("boom"));
    host.close_input();
    host.join().unwrap();
}

#[test]
fn nothing_is_written_after_a_terminal_result() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.run(id, "after_terminal");
    let lines = host.until_done(id);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["result"]["type"], "run.completed");
    host.close_input();
    host.join().unwrap();
}

#[test]
fn cancel_ends_a_waiting_run_as_cancelled() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.run(id, "wait");
    std::thread::sleep(Duration::from_millis(50));
    host.send(json!({"op": "cancel", "run_id": id, "reason": "user asked"}));
    let lines = host.until_done(id);
    let res = results(&lines);
    assert_eq!(res.len(), 1);
    assert_eq!(res[0]["type"], "run.failed");
    assert_eq!(res[0]["data"]["code"], "cancelled");
    assert_eq!(res[0]["data"]["error"], "user asked");
    host.close_input();
    host.join().unwrap();
}

#[test]
fn api_calls_are_matched_by_id() {
    let mut host = FakeHost::start(Scripted);
    let (a, b) = (RunId::new(), RunId::new());
    host.run(a, "version");
    host.run(b, "version");
    // Collect both calls, then answer them in reverse order.
    let mut calls = Vec::new();
    while calls.len() < 2 {
        let msg = host.next();
        assert_eq!(msg["op"], "api");
        assert_eq!(msg["action"], "get_host_version");
        calls.push(msg);
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    for call in calls.iter().rev() {
        let version = format!("v-{}", call["run_id"].as_str().unwrap());
        host.send(
            json!({"op": "api_result", "id": call["id"], "ok": true, "data": {"version": version}}),
        );
    }
    let mut finals = HashMap::new();
    let mut done = 0;
    while done < 2 {
        let msg = host.next();
        if msg["op"] == "done" {
            done += 1;
        } else if msg["result"]["type"] == "message.completed" {
            finals.insert(
                msg["run_id"].as_str().unwrap().to_owned(),
                msg["result"]["data"]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    for id in [a, b] {
        assert_eq!(finals[&id.to_string()], format!("v-{id}"));
    }
    host.close_input();
    host.join().unwrap();
}

#[test]
fn api_errors_end_the_run_with_the_mapped_code() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.run(id, "version");
    let call = host.next();
    host.send(json!({"op": "api_result", "id": call["id"], "ok": false,
        "error": {"code": "unauthorized", "message": "nope", "retryable": false, "details": {}}}));
    let lines = host.until_done(id);
    let res = results(&lines);
    assert_eq!(res[0]["data"]["code"], "runner.error");
    assert!(
        res[0]["data"]["error"]
            .as_str()
            .unwrap()
            .contains("unauthorized")
    );
    host.close_input();
    host.join().unwrap();
}

#[test]
fn streamed_chunks_arrive_before_the_final_answer() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.run(id, "stream");
    let call = host.next();
    assert_eq!(call["action"], "invoke_llm_stream");
    assert_eq!(call["params"], json!({"m": 1}));
    host.send(json!({"op": "api_chunk", "id": call["id"], "data": "x"}));
    host.send(json!({"op": "api_chunk", "id": call["id"], "data": "y"}));
    host.send(json!({"op": "api_result", "id": call["id"], "ok": true, "data": "end"}));
    let lines = host.until_done(id);
    let res = results(&lines);
    assert_eq!(
        res[0]["data"]["message"]["content"],
        r#"[String("x"), String("y")]|"end""#
    );
    host.close_input();
    host.join().unwrap();
}

#[test]
fn cancel_unblocks_a_pending_api_call() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.run(id, "blocked_call");
    let call = host.next();
    assert_eq!(call["op"], "api");
    host.send(json!({"op": "cancel", "run_id": id, "reason": "stop"}));
    let lines = host.until_done(id);
    let res = results(&lines);
    assert_eq!(res[0]["data"]["code"], "cancelled");
    // A late answer for the forgotten call is ignored.
    host.send(json!({"op": "api_result", "id": call["id"], "ok": true, "data": null}));
    host.close_input();
    host.join().unwrap();
}

#[test]
fn a_passed_deadline_fails_api_calls_as_timeout() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    // Deadline one second in the past.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    host.run_with(id, "version", Some(now - 1.0));
    let lines = host.until_done(id);
    let res = results(&lines);
    assert_eq!(res.last().unwrap()["data"]["code"], "timeout");
    host.close_input();
    host.join().unwrap();
}

#[test]
fn shutdown_waits_for_runs_and_refuses_new_ones() {
    let mut host = FakeHost::start(Scripted);
    let (a, b) = (RunId::new(), RunId::new());
    host.run(a, "version");
    let call = host.next();
    host.send(json!({"op": "shutdown"}));
    host.run(b, "x");
    let refused = host.until_done(b);
    assert_eq!(results(&refused)[0]["type"], "run.failed");
    // The in-flight run still gets its API answer after the shutdown request.
    host.send(json!({"op": "api_result", "id": call["id"], "ok": true, "data": {"version": "1"}}));
    let lines = host.until_done(a);
    assert_eq!(results(&lines).last().unwrap()["type"], "run.completed");
    host.join().unwrap();
}

#[test]
fn end_of_input_fails_pending_calls_and_cancels_after_grace() {
    let config = ServeOptions {
        eof_grace: Duration::from_millis(100),
        cancel_grace: Duration::from_secs(5),
    };
    let mut host = FakeHost::start_with(Scripted, config);
    let (a, b) = (RunId::new(), RunId::new());
    host.run(a, "blocked_call");
    host.run(b, "wait");
    let call = host.next();
    assert_eq!(call["op"], "api");
    host.close_input();
    let mut codes = HashMap::new();
    let mut done = 0;
    while done < 2 {
        let msg = host.next();
        if msg["op"] == "done" {
            done += 1;
        } else if msg["op"] == "result" {
            codes.insert(
                msg["run_id"].as_str().unwrap().to_owned(),
                msg["result"]["data"]["code"].clone(),
            );
        }
    }
    assert_eq!(
        codes[&a.to_string()],
        "runner.error",
        "pending call failed as unavailable"
    );
    assert_eq!(
        codes[&b.to_string()],
        "cancelled",
        "waiting run cancelled after the grace"
    );
    host.join().unwrap();
}

#[test]
fn an_unparseable_run_is_failed_not_dropped() {
    let mut host = FakeHost::start(Scripted);
    let id = RunId::new();
    host.send(
        json!({"op": "run", "run_id": id, "runner": "plugin:t/t/t", "context": {"nope": true}}),
    );
    let lines = host.until_done(id);
    assert_eq!(results(&lines)[0]["data"]["code"], "runner.error");
    host.send(json!({"op": "teleport"}));
    assert_eq!(host.next()["op"], "log");
    host.close_input();
    host.join().unwrap();
}

#[test]
fn emitter_and_api_are_shareable_across_threads() {
    fn is<T: Send + Sync>() {}
    is::<Emitter>();
    is::<HostApi>();
    is::<Run>();
}
