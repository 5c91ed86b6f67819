//! Python `json.dumps`-style serialization for the template's `tojson` filter.
//!
//! HF's chat-template environment replaces Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
//! no HTML escaping, `", "`/`": "` separators, Python float repr.

use std::io::{self, Write};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// How to lay out the JSON text.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: newline plus `s` per nesting level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The `tojson` filter: `x | tojson`, `tojson(indent=2)`, `tojson(ensure_ascii=False)`, ...
/// Positional order follows HF: `ensure_ascii, indent, separators`; `sort_keys` by keyword.
pub(crate) fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        match (pos, kw) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson got `{name}` twice"),
            )),
            (p, k) => Ok(p.or(k).filter(|v| !v.is_none() && !v.is_undefined())),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(separators, "separators")?;
    let sort_keys = pick(None, "sort_keys")?;
    kwargs.assert_all_used()?;

    let mut opts = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..DumpOptions::default()
    };
    if let Some(ind) = indent {
        opts.indent = Some(if let Some(s) = ind.as_str() {
            s.to_string()
        } else if let Some(n) = ind.as_i64() {
            // Python: a negative indent behaves like 0 (newlines, no spaces).
            " ".repeat(n.max(0) as usize)
        } else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an integer or a string",
            ));
        });
        // Python drops the space after ',' when indenting.
        opts.item_sep = ",".into();
    }
    if let Some(seps) = separators {
        let pair: Vec<Value> = seps.try_iter().map_err(|_| bad_separators())?.collect();
        match pair.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_sep = a.as_str().unwrap_or_default().to_string();
                opts.key_sep = b.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(bad_separators()),
        }
    }
    dumps(value, &opts).map(Value::from)
}

fn bad_separators() -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        "tojson: separators must be a pair of strings",
    )
}

/// Serializes a template value like Python's `json.dumps` with `opts`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let sorted;
    let value = if opts.sort_keys {
        sorted = sort_maps(value)?;
        &sorted
    } else {
        value
    };
    let mut out = Vec::new();
    let fmt = PyFormatter {
        opts,
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(value, &mut ser).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value cannot be serialized",
        )
        .with_source(e)
    })?;
    String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "tojson: not UTF-8").with_source(e))
}

/// Copies `value` with every map's keys in sorted order (`sort_keys=True`).
fn sort_maps(value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                pairs.push((key, sort_maps(&item)?));
            }
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(Value::from_pairs(pairs))
        }
        ValueKind::Seq | ValueKind::Iterable => value
            .try_iter()?
            .map(|v| sort_maps(&v))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::from),
        _ => Ok(value.clone()),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4..1e16.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // e.g. "-1.25e-7", shortest digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let (int_part, frac) = if digits.len() > int_len {
                (digits[..int_len].to_string(), digits[int_len..].to_string())
            } else {
                (format!("{digits:0<int_len$}"), "0".to_string())
            };
            format!("{sign}{int_part}.{frac}")
        } else {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// serde_json formatter that writes Python `json.dumps` punctuation.
struct PyFormatter<'a> {
    opts: &'a DumpOptions,
    level: usize,
    has_value: bool,
}

impl PyFormatter<'_> {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(ind) = &self.opts.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(ind.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(c)
    }

    fn close<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(c)
    }

    fn item<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(self.opts.item_sep.as_bytes())?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyFormatter<'_> {
    fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, value: f64) -> io::Result<()> {
        w.write_all(py_float_repr(value).as_bytes())
    }

    fn write_f32<W: ?Sized + Write>(&mut self, w: &mut W, value: f32) -> io::Result<()> {
        w.write_all(py_float_repr(value as f64).as_bytes())
    }

    fn write_string_fragment<W: ?Sized + Write>(&mut self, w: &mut W, s: &str) -> io::Result<()> {
        if !self.opts.ensure_ascii || s.is_ascii() {
            return w.write_all(s.as_bytes());
        }
        let mut buf = [0u16; 2];
        for c in s.chars() {
            if c.is_ascii() {
                w.write_all(&[c as u8])?;
            } else {
                for unit in c.encode_utf16(&mut buf) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(self.opts.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    // Expected strings below were produced with CPython 3 `json.dumps` / `repr`.
    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (2.5e-300, "2.5e-300"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (100.0, "100.0"),
            (0.30000000000000004, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn default_layout_matches_python() {
        // json.dumps({"b": [1, 2.5, None, True], "a": {"x": "é<&>\"\n"}, "e": [], "f": {}},
        //            ensure_ascii=False)
        let v = parse(r#"{"b": [1, 2.5, null, true], "a": {"x": "é<&>\"\n"}, "e": [], "f": {}}"#);
        let got = dumps(&v, &DumpOptions::default()).unwrap();
        assert_eq!(
            got,
            r#"{"b": [1, 2.5, null, true], "a": {"x": "é<&>\"\n"}, "e": [], "f": {}}"#
        );
    }

    #[test]
    fn indent_matches_python() {
        // json.dumps({"a": [1, {"b": None}], "c": [], "d": "中"}, indent=2, ensure_ascii=False)
        let v = parse(r#"{"a": [1, {"b": null}], "c": [], "d": "中"}"#);
        let opts = DumpOptions {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ..DumpOptions::default()
        };
        let want = "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": [],\n  \"d\": \"中\"\n}";
        assert_eq!(dumps(&v, &opts).unwrap(), want);
    }

    #[test]
    fn ensure_ascii_and_sort_keys_match_python() {
        // json.dumps({"z": "中😀", "a": 1}, ensure_ascii=True, sort_keys=True)
        let v = parse(r#"{"z": "中😀", "a": 1}"#);
        let opts = DumpOptions {
            ensure_ascii: true,
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            r#"{"a": 1, "z": "\u4e2d\ud83d\ude00"}"#
        );
    }

    #[test]
    fn filter_arguments() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        let ctx = minijinja::context! { x => parse(r#"{"k": [1, "ü"]}"#) };
        let render = |src: &str| env.render_str(src, ctx.clone());
        assert_eq!(render("{{ x | tojson }}").unwrap(), r#"{"k": [1, "ü"]}"#);
        assert_eq!(
            render("{{ x | tojson(ensure_ascii=True) }}").unwrap(),
            r#"{"k": [1, "\u00fc"]}"#
        );
        assert_eq!(
            render("{{ x | tojson(indent=1) }}").unwrap(),
            "{\n \"k\": [\n  1,\n  \"ü\"\n ]\n}"
        );
        assert_eq!(
            render("{{ x | tojson(separators=(',', ':')) }}").unwrap(),
            r#"{"k":[1,"ü"]}"#
        );
        assert!(render("{{ x | tojson(bogus=1) }}").is_err());
        assert!(render("{{ x | tojson(separators=1) }}").is_err());
    }
}
