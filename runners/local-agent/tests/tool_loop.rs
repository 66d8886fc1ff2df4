//! The local agent's I/O loop against a scripted host: the runner is served over in-memory
//! pipes (`sb_runner::serve_io`, the same loop as the binary), and this file plays the
//! worker, answering each Host API call from a script and recording what the runner wrote.
//! The pure decisions have their own unit tests; these check that the loop carries them
//! out: fallback, tools with call ids, knowledge, history with compaction, steering,
//! budgets and the round bound, each ending with the right terminal result.

use std::io::{BufRead, Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

/// One answer of the scripted host.
enum Reply {
    /// `api_result` ok with `data`.
    Ok(Value),
    /// `api_chunk`s then `api_result` ok.
    Stream(Vec<Value>, Value),
    /// `api_result` with an error.
    Err(Value),
}

fn error(code: &str, retryable: bool, details: Value) -> Reply {
    Reply::Err(
        json!({"code": code, "message": format!("{code} from the test host"),
                      "retryable": retryable, "details": details}),
    )
}

/// What the runner did during one run.
#[derive(Debug, Default)]
struct Transcript {
    /// `(action, params)` of every Host API call, in order.
    calls: Vec<(String, Value)>,
    /// Every result envelope, in order.
    results: Vec<Value>,
}

impl Transcript {
    fn types(&self) -> Vec<&str> {
        self.results
            .iter()
            .map(|r| r["type"].as_str().unwrap_or("?"))
            .collect()
    }

    fn last(&self) -> &Value {
        self.results.last().expect("a result")
    }

    fn calls_of(&self, action: &str) -> Vec<&Value> {
        self.calls
            .iter()
            .filter(|(a, _)| a == action)
            .map(|(_, p)| p)
            .collect()
    }

    fn deltas(&self) -> Vec<&str> {
        self.results
            .iter()
            .filter(|r| r["type"] == "message.delta")
            .map(|r| r["data"]["chunk"]["content"].as_str().unwrap())
            .collect()
    }
}

/// A run context with the given resources, APIs, config and state.
fn context(resources: Value, apis: Value, config: Value, state: Value) -> Value {
    let run_id = "01a2333d-8c3b-752d-b0ea-1dc2fa7066c6";
    json!({
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api", "timestamp": 1_796_156_001},
        "event": {"event_id": "ev-now", "event_type": "message.received", "event_time": 1,
                  "source": "api", "data": {}},
        "conversation": {"conversation_id": "c1", "bot_id": null, "workspace_id": "default"},
        "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ada", "metadata": {}},
        "subject": null,
        "input": {"text": "annual leave days", "contents": [], "attachments": []},
        "delivery": {"surface": "api", "supports_streaming": true},
        "resources": resources,
        "context": {"conversation_id": "c1", "has_history_before": true,
                    "inline_policy": {"mode": "current_event"}, "available_apis": apis},
        "state": {"conversation": state, "actor": {}, "subject": {}, "runner": {}},
        "runtime": {"trace_id": run_id, "deadline_at": null,
                    "metadata": {"model_context_window_tokens": null}},
        "config": config,
        "adapter": {"extra": {}},
        "metadata": {},
    })
}

const LLM: [&str; 2] = ["invoke", "stream"];

/// The runner's stdin: byte chunks the host sends through a channel (end of input when
/// the host drops its sender).
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(out.len());
        out[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for ChannelReader {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        if self.pos >= self.buf.len() {
            match self.rx.recv() {
                Ok(bytes) => {
                    self.buf = bytes;
                    self.pos = 0;
                }
                Err(_) => return Ok(&[]),
            }
        }
        Ok(&self.buf[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
    }
}

/// The runner's stdout: what it writes goes to the host through a channel.
struct ChannelWriter(mpsc::Sender<Vec<u8>>);

impl Write for ChannelWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.send(bytes.to_vec());
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Serves one run of the local agent, answering its calls with `script`.
fn run(context: Value, mut script: impl FnMut(&str, &Value) -> Reply) -> Transcript {
    let (to_runner, runner_in) = mpsc::channel::<Vec<u8>>();
    let (runner_out, from_runner) = mpsc::channel::<Vec<u8>>();
    let runner = std::thread::spawn(move || {
        sb_runner::serve_io(
            sb_runner_local_agent::LocalAgent,
            ChannelReader {
                rx: runner_in,
                buf: Vec::new(),
                pos: 0,
            },
            ChannelWriter(runner_out),
        )
    });
    let send = |v: Value| {
        let mut line = serde_json::to_vec(&v).unwrap();
        line.push(b'\n');
        to_runner.send(line).unwrap();
    };
    let run_id = context["run_id"].clone();
    send(
        json!({"op": "run", "run_id": run_id, "runner": sb_runner_local_agent::RUNNER_ID,
                "context": context}),
    );
    // The runner's lines; a hung runner fails the test instead of hanging it.
    let mut pending: Vec<u8> = Vec::new();
    let mut next_line = || -> Value {
        loop {
            if let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                return serde_json::from_slice(&line).unwrap();
            }
            let bytes = from_runner
                .recv_timeout(Duration::from_secs(20))
                .expect("the runner answered in time");
            pending.extend(bytes);
        }
    };
    let mut transcript = Transcript::default();
    loop {
        let msg = next_line();
        match msg["op"].as_str().unwrap() {
            "api" => {
                let action = msg["action"].as_str().unwrap().to_owned();
                let params = msg["params"].clone();
                let id = msg["id"].clone();
                let reply = script(&action, &params);
                transcript.calls.push((action, params));
                match reply {
                    Reply::Ok(data) => {
                        send(json!({"op": "api_result", "id": id, "ok": true, "data": data}))
                    }
                    Reply::Stream(chunks, data) => {
                        for chunk in chunks {
                            send(json!({"op": "api_chunk", "id": id, "data": {"chunk": chunk}}));
                        }
                        send(json!({"op": "api_result", "id": id, "ok": true, "data": data}));
                    }
                    Reply::Err(e) => {
                        send(json!({"op": "api_result", "id": id, "ok": false, "error": e}))
                    }
                }
            }
            "result" => transcript.results.push(msg["result"].clone()),
            "done" => break,
            "log" => eprintln!("runner log: {}", msg["message"]),
            other => panic!("unexpected line {other}: {msg}"),
        }
    }
    send(json!({"op": "shutdown"}));
    drop(to_runner);
    runner.join().unwrap().unwrap();
    transcript
}

fn text_chunk(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

fn answer(text: &str, usage: Value) -> Value {
    json!({"message": {"role": "assistant", "content": text}, "usage": usage})
}

fn history_item(seq: i64, role: &str, content: &str) -> Value {
    json!({"transcript_id": format!("t{seq}"), "event_id": format!("e{seq}"), "role": role,
           "item_type": "message", "content": content, "cursor": format!("cur{seq}"), "seq": seq})
}

#[test]
fn fallback_tools_knowledge_history_and_compaction_in_one_run() {
    let resources = json!({
        "models": [{"model_id": "m1", "operations": LLM}, {"model_id": "m2", "operations": LLM}],
        "tools": [{"tool_name": "lookup", "description": "short", "operations": ["detail", "call"]}],
        "knowledge_bases": [{"kb_id": "kb1", "operations": ["list", "retrieve"]}],
    });
    let apis = json!({"history_page": true, "state": true, "steering_pull": true});
    // A small window: the 40 older turns (14 tokens each) cannot all fit.
    let config = json!({"model": {"primary": "m1", "fallbacks": ["m2"]},
                        "context_window_tokens": 1000, "max_output_tokens": 100});
    // Newest first, as `history_page` pages backwards; the current event's own row first.
    let mut items = vec![history_item(99, "user", "annual leave days")];
    items[0]["event_id"] = json!("ev-now");
    for seq in (1..=40).rev() {
        let role = if seq % 2 == 1 { "user" } else { "assistant" };
        items.push(history_item(
            seq,
            role,
            &format!("{seq:02} {}", "w".repeat(37)),
        ));
    }
    let mut model_calls = 0;
    let t = run(
        context(resources, apis, config, json!({})),
        |action, params| match action {
            "retrieve_knowledge" => Reply::Ok(json!({"results": [
            {"content": "Annual leave is 25 days.", "score": 1.5, "document_id": "d1",
             "title": "leave", "chunk_index": 0}]})),
            "get_tool_detail" => Reply::Ok(json!({"tool": {"name": "lookup",
            "description": "Looks up a policy",
            "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}}}})),
            "history_page" => {
                Reply::Ok(json!({"items": items, "has_more": false, "next_cursor": null}))
            }
            "state_set" => Reply::Ok(json!({"success": true, "revision": 1})),
            "steering_pull" => Reply::Ok(json!({"items": []})),
            "invoke_llm_stream" if params["llm_model_uuid"] == "m1" => {
                error("unavailable", true, json!({}))
            }
            "invoke_llm_stream" => {
                model_calls += 1;
                if model_calls == 1 {
                    Reply::Stream(
                        vec![],
                        json!({
                    "message": {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"topic\":\"leave\"}"}}]},
                    "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}}),
                    )
                } else {
                    Reply::Stream(
                        vec![
                            text_chunk(""),
                            text_chunk("You get "),
                            text_chunk("25 days [1]."),
                        ],
                        answer(
                            "You get 25 days [1].",
                            json!({"prompt_tokens": 80, "completion_tokens": 6, "total_tokens": 86}),
                        ),
                    )
                }
            }
            "call_tool" => Reply::Ok(json!({"result": {"days": 25}})),
            other => panic!("unexpected call {other}"),
        },
    );

    assert_eq!(
        t.types(),
        [
            "tool.call.started",
            "tool.call.completed",
            "message.delta",
            "message.delta",
            "message.completed",
            "run.completed"
        ]
    );
    // The knowledge search ran on the message before the first model call.
    let retrieve = t.calls_of("retrieve_knowledge");
    assert_eq!(retrieve[0]["query_text"], "annual leave days");
    assert_eq!(retrieve[0]["top_k"], 5);
    let first_model = t
        .calls
        .iter()
        .position(|(a, _)| a == "invoke_llm_stream")
        .unwrap();
    let first_retrieve = t
        .calls
        .iter()
        .position(|(a, _)| a == "retrieve_knowledge")
        .unwrap();
    assert!(first_retrieve < first_model);

    // m1 failed (retryable), m2 answered; round 2 went straight to m2.
    let models: Vec<&str> = t
        .calls_of("invoke_llm_stream")
        .iter()
        .map(|p| p["llm_model_uuid"].as_str().unwrap())
        .collect();
    assert_eq!(models, ["m1", "m2", "m2"]);
    let round1 = t.calls_of("invoke_llm_stream")[1];
    let messages = round1["messages"].as_array().unwrap();
    let system = messages[0]["content"].as_str().unwrap();
    assert_eq!(messages[0]["role"], "system");
    assert!(
        system.contains("[1] leave\nAnnual leave is 25 days."),
        "{system}"
    );
    assert!(
        system.contains("Summary of the earlier part of this conversation"),
        "{system}"
    );
    assert_eq!(
        messages.last().unwrap(),
        &json!({"role": "user", "content": "annual leave days"})
    );
    assert!(
        !messages[1..messages.len() - 1]
            .iter()
            .any(|m| m["content"] == "annual leave days"),
        "the current event's row is not history"
    );
    // History: the newest turns, oldest first, starting with a user turn.
    assert_eq!(messages[1]["role"], "user");
    assert!(
        messages[messages.len() - 2]["content"]
            .as_str()
            .unwrap()
            .starts_with("40 ")
    );
    assert_eq!(round1["funcs"][0]["name"], "lookup");
    assert_eq!(round1["funcs"][0]["description"], "Looks up a policy");
    assert_eq!(
        round1["funcs"][0]["parameters"]["properties"]["topic"]["type"],
        "string"
    );

    // The tool ran once, under a run-unique call id, and its result went back to the model.
    let tool = t.calls_of("call_tool");
    assert_eq!(tool.len(), 1);
    assert_eq!(tool[0]["call_id"], "r1.0.call_1");
    assert_eq!(tool[0]["parameters"], json!({"topic": "leave"}));
    assert_eq!(t.results[0]["data"]["tool_call_id"], "r1.0.call_1");
    assert_eq!(t.results[1]["data"]["result"], json!({"days": 25}));
    let round2 = t.calls_of("invoke_llm_stream")[2]["messages"]
        .as_array()
        .unwrap()
        .clone();
    let n = round2.len();
    assert_eq!(round2[n - 2]["tool_calls"][0]["id"], "call_1");
    assert_eq!(
        round2[n - 1],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"days\":25}"})
    );

    // Deltas as streamed; the completed message is what the user saw; usage summed.
    assert_eq!(t.deltas(), ["You get ", "25 days [1]."]);
    assert_eq!(
        t.results[4]["data"]["message"]["content"],
        "You get 25 days [1]."
    );
    let usage = &t.last()["usage"];
    assert_eq!(usage["total_tokens"], 141);
    assert_eq!(
        (usage["model_calls"].as_u64(), usage["tool_calls"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(t.last()["data"]["finish_reason"], "stop");

    // The dropped turns were compacted into a checkpoint in conversation state.
    let set = t.calls_of("state_set");
    assert_eq!(set.len(), 1);
    assert_eq!(set[0]["scope"], "conversation");
    assert_eq!(set[0]["key"], "runner.compaction.checkpoint");
    let checkpoint = &set[0]["value"];
    assert_eq!(
        checkpoint["schema_version"],
        "switchboard.local_agent.compaction_checkpoint.v1"
    );
    assert_eq!(checkpoint["conversation_id"], "c1");
    assert!(
        checkpoint["summary"]
            .as_str()
            .unwrap()
            .contains("user: 01 ")
    );
    let covered = checkpoint["covers_until_seq"].as_i64().unwrap();
    let first_kept: i64 = messages[1]["content"].as_str().unwrap()[..2]
        .parse()
        .unwrap();
    assert_eq!(
        covered + 1,
        first_kept,
        "the checkpoint ends where the kept history starts"
    );
}

#[test]
fn a_checkpoint_in_state_is_the_start_of_the_history() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}]});
    let apis = json!({"history_page": true, "state": true});
    let checkpoint = json!({
        "schema_version": "switchboard.local_agent.compaction_checkpoint.v1",
        "summary": "user: earlier question", "covers_until": "cur10", "covers_until_seq": 10,
        "tokens_before": 500, "created_at": 1, "conversation_id": "c1"});
    let state = json!({"runner.compaction.checkpoint": checkpoint});
    let t = run(
        context(resources, apis, json!({}), state),
        |action, _| match action {
            "history_page" => Reply::Ok(json!({"items": [history_item(12, "assistant", "a12"),
                                                     history_item(11, "user", "q11")],
                                           "has_more": false})),
            "invoke_llm_stream" => Reply::Stream(vec![text_chunk("ok")], answer("ok", json!({}))),
            other => panic!("unexpected call {other}"),
        },
    );
    assert_eq!(t.calls_of("history_page")[0]["after_cursor"], "cur10");
    let messages = t.calls_of("invoke_llm_stream")[0]["messages"].clone();
    assert!(
        messages[0]["content"]
            .as_str()
            .unwrap()
            .ends_with("oldest first:\nuser: earlier question")
    );
    assert_eq!(messages[1], json!({"role": "user", "content": "q11"}));
    assert_eq!(messages[2], json!({"role": "assistant", "content": "a12"}));
    assert!(t.calls_of("state_set").is_empty(), "nothing new to compact");
    assert_eq!(
        t.types(),
        ["message.delta", "message.completed", "run.completed"]
    );
}

#[test]
fn a_budget_refusal_fails_the_run_with_its_own_code() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM},
                                      {"model_id": "m2", "operations": LLM}]});
    let t = run(
        context(resources, json!({}), json!({}), json!({})),
        |action, _| match action {
            "invoke_llm_stream" => error(
                "budget_exceeded",
                false,
                json!({"budget": "model_calls", "limit": 16}),
            ),
            other => panic!("unexpected call {other}"),
        },
    );
    assert_eq!(
        t.calls_of("invoke_llm_stream").len(),
        1,
        "a budget refusal is no reason to fall back"
    );
    assert_eq!(t.types(), ["run.failed"]);
    let data = &t.last()["data"];
    assert_eq!(data["code"], "runner.budget_exceeded");
    assert!(
        data["error"].as_str().unwrap().contains("model_calls"),
        "{data}"
    );
    assert_eq!(t.last()["usage"]["model_calls"], 0);
}

#[test]
fn a_tool_budget_refusal_ends_the_run_after_reporting_the_call() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}],
                           "tools": [{"tool_name": "lookup", "operations": ["call"]}]});
    let t = run(
        context(resources, json!({}), json!({}), json!({})),
        |action, _| match action {
            "invoke_llm_stream" => Reply::Stream(
                vec![],
                json!({"message": {"role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "lookup", "arguments": "{}"}}]},
            "usage": {"total_tokens": 3}}),
            ),
            "call_tool" => error("budget_exceeded", false, json!({"budget": "tool_calls"})),
            other => panic!("unexpected call {other}"),
        },
    );
    assert_eq!(
        t.types(),
        ["tool.call.started", "tool.call.completed", "run.failed"]
    );
    assert_eq!(t.last()["data"]["code"], "runner.budget_exceeded");
    assert_eq!(t.last()["usage"]["total_tokens"], 3);
}

#[test]
fn every_model_down_fails_retryable_and_tool_errors_go_back_to_the_model() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM},
                                      {"model_id": "m2", "operations": ["invoke"]}]});
    let t = run(
        context(resources, json!({}), json!({}), json!({})),
        |action, _| match action {
            "invoke_llm_stream" => error("unavailable", true, json!({})),
            "invoke_llm" => error("rate_limited", true, json!({})),
            other => panic!("unexpected call {other}"),
        },
    );
    // m2 is granted `invoke` only: called without streaming.
    assert_eq!(t.calls_of("invoke_llm")[0]["llm_model_uuid"], "m2");
    assert_eq!(t.last()["data"]["code"], "runner.model_unavailable");
    assert_eq!(t.last()["data"]["retryable"], true);

    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}],
                           "tools": [{"tool_name": "lookup", "operations": ["call"]}]});
    let mut round = 0;
    let t = run(
        context(resources, json!({}), json!({}), json!({})),
        |action, params| match action {
            "invoke_llm_stream" => {
                round += 1;
                if round == 1 {
                    Reply::Stream(
                        vec![text_chunk("Checking.")],
                        json!({"message": {"role": "assistant",
                    "content": "Checking.", "tool_calls": [
                        {"id": "a", "function": {"name": "lookup", "arguments": "{}"}},
                        {"id": "b", "function": {"name": "ghost", "arguments": "{}"}},
                        {"id": "c", "function": {"name": "lookup", "arguments": "{oops"}}]},
                    "usage": {}}),
                    )
                } else {
                    let messages = params["messages"].as_array().unwrap();
                    let tools: Vec<&Value> =
                        messages.iter().filter(|m| m["role"] == "tool").collect();
                    assert_eq!(tools.len(), 3);
                    assert!(
                        tools[0]["content"]
                            .as_str()
                            .unwrap()
                            .contains("\"unavailable\"")
                    );
                    assert!(
                        tools[1]["content"]
                            .as_str()
                            .unwrap()
                            .contains("no tool named ghost")
                    );
                    assert!(
                        tools[2]["content"]
                            .as_str()
                            .unwrap()
                            .contains("not valid JSON")
                    );
                    Reply::Stream(
                        vec![text_chunk("Sorry, it is down.")],
                        answer("Sorry, it is down.", json!({})),
                    )
                }
            }
            "call_tool" => error("unavailable", true, json!({})),
            other => panic!("unexpected call {other}"),
        },
    );
    assert_eq!(
        t.calls_of("call_tool").len(),
        1,
        "unknown tools and bad arguments are not called"
    );
    assert_eq!(t.deltas(), ["Checking.", "\n\nSorry, it is down."]);
    assert_eq!(
        t.results[t.results.len() - 2]["data"]["message"]["content"],
        "Checking.\n\nSorry, it is down."
    );
    assert_eq!(t.last()["type"], "run.completed");
}

#[test]
fn the_last_round_offers_no_tools_and_a_model_that_insists_ends_the_run() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}],
                           "tools": [{"tool_name": "lookup", "operations": ["call"]}]});
    let t = run(
        context(resources, json!({}), json!({"max_rounds": 2}), json!({})),
        |action, _| match action {
            "invoke_llm_stream" => Reply::Stream(
                vec![],
                json!({"message": {"role": "assistant",
                "tool_calls": [{"id": "x", "function": {"name": "lookup", "arguments": "{}"}}]},
                "usage": {}}),
            ),
            "call_tool" => Reply::Ok(json!({"result": "again"})),
            other => panic!("unexpected call {other}"),
        },
    );
    let calls = t.calls_of("invoke_llm_stream");
    assert_eq!(calls.len(), 2);
    assert!(calls[0].get("funcs").is_some());
    assert!(
        calls[1].get("funcs").is_none(),
        "no tools in the last round"
    );
    assert_eq!(t.last()["data"]["code"], "runner.max_rounds");
}

#[test]
fn steering_input_between_rounds_continues_the_answer() {
    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}]});
    let apis = json!({"steering_pull": true});
    let mut pulls = 0;
    let mut round = 0;
    let t = run(
        context(resources, apis, json!({}), json!({})),
        |action, params| match action {
            "steering_pull" => {
                pulls += 1;
                assert_eq!(params["mode"], "all");
                if pulls == 1 {
                    Reply::Ok(json!({"items": [{"input": {"text": "and sick leave?"}}]}))
                } else {
                    Reply::Ok(json!({"items": []}))
                }
            }
            "invoke_llm_stream" => {
                round += 1;
                if round == 2 {
                    let messages = params["messages"].as_array().unwrap();
                    let n = messages.len();
                    assert_eq!(
                        messages[n - 2],
                        json!({"role": "assistant", "content": "25 days."})
                    );
                    assert_eq!(
                        messages[n - 1],
                        json!({"role": "user", "content": "and sick leave?"})
                    );
                }
                let text = if round == 1 {
                    "25 days."
                } else {
                    "Sick leave is separate."
                };
                Reply::Stream(vec![text_chunk(text)], answer(text, json!({})))
            }
            other => panic!("unexpected call {other}"),
        },
    );
    assert_eq!(pulls, 2);
    assert_eq!(t.deltas(), ["25 days.", "\n\nSick leave is separate."]);
    assert_eq!(t.last()["type"], "run.completed");
}

#[test]
fn without_a_model_or_with_a_bad_config_the_run_says_why() {
    let t = run(
        context(json!({}), json!({}), json!({}), json!({})),
        |a, _| panic!("no call expected: {a}"),
    );
    assert_eq!(t.types(), ["run.failed"]);
    assert_eq!(t.last()["data"]["code"], "runner.no_model");

    let resources = json!({"models": [{"model_id": "m1", "operations": LLM}]});
    let t = run(
        context(
            resources.clone(),
            json!({}),
            json!({"model": "m9"}),
            json!({}),
        ),
        |a, _| panic!("no call expected: {a}"),
    );
    assert_eq!(t.last()["data"]["code"], "runner.no_model");
    assert!(t.last()["data"]["error"].as_str().unwrap().contains("m9"));

    let t = run(
        context(resources, json!({}), json!({"max_rounds": 0}), json!({})),
        |a, _| panic!("no call expected: {a}"),
    );
    assert_eq!(t.last()["data"]["code"], "runner.invalid_config");
    assert!(
        t.last()["data"]["error"]
            .as_str()
            .unwrap()
            .starts_with("runner_config.max_rounds")
    );
}
