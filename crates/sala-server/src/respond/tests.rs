//! The response side with scripted engine events: streamed and whole replies, their
//! reasoning and tool calls, and what the official `openai` client reads of them.

use super::*;

/// The SSE data lines of a streamed chat reply made of `pieces`.
async fn streamed(pieces: &[&str]) -> Vec<Value> {
    streamed_with(pieces, &ReplySetup::default(), FinishReason::Stop).await
}

/// The engine's events of a chat reply generated as `pieces`, ending with `finish`.
async fn scripted(pieces: &[&str], finish: FinishReason) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel(pieces.len() + 1);
    for p in pieces {
        tx.send(Event::Text {
            text: p.to_string(),
            logprobs: Vec::new(),
        })
        .await
        .unwrap();
    }
    tx.send(Event::Done {
        finish,
        prompt_tokens: 3,
        cached_tokens: 0,
        completion_tokens: pieces.len(),
    })
    .await
    .unwrap();
    rx
}

fn chat_meta() -> Meta {
    Meta {
        id: "chatcmpl-test".into(),
        created: 0,
        model: "m".into(),
        kind: Kind::Chat,
        logprobs: false,
        n: 1,
        prompt: None,
        max_logprobs: usize::MAX,
    }
}

/// The SSE body of a streamed chat reply generated as `pieces`, read as `reply` says.
async fn stream_body(pieces: &[&str], reply: &ReplySetup, finish: FinishReason) -> String {
    let rx = scripted(pieces, finish).await;
    let body = stream_response(chat_meta(), vec![rx], true, reply)
        .into_response()
        .into_body();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// [`streamed`], the reply read as `reply` says, ending with `finish`.
async fn streamed_with(pieces: &[&str], reply: &ReplySetup, finish: FinishReason) -> Vec<Value> {
    stream_body(pieces, reply, finish)
        .await
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The body of the same reply answered whole.
async fn whole(pieces: &[&str], reply: &ReplySetup, finish: FinishReason) -> Value {
    let rx = scripted(pieces, finish).await;
    match whole_response(&chat_meta(), vec![rx], reply).await {
        Ok(v) => v,
        Err(Failed::Engine(e) | Failed::Here(e)) => panic!("{}", e.message),
    }
}

/// A streamed chat reply's `<think>` text arrives as `reasoning_content` deltas, the rest
/// as `content`, with the finish and usage chunks after; the same split as unstreamed.
#[tokio::test]
async fn streamed_reasoning_goes_to_reasoning_content() {
    let chunks = streamed(&["<thi", "nk>Two and", " two</th", "ink>\n\nFour", "."]).await;
    let field = |f: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][f].as_str())
            .collect()
    };
    assert_eq!(field("reasoning_content"), "Two and two");
    assert_eq!(field("content"), "Four.");
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["stop"]);
    assert!(chunks.last().unwrap()["usage"].is_object(), "{chunks:?}");
    // Held text released at the end still comes before the finish chunk.
    let chunks = streamed(&["<think>unfinished</thi"]).await;
    let at_finish = chunks
        .iter()
        .position(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    let reasoning: String = chunks[..at_finish]
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, "unfinished</thi");
}

/// The tools of the tests below, as a request gives them.
fn weather_tool_list() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "strict": true,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}, "required": ["city", "days"],
            "additionalProperties": false}}}])
}

fn weather_tools(prefix: &str) -> ReplySetup {
    let tools = weather_tool_list();
    ReplySetup {
        prefix: prefix.into(),
        calls: Some(crate::tools::CallReading {
            tools: Arc::new(crate::tools::ToolSet::new(tools.as_array().unwrap()).unwrap()),
            max_calls: usize::MAX,
        }),
    }
}

/// Streamed calls arrive as OpenAI streams them: per call, a delta with its index, id,
/// type and name (empty arguments), then one with the arguments; the finish reason is
/// `tool_calls`. Text before the calls is content.
#[tokio::test]
async fn streamed_tool_calls_are_deltas() {
    let pieces = [
        "Looking.\n<func",
        "tion name=\"get_weather\"><param name=\"days\">",
        "3</param></function>\n<function name=\"get_weather\"></function>",
    ];
    let chunks = streamed_with(&pieces, &weather_tools(""), FinishReason::Stop).await;
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Looking.");
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 4, "{chunks:?}");
    for (i, pair) in calls.chunks(2).enumerate() {
        let (head, args) = (pair[0], pair[1]);
        assert_eq!(head["index"], i);
        assert!(head["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(head["type"], "function");
        assert_eq!(head["function"]["name"], "get_weather");
        assert_eq!(head["function"]["arguments"], "");
        assert_eq!(args["index"], i);
        assert!(args.get("id").is_none());
    }
    assert_eq!(calls[1]["function"]["arguments"], r#"{"days":3}"#);
    assert_eq!(calls[3]["function"]["arguments"], "{}");
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["tool_calls"]);
    // Cut off by the length: `length`, and a call cut off stays content.
    let chunks = streamed_with(
        &["<param name=\"days\">"],
        &weather_tools("<function name=\"get_weather\">"),
        FinishReason::Length,
    )
    .await;
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        "<function name=\"get_weather\"><param name=\"days\">"
    );
    assert!(chunks.last().unwrap()["usage"].is_object());
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["length"]);
}

/// The whole reply reads as the streamed one: content (null when empty beside calls),
/// `tool_calls` with ids, and `tool_calls` as the finish reason; without calls, no
/// `tool_calls` field and a `stop`.
#[tokio::test]
async fn whole_replies_hold_tool_calls() {
    let pieces = [
        "<function name=\"get_weather\"><param name=\"city\">Oslo</param>",
        "<param name=\"days\">2</param></function>",
    ];
    let body = whole(&pieces, &weather_tools(""), FinishReason::Stop).await;
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["role"], "assistant");
    assert!(message["content"].is_null(), "{message}");
    let call = &message["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"city":"Oslo","days":2}"#);
    // The forced prefix and text that makes no call: all content, no calls.
    let prefix = weather_tools("<function name=\"get_weather\">");
    let body = whole(&["zq xv"], &prefix, FinishReason::Stop).await;
    let message = &body["choices"][0]["message"];
    assert_eq!(message["content"], "<function name=\"get_weather\">zq xv");
    assert!(message.get("tool_calls").is_none());
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
}

/// The Python of the `openai` client: `SALA_TEST_PYTHON` (scripts/test.sh sets it), else the
/// workspace's `target/cuda-venv`.
fn python() -> std::path::PathBuf {
    let path = std::env::var_os("SALA_TEST_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/cuda-venv/bin/python")
        });
    assert!(
        path.exists(),
        "no Python with the openai client at {}: run scripts/test.sh, or set SALA_TEST_PYTHON",
        path.display()
    );
    path
}

/// The official `openai` client reads the calls of a whole reply and of a streamed one (by
/// `ChatCompletionStreamState` and by the `stream()` helper with its events) as this server
/// writes them: the bodies are served to it by a mock transport
/// (`tests/openai_tool_replies.py`).
#[tokio::test]
async fn the_openai_client_reads_the_tool_calls() {
    let pieces = [
        "Checking both.\n<function name=\"get_weather\"><param name=\"city\">Paris</param>",
        "<param name=\"days\">3</param></function>\n<function name=\"get_weather\">",
        "<param name=\"city\"><![CDATA[Rome & <co>]]></param><param name=\"days\">1</param>",
        "</function>",
    ];
    let reply = weather_tools("");
    let dir = tempfile::tempdir().unwrap();
    let body = whole(&pieces, &reply, FinishReason::Stop).await;
    std::fs::write(dir.path().join("whole.json"), body.to_string()).unwrap();
    let sse = stream_body(&pieces, &reply, FinishReason::Stop).await;
    std::fs::write(dir.path().join("stream.sse"), sse).unwrap();
    std::fs::write(
        dir.path().join("tools.json"),
        weather_tool_list().to_string(),
    )
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_tool_replies.py");
    let run = std::process::Command::new(python())
        .arg(script)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let out: Value = serde_json::from_slice(&run.stdout).unwrap();
    let want_calls = json!([
        ["get_weather", {"city": "Paris", "days": 3}],
        ["get_weather", {"city": "Rome & <co>", "days": 1}],
    ]);
    for key in ["whole", "accumulated", "helper"] {
        let got = &out[key];
        assert_eq!(got["content"], "Checking both.", "{key}: {got}");
        assert_eq!(got["finish"], "tool_calls", "{key}: {got}");
        assert_eq!(got["calls"], want_calls, "{key}: {got}");
        let ids = got["ids"].as_array().unwrap();
        assert!(
            ids.iter().all(|i| i.as_str().unwrap().starts_with("call_")),
            "{key}"
        );
        assert_ne!(ids[0], ids[1], "{key}");
    }
    // The helper's events: each call's arguments done, parsed (the tools are strict).
    assert_eq!(out["helper"]["done_events"], want_calls);
}
