//! The `sala` binary end to end, by command: generate and friends, bench, perplexity.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sala(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run sala")
}

/// Runs `sala` with `input` on its standard input. A run that ends before reading all of it
/// (a refusal at start) closes the pipe: that write error is not the test's failure.
fn sala_with_stdin(args: &[&str], input: &[u8], cache: &Path) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run sala");
    let written = child.stdin.take().expect("piped").write_all(input);
    if let Err(e) = written {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    child.wait_with_output().expect("wait for sala")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "failed: {}\n{}", o.status, stderr(o));
}

/// Fails with exit code 1 and a message containing every `needle`.
fn fails_with(o: &Output, needles: &[&str]) {
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
    let e = stderr(o);
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "expected {n:?} in: {e}");
    }
}

fn tiny_checkpoint(tmp: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let dir = tmp.join(name);
    let mut args = vec!["init", "--preset", "tiny", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(&sala(&args, tmp));
    dir
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn positive(v: &serde_json::Value, field: &str, what: &str) -> f64 {
    let x = v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: no number {field}: {v}"));
    assert!(x > 0.0 && x.is_finite(), "{what}: {field} = {x}");
    x
}

/// A `sala serve` of `model` on a free port, ended when dropped.
struct Server {
    child: std::process::Child,
    addr: String,
}

impl Server {
    fn start(model: &str, cache: &Path) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(env!("CARGO_BIN_EXE_sala"))
            .args(["serve", "--device", "cpu", "-m", model, "--port", "0"])
            .env("XDG_CACHE_HOME", cache)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run sala serve");
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("sala serve says where it serves")
                .unwrap();
            if let Some(at) = line.split("http://").nth(1) {
                break at.trim_end_matches("/v1").to_string();
            }
        };
        // Its later lines go nowhere.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    /// POSTs `body` as JSON to `path`; returns the status and the JSON answer.
    fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, serde_json::from_str(body).unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sala init --preset tiny` into `bf16` and `sala quantize` of it (with `args`) into `w4`.
fn tiny_and_quantized(cache: &Path, args: &[&str]) -> (PathBuf, PathBuf) {
    let (src, out) = (cache.join("bf16"), cache.join("w4"));
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    ok(&sala(&["init", "--preset", "tiny", s], cache));
    ok(&sala(&[&["quantize", s, o][..], args].concat(), cache));
    (src, out)
}

mod bench;
mod generate;
mod parallel;
mod perplexity;
