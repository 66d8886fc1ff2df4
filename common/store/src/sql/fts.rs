//! Turning user search text into a safe SQLite FTS5 `MATCH` expression.
//!
//! Postgres parses user text itself with `websearch_to_tsquery`, which never fails. FTS5's
//! query language does fail on stray quotes, `*`, `:`, `^`, parentheses, keywords in odd
//! places…, so the text is parsed here with the same web-search rules and every operand is
//! re-emitted as an FTS5 string literal (`"…"` with `"` doubled), inside which FTS5 treats
//! everything as text for its tokenizer. The result contains only string literals and the
//! operators `AND`, `OR`, `NOT` and parentheses that this module writes itself.
//!
//! Rules (as `websearch_to_tsquery`): words must all match; `"a phrase"` matches the words
//! in order; `x OR y` (any case) matches either; `-word` excludes. An operand with no
//! letter or digit contributes nothing. FTS5 cannot express a query made only of
//! exclusions, so such a query matches nothing (Postgres would match every row without the
//! excluded words) — the one deliberate difference.

/// One operand of the query: the text of a word or phrase.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Operand {
    text: String,
    negated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Operand(Operand),
    Or,
}

fn tokenize(input: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut chars = input.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut negated = false;
        if c == '-' {
            chars.next();
            match chars.peek() {
                Some(n) if !n.is_whitespace() => negated = true,
                _ => continue,
            }
        }
        if chars.peek() == Some(&'"') {
            chars.next();
            let mut text = String::new();
            for ch in chars.by_ref() {
                if ch == '"' {
                    break;
                }
                text.push(ch);
            }
            tokens.push(Token::Operand(Operand { text, negated }));
            continue;
        }
        let mut text = String::new();
        while let Some(&ch) = chars.peek() {
            if ch.is_whitespace() || ch == '"' {
                break;
            }
            text.push(ch);
            chars.next();
        }
        if !negated && text.eq_ignore_ascii_case("or") {
            tokens.push(Token::Or);
        } else {
            tokens.push(Token::Operand(Operand { text, negated }));
        }
    }
    tokens
}

/// `text` as an FTS5 string literal, or `None` if it has nothing the tokenizer would index.
fn literal(text: &str) -> Option<String> {
    if !text.chars().any(char::is_alphanumeric) {
        return None;
    }
    Some(format!("\"{}\"", text.replace('"', "\"\"")))
}

/// The FTS5 `MATCH` expression for user `input`, or `None` when nothing can match.
pub(crate) fn fts5_match_expression(input: &str) -> Option<String> {
    // Groups of alternatives; the groups are ANDed.
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut excluded: Vec<String> = Vec::new();
    let mut pending_or = false;
    for token in tokenize(input) {
        match token {
            Token::Or => pending_or = !groups.is_empty(),
            Token::Operand(op) => {
                let Some(lit) = literal(&op.text) else {
                    continue;
                };
                if op.negated {
                    excluded.push(lit);
                } else if pending_or {
                    if let Some(last) = groups.last_mut() {
                        last.push(lit);
                    }
                } else {
                    groups.push(vec![lit]);
                }
                pending_or = false;
            }
        }
    }
    if groups.is_empty() {
        return None;
    }
    let mut expr = groups
        .into_iter()
        .map(|group| {
            if group.len() == 1 {
                group.into_iter().next().unwrap_or_default()
            } else {
                format!("({})", group.join(" OR "))
            }
        })
        .collect::<Vec<_>>()
        .join(" AND ");
    for lit in excluded {
        expr = format!("({expr}) NOT {lit}");
    }
    Some(expr)
}

#[cfg(test)]
mod tests {
    use super::fts5_match_expression as q;

    #[test]
    fn words_are_anded_literals() {
        assert_eq!(q("hello world").as_deref(), Some("\"hello\" AND \"world\""));
    }

    #[test]
    fn phrases_or_and_exclusions() {
        assert_eq!(
            q("\"big cat\" or dog -fish").as_deref(),
            Some("((\"big cat\" OR \"dog\")) NOT \"fish\"")
        );
        assert_eq!(q("a OR").as_deref(), Some("\"a\""));
        assert_eq!(q("OR a").as_deref(), Some("\"a\""));
    }

    #[test]
    fn hostile_input_is_quoted_or_dropped() {
        assert_eq!(q("\""), None);
        assert_eq!(q("*"), None);
        assert_eq!(q("OR"), None);
        assert_eq!(q("-x"), None);
        assert_eq!(q(""), None);
        assert_eq!(q("   "), None);
        assert_eq!(
            q("'; drop table transcript; --").as_deref(),
            Some("\"drop\" AND \"table\" AND \"transcript;\"")
        );
        assert_eq!(q("a\"b").as_deref(), Some("\"a\" AND \"b\""));
        assert_eq!(q("NEAR(a b)").as_deref(), Some("\"NEAR(a\" AND \"b)\""));
        assert_eq!(q("col:val ^x").as_deref(), Some("\"col:val\" AND \"^x\""));
    }
}
