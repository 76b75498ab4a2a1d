//! Configuration errors that name the key, line and column without quoting
//! what the file said there: a value under the wrong key may be a password.

use std::path::Path;

/// The error for `e`, met parsing `text` (read from `origin`): where it is (the
/// table and key of the line, line and column) and what is wrong, never the value.
pub(super) fn parse_error(text: &str, origin: &Path, e: &toml::de::Error) -> anyhow::Error {
    let at = e.span().map_or_else(String::new, |span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before.len() - line_start + 1;
        // The key of the line, and the table it is in; never the value.
        let this_line = text[line_start..].lines().next().unwrap_or_default();
        let key = this_line
            .split_once('=')
            .map(|(k, _)| k.trim().trim_matches('"'))
            .filter(|k| !k.is_empty());
        let table = before
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| l.starts_with('['))
            .map(|l| l.trim_matches(|c| c == '[' || c == ']'));
        let name = match (table, key) {
            (Some(t), Some(k)) => format!(" {t}.{k}"),
            (None, Some(k)) => format!(" {k}"),
            _ => String::new(),
        };
        format!("{name} at line {line}, column {column}")
    });
    anyhow::anyhow!(
        "configuration {}{at}: {}",
        origin.display(),
        without_values(e.message().trim_end())
    )
}

/// A deserializer's message with the values it quotes taken out: a string in
/// double quotes (`invalid type: string "...", expected a boolean`) and the
/// variant of `unknown variant `...``, which are what the file said and may be a
/// password put under the wrong key. Names of keys and the expected forms stay.
pub(super) fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        if c == '"' {
            // Skip to the closing quote, minding escapes.
            let mut escaped = false;
            for c in chars.by_ref() {
                match (escaped, c) {
                    (false, '\\') => escaped = true,
                    (false, '"') => break,
                    _ => escaped = false,
                }
            }
            out.push_str("\"(a value)\"");
        } else {
            out.push(c);
        }
    }
    if let Some(rest) = out.strip_prefix("unknown variant `")
        && let Some(end) = rest.find('`')
    {
        return format!("unknown variant `(a value)`{}", &rest[end + 1..]);
    }
    out
}
