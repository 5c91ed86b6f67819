//! What users meet at the edges of the API: methods, model lookups, parameter ranges, the
//! `developer` role, prompts as token ids, and errors in our own words.

use crate::common::*;
use serde_json::json;

#[test]
fn a_wrong_method_gets_an_openai_error_and_allow() {
    for (method, path, allow) in [
        ("GET", "/v1/completions", "post"),
        ("DELETE", "/v1/chat/completions", "post"),
        ("POST", "/v1/models", "get"),
        ("PUT", "/health", "get"),
    ] {
        let (status, head, body) = request_full(server(), method, path, b"{}");
        assert_error(status, &body, 405, None, &format!("{method} {path}"));
        let line = head
            .lines()
            .find(|l| l.starts_with("allow:"))
            .unwrap_or_else(|| panic!("{method} {path}: no Allow header in {head}"));
        assert!(line.contains(allow), "{method} {path}: {line}");
        // The message names them too.
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let message = v["error"]["message"].as_str().unwrap().to_ascii_lowercase();
        assert!(message.contains(allow), "{method} {path}: {message}");
    }
}

#[test]
fn one_model_is_listed_and_found_by_id() {
    let (status, body) = request("GET", "/v1/models", b"");
    assert_eq!(status, 200, "{body}");
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    let id = list["data"][0]["id"].as_str().unwrap().to_string();
    let (status, body) = request("GET", &format!("/v1/models/{id}"), b"");
    assert_eq!(status, 200, "{body}");
    let card: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(card, list["data"][0]);
    let (status, body) = request("GET", "/v1/models/gpt-nothing", b"");
    assert_error(status, &body, 404, Some("model"), "an unknown model");
    assert!(
        body.contains("model_not_found") && body.contains("gpt-nothing"),
        "{body}"
    );
    // An id that is not UTF-8 once decoded: an OpenAI error body too.
    let (status, body) = request("GET", "/v1/models/%ff%fe", b"");
    assert_error(status, &body, 400, Some("model"), "a model id of bad UTF-8");
}

#[test]
fn parameters_out_of_range_are_named() {
    let base = |extra: serde_json::Value| {
        let mut b = json!({"prompt": "Hello", "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (extra, param, words) in [
        (json!({"temperature": 2.5}), "temperature", "[0, 2]"),
        (json!({"temperature": -0.1}), "temperature", "[0, 2]"),
        (json!({"stop": vec!["x"; 17]}), "stop", "at most 16"),
        (
            json!({"prompt": 12}),
            "prompt",
            "a string, a list of token ids",
        ),
        (
            json!({"prompt": [1, "a"]}),
            "prompt",
            "a string, a list of token ids",
        ),
        (json!({"stop": 3}), "stop", "a string or a list of strings"),
        (json!({"prompt": vec!["a"; 65]}), "prompt", "at most 64"),
        (
            json!({"prompt": ["a", ""]}),
            "prompt",
            "prompt[1] must not be empty",
        ),
        (json!({"n": 9}), "n", "1..=8"),
        (json!({"prompt": []}), "prompt", "must not be empty"),
        (
            json!({"prompt": [4_000_000_000u64]}),
            "prompt",
            "outside the vocabulary",
        ),
        (json!({"prompt": [5, -1]}), "prompt", "integers from 0"),
        (
            serde_json::from_str::<serde_json::Value>(r#"{"seed": 1180591620717411303424}"#)
                .unwrap(),
            "seed",
            "fits in 64 bits",
        ),
    ] {
        let (status, v) = post("/v1/completions", &base(extra.clone()));
        let text = v.to_string();
        assert_error(status, &text, 400, Some(param), &extra.to_string());
        assert!(text.contains(words), "{extra}: {text}");
        assert!(
            !text.contains("untagged") && !text.contains("PromptField"),
            "{text}"
        );
    }
}

#[test]
fn prompts_as_token_ids_and_the_developer_role_are_served_unknown_roles_refused() {
    for prompt in [json!([5, 6, 7, 8]), json!([[5, 6, 7, 8]])] {
        let (status, v) = post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    }
    let chat = |role: &str| {
        post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": role, "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}],
                    "max_tokens": 3, "temperature": 0}),
        )
    };
    let (status, dev) = chat("developer");
    assert_eq!(status, 200, "{dev}");
    let (_, sys) = chat("system");
    // The developer message is the system prompt: the same tokens in, the same answer out.
    assert_eq!(dev["usage"], sys["usage"], "{dev} {sys}");
    assert_eq!(
        dev["choices"][0]["message"]["content"],
        sys["choices"][0]["message"]["content"]
    );
    // A role OpenAI does not know is a 400 naming it, not a template's guess.
    for role in ["robot", "", "USER"] {
        let (status, v) = chat(role);
        assert_eq!(status, 400, "{role}: {v}");
        assert_eq!(v["error"]["param"], "messages[0].role", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("user"),
            "{v}"
        );
    }
}

#[test]
fn a_chat_may_end_open_for_the_reply_to_continue() {
    let chat = |extra: serde_json::Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Name a colour."},
                                        {"role": "assistant", "content": "The colour is"}],
                           "max_tokens": 2, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        post("/v1/chat/completions", &b)
    };
    let tokens = |v: &serde_json::Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let (s1, default) = chat(json!({}));
    let (s2, rendered) = chat(json!({"add_generation_prompt": false}));
    let (s3, open) = chat(json!({"continue_final_message": true, "add_generation_prompt": false}));
    assert_eq!((s1, s2, s3), (200, 200, 200), "{default} {rendered} {open}");
    // Without the assistant header fewer tokens; left open, fewer still (no end of turn).
    assert!(tokens(&rendered) < tokens(&default), "{rendered} {default}");
    assert!(tokens(&open) < tokens(&rendered), "{open} {rendered}");
    let (status, v) = chat(json!({"continue_final_message": true, "add_generation_prompt": true}));
    assert_error(
        status,
        &v.to_string(),
        400,
        Some("continue_final_message"),
        "both",
    );
    let (status, v) = post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}],
                "continue_final_message": true, "max_tokens": 2}),
    );
    assert_error(
        status,
        &v.to_string(),
        400,
        Some("messages"),
        "a user message to continue",
    );
    assert!(v.to_string().contains("assistant"), "{v}");
    // A structured reply constrains a whole message, not a continuation of one.
    let schema = json!({"type": "json_schema", "json_schema": {"name": "c",
                        "schema": {"const": "abc"}}});
    let (status, v) = chat(
        json!({"continue_final_message": true, "add_generation_prompt": false,
                                  "response_format": schema}),
    );
    assert_error(
        status,
        &v.to_string(),
        400,
        Some("response_format"),
        "a structured continuation",
    );
}

/// Requests hyper cannot parse (a garbage request line, a header name with a space, a
/// duplicated Content-Length that disagrees, headers past the limit, a URI past its limit)
/// are answered by hyper before any route: each answer is still a 4xx with an OpenAI-style
/// error body, and the server serves the next request.
#[test]
fn unparsable_requests_get_an_openai_error_body() {
    use std::io::{Read, Write};
    let long_header = format!("X-Big: {}\r\n", "a".repeat(600_000));
    let long_uri = format!("/{}", "u".repeat(100_000));
    for (what, raw, want) in [
        ("garbage", "NOT HTTP AT ALL\r\n\r\n".to_string(), 400),
        (
            "a header name with a space",
            "GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n".to_string(),
            400,
        ),
        (
            "two Content-Lengths",
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
                .to_string(),
            400,
        ),
        (
            "headers too large",
            format!("GET /health HTTP/1.1\r\nHost: x\r\n{long_header}\r\n"),
            431,
        ),
        (
            "a URI too long",
            format!("GET {long_uri} HTTP/1.1\r\nHost: x\r\n\r\n"),
            414,
        ),
    ] {
        let mut s = std::net::TcpStream::connect(server()).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let _ = s.write_all(raw.as_bytes()); // the server may answer before reading it all
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        let (head, body) = text
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("{what}: no answer head in {text:?}"));
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{what}: {head}"
        );
        assert_error(status, body, want, None, what);
    }
    let (status, _) = request("GET", "/health", b"");
    assert_eq!(status, 200);
}

/// A compressed body is a 415 naming Content-Encoding (it is never decompressed, so it would
/// only fail as JSON); a UTF-8 byte order mark before the JSON is read past.
#[test]
fn compressed_bodies_are_refused_and_a_byte_order_mark_is_read_past() {
    use std::io::{Read, Write};
    let send = |extra_header: &str, body: &[u8]| {
        let mut s = std::net::TcpStream::connect(server()).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {extra_header}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(body);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out).to_string();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, body.to_string())
    };
    let json = br#"{"prompt": "Hi", "max_tokens": 1}"#;
    for coding in ["gzip", "br", "x-unknown"] {
        let (status, body) = send(&format!("Content-Encoding: {coding}\r\n"), json);
        assert_error(status, &body, 415, None, coding);
        assert!(body.contains("Content-Encoding"), "{coding}: {body}");
    }
    let (status, body) = send("Content-Encoding: identity\r\n", json);
    assert_eq!(status, 200, "identity: {body}");
    let with_bom = [&b"\xEF\xBB\xBF"[..], json].concat();
    let (status, body) = send("", &with_bom);
    assert_eq!(status, 200, "a byte order mark: {body}");
}

/// An HTTP/2 client with prior knowledge hears, as RFC 9113 has an HTTP/1.1-only server say
/// it, an empty SETTINGS frame then GOAWAY with HTTP_1_1_REQUIRED (its debug data the OpenAI
/// error); the server goes on serving HTTP/1.1.
#[test]
fn http2_with_prior_knowledge_is_told_to_use_http1() {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    let _ = s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // the client's SETTINGS
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(out.len() > 26, "{out:?}");
    assert_eq!(&out[..9], &[0, 0, 0, 4, 0, 0, 0, 0, 0], "SETTINGS first");
    let goaway = &out[9..];
    let len = u32::from_be_bytes([0, goaway[0], goaway[1], goaway[2]]) as usize;
    assert_eq!(goaway[3], 7, "a GOAWAY frame");
    assert_eq!(goaway.len(), 9 + len);
    assert_eq!(&goaway[13..17], &0xdu32.to_be_bytes(), "HTTP_1_1_REQUIRED");
    let debug: serde_json::Value = serde_json::from_slice(&goaway[17..]).unwrap();
    assert_eq!(debug["error"]["code"], "http_1_1_required", "{debug}");
    let (status, _) = request("GET", "/health", b"");
    assert_eq!(status, 200);
}
