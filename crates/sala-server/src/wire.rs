//! A connection's bytes on their way out: hyper answers requests it cannot parse (a malformed
//! request line or header, headers too large, a URI too long) with a 4xx of no body before any
//! route sees them; [`ErrorBodies`] gives such an answer an OpenAI-style error body.

use crate::api::ApiError;
use axum::http::StatusCode;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A stream whose body-less 4xx answers are rewritten with an error body, and whose writes
/// fail (`TimedOut`) once the peer has taken no byte for `write_timeout`: a client that stops
/// reading holds its reply's memory no longer (hyper then closes the connection, which ends
/// the request). Writes are not vectored, so each answer's head comes whole at the start of one
/// write.
pub struct ErrorBodies<S> {
    inner: S,
    /// An answer being written in place of the one hyper gave: its bytes, how many are
    /// written, and the length of hyper's to report once all are.
    pending: Option<(Vec<u8>, usize, usize)>,
    write_timeout: std::time::Duration,
    /// Since when a write has waited for the peer to read (armed at its first `Pending`).
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> ErrorBodies<S> {
    pub fn new(inner: S, write_timeout: std::time::Duration) -> Self {
        Self {
            inner,
            pending: None,
            write_timeout,
            stalled: None,
        }
    }
}

impl<S: AsyncWrite + Unpin> ErrorBodies<S> {
    /// The inner stream's write, failing once it has waited `write_timeout` without progress.
    fn poll_inner_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Poll::Ready(done) = Pin::new(&mut self.inner).poll_write(cx, buf) {
            self.stalled = None;
            return Poll::Ready(done);
        }
        let timeout = self.write_timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client took no byte of its answer for {timeout:?}"),
        )))
    }
}

/// Answers 408, with an OpenAI error body and `connection: close`, a request whose head did
/// not arrive whole within the header timeout (written at most once, given up on error).
pub async fn answer_late_head<S: AsyncWrite + Unpin>(stream: &mut S) {
    use tokio::io::AsyncWriteExt;
    let error = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        "the request's head did not arrive whole within the header timeout",
    )
    .code("request_timeout");
    let head = ["HTTP/1.1 408 Request Timeout", "connection: close"];
    let _ = stream.write_all(&json_answer(head, &error)).await;
    let _ = stream.flush().await;
}

/// `out` (what hyper writes) with an error body, when it is exactly the head of a 4xx whose
/// body is empty (`content-length: 0`, nothing after the head).
fn with_error_body(out: &[u8]) -> Option<Vec<u8>> {
    if !out.starts_with(b"HTTP/1.") {
        return None;
    }
    let end = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    if end + 4 != out.len() {
        return None;
    }
    let head = std::str::from_utf8(&out[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let status = StatusCode::from_bytes(status_line.split(' ').nth(1)?.as_bytes()).ok()?;
    if !status.is_client_error() {
        return None;
    }
    let mut kept = Vec::new();
    let mut empty = false;
    for line in lines {
        let name = line.split(':').next().unwrap_or("").to_ascii_lowercase();
        match name.as_str() {
            "content-length" => empty = line[name.len() + 1..].trim() == "0",
            "content-type" | "transfer-encoding" => return None,
            _ => kept.push(line),
        }
    }
    if !empty {
        return None;
    }
    let (message, code) = match status {
        StatusCode::BAD_REQUEST => (
            "the request is not valid HTTP/1.1: its request line or a header could not be parsed",
            "malformed_request",
        ),
        StatusCode::URI_TOO_LONG => ("the request's URI is too long", "uri_too_long"),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => {
            ("the request's headers are too large", "headers_too_large")
        }
        _ => ("the request was refused", "refused"),
    };
    let head = std::iter::once(status_line).chain(kept);
    Some(json_answer(head, &ApiError::invalid(message).code(code)))
}

/// An HTTP/1.1 answer: its status line and headers (`head`, without line ends), then
/// `error` as its JSON body.
fn json_answer<'a>(head: impl IntoIterator<Item = &'a str>, error: &ApiError) -> Vec<u8> {
    let body = error.body().to_string();
    let mut answer = Vec::with_capacity(body.len() + 256);
    for line in head {
        answer.extend_from_slice(line.as_bytes());
        answer.extend_from_slice(b"\r\n");
    }
    let typed = format!(
        "content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    answer.extend_from_slice(typed.as_bytes());
    answer.extend_from_slice(body.as_bytes());
    answer
}

impl<S: AsyncRead + Unpin> AsyncRead for ErrorBodies<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ErrorBodies<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let (answer, mut written, stands_for) = match this.pending.take() {
            Some(pending) => pending,
            None => match with_error_body(buf) {
                Some(answer) => (answer, 0, buf.len()),
                None => return this.poll_inner_write(cx, buf),
            },
        };
        while written < answer.len() {
            match this.poll_inner_write(cx, &answer[written..]) {
                Poll::Pending => {
                    this.pending = Some((answer, written, stands_for));
                    return Poll::Pending;
                }
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(0)),
                Poll::Ready(Ok(n)) => written += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(stands_for))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What a new connection opens with, by a look at its first bytes (left unread).
pub enum Opening {
    /// HTTP/1 (or anything else hyper parses or refuses itself).
    Http1,
    /// HTTP/2's connection preface, sent with prior knowledge.
    Http2,
    /// Nothing within the header timeout, or the connection failed: closed unanswered, as
    /// hyper closes a connection that sends no head in time.
    Silent,
}

/// How the connection on `stream` opens (waiting at most `within` for its first bytes).
pub async fn opening(stream: &tokio::net::TcpStream, within: std::time::Duration) -> Opening {
    let mut first = [0u8; 16];
    match tokio::time::timeout(within, stream.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {
            if first[..n].starts_with(b"PRI * HTTP/2") {
                Opening::Http2
            } else {
                Opening::Http1
            }
        }
        _ => Opening::Silent,
    }
}

/// Answers an HTTP/2 connection preface as RFC 9113 asks of a server that speaks only
/// HTTP/1.1: its own (empty) SETTINGS frame, then GOAWAY with HTTP_1_1_REQUIRED, whose debug
/// data is the OpenAI-style error; then closes. (hyper's HTTP/1 server would close without a
/// word.)
pub async fn refuse_http2(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = ApiError::new(
        StatusCode::HTTP_VERSION_NOT_SUPPORTED,
        "invalid_request_error",
        "this server speaks HTTP/1.1 only; HTTP/2 with prior knowledge is not supported",
    )
    .code("http_1_1_required")
    .body()
    .to_string();
    let mut out = vec![0, 0, 0, 4, 0, 0, 0, 0, 0]; // SETTINGS, no parameters, stream 0
    let len = 8 + body.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]); // GOAWAY's 24-bit length
    out.extend_from_slice(&[7, 0, 0, 0, 0, 0]); // type GOAWAY, no flags, stream 0
    out.extend_from_slice(&0u32.to_be_bytes()); // last stream id: none processed
    out.extend_from_slice(&0xdu32.to_be_bytes()); // HTTP_1_1_REQUIRED
    out.extend_from_slice(body.as_bytes());
    let _ = stream.write_all(&out).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that takes no byte fails the write after the write timeout; one that takes its
    /// bytes slowly, each wait shorter than the timeout, gets them all.
    #[tokio::test]
    async fn a_peer_that_stops_reading_fails_the_write() {
        let timeout = Duration::from_millis(200);
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut stream = ErrorBodies::new(ours, timeout);
        let started = Instant::now();
        let written = tokio::time::timeout(Duration::from_secs(10), stream.write_all(&[7u8; 1024]));
        let err = written
            .await
            .expect("the write neither ended nor failed in 10 s")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(started.elapsed() >= timeout, "{:?}", started.elapsed());

        let (ours, mut theirs_slow) = tokio::io::duplex(64);
        let mut stream = ErrorBodies::new(ours, timeout);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut chunk = [0u8; 64];
            while got.len() < 1024 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let n = theirs_slow.read(&mut chunk).await.unwrap();
                got.extend_from_slice(&chunk[..n]);
            }
            got
        });
        stream.write_all(&[9u8; 1024]).await.unwrap();
        assert_eq!(reader.await.unwrap(), vec![9u8; 1024]);
    }

    #[test]
    fn only_bodiless_client_errors_get_a_body() {
        let hyper_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(with_error_body(hyper_400).unwrap()).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 400 Bad Request\r\ndate: x\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "malformed_request");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let b431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        assert!(String::from_utf8(with_error_body(b431).unwrap())
            .unwrap()
            .contains("headers_too_large"));
        // Answers with a body, or not 4xx, or not a whole head, pass as they are.
        for kept in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"[..],
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n",
            b"{\"HTTP/1.1 400\"}",
        ] {
            assert!(
                with_error_body(kept).is_none(),
                "{:?}",
                String::from_utf8_lossy(kept)
            );
        }
    }
}
