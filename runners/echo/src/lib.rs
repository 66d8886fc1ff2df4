//! The official echo runner: streams its input back word by word.
//!
//! For input text `T` it emits one `message.delta` per whitespace-separated word of `T` (each
//! chunk is the word plus a trailing space, except the last), then `message.completed` with
//! content `T`, then `run.completed`. It serves any number of runs at once (`mode = "shared"`)
//! and is what the end-to-end tests and `switchboard bench` drive.
//!
//! # Layout
//! - [`Echo`]: the runner; [`serve`]: its stdio loop; `chunks`: the word split (pure, tested).
//! - `src/main.rs`: the `echo` binary the bundled manifest starts. The `switchboard` binary
//!   embeds the same runner for `dev` when the standalone binary is missing.

use sb_runner::sb_protocol::error::run_failure;
use sb_runner::{Emitter, Run, RunError, Runner};

/// The echo runner.
#[derive(Debug, Clone, Copy, Default)]
pub struct Echo;

impl Runner for Echo {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        let text = run.input_text();
        for chunk in chunks(text) {
            if run.is_cancelled() {
                return Err(RunError::new(
                    run_failure::CANCELLED,
                    "cancelled by the host",
                ));
            }
            out.delta(chunk)?;
        }
        out.completed_text(text)?;
        out.run_completed()?;
        Ok(())
    }
}

/// The delta chunks for `text`: each word with one trailing space, the last without.
fn chunks(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let last = words.len().saturating_sub(1);
    words
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if i == last {
                (*w).to_owned()
            } else {
                format!("{w} ")
            }
        })
        .collect()
}

/// Serves the echo runner on stdin/stdout until the host says `shutdown` or closes stdin.
/// Blocks the calling thread.
pub fn serve() -> std::io::Result<()> {
    sb_runner::serve(Echo)
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn words_with_trailing_spaces_except_the_last() {
        assert_eq!(chunks("hello  big\tworld"), vec!["hello ", "big ", "world"]);
        assert_eq!(chunks("one"), vec!["one"]);
        assert!(chunks("   ").is_empty());
    }
}
