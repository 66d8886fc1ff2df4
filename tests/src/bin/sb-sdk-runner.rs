//! `sb-sdk-runner`: a well-behaved runner built on the `sb-runner` SDK, for end-to-end tests
//! of the SDK against the worker's real runner host. The first word of the input picks:
//!
//! | script | behaviour |
//! | --- | --- |
//! | `version` | calls `get_host_version` and reports the version |
//! | `denied` | calls `call_tool` (refused by a host without grants) and reports the error code |
//! | `wait` | waits for a cancel; the SDK then ends the run as `cancelled` |
//! | `panic` | panics; the SDK ends the run as `run.failed {code: "runner.error"}` |
//! | `error` | returns an error with code `runner.custom` |
//! | (anything else) | echoes the text as one delta, the message, and `run.completed` |

use std::time::Duration;

use sb_runner::{Emitter, Run, RunError, Runner};
use serde_json::json;

struct Probe;

impl Runner for Probe {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        let text = run.input_text().to_owned();
        match text.split_whitespace().next().unwrap_or("") {
            "version" => {
                let answer = run.api().get_host_version()?;
                out.completed_text(answer["version"].as_str().unwrap_or("?"))?;
                out.run_completed()?;
            }
            "denied" => {
                let code = match run
                    .api()
                    .call("call_tool", json!({"tool_name": "x", "parameters": {}}))
                {
                    Ok(_) => "allowed".to_owned(),
                    Err(e) => e.code,
                };
                out.completed_text(code)?;
                out.run_completed()?;
            }
            "wait" => {
                out.delta("waiting")?;
                // Returns early on cancel; the SDK turns a cancelled run into `cancelled`.
                let _ = run.cancelled_within(Duration::from_secs(60));
            }
            "panic" => panic!("scripted panic"),
            "error" => return Err(RunError::new("runner.custom", "scripted error")),
            _ => {
                out.delta(text.clone())?;
                out.completed_text(text)?;
                out.run_completed()?;
            }
        }
        Ok(())
    }
}

fn main() -> std::io::Result<()> {
    sb_runner::serve(Probe)
}
