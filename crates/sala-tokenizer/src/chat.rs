//! Chat templates: Jinja rendered with minijinja, configured like HF transformers'
//! jinja2 environment (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
//! `strftime_now`, a `json.dumps`-style `tojson`, Python string/dict methods).

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};
use crate::pyjson;

/// The fallback used when a checkpoint has no template (SPEC §14): ChatML turns
/// `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n` when
/// `add_generation_prompt`. No BOS text, no default system prompt.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' }}\
{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}\
{{- '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// Names the renderer sets itself; kwargs may not use them.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// One chat message. Extra fields (`tool_calls`, `name`, `reasoning_content`, ...) are passed
/// to the template unchanged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` renders as Jinja `none` (e.g. assistant turns that only carry tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Message content: a string, or OpenAI-style parts `[{"type": "text", "text": ".."}, ..]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part; only `"type": "text"` parts are supported (this is a text-only model).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            extra: Default::default(),
        }
    }

    /// The content as one string: text parts are joined with `"\n"` (as vLLM does for
    /// string-format templates). Non-text parts are an error.
    pub fn text(&self) -> Result<Option<String>> {
        match &self.content {
            None => Ok(None),
            Some(MessageContent::Text(s)) => Ok(Some(s.clone())),
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (i, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => texts.push(t.as_str()),
                        ("text", None) => {
                            return Err(chat_input(format!(
                                "content part {i} of type \"text\" has no \"text\" string"
                            )))
                        }
                        (other, _) => {
                            return Err(chat_input(format!(
                                "content part {i} has unsupported type {other:?} (only \"text\")"
                            )))
                        }
                    }
                }
                Ok(Some(texts.join("\n")))
            }
        }
    }
}

/// Render inputs besides the messages.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers next.
    pub add_generation_prompt: bool,
    /// Tool (function) definitions, passed as `tools` (`none` when absent, as in HF).
    /// Key order follows `serde_json::Map` (sorted unless serde_json's `preserve_order` is on).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Extra template variables such as `enable_thinking`; they may override
    /// `bos_token`/`eos_token` but not `messages`, `tools`, `documents`, `add_generation_prompt`.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// Marks the error of `raise_exception` so that rendering can report it as such.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(RaisedException(msg)))
}

fn strftime_now(fmt: String) -> std::result::Result<Value, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(&fmt, secs)
        .map(Value::from)
        .map_err(|m| Error::new(ErrorKind::InvalidOperation, m))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of a 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// C `strftime` for a UTC timestamp. Supports `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j
/// %F %T %%` and the glibc no-padding forms `%-d %-m %-H %-I %-M %-S %-j`.
pub(crate) fn strftime_utc(fmt: &str, unix_secs: i64) -> std::result::Result<String, String> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day as i64 + i64::from(month > 2 && is_leap(year));
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = if spec == Some('-') {
            spec = chars.next();
            false
        } else {
            true
        };
        let num = |v: i64, width: usize| {
            if pad {
                format!("{v:0width$}")
            } else {
                v.to_string()
            }
        };
        let piece = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(month as i64, 2),
            Some('d') => num(day as i64, 2),
            Some('e') => format!("{day:>2}"),
            Some('H') => num(hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('p') => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            Some('B') => MONTHS[month as usize - 1].to_string(),
            Some('b') | Some('h') => MONTHS[month as usize - 1][..3].to_string(),
            Some('A') => WEEKDAYS[weekday].to_string(),
            Some('a') => WEEKDAYS[weekday][..3].to_string(),
            Some('F') => format!("{year:04}-{month:02}-{day:02}"),
            Some('T') => format!("{hour:02}:{minute:02}:{second:02}"),
            Some('%') if pad => "%".to_string(),
            Some(other) => return Err(format!("strftime_now: unsupported directive %{other}")),
            None => return Err("strftime_now: format ends with a lone %".to_string()),
        };
        out.push_str(&piece);
    }
    Ok(out)
}

fn chat_input(message: String) -> TokenizerError {
    TokenizerError::ChatInput { message }
}

/// Maps a render error, recognising `raise_exception` anywhere in the source chain.
fn render_error(err: Error) -> TokenizerError {
    if err.kind() == minijinja::ErrorKind::OutOfFuel {
        return TokenizerError::TemplateRender {
            message: format!(
                "the chat template ran past its limit of {TEMPLATE_FUEL} steps (a template that \
                 loops without end, or a conversation far too long for it)"
            ),
        };
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TokenizerError::TemplateRaised {
                message: raised.0.clone(),
            };
        }
        cur = e.source();
    }
    let mut message = err.to_string();
    let mut src = std::error::Error::source(&err);
    while let Some(e) = src {
        message.push_str(": ");
        message.push_str(&e.to_string());
        src = e.source();
    }
    TokenizerError::TemplateRender { message }
}

/// Steps a template render may take (minijinja's fuel): far beyond any real conversation's
/// render, so that a template that loops without end fails its request instead of hanging.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

impl ChatTemplate {
    /// Compiles `source`; a template that does not parse is a [`TokenizerError::TemplateSyntax`].
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TokenizerError::TemplateSyntax {
                message: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::TemplateSyntax {
                message: e.to_string(),
            })?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        })
    }

    /// The built-in ChatML fallback ([`CHATML_TEMPLATE`]).
    pub fn chatml(bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        Self::new(CHATML_TEMPLATE, bos_token, eos_token)
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the prompt text. Variables: `messages` (content parts joined to strings),
    /// `tools`, `documents` (none), `add_generation_prompt`, `bos_token`, `eos_token`,
    /// then `opts.kwargs`.
    pub fn render(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String> {
        let mut msgs = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let text = m.text().map_err(|e| match e {
                TokenizerError::ChatInput { message } => {
                    chat_input(format!("message {i}: {message}"))
                }
                other => other,
            })?;
            let mut pairs: Vec<(String, Value)> = Vec::with_capacity(2 + m.extra.len());
            pairs.push(("role".into(), Value::from(m.role.as_str())));
            pairs.push(("content".into(), text.map_or(Value::from(()), Value::from)));
            for (k, v) in &m.extra {
                if k == "role" || k == "content" {
                    continue;
                }
                pairs.push((k.clone(), json_to_value(v)));
            }
            msgs.push(Value::from_pairs(pairs));
        }

        let tools = match &opts.tools {
            Some(list) => Value::from(list.iter().map(json_to_value).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(msgs)),
            ("tools".into(), tools),
            ("documents".into(), Value::from(())),
            (
                "add_generation_prompt".into(),
                Value::from(opts.add_generation_prompt),
            ),
        ];
        if let Some(b) = &self.bos_token {
            ctx.push(("bos_token".into(), Value::from(b.as_str())));
        }
        if let Some(e) = &self.eos_token {
            ctx.push(("eos_token".into(), Value::from(e.as_str())));
        }
        for (k, v) in &opts.kwargs {
            if RESERVED.contains(&k.as_str()) {
                return Err(chat_input(format!(
                    "kwarg `{k}` is reserved; use the ChatOptions field or the messages argument"
                )));
            }
            // Later entries win, so kwargs override bos_token/eos_token (HF behaviour).
            ctx.retain(|(name, _)| name != k);
            ctx.push((k.clone(), json_to_value(v)));
        }

        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        tmpl.render(Value::from_pairs(ctx)).map_err(render_error)
    }
}

fn json_to_value(v: &serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(v))
}

#[cfg(test)]
mod tests {
    /// A template that loops without end fails its render with an error naming the limit, in
    /// bounded time; a real conversation's render takes a sliver of the fuel.
    #[test]
    fn a_template_that_does_not_end_runs_out_of_fuel() {
        let looping = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}\
                       {% endfor %}{% endfor %}";
        let t = ChatTemplate::new(looping, None, None).unwrap();
        let start = std::time::Instant::now();
        let e = t
            .render(&[ChatMessage::new("user", "hi")], &ChatOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("limit of"), "{e}");
        assert!(start.elapsed().as_secs() < 30, "{:?}", start.elapsed());
    }

    use super::*;
    use serde_json::json;

    fn user(text: &str) -> ChatMessage {
        ChatMessage::new("user", text)
    }

    fn gen_prompt() -> ChatOptions {
        ChatOptions {
            add_generation_prompt: true,
            ..Default::default()
        }
    }

    #[test]
    fn chatml_fallback_matches_spec_example() {
        // SPEC §9: the April-2026 render of this exact conversation (76 characters).
        let t = ChatTemplate::chatml(Some("<s>"), Some("<|im_end|>")).unwrap();
        let out = t
            .render(&[user("Hello, world! Test prompt.")], &gen_prompt())
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHello, world! Test prompt.<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(out.chars().count(), 76);
    }

    #[test]
    fn chatml_multi_turn_without_generation_prompt() {
        let t = ChatTemplate::chatml(None, None).unwrap();
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            user("2+2?"),
            ChatMessage::new("assistant", "4"),
        ];
        let out = t.render(&msgs, &ChatOptions::default()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n"
        );
    }

    #[test]
    fn content_parts_are_joined() {
        let m: ChatMessage = serde_json::from_value(json!({
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
        }))
        .unwrap();
        let t = ChatTemplate::chatml(None, None).unwrap();
        let out = t.render(&[m], &ChatOptions::default()).unwrap();
        assert_eq!(out, "<|im_start|>user\nfirst\nsecond<|im_end|>\n");

        let bad: ChatMessage = serde_json::from_value(json!({
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "x"}}]
        }))
        .unwrap();
        let err = t
            .render(&[user("ok"), bad], &ChatOptions::default())
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("message 1") && msg.contains("image_url"),
            "{msg}"
        );
    }

    #[test]
    fn extra_message_fields_reach_the_template() {
        let m: ChatMessage = serde_json::from_value(json!({
            "role": "assistant", "content": null,
            "tool_calls": [{"name": "f", "arguments": {"x": 1}}]
        }))
        .unwrap();
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content is none }}|{{ m.tool_calls[0].name }}|\
             {{ m.tool_calls[0].arguments | tojson }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            t.render(&[m], &ChatOptions::default()).unwrap(),
            "True|f|{\"x\": 1}"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        // jinja2 with trim_blocks + lstrip_blocks renders this as "A\nB\n" for flag=True
        // and "B\n" for flag=False (block lines vanish entirely).
        let src = "    {% if flag %}\nA\n    {% endif %}\nB\n";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let mut opts = ChatOptions::default();
        opts.kwargs.insert("flag".into(), json!(true));
        // keep_trailing_newline=False drops the final newline.
        assert_eq!(t.render(&[], &opts).unwrap(), "A\nB");
        opts.kwargs.insert("flag".into(), json!(false));
        assert_eq!(t.render(&[], &opts).unwrap(), "B");
    }

    #[test]
    fn loop_controls_and_pycompat_methods() {
        let src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
                   {{ m.content.strip().upper() }};{% endfor %}\
                   {{ extra.get('k', 'none') }}|{{ 'a,b'.split(',') | length }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let mut opts = ChatOptions::default();
        opts.kwargs.insert("extra".into(), json!({"k": "v"}));
        let msgs = [user("  x "), user("y"), user("z")];
        assert_eq!(t.render(&msgs, &opts).unwrap(), "X;Y;v|2");
    }

    #[test]
    fn raise_exception_surfaces() {
        let src = "{% if messages[0].role != 'system' %}\
                   {{ raise_exception('First message must be system, got ' + messages[0].role) }}\
                   {% endif %}ok";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let err = t
            .render(&[user("hi")], &ChatOptions::default())
            .unwrap_err();
        match &err {
            TokenizerError::TemplateRaised { message } => {
                assert_eq!(message, "First message must be system, got user")
            }
            other => panic!("expected TemplateRaised, got {other:?}"),
        }
        assert!(err.to_string().contains("raised an exception"));
        assert_eq!(
            t.render(&[ChatMessage::new("system", "s")], &ChatOptions::default())
                .unwrap(),
            "ok"
        );
    }

    #[test]
    fn syntax_and_render_errors_say_so() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.role }}", None, None).unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("syntax error"), "{err}");

        let t = ChatTemplate::new("{{ messages | no_such_filter }}", None, None).unwrap();
        let err = t.render(&[], &ChatOptions::default()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRender { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("no_such_filter"), "{err}");
    }

    #[test]
    fn tools_tojson_keeps_non_ascii_and_is_not_html_escaped() {
        let src = "{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}\
                   {{ tools[0] | tojson }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let opts = ChatOptions {
            tools: Some(vec![json!({"description": "查询天气 <city> & 😀"})]),
            ..Default::default()
        };
        let want = "{\"description\": \"查询天气 <city> & 😀\"}";
        assert_eq!(t.render(&[], &opts).unwrap(), format!("{want}\n{want}"));
    }

    #[test]
    fn tools_absent_is_none_and_kwargs_flow_through() {
        // Booleans print as Python's True/False, as in jinja2.
        let src = "{{ tools is none }}|{{ enable_thinking }}|{{ bos_token }}|{{ eos_token }}";
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>")).unwrap();
        let mut opts = ChatOptions::default();
        opts.kwargs.insert("enable_thinking".into(), json!(false));
        assert_eq!(t.render(&[], &opts).unwrap(), "True|False|<s>|</s>");
        opts.kwargs.insert("bos_token".into(), json!("[BOS]"));
        assert_eq!(t.render(&[], &opts).unwrap(), "True|False|[BOS]|</s>");
        opts.kwargs.insert("messages".into(), json!([]));
        assert!(matches!(
            t.render(&[], &opts).unwrap_err(),
            TokenizerError::ChatInput { .. }
        ));
    }

    #[test]
    fn strftime_matches_python() {
        // datetime(2000, 2, 29, 13, 4, 5, tzinfo=timezone.utc).timestamp() == 951829445;
        // strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %I %p %y") in CPython gives the string below.
        let got = strftime_utc("%Y-%m-%d %H:%M:%S %a %A %b %B %j %I %p %y", 951_829_445).unwrap();
        assert_eq!(
            got,
            "2000-02-29 13:04:05 Tue Tuesday Feb February 060 01 PM 00"
        );
        // 1969-12-31 23:59:59 UTC (Wednesday), day 365; glibc %-d / %e.
        assert_eq!(
            strftime_utc("%-d %e %F %T %A %j %%", -1).unwrap(),
            "31 31 1969-12-31 23:59:59 Wednesday 365 %"
        );
        // 2024-12-31 (leap year, day 366) 00:00:00 -> 12 AM.
        assert_eq!(
            strftime_utc("%d %b %Y %j %I %p", 1_735_603_200).unwrap(),
            "31 Dec 2024 366 12 AM"
        );
        assert!(strftime_utc("%Q", 0).is_err());
        assert!(strftime_utc("50%", 0).is_err());
    }

    #[test]
    fn strftime_now_is_callable() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        let year: i64 = t
            .render(&[], &ChatOptions::default())
            .unwrap()
            .parse()
            .unwrap();
        assert!(year >= 2024, "{year}");
    }
}
