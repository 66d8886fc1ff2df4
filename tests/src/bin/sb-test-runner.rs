//! `sb-test-runner`: a runner that misbehaves on request, for tests of the worker's runner
//! host (SPEC §4). It speaks the stdio wire directly (not through `sb-runner`) so it can
//! break the protocol in precise ways.
//!
//! The first word of the run's input text (or `context.config.script`, if set) picks the
//! script; the rest of the text is its argument:
//!
//! | script | behaviour |
//! | --- | --- |
//! | (anything else) | echo: one delta per word, `message.completed`, `run.completed` |
//! | `crash` | one delta, then the whole process exits with status 1 |
//! | `garbage` | one delta, one non-JSON line, then completes normally |
//! | `garbage2` | two non-JSON lines in a row (cannot resynchronise), then completes |
//! | `empty` | `done` with no output at all |
//! | `huge` | a `message.delta` of 2 MiB (truncated by the host), then completes |
//! | `hugestate` | a `state.updated` of 2 MiB (a protocol error) |
//! | `overlong` | one 5 MiB line (over the 4 MiB line cap) |
//! | `unknown` | a result of an unknown type, then echoes normally |
//! | `notype` | a result without `type` (a protocol error) |
//! | `fail` | `run.failed {code: "runner.error"}` |
//! | `stall` | never answers, ignores cancel |
//! | `cancellable` | waits for `cancel`, then `run.failed {code: "cancelled"}` |
//! | `noterminal` | `message.completed`, then `done` without a terminal result |
//! | `late` | `run.completed`, then more results and `done` |
//! | `dup` | deltas with sequences 1, 1, 2, 2, 3, then `run.completed` (sequence 4) |
//! | `api <action>` | calls the Host API action (default `get_host_version`) and reports the answer |
//! | `api_foreign [<run_id> [<action>]]` | calls the Host API (default `get_host_version`) with another run's id (default: one that never existed) and reports the answer |
//! | `env` | reports the names of its environment variables |
//! | `pid` | reports its process id |
//! | `exit0` | one delta, then the process exits with status 0 (no `done`) |
//! | `grandchild` | starts `sleep 600` in its process group, reports its pid, stalls |
//! | `slow <n>` | `n` deltas 5 ms apart, then completes |
//! | `raw <json array>` | sends each element of the array as a result exactly as written (no `sequence` added), then `done`; a text that is not a JSON array is reported instead |
//! | `wire <n> <json array>` | writes each element of the array as one line exactly as written, with every `$RUN` replaced by the run's id; then, if `n > 0`, takes the host answers not claimed by an `api` script (see `answers`) until `n` `api_result`s arrived (at most 10 s) and reports them as a JSON array; then completes |
//! | `answers` | reports, as a JSON array, every `api_result` and `api_chunk` line that no `api` script waited for since the last `answers` or `wire` |
//!
//! "Reports" means: a `message.completed` whose content is the answer, then `run.completed`.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[derive(Default)]
struct State {
    out: Mutex<()>,
    cancels: Mutex<HashMap<String, Arc<AtomicBool>>>,
    calls: Mutex<HashMap<String, mpsc::Sender<Value>>>,
    next_call: AtomicU64,
    /// Host answers (`api_result`, `api_chunk`) that no `api` script waited for, in arrival
    /// order: the `wire` and `answers` scripts report them.
    unclaimed: Mutex<Vec<Value>>,
    unclaimed_changed: Condvar,
}

impl State {
    fn record_unclaimed(&self, msg: Value) {
        self.unclaimed.lock().unwrap().push(msg);
        self.unclaimed_changed.notify_all();
    }

    /// Takes the unclaimed answers once `n` of them are `api_result`s (or after `wait`).
    fn take_unclaimed(&self, n: usize, wait: Duration) -> Vec<Value> {
        let deadline = Instant::now() + wait;
        let mut unclaimed = self.unclaimed.lock().unwrap();
        loop {
            let results = unclaimed.iter().filter(|m| m["op"] == "api_result").count();
            let now = Instant::now();
            if results >= n || now >= deadline {
                return std::mem::take(&mut *unclaimed);
            }
            unclaimed = self
                .unclaimed_changed
                .wait_timeout(unclaimed, deadline - now)
                .unwrap()
                .0;
        }
    }
}

impl State {
    fn write_line(&self, line: &str) {
        let _guard = self
            .out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut stdout = io::stdout().lock();
        // The host may be gone; nothing useful to do about it here.
        let _ = stdout.write_all(line.as_bytes());
        let _ = stdout.write_all(b"\n");
        let _ = stdout.flush();
    }

    fn send(&self, msg: &Value) {
        self.write_line(&msg.to_string());
    }
}

struct Run {
    id: String,
    state: Arc<State>,
    cancelled: Arc<AtomicBool>,
    seq: AtomicU64,
}

impl Run {
    fn result(&self, result_type: &str, data: Value) {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        self.result_with_seq(result_type, data, Some(seq));
    }

    fn result_with_seq(&self, result_type: &str, data: Value, sequence: Option<u64>) {
        let mut result = json!({"type": result_type, "data": data});
        if let Some(seq) = sequence {
            result["sequence"] = json!(seq);
        }
        self.state
            .send(&json!({"op": "result", "run_id": self.id, "result": result}));
    }

    fn delta(&self, text: &str) {
        self.result(
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": text}}),
        );
    }

    fn completed(&self, text: &str) {
        self.result(
            "message.completed",
            json!({"message": {"role": "assistant", "content": text}}),
        );
    }

    fn run_completed(&self) {
        self.result("run.completed", json!({"finish_reason": "stop"}));
    }

    fn report(&self, text: &str) {
        self.completed(text);
        self.run_completed();
    }

    fn done(&self) {
        self.state.send(&json!({"op": "done", "run_id": self.id}));
    }

    fn echo(&self, text: &str) {
        let words: Vec<&str> = text.split_whitespace().collect();
        for (i, w) in words.iter().enumerate() {
            if i + 1 < words.len() {
                self.delta(&format!("{w} "));
            } else {
                self.delta(w);
            }
        }
        self.report(text);
    }

    /// A Host API call on behalf of `run_id`; blocks until the answer.
    fn api(&self, run_id: &str, action: &str) -> Value {
        let id = format!("c{}", self.state.next_call.fetch_add(1, Ordering::SeqCst));
        let (tx, rx) = mpsc::channel();
        self.state.calls.lock().unwrap().insert(id.clone(), tx);
        self.state.send(
            &json!({"op": "api", "id": id, "run_id": run_id, "action": action, "params": {}}),
        );
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or(json!({"timeout": true}))
    }
}

fn execute(run: &Run, text: &str, script_override: Option<&str>) {
    let (script, arg) = match script_override {
        Some(s) => (s, text),
        None => text.split_once(' ').unwrap_or((text, "")),
    };
    match script {
        "crash" => {
            run.delta("about to crash");
            std::thread::sleep(Duration::from_millis(50));
            std::process::exit(1);
        }
        "garbage" => {
            run.delta("before garbage");
            run.state.write_line("this is not json");
            run.echo("after garbage");
        }
        "garbage2" => {
            run.state.write_line("not json 1");
            run.state.write_line("[\"not an object\"]");
            run.echo("after garbage");
        }
        "empty" => {}
        "huge" => {
            run.delta(&"x".repeat(2 * 1024 * 1024));
            run.report("huge done");
        }
        "hugestate" => {
            run.result(
                "state.updated",
                json!({"scope": "conversation", "key": "k", "value": "y".repeat(2 * 1024 * 1024)}),
            );
            run.report("should not be delivered");
        }
        "overlong" => {
            run.delta(&"z".repeat(5 * 1024 * 1024));
            run.report("after overlong");
        }
        "unknown" => {
            run.result("telepathy.sent", json!({"to": "you"}));
            run.echo(if arg.is_empty() { "after unknown" } else { arg });
        }
        "notype" => {
            run.state
                .send(&json!({"op": "result", "run_id": run.id, "result": {"data": {}}}));
            run.report("should not be delivered");
        }
        "fail" => run.result(
            "run.failed",
            json!({"code": "runner.error", "error": "scripted failure", "retryable": false}),
        ),
        "stall" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        "cancellable" => {
            run.delta("waiting for cancel");
            while !run.cancelled.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            run.result(
                "run.failed",
                json!({"code": "cancelled", "error": "cancelled as asked", "retryable": false}),
            );
        }
        "noterminal" => run.completed("no terminal follows"),
        "late" => {
            run.report("on time");
            run.delta("late 1");
            run.completed("late 2");
        }
        "dup" => {
            for (seq, text) in [(1, "a"), (1, "a-again"), (2, "b"), (2, "b-again"), (3, "c")] {
                run.result_with_seq(
                    "message.delta",
                    json!({"chunk": {"role": "assistant", "content": text}}),
                    Some(seq),
                );
            }
            run.result_with_seq("run.completed", json!({"finish_reason": "stop"}), Some(4));
        }
        "api" => {
            let action = if arg.is_empty() {
                "get_host_version"
            } else {
                arg
            };
            let answer = run.api(&run.id, action);
            run.report(&answer.to_string());
        }
        "api_foreign" => {
            let mut words = arg.split_whitespace();
            let foreign = words
                .next()
                .unwrap_or("00000000-0000-7000-8000-000000000000");
            let action = words.next().unwrap_or("get_host_version");
            let answer = run.api(foreign, action);
            run.report(&answer.to_string());
        }
        "env" => {
            let mut names: Vec<String> = std::env::vars_os()
                .map(|(k, _)| k.to_string_lossy().into_owned())
                .collect();
            names.sort();
            run.report(&names.join(","));
        }
        "pid" => run.report(&std::process::id().to_string()),
        "exit0" => {
            run.delta("exiting cleanly");
            std::thread::sleep(Duration::from_millis(20));
            std::process::exit(0);
        }
        "grandchild" => {
            let child = std::process::Command::new("sleep").arg("600").spawn();
            match child {
                Ok(child) => run.delta(&child.id().to_string()),
                Err(e) => run.delta(&format!("spawn failed: {e}")),
            }
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        "slow" => {
            let n: u64 = arg.parse().unwrap_or(10);
            for i in 0..n {
                run.delta(&format!("{i} "));
                std::thread::sleep(Duration::from_millis(5));
            }
            run.report(&format!("slow {n}"));
        }
        "wire" => {
            let (n, lines) = arg.split_once(' ').unwrap_or((arg, "[]"));
            let n: usize = n.parse().unwrap_or(0);
            match serde_json::from_str::<Vec<Value>>(lines) {
                Ok(lines) => {
                    if n > 0 {
                        // Answers left over from earlier runs are not this run's.
                        run.state.unclaimed.lock().unwrap().clear();
                    }
                    for line in lines {
                        run.state
                            .write_line(&line.to_string().replace("$RUN", &run.id));
                    }
                    let answers = if n > 0 {
                        run.state.take_unclaimed(n, Duration::from_secs(10))
                    } else {
                        Vec::new()
                    };
                    run.report(&Value::Array(answers).to_string());
                }
                Err(e) => run.report(&format!(
                    "wire needs a count and a JSON array of lines: {e}"
                )),
            }
        }
        "answers" => {
            let answers = std::mem::take(&mut *run.state.unclaimed.lock().unwrap());
            run.report(&Value::Array(answers).to_string());
        }
        "raw" => match serde_json::from_str::<Vec<Value>>(arg) {
            Ok(results) => {
                for result in results {
                    run.state
                        .send(&json!({"op": "result", "run_id": run.id, "result": result}));
                }
            }
            Err(e) => run.report(&format!("raw needs a JSON array of results: {e}")),
        },
        _ => run.echo(text),
    }
    run.done();
}

fn main() {
    let state = Arc::new(State::default());
    let active = Arc::new(AtomicU64::new(0));
    let shutting_down = Arc::new(AtomicBool::new(false));
    let stdin = io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        match msg["op"].as_str() {
            Some("run") => {
                let id = msg["run_id"].as_str().unwrap_or_default().to_owned();
                let text = msg["context"]["input"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let script = msg["context"]["config"]["script"]
                    .as_str()
                    .map(str::to_owned);
                let cancelled = Arc::new(AtomicBool::new(false));
                state
                    .cancels
                    .lock()
                    .unwrap()
                    .insert(id.clone(), cancelled.clone());
                let run = Run {
                    id,
                    state: state.clone(),
                    cancelled,
                    seq: AtomicU64::new(0),
                };
                let (active, shutting_down) = (active.clone(), shutting_down.clone());
                active.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    execute(&run, &text, script.as_deref());
                    run.state.cancels.lock().unwrap().remove(&run.id);
                    if active.fetch_sub(1, Ordering::SeqCst) == 1
                        && shutting_down.load(Ordering::SeqCst)
                    {
                        std::process::exit(0);
                    }
                });
            }
            Some("cancel") => {
                let id = msg["run_id"].as_str().unwrap_or_default();
                if let Some(flag) = state.cancels.lock().unwrap().get(id) {
                    flag.store(true, Ordering::SeqCst);
                }
            }
            Some("api_result") => {
                let waiting = msg["id"]
                    .as_str()
                    .and_then(|id| state.calls.lock().unwrap().remove(id));
                match waiting {
                    Some(tx) => {
                        let _ = tx.send(msg.clone());
                    }
                    None => state.record_unclaimed(msg),
                }
            }
            Some("api_chunk") => {
                let waited = msg["id"]
                    .as_str()
                    .is_some_and(|id| state.calls.lock().unwrap().contains_key(id));
                if !waited {
                    state.record_unclaimed(msg);
                }
            }
            Some("shutdown") => {
                shutting_down.store(true, Ordering::SeqCst);
                if active.load(Ordering::SeqCst) == 0 {
                    std::process::exit(0);
                }
            }
            _ => {}
        }
    }
    // End of input: the host is done with us.
}
