//! Requests that crowd the engine: more choices than its batch holds, clients that stop
//! reading, clients that leave while their requests wait, choices that memory could never hold
//! at once. None of them may hold the engine for everyone else.

use crate::common::*;
use sala_server::engine::Event;
use serde_json::json;
use std::time::{Duration, Instant};

/// Reads a request's events to its end: its completion tokens, or why it failed.
fn finish(rx: &mut tokio::sync::mpsc::Receiver<Event>) -> Result<usize, String> {
    loop {
        match rx.blocking_recv() {
            Some(Event::Done {
                completion_tokens, ..
            }) => return Ok(completion_tokens),
            Some(Event::Error(e)) => return Err(format!("{e:?}")),
            Some(_) => {}
            None => return Err("the channel closed before the end".into()),
        }
    }
}

/// One request's prompts times n above the batch: its first choices are admitted while the
/// others wait for room, and the server reads the admitted ones meanwhile (it used to wait for
/// every choice's start first, while the admitted ones paused on full channels: a deadlock).
/// The end of sequence is barred, so every choice runs to max_tokens and fills its channel.
#[test]
fn more_choices_than_the_batch_holds_are_all_served() {
    let addr = serve(spawn_engine_batched(16, 4));
    let no_eos = json!({"2": -100, "1016": -100});
    for stream in [false, true] {
        let body = json!({"prompt": ["one", "two", "three"], "n": 2, "max_tokens": 150,
                          "logit_bias": no_eos, "stream": stream});
        let t = Instant::now();
        let (status, text) =
            request_to(addr, "POST", "/v1/completions", body.to_string().as_bytes());
        assert_eq!(status, 200, "stream {stream}: {text}");
        assert!(t.elapsed() < Duration::from_secs(50), "{:?}", t.elapsed());
        let finishes: Vec<String> = if stream {
            sse_chunks(&text)
                .iter()
                .filter_map(|c| c["choices"][0]["finish_reason"].as_str().map(String::from))
                .collect()
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["finish_reason"].as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(finishes, vec!["length"; 6], "stream {stream}");
    }
}

/// A client that stops reading holds its place while nobody needs it; once another request
/// waits for a place, it keeps it for at most the pause limit and then ends as if its client
/// had left (its channel closes without an end), and the waiting request is served.
#[test]
fn a_stalled_client_gives_up_its_place_to_a_waiting_request() {
    let engine = spawn_engine_runner(4, 1, MAX_CONTEXT, |r| {
        r.pause_limit(Duration::from_millis(500))
    });
    let mut stalled = engine.submit(busy_request(10_000)).unwrap();
    assert!(matches!(
        stalled.blocking_recv(),
        Some(Event::Started { .. })
    ));
    // Nobody reads A: its channel fills and it pauses; B waits for the batch's one place.
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let mut waiting = engine.submit(busy_request(5)).unwrap();
    assert_eq!(finish(&mut waiting), Ok(5));
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // A's buffered events, then the error that ended it (its channel had room for one).
    let e = finish(&mut stalled).unwrap_err();
    assert!(e.contains("Stalled"), "{e}");
}

/// Requests whose clients leave while they wait are dropped at once, freeing their places in
/// the queue, even while the batch stays full (they used to sit in the queue until the batch
/// had room, and new requests got 429).
#[test]
fn requests_abandoned_in_the_queue_free_their_places() {
    let engine = spawn_engine_runner(2, 1, MAX_CONTEXT, |r| {
        r.pause_limit(Duration::from_secs(3600))
    });
    // A fills the batch and pauses (nobody reads it) for the whole test.
    let mut a = engine.submit(busy_request(10_000)).unwrap();
    assert!(matches!(a.blocking_recv(), Some(Event::Started { .. })));
    let b = engine.submit(busy_request(5)).unwrap();
    let c = engine.submit(busy_request(5)).unwrap();
    let full = engine
        .submit(busy_request(5))
        .expect_err("the queue is full");
    assert_eq!(full.status.as_u16(), 429);
    drop(b);
    drop(c);
    let t = Instant::now();
    let d = loop {
        match engine.submit(busy_request(5)) {
            Ok(rx) => break rx,
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("the queue never freed: {e:?}"),
        }
    };
    assert!(engine.queue_depth() <= 1, "{}", engine.queue_depth());
    drop(d);
    drop(a);
}

/// A streaming request with more choices than the batch whose client reads nothing: its
/// admitted choices pause once the connection's buffers and their channels fill (nothing
/// reads them on its behalf), and, since its other choices and another request wait, they end
/// after the pause limit; the other request is served (it used to wait for as long as the
/// stalled client kept its connection).
#[test]
fn a_stalled_stream_above_the_batch_lets_others_through() {
    use std::io::Write;
    // A context long enough that the stalled choices are still generating when the other
    // request comes.
    let engine = spawn_engine_runner(8, 4, 32768, |r| r.pause_limit(Duration::from_millis(300)));
    let addr = serve(engine);
    let body = json!({"prompt": ["one", "two", "three"], "n": 2, "max_tokens": 20000,
                      "logit_bias": {"2": -100, "1016": -100}, "stream": true})
    .to_string();
    let mut stalled = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stalled,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Never read from `stalled`; another request must still be answered.
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let (status, v) = post_to(
        addr,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(t.elapsed() < Duration::from_secs(50), "{:?}", t.elapsed());
    drop(stalled);
}
