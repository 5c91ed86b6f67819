//! Servers on 127.0.0.1 with the tiny random model on the CPU, and a small HTTP/1.1 client
//! over `TcpStream`.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::generate::Engine;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub const MODEL_ID: &str = "test-model";
pub const MAX_CONTEXT: usize = 256;
pub const BODY_LIMIT: usize = 64 << 10;

pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let config = preset("tiny").unwrap();
        write_random_checkpoint(&dir, &config, &WriteOptions::default()).unwrap();
        sala_tokenizer::write_test_tokenizer(&dir, config.vocab_size).unwrap();
        dir
    })
}

/// The model of the test servers, loaded in the test process.
pub fn load_engine() -> Engine<CpuBackend> {
    engine_from(model_dir()).unwrap()
}

/// The model in `dir` on the CPU, an error as text (as an engine thread's start reports it).
pub fn engine_from(dir: &Path) -> Result<Engine<CpuBackend>, String> {
    Engine::load(CpuBackend::default(), dir, 64, &mut |_, _| {}).map_err(|e| e.to_string())
}

pub fn spawn_engine(queue: usize) -> sala_server::EngineHandle {
    spawn_engine_batched(queue, 64)
}

/// An engine whose batch holds at most `max_batch` requests.
pub fn spawn_engine_batched(queue: usize, max_batch: usize) -> sala_server::EngineHandle {
    spawn_engine_sized(queue, max_batch, MAX_CONTEXT)
}

/// An engine whose batch holds at most `max_batch` requests of at most `context` tokens.
pub fn spawn_engine_sized(
    queue: usize,
    max_batch: usize,
    context: usize,
) -> sala_server::EngineHandle {
    spawn_engine_with(queue, max_batch, context, |_| {})
}

/// [`spawn_engine_sized`] with `setup` applied to the engine before it serves.
pub fn spawn_engine_with(
    queue: usize,
    max_batch: usize,
    context: usize,
    setup: impl FnOnce(&mut Engine<CpuBackend>) + Send + 'static,
) -> sala_server::EngineHandle {
    let dir = model_dir().to_path_buf();
    sala_server::spawn_engine(MODEL_ID.into(), Some(context), queue, move |runner| {
        let mut engine = Engine::load(CpuBackend::default(), &dir, 64, &mut |_, _| {})
            .map_err(|e| e.to_string())?;
        setup(&mut engine);
        runner.max_batch(max_batch).run(engine);
        Ok(())
    })
    .unwrap()
}

/// An engine whose batch holds at most `max_batch` requests of at most `context` tokens, its
/// runner set up by `configure`.
pub fn spawn_engine_runner(
    queue: usize,
    max_batch: usize,
    context: usize,
    configure: impl FnOnce(sala_server::EngineRunner) -> sala_server::EngineRunner + Send + 'static,
) -> sala_server::EngineHandle {
    let dir = model_dir().to_path_buf();
    sala_server::spawn_engine(MODEL_ID.into(), Some(context), queue, move |runner| {
        let engine = Engine::load(CpuBackend::default(), &dir, 64, &mut |_, _| {})
            .map_err(|e| e.to_string())?;
        configure(runner.max_batch(max_batch)).run(engine);
        Ok(())
    })
    .unwrap()
}

/// Serves `engine` on a free port of 127.0.0.1 from a thread of its own, with the tests'
/// small body limit.
pub fn serve(engine: sala_server::EngineHandle) -> SocketAddr {
    let opts = sala_server::ServerOptions {
        max_body_bytes: BODY_LIMIT,
        ..Default::default()
    };
    serve_with(engine, opts)
}

/// [`serve`] with `opts`.
pub fn serve_with(
    engine: sala_server::EngineHandle,
    opts: sala_server::ServerOptions,
) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            sala_server::serve(listener, engine, &opts).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// The server most tests share (queue of 64).
pub fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| serve(spawn_engine(64)))
}

/// A server for long prompts (tool definitions): 2048 tokens of context.
pub fn long_server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| serve(spawn_engine_sized(16, 16, 2048)))
}

/// Undoes `Transfer-Encoding: chunked`.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = body.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = std::str::from_utf8(&body[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&body[start..start + size]);
        body = &body[start + size + 2..];
    }
}

/// Sends one request (`Connection: close`) to `addr`; returns the status, the lower-cased
/// head and the decoded body.
pub fn request_full(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body); // the server may answer (413) before reading it all
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, head, String::from_utf8(body).unwrap())
}

pub fn request_to(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) = request_full(addr, method, path, body);
    (status, body)
}

/// A request to the shared server.
pub fn request(method: &str, path: &str, body: &[u8]) -> (u16, String) {
    request_to(server(), method, path, body)
}

pub fn post_to(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request_to(addr, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// A POST of JSON to the shared server.
pub fn post(path: &str, body: &Value) -> (u16, Value) {
    post_to(server(), path, body)
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

/// The JSON chunks of an SSE body, checking that it ends with `[DONE]`.
pub fn sse_chunks(body: &str) -> Vec<Value> {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// Checks `usage` and returns (prompt, completion) tokens.
pub fn check_usage(v: &Value) -> (u64, u64) {
    let u = &v["usage"];
    let (p, c, t) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0);
    assert_eq!(p + c, t, "{u}");
    (p, c)
}

/// Checks an OpenAI-style error answer.
pub fn assert_error(status: u16, body: &str, want: u16, param: Option<&str>, what: &str) {
    assert_eq!(status, want, "{what}: {body}");
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: body {body}"));
    let err = &v["error"];
    assert!(
        !err["message"].as_str().unwrap_or("").is_empty(),
        "{what}: {body}"
    );
    assert!(err["type"].is_string(), "{what}: {body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{what}: {body}"
    );
    if let Some(p) = param {
        assert_eq!(err["param"], p, "{what}: {body}");
    }
}

/// `GET /metrics`, parsed: each sample (`name` or `name{labels}` as written) to its value.
/// Checks the exposition format on the way: `# HELP`/`# TYPE` before a family's samples,
/// one sample per line, values that parse as numbers.
pub fn metrics(addr: SocketAddr) -> BTreeMap<String, f64> {
    let (status, head, body) = request_full(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200, "{body}");
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let mut typed: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(typed.insert(name.into(), kind.into()).is_none(), "{line}");
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
        };
        let name = key.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line}"
        );
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| typed.get(*f).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        assert!(typed.contains_key(family), "no # TYPE before {line}");
        assert!(
            samples.insert(key.to_string(), value).is_none(),
            "{line} twice"
        );
    }
    samples
}

/// Checks a histogram's buckets (cumulative, ending in `+Inf` = count) and returns its count.
pub fn histogram_count(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = m
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            Some((le, *v))
        })
        .collect();
    assert!(buckets.len() > 2, "{name} has no buckets");
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    for w in buckets.windows(2) {
        assert!(
            w[0].1 <= w[1].1,
            "{name} buckets are not cumulative: {buckets:?}"
        );
    }
    let (last_le, last) = *buckets.last().unwrap();
    assert_eq!(last_le, f64::INFINITY);
    let count = m[&format!("{name}_count")];
    assert_eq!(last, count, "{name}: +Inf bucket and count");
    assert!(m[&format!("{name}_sum")] >= 0.0);
    count
}

/// An engine request for "busy busy" that generates `max_tokens` tokens (end of sequence
/// ignored), for tests that drive the engine without HTTP.
pub fn busy_request(max_tokens: usize) -> sala_server::engine::Request {
    sala_server::engine::Request {
        prompt: sala_server::engine::Prompt::Text("busy busy".into()),
        sampling: sala_engine::sampling::SamplingParams::default(),
        max_tokens,
        stop: Vec::new(),
        ignore_eos: true,
        speculative: true,
        logprobs: None,
        prompt_logprobs: None,
        grammar: None,
    }
}
