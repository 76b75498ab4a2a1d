//! Reading a message's JSON content without re-encoding it: the byte range of
//! each top-level member's value (so a payload is embedded exactly as written,
//! numbers of any size included), and base64 for content that is not UTF-8.

use std::borrow::Cow;
use std::ops::Range;

/// The top-level members of `json` (already checked to be valid JSON): name and
/// the byte range of the value; a name borrows `json` unless it holds an
/// escape. `None` when the document is not an object.
pub(super) fn members(json: &[u8]) -> Option<Vec<(Cow<'_, str>, Range<usize>)>> {
    let mut i = skip_ws(json, 0);
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut out = Vec::with_capacity(8);
    loop {
        i = skip_ws(json, i);
        match json.get(i) {
            Some(b'}') | None => return Some(out),
            Some(b',') => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let key_end = skip_string(json, i)?;
        let quoted = json.get(i..key_end)?;
        let name = if quoted.contains(&b'\\') {
            Cow::Owned(serde_json::from_slice::<String>(quoted).ok()?)
        } else {
            Cow::Borrowed(std::str::from_utf8(quoted.get(1..quoted.len() - 1)?).ok()?)
        };
        i = skip_ws(json, key_end);
        if json.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(json, i + 1);
        let end = skip_value(json, start)?;
        out.push((name, start..end));
        i = end;
    }
}

fn skip_ws(json: &[u8], mut i: usize) -> usize {
    while json.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The end of the string starting at `i` (after its closing quote).
fn skip_string(json: &[u8], i: usize) -> Option<usize> {
    if json.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match json.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// The end of the value starting at `i`.
fn skip_value(json: &[u8], i: usize) -> Option<usize> {
    match json.get(i)? {
        b'"' => skip_string(json, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match json.get(j)? {
                    b'"' => {
                        j = skip_string(json, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            // A number, true, false or null: up to the next delimiter.
            let mut j = i;
            while json
                .get(j)
                .is_some_and(|b| !matches!(b, b',' | b'}' | b']') && !b.is_ascii_whitespace())
            {
                j += 1;
            }
            Some(j)
        }
    }
}

/// Standard base64 with padding.
pub(super) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk.first().copied().unwrap_or(0),
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                let idx = usize::try_from((n >> (18 - 6 * k)) & 63).unwrap_or(0);
                out.push(char::from(ALPHABET[idx]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(json: &str) -> Vec<(String, &str)> {
        members(json.as_bytes())
            .unwrap()
            .into_iter()
            .map(|(k, r)| (k.into_owned(), &json[r]))
            .collect()
    }

    #[test]
    fn members_keep_each_value_as_written() {
        let doc = r#" { "id" : "a\"}b", "n":123456789012345678901234567890 ,
            "p": {"x": [1, {"y": "]}"}], "z": null}, "e\u0041": true, "last":[] } "#;
        assert_eq!(
            spans(doc),
            vec![
                ("id".to_owned(), r#""a\"}b""#),
                ("n".to_owned(), "123456789012345678901234567890"),
                ("p".to_owned(), r#"{"x": [1, {"y": "]}"}], "z": null}"#),
                ("eA".to_owned(), "true"),
                ("last".to_owned(), "[]"),
            ]
        );
        assert_eq!(spans("{}"), vec![]);
        assert!(members(b"[1]").is_none());
        assert!(members(b"\"s\"").is_none());
    }

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(&[0xff, 0xfe, 0x00, 0x80]), "//4AgA==");
    }
}
