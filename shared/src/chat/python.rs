//! Python's formatting of template values, so minijinja prints what Jinja2 prints.
//!
//! HuggingFace renders chat templates with Jinja2, whose output is Python's: `{{ none }}` is
//! `None`, `{{ [1, 'a'] }}` is `[1, 'a']`, floats use `repr`, and the `tojson` filter HF installs
//! is `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` (spaces
//! after `,` and `:`, keys in insertion order, non-ASCII unescaped). minijinja's defaults differ
//! on each of these, and a single differing byte changes the token ids, so this module re-states
//! Python's rules for the value kinds a JSON request can carry.
//!
//! Known gaps (documented rather than guessed): `repr` of a string escapes only the
//! non-printable characters this module lists (Python consults the full Unicode database), and
//! integers beyond 128 bits cannot occur because requests are parsed by serde_json.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How `json.dumps` lays out containers: HF's `tojson` exposes these keyword arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpOptions {
    /// `ensure_ascii`: escape every non-ASCII character as `\uXXXX` (HF's default is false).
    pub ensure_ascii: bool,
    /// `indent`: `None` for one line, else the string repeated once per nesting level.
    pub indent: Option<String>,
    /// `separators`: item and key separators; `None` picks Python's defaults for `indent`.
    pub separators: Option<(String, String)>,
    /// `sort_keys`: sort object keys.
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Reads the keyword arguments of HF's `tojson(x, ensure_ascii, indent, separators, sort_keys)`.
    pub fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let mut options = Self::default();
        if let Some(value) = kwargs.get::<Option<bool>>("ensure_ascii")? {
            options.ensure_ascii = value;
        }
        if let Some(value) = kwargs.get::<Option<Value>>("indent")? {
            options.indent = indent_string(&value)?;
        }
        if let Some(value) = kwargs.get::<Option<Value>>("separators")? {
            if !value.is_none() {
                let items: Vec<String> = value
                    .try_iter()?
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| invalid("tojson: separators must be two strings"))?;
                match <[String; 2]>::try_from(items) {
                    Ok([item, key]) => options.separators = Some((item, key)),
                    Err(_) => return Err(invalid("tojson: separators must be two strings")),
                }
            }
        }
        if let Some(value) = kwargs.get::<Option<bool>>("sort_keys")? {
            options.sort_keys = value;
        }
        kwargs.assert_all_used()?;
        Ok(options)
    }
}

/// Python's `indent`: an int means that many spaces (negative: none), a string is used as is.
fn indent_string(value: &Value) -> Result<Option<String>, Error> {
    if value.is_none() {
        return Ok(None);
    }
    if let Some(s) = value.as_str() {
        return Ok(Some(s.to_owned()));
    }
    match value.as_i64() {
        Some(n) => Ok(Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(64)))),
        None => Err(invalid(
            "tojson: indent must be an integer, a string or none",
        )),
    }
}

fn invalid(message: &'static str) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// `json.dumps(value, **options)` as Python prints it.
pub fn json_dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match (&options.separators, &options.indent) {
        (Some((item, key)), _) => (item.clone(), key.clone()),
        (None, None) => (", ".to_owned(), ": ".to_owned()),
        (None, Some(_)) => (",".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    let writer = JsonWriter {
        options,
        item_sep: &item_sep,
        key_sep: &key_sep,
    };
    writer.write(&mut out, value, 0)?;
    Ok(out)
}

struct JsonWriter<'a> {
    options: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl JsonWriter<'_> {
    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(out, value, true),
            ValueKind::String => write_json_string(
                out,
                value.as_str().unwrap_or_default(),
                self.options.ensure_ascii,
            ),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, ('[', ']'), items.len(), level, |out, i, level| {
                    items
                        .get(i)
                        .map_or(Ok(()), |item| self.write(out, item, level))
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.options.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, ('{', '}'), entries.len(), level, |out, i, level| {
                    if let Some((key, item)) = entries.get(i) {
                        write_json_string(out, key, self.options.ensure_ascii);
                        out.push_str(self.key_sep);
                        self.write(out, item, level)?;
                    }
                    Ok(())
                })?;
            }
            // Python raises TypeError for anything else (Jinja2's Undefined included).
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of kind {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// Python's `_iterencode_list`/`_iterencode_dict` layout: empty containers stay `[]`/`{}`,
    /// otherwise items are separated by `item_sep` (plus a newline and indent when indenting).
    fn write_container(
        &self,
        out: &mut String,
        (open, close): (char, char),
        len: usize,
        level: usize,
        mut item: impl FnMut(&mut String, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        let inner = level + 1;
        for i in 0..len {
            if i > 0 {
                out.push_str(self.item_sep);
            }
            if let Some(indent) = &self.options.indent {
                out.push('\n');
                out.push_str(&indent.repeat(inner));
            }
            item(out, i, inner)?;
        }
        if let Some(indent) = &self.options.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
        out.push(close);
        Ok(())
    }
}

/// Python converts int, float, bool and None keys to strings; anything else is a TypeError.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key, true);
            Ok(s)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// Integers print as digits; floats as Python's `repr` (`json` spells non-finite ones
/// `NaN`/`Infinity`, `repr` spells them `nan`/`inf`).
fn write_number(out: &mut String, value: &Value, json: bool) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if x.is_nan() {
        out.push_str(if json { "NaN" } else { "nan" });
    } else if x.is_infinite() {
        let sign = if x < 0.0 { "-" } else { "" };
        out.push_str(sign);
        out.push_str(if json { "Infinity" } else { "inf" });
    } else {
        out.push_str(&float_repr(x));
    }
}

/// Python's `repr(float)` for a finite value: the shortest digits that round-trip, in fixed
/// notation when the decimal exponent is in -4..16, else `d.ddde±XX`; fixed always has a `.`.
pub fn float_repr(x: f64) -> String {
    // Rust's `{:e}` prints the same shortest round-trip digits Python's repr uses.
    let sci = format!("{x:e}");
    let (negative, sci) = match sci.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, sci.as_str()),
    };
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
        return out;
    }
    let decpt = exp + 1;
    let n = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    if decpt <= 0 {
        out.push_str("0.");
        out.push_str(&"0".repeat(decpt.unsigned_abs() as usize));
        out.push_str(&digits);
    } else if decpt >= n {
        out.push_str(&digits);
        out.push_str(&"0".repeat((decpt - n).unsigned_abs() as usize));
        out.push_str(".0");
    } else {
        let (int, frac) = digits.split_at(decpt.unsigned_abs() as usize);
        out.push_str(int);
        out.push('.');
        out.push_str(frac);
    }
    out
}

/// A JSON string literal as Python's `json` encoder writes it.
fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            // ensure_ascii escapes everything outside printable ASCII, DEL included.
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `str(value)` as Jinja2 prints `{{ value }}`: strings verbatim, undefined as nothing, the rest
/// as Python's `str`/`repr` (`None`, `True`, `[1, 'a']`, `{'k': 1.0}`).
pub fn py_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => py_repr(out, value),
    }
}

/// Python's `repr` for the value kinds a request can carry; other kinds fall back to minijinja's
/// own formatting, which Jinja2 could not have produced anyway.
pub fn py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value, false),
        ValueKind::String => repr_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &key);
                    out.push_str(": ");
                    if let Ok(item) = value.get_item(&key) {
                        py_repr(out, &item);
                    }
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`; escapes `\\`, the
/// quote, `\n`, `\r`, `\t` and non-printable characters (`\xNN`, `\uNNNN`).
fn repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_printable(c) => {
                let n = c as u32;
                let _ = if n <= 0xff {
                    write!(out, "\\x{n:02x}")
                } else if n <= 0xffff {
                    write!(out, "\\u{n:04x}")
                } else {
                    write!(out, "\\U{n:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for the characters that occur in practice: controls, the
/// separators other than the ASCII space, and the common format characters are not printable.
fn is_printable(c: char) -> bool {
    !matches!(c,
        '\u{00}'..='\u{1f}' | '\u{7f}'..='\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{180e}'
        | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{206f}'
        | '\u{3000}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}' | '\u{e000}'..='\u{f8ff}')
}

/// Python's `str.isspace` (what `str.strip()` removes): Unicode white space plus the
/// information separators U+001C..U+001F that Python also counts.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn dumps(json: &str) -> String {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        json_dumps(&Value::from_serialize(&v), &DumpOptions::default()).unwrap()
    }

    #[test]
    fn float_repr_matches_python() {
        // Each right-hand side is CPython's repr().
        for (x, py) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.5, "0.5"),
            (3.0, "3.0"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345.6, "123456789012345.6"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (2.25, "2.25"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-1234.5, "-1234.5"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(float_repr(x), py, "{x}");
        }
    }

    #[test]
    fn dumps_like_python_json() {
        assert_eq!(
            dumps(r#"{"b": 1, "a": [1, 2.5, null, true], "c": {}}"#),
            r#"{"b": 1, "a": [1, 2.5, null, true], "c": {}}"#
        );
        assert_eq!(
            dumps(r#""caf\u00e9 \u6771 \ud83c\udf63 \u007f \u2028""#),
            "\"café 東 🍣 \u{7f} \u{2028}\""
        );
        assert_eq!(
            dumps(r#""a\"b\\c\nd\te\u0001\b\f\r""#),
            r#""a\"b\\c\nd\te\u0001\b\f\r""#
        );
        assert_eq!(dumps("[]"), "[]");
        assert_eq!(dumps("12345678901234567890"), "12345678901234567890");
        assert_eq!(dumps("1e20"), "1e+20");
    }

    #[test]
    fn dumps_options() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, {"x": "é"}], "a": []}"#).unwrap();
        let v = Value::from_serialize(&v);
        let indented = DumpOptions {
            indent: Some("  ".into()),
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            json_dumps(&v, &indented).unwrap(),
            "{\n  \"a\": [],\n  \"b\": [\n    1,\n    {\n      \"x\": \"é\"\n    }\n  ]\n}"
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            separators: Some((",".into(), ":".into())),
            ..DumpOptions::default()
        };
        assert_eq!(
            json_dumps(&v, &ascii).unwrap(),
            r#"{"b":[1,{"x":"\u00e9"}],"a":[]}"#
        );
    }

    #[test]
    fn undefined_is_not_serializable() {
        assert!(json_dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
    }

    #[test]
    fn repr_like_python() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"a": [1, 2.0, null, true, "it's", "x\ny", "q\"'"]}"#).unwrap();
        let mut out = String::new();
        py_str(&mut out, &Value::from_serialize(&v));
        assert_eq!(
            out,
            r#"{'a': [1, 2.0, None, True, "it's", 'x\ny', 'q"\'']}"#
        );
        let mut out = String::new();
        py_str(&mut out, &Value::from("plain"));
        assert_eq!(out, "plain");
    }
}
