//! A checked request queued on the engine, and its events as a response: one JSON body, or
//! an SSE stream of chunks.

use crate::api::{parse_json, ApiError};
use crate::chat::{chat_deltas, chat_finish, chat_message, check_chat};
use crate::completion::check_completion;
use crate::engine::{Event, LogprobEntry, Prompt, TokenText};
use crate::http::{now, AppState};
use crate::metrics::Outcome;
use crate::params::{body_bytes, Checked, Kind};
use crate::reply::{ReplyPiece, ReplyReader, ReplySetup};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use sala_engine::generate::FinishReason;
use sala_engine::grammar::GrammarSpec;
use sala_engine::request::{PromptLogprobs, RequestError};
use sala_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// A request that passed the checks and is queued: one engine request per choice (prompt
/// `p`'s choice `j` is choice `p * n + j`).
struct Admitted {
    events: Vec<mpsc::Receiver<Event>>,
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    reply: Option<ReplySetup>,
    prompt: Option<PromptReport>,
}

/// What a completion shows of its prompts: with `echo`, each prompt's text before its
/// choices' text (and with `logprobs` its tokens' before theirs); with `prompt_logprobs`,
/// vLLM's `prompt_logprobs` list in each choice.
pub(crate) struct PromptReport {
    /// With `echo`: each prompt's text (as sent, or its token ids decoded) and first token.
    echo: Option<Vec<(String, u32)>>,
    /// Alternatives `logprobs` lists at each position.
    top: usize,
    /// Alternatives `prompt_logprobs` lists at each position, when asked for.
    vllm: Option<usize>,
    tokenizer: Tokenizer,
}

impl PromptReport {
    /// The echo of prompt `p`: its text and first token.
    fn echo(&self, p: usize) -> Option<&(String, u32)> {
        self.echo.as_ref().and_then(|e| e.get(p))
    }

    /// The prompt's tokens in the legacy shape: the first (no logprob), then each with its
    /// logprob and the `top` most likely tokens.
    fn legacy(&self, first: u32, lp: &PromptLogprobs, out: &mut Legacy, offset: &mut usize) {
        let text = |id| TokenText::of(&self.tokenizer, id);
        out.push(&text(first), None, offset);
        for t in &lp.tokens {
            let top: Vec<(TokenText, f32)> = t
                .top
                .iter()
                .take(self.top)
                .map(|&(id, l)| (text(id), l))
                .collect();
            out.push(&text(t.id), Some((t.logprob, &top)), offset);
        }
    }

    /// vLLM's `prompt_logprobs`: `null` for the first token, then for each token a map from
    /// token ids (the token's and the `n` most likely) to `{logprob, rank, decoded_token}`.
    fn vllm(&self, lp: &PromptLogprobs, n: usize) -> Value {
        let entry = |id: u32, logprob: f32, rank: usize| {
            json!({
                "logprob": logprob_value(logprob),
                "rank": rank,
                "decoded_token": TokenText::of(&self.tokenizer, id).text,
            })
        };
        let mut list = Vec::with_capacity(lp.tokens.len() + 1);
        list.push(Value::Null);
        for t in &lp.tokens {
            let mut m = Map::new();
            m.insert(t.id.to_string(), entry(t.id, t.logprob, t.rank as usize));
            for (i, &(id, l)) in t.top.iter().take(n).enumerate() {
                m.entry(id.to_string())
                    .or_insert_with(|| entry(id, l, i + 1));
            }
            list.push(Value::Object(m));
        }
        Value::Array(list)
    }
}

async fn admit(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Admitted, ApiError> {
    let bytes = body_bytes(body)?;
    // Reading and checking a body takes time in proportion to its size (tools' schemas walked
    // for their grammar, up to the body limit): on a blocking thread, so that a large request
    // stalls no server thread, and with it every other client.
    let state = st.clone();
    let mut checked = tokio::task::spawn_blocking(move || {
        let value = parse_json(&bytes)?;
        match kind {
            Kind::Chat => check_chat(&state, &value),
            Kind::Completion => check_completion(&state, &value),
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking the request: {e}")))??;
    // The template and the tokenizer run on a blocking thread of their own, never on the
    // engine thread: a long prompt delays no other request. So does an echo's text.
    let first = std::mem::replace(&mut checked.request.prompt, Prompt::Tokens(Vec::new()));
    let mut prompts: Vec<Prompt> = std::iter::once(first)
        .chain(std::mem::take(&mut checked.more_prompts))
        .collect();
    let echo = checked.echo;
    let mut echoed = Vec::new();
    if echo || prompts.iter().any(|p| !matches!(p, Prompt::Tokens(_))) {
        let engine = st.engine.clone();
        (prompts, echoed) = tokio::task::spawn_blocking(move || {
            let mut echoed = Vec::new();
            let prompts = prompts
                .into_iter()
                .map(|p| {
                    let ids = match &p {
                        Prompt::Tokens(ids) => ids.clone(),
                        p => engine.token_ids(p)?,
                    };
                    if echo {
                        let text = match p {
                            Prompt::Text(text) => text,
                            _ => engine.tokenizer().decode(&ids, true).map_err(|e| {
                                RequestError::invalid(format!("decoding the prompt to echo: {e}"))
                                    .param("prompt")
                            })?,
                        };
                        echoed.push((text, ids.first().copied().unwrap_or_default()));
                    }
                    Ok(Prompt::Tokens(ids))
                })
                .collect::<Result<Vec<_>, RequestError>>()?;
            Ok::<_, RequestError>((prompts, echoed))
        })
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt: {e}")))?
        .map_err(|e| ApiError::from(&e))?;
    }
    check_prompt_scores(&prompts, &checked)?;
    let prompt = (echo || checked.prompt_logprobs.is_some()).then(|| PromptReport {
        echo: echo.then_some(echoed),
        top: checked.request.logprobs.unwrap_or(0),
        vllm: checked.prompt_logprobs,
        tokenizer: st.engine.tokenizer().clone(),
    });
    // So is a grammar's compilation: an invalid schema is a 400 before any engine work. A
    // strict tool's schema is compiled whole too, naming its field.
    let schemas = std::mem::take(&mut checked.schemas);
    if !schemas.is_empty() {
        let engine = st.engine.clone();
        tokio::task::spawn_blocking(move || {
            for (param, schema) in schemas {
                engine
                    .grammar(&GrammarSpec::JsonSchema(schema))
                    .map_err(|e| {
                        let message = e.to_string();
                        let detail = message
                            .strip_prefix("response_format: ")
                            .unwrap_or(&message);
                        ApiError::invalid(format!("{param}: {detail}")).param(param)
                    })?;
            }
            Ok::<(), ApiError>(())
        })
        .await
        .map_err(|e| ApiError::internal(format!("checking the tools' schemas: {e}")))??;
    }
    // A prompt that leaves no room is refused before its grammar is compiled (seconds for the
    // call grammar of many tools); the engine checks it again as it admits the request.
    let max_context = st.engine.info.max_context;
    let longest = prompts.iter().map(|p| match p {
        Prompt::Tokens(ids) => ids.len(),
        _ => 0,
    });
    if let Some(len) = longest.max().filter(|&len| len >= max_context) {
        return Err(ApiError::from(&RequestError::ContextLengthExceeded {
            message: format!(
                "the prompt has {len} tokens, which leaves no room in the context budget of \
                 {max_context} tokens"
            ),
        }));
    }
    if let Some(spec) = checked.grammar.take() {
        let engine = st.engine.clone();
        let grammar = tokio::task::spawn_blocking(move || engine.grammar(&spec))
            .await
            .map_err(|e| ApiError::internal(format!("compiling response_format: {e}")))?
            .map_err(|e| ApiError::from(&e))?;
        checked.request.grammar = Some(grammar);
    }
    let logprobs = checked.request.logprobs.is_some();
    // Each choice is a request of its own, sampled with the seed plus its index among its
    // prompt's choices; a prompt's choices are queued together, so that the engine reads the
    // prompt once and copies its state to the others.
    let n = checked.n;
    // Several sequences that the memory limit could never hold at once are refused whole (each
    // alone is checked at admission).
    if prompts.len() * n > 1 {
        let lens: Option<Vec<usize>> = prompts
            .iter()
            .map(|p| match p {
                Prompt::Tokens(ids) => Some(ids.len()),
                _ => None,
            })
            .collect();
        if let Some(lens) = lens {
            let each: Vec<usize> = lens
                .iter()
                .flat_map(|&l| std::iter::repeat_n(l, n))
                .collect();
            st.engine
                .check_together(&each, checked.request.max_tokens)
                .map_err(|e| ApiError::from(&e))?;
        }
    }
    let mut events = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        let choices = (0..n)
            .map(|j| {
                let mut request = checked.request.clone();
                request.prompt = prompt.clone();
                request.sampling.seed = request.sampling.seed.map(|s| s.wrapping_add(j as u64));
                request
            })
            .collect();
        // A refusal drops the choices queued before it, which cancels them.
        events.extend(st.engine.submit_choices(choices)?);
    }
    Ok(Admitted {
        events,
        n,
        stream: checked.stream,
        include_usage: checked.include_usage,
        logprobs,
        reply: checked.reply,
        prompt,
    })
}

/// Most log-probabilities of prompt tokens one response may list (each token's own and each
/// alternative beside it, in every choice): their JSON costs the server about a kilobyte of
/// memory apiece, so a request past this is refused before any work rather than held in
/// gigabytes. A 64K-token prompt's 20 alternatives in one choice fit.
pub(crate) const MAX_PROMPT_SCORES: usize = 2_000_000;

/// Refuses a request whose prompts' scores (`echo` with `logprobs`, `prompt_logprobs`, in each
/// of `n` choices) would list more than [`MAX_PROMPT_SCORES`] entries.
fn check_prompt_scores(prompts: &[Prompt], checked: &Checked) -> Result<(), ApiError> {
    let echo_top = checked.request.logprobs.filter(|_| checked.echo);
    let per_token = echo_top.map_or(0, |t| t + 1) + checked.prompt_logprobs.map_or(0, |k| k + 1);
    if per_token == 0 {
        return Ok(());
    }
    let tokens: usize = prompts
        .iter()
        .map(|p| match p {
            Prompt::Tokens(ids) => ids.len(),
            _ => 0,
        })
        .sum();
    let entries = tokens.saturating_mul(checked.n).saturating_mul(per_token);
    if entries <= MAX_PROMPT_SCORES {
        return Ok(());
    }
    let param = if checked.prompt_logprobs.is_some() {
        "prompt_logprobs"
    } else {
        "logprobs"
    };
    Err(ApiError::invalid(format!(
        "the prompt scores asked for would list {entries} log-probabilities ({tokens} prompt          tokens x {} choices x {per_token} a token, from echo with logprobs and          prompt_logprobs); at most {MAX_PROMPT_SCORES} fit one response: ask for fewer          alternatives, fewer choices or a shorter prompt",
        checked.n
    ))
    .param(param)
    .code("response_too_large"))
}

/// Answers one completion request (`kind`): checks it, queues it, and answers with the
/// whole reply or a stream.
pub(crate) async fn handle(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    // Errors from the engine thread are counted there; these are counted here.
    let counted = |e: ApiError| {
        st.engine
            .metrics
            .request_done(Outcome::of_status(e.status.as_u16()));
        e
    };
    let admitted = admit(&st, body, kind).await.map_err(counted)?;
    let mut events = admitted.events;
    // A stream's status is its first choice's admission (the others, admitted as the batch
    // has room, start while it runs; one refused then ends the stream with an error event).
    // Nothing waits for every choice to start: the admitted ones must be read meanwhile, or
    // they pause and never make room for the rest. A whole response reads them all at once
    // and answers with the first refusal's status.
    if admitted.stream {
        match events[0].recv().await {
            Some(Event::Started { .. }) => {}
            Some(Event::Error(e)) => return Err(ApiError::from(&e)),
            _ => {
                return Err(counted(ApiError::internal(
                    "the engine stopped before answering",
                )))
            }
        }
    }
    let id = st.new_id(match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    });
    let meta = Meta {
        id,
        created: now(),
        model: st.engine.info.id.clone(),
        kind,
        logprobs: admitted.logprobs,
        n: admitted.n,
        prompt: admitted.prompt,
        max_logprobs: st.max_whole_logprobs,
    };
    let reply = admitted.reply.unwrap_or_default();
    if admitted.stream {
        let stream = stream_response(meta, events, admitted.include_usage, &reply);
        return Ok(stream.into_response());
    }
    match whole_response(&meta, events, &reply).await {
        Ok(body) => Ok(Json(body).into_response()),
        Err(Failed::Engine(e)) => Err(e),
        Err(Failed::Here(e)) => Err(counted(e)),
    }
}

/// Why a whole response failed: the engine said so (and counted it), or it is found here.
enum Failed {
    Engine(ApiError),
    Here(ApiError),
}

/// The response body of a request answered whole: every choice's events read to the end
/// (together, so that none waits for its reader).
async fn whole_response(
    meta: &Meta,
    events: Vec<mpsc::Receiver<Event>>,
    reply: &ReplySetup,
) -> Result<Value, Failed> {
    let listed = AtomicUsize::new(0);
    let listed = &listed;
    let reads =
        events
            .into_iter()
            .enumerate()
            .map(|(index, mut rx)| async move {
                whole_choice(meta, index, &mut rx, reply, listed).await
            });
    // The first failure drops the other choices, which cancels them.
    let choices = futures_util::future::try_join_all(reads).await?;
    let mut counts = Usage::default();
    for (i, (_, c)) in choices.iter().enumerate() {
        counts.add(i, meta.n, *c);
    }
    Ok(json!({
        "id": meta.id,
        "object": match meta.kind {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        },
        "created": meta.created,
        "model": meta.model,
        "choices": choices.into_iter().map(|(c, _)| c).collect::<Vec<_>>(),
        "usage": counts.json(),
    }))
}

/// One choice of a whole response, and its token counts; `listed` counts the log-probabilities
/// its response holds so far, which may not pass [`Meta::max_logprobs`] (a stream sends them as
/// they come, and holds none).
async fn whole_choice(
    meta: &Meta,
    index: usize,
    events: &mut mpsc::Receiver<Event>,
    reply: &ReplySetup,
    listed: &AtomicUsize,
) -> Result<(Value, Usage), Failed> {
    let kind = meta.kind;
    let mut reader = ReplyReader::new(reply);
    let mut read = ReplyPiece::default();
    let mut text = String::new();
    let mut entries = Vec::new();
    let mut prompt_lp = None;
    loop {
        match events.recv().await {
            Some(Event::Prompt { logprobs }) => prompt_lp = Some(logprobs),
            Some(Event::Text { text: t, logprobs }) => {
                match kind {
                    Kind::Chat => read.append(reader.push(&t)),
                    Kind::Completion => text.push_str(&t),
                }
                let count: usize = logprobs.iter().map(|e| 1 + e.top.len()).sum();
                let most = meta.max_logprobs;
                if listed.fetch_add(count, Ordering::Relaxed) + count > most {
                    let param = match kind {
                        Kind::Chat => "top_logprobs",
                        Kind::Completion => "logprobs",
                    };
                    return Err(Failed::Here(
                        ApiError::invalid(format!(
                            "the reply's log-probabilities passed {most} \
                             (each token's and its alternatives', in every choice), the most \
                             one response answered whole may list: stream the response, or \
                             ask for fewer tokens, choices or alternatives"
                        ))
                        .param(param)
                        .code("response_too_large"),
                    ));
                }
                entries.extend(logprobs);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            }) => {
                let counts = Usage {
                    prompt: prompt_tokens,
                    cached: cached_tokens,
                    completion: completion_tokens,
                };
                let report = meta.prompt.as_ref();
                let wants_scores = report.is_some_and(|r| r.vllm.is_some())
                    || (meta.logprobs && report.and_then(|r| r.echo(index / meta.n)).is_some());
                if wants_scores && prompt_lp.is_none() {
                    return Err(Failed::Here(ApiError::internal(
                        "the engine did not report the prompt's logprobs",
                    )));
                }
                let mut legacy = Legacy::default();
                let mut offset = 0;
                // An echo: the prompt's text and tokens come first.
                if let Some((echo, first)) = report.and_then(|r| r.echo(index / meta.n)) {
                    text.insert_str(0, echo);
                    if let (true, Some(r), Some(lp)) = (meta.logprobs, report, &prompt_lp) {
                        r.legacy(*first, lp, &mut legacy, &mut offset);
                    }
                }
                let logprobs = match (meta.logprobs, kind) {
                    (false, _) => Value::Null,
                    (true, Kind::Chat) => chat_logprobs(&entries),
                    (true, Kind::Completion) => {
                        legacy.extend(&entries, &mut offset);
                        legacy.json()
                    }
                };
                let mut choice = match kind {
                    Kind::Chat => {
                        read.append(reader.finish());
                        json!({
                            "index": index,
                            "message": chat_message(&read),
                            "logprobs": logprobs,
                            "finish_reason": chat_finish(finish, read.calls.len()),
                        })
                    }
                    Kind::Completion => json!({
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_str(finish),
                    }),
                };
                if let (Some(r), Some(n), Some(lp)) =
                    (report, report.and_then(|r| r.vllm), &prompt_lp)
                {
                    choice["prompt_logprobs"] = r.vllm(lp, n);
                }
                return Ok((choice, counts));
            }
            Some(Event::Error(e)) => return Err(Failed::Engine(ApiError::from(&e))),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(Failed::Here(ApiError::internal(
                    "the engine stopped mid-generation",
                )))
            }
        }
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Whether the request asked for logprobs.
    logprobs: bool,
    /// Choices per prompt.
    n: usize,
    /// What a completion shows of its prompts.
    prompt: Option<PromptReport>,
    /// Most log-probabilities a whole response may hold ([`crate::ServerOptions`]).
    max_logprobs: usize,
}

impl Meta {
    /// One chunk: a chat `delta` or a completion's `text`, the chunk's logprobs (or null) and
    /// a finish reason.
    fn chunk(
        &self,
        index: usize,
        delta: Map<String, Value>,
        text: &str,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Completion => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }
}

/// A choice's events, tagged with its index; `None` once its channel has closed.
type Tagged = futures_util::stream::BoxStream<'static, (usize, Option<Event>)>;

fn tagged(index: usize, rx: mpsc::Receiver<Event>) -> Tagged {
    Box::pin(stream::unfold(Some(rx), move |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Some(e) => Some(((index, Some(e)), Some(rx))),
            None => Some(((index, None), None)),
        }
    }))
}

/// What a stream keeps of one choice.
struct ChoiceState {
    /// Characters of completion text so far (`text_offset` of the legacy logprobs).
    offset: usize,
    /// A chat reply's reasoning, content and calls apart.
    reader: ReplyReader,
    /// Tool calls streamed so far.
    calls: usize,
    done: bool,
}

struct StreamState {
    meta: Meta,
    events: futures_util::stream::SelectAll<Tagged>,
    include_usage: bool,
    /// Chunks ready to send, then (once `ended`) nothing more from the engine.
    queue: VecDeque<SseEvent>,
    ended: bool,
    choices: Vec<ChoiceState>,
    /// Choices not yet done.
    left: usize,
    counts: Usage,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl StreamState {
    fn send(&mut self, chunk: Value) {
        self.queue.push_back(data(&chunk));
    }

    /// The chunks of a chat reply's piece for choice `i`; `logprobs` go with the first (or
    /// alone).
    fn send_piece(&mut self, i: usize, piece: &ReplyPiece, mut logprobs: Value) {
        for delta in chat_deltas(piece, &mut self.choices[i].calls) {
            let lp = std::mem::take(&mut logprobs);
            self.send(self.meta.chunk(i, delta, "", lp, None));
        }
        if !logprobs.is_null() {
            self.send(self.meta.chunk(i, Map::new(), "", logprobs, None));
        }
    }

    /// Queues what one engine event of choice `i` makes.
    fn on_event(&mut self, i: usize, event: Option<Event>) {
        let kind = self.meta.kind;
        match event {
            Some(Event::Text { text, logprobs }) => {
                if text.is_empty() && logprobs.is_empty() {
                    return;
                }
                let lp = match (self.meta.logprobs, kind) {
                    (false, _) => Value::Null,
                    (true, Kind::Chat) => chat_logprobs(&logprobs),
                    (true, Kind::Completion) => {
                        completion_logprobs(&logprobs, &mut self.choices[i].offset)
                    }
                };
                match kind {
                    Kind::Completion => self.send(self.meta.chunk(i, Map::new(), &text, lp, None)),
                    Kind::Chat => {
                        let piece = self.choices[i].reader.push(&text);
                        self.send_piece(i, &piece, lp);
                    }
                }
            }
            Some(Event::Started { .. }) => {}
            // An echo with logprobs: the prompt's text and tokens, before any generated.
            Some(Event::Prompt { logprobs }) => {
                let meta = &self.meta;
                let echo = meta.prompt.as_ref().filter(|_| meta.logprobs);
                let Some((r, (text, first))) = echo.and_then(|r| Some((r, r.echo(i / meta.n)?)))
                else {
                    return;
                };
                let mut legacy = Legacy::default();
                r.legacy(*first, &logprobs, &mut legacy, &mut self.choices[i].offset);
                let chunk = meta.chunk(i, Map::new(), text, legacy.json(), None);
                self.send(chunk);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            }) => {
                // A chat reply's held-back text goes out before its finish chunk.
                let finish = match kind {
                    Kind::Chat => {
                        let rest = self.choices[i].reader.finish();
                        self.send_piece(i, &rest, Value::Null);
                        chat_finish(finish, self.choices[i].calls)
                    }
                    Kind::Completion => finish_str(finish),
                };
                self.send(
                    self.meta
                        .chunk(i, Map::new(), "", Value::Null, Some(finish)),
                );
                self.choices[i].done = true;
                self.left -= 1;
                let counts = Usage {
                    prompt: prompt_tokens,
                    cached: cached_tokens,
                    completion: completion_tokens,
                };
                self.counts.add(i, self.meta.n, counts);
                if self.left > 0 {
                    return;
                }
                if self.include_usage {
                    let mut chunk = self.meta.chunk(0, Map::new(), "", Value::Null, None);
                    chunk["choices"] = json!([]);
                    chunk["usage"] = self.counts.json();
                    self.send(chunk);
                }
                self.end();
            }
            Some(Event::Error(e)) => {
                self.send(ApiError::from(&e).body());
                self.end();
            }
            // A choice's channel closes after its end.
            None if self.choices[i].done => {}
            None => {
                self.send(ApiError::internal("the engine stopped mid-generation").body());
                self.end();
            }
        }
    }

    fn end(&mut self) {
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.ended = true;
    }
}

/// The SSE stream of one request, its choices' chunks as they come; dropping it (the client
/// left, or a choice failed) closes the event channels, which stops the generation.
fn stream_response(
    meta: Meta,
    events: Vec<mpsc::Receiver<Event>>,
    include_usage: bool,
    reply: &ReplySetup,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let choices: Vec<ChoiceState> = events
        .iter()
        .map(|_| ChoiceState {
            offset: 0,
            reader: ReplyReader::new(reply),
            calls: 0,
            done: false,
        })
        .collect();
    let mut state = StreamState {
        meta,
        left: choices.len(),
        choices,
        events: stream::select_all(events.into_iter().enumerate().map(|(i, rx)| tagged(i, rx))),
        include_usage,
        queue: VecDeque::new(),
        ended: false,
        counts: Usage::default(),
    };
    // An echo without logprobs: the prompt's text first (with them it comes with its
    // tokens' logprobs, once the prompt is read).
    if let (false, Some(r)) = (state.meta.logprobs, state.meta.prompt.as_ref()) {
        let chunks: Vec<Value> = (0..state.choices.len())
            .filter_map(|i| {
                let (echo, _) = r.echo(i / state.meta.n)?;
                Some(state.meta.chunk(i, Map::new(), echo, Value::Null, None))
            })
            .collect();
        chunks.into_iter().for_each(|c| state.send(c));
    }
    if state.meta.kind == Kind::Chat {
        for i in 0..state.choices.len() {
            let mut role = Map::new();
            role.insert("role".into(), "assistant".into());
            role.insert("content".into(), "".into());
            state.send(state.meta.chunk(i, role, "", Value::Null, None));
        }
    }
    Sse::new(stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.queue.pop_front() {
                return Some((Ok(event), st));
            }
            if st.ended {
                return None;
            }
            match st.events.next().await {
                Some((i, event)) => st.on_event(i, event),
                None => st.on_event(0, None),
            }
        }
    }))
}

pub(crate) fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// A response's token counts: its prompts' (those taken from the prefix cache among them)
/// and its choices'.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    prompt: usize,
    cached: usize,
    completion: usize,
}

impl Usage {
    /// Adds choice `i`'s counts; its prompt counts once for the `n` choices that share it.
    fn add(&mut self, i: usize, n: usize, c: Usage) {
        if i.is_multiple_of(n) {
            self.prompt += c.prompt;
            self.cached += c.cached;
        }
        self.completion += c.completion;
    }

    /// OpenAI's `usage` object.
    fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// A logprob as JSON; a non-finite one (a token the model rules out) is -9999, OpenAI's
/// value for very unlikely tokens.
fn logprob_value(x: f32) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!(-9999.0)
    }
}

/// The chat shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> = e
                .top
                .iter()
                .map(|(t, l)| json!({"token": t.text, "logprob": logprob_value(*l), "bytes": t.bytes}))
                .collect();
            json!({
                "token": e.token.text,
                "logprob": logprob_value(e.logprob),
                "bytes": e.token.bytes,
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content })
}

/// The legacy completions shape: `tokens`, `token_logprobs`, `top_logprobs` (the most likely
/// tokens plus the token itself, by text) and `text_offset` (characters from the start of the
/// text, counted by token; `offset` carries it across stream chunks).
fn completion_logprobs(entries: &[LogprobEntry], offset: &mut usize) -> Value {
    let mut legacy = Legacy::default();
    legacy.extend(entries, offset);
    legacy.json()
}

/// [`completion_logprobs`]'s lists, built token by token.
#[derive(Default)]
pub(crate) struct Legacy {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

impl Legacy {
    /// One token, with its logprob and the most likely tokens at its position (`None` for a
    /// prompt's first token: `null`s).
    fn push(
        &mut self,
        token: &TokenText,
        scored: Option<(f32, &[(TokenText, f32)])>,
        offset: &mut usize,
    ) {
        self.tokens.push(json!(token.text));
        match scored {
            None => {
                self.token_logprobs.push(Value::Null);
                self.top_logprobs.push(Value::Null);
            }
            Some((logprob, top)) => {
                self.token_logprobs.push(logprob_value(logprob));
                let mut map = Map::new();
                for (t, l) in top.iter().map(|(t, l)| (t, *l)).chain([(token, logprob)]) {
                    map.entry(t.text.clone())
                        .or_insert_with(|| logprob_value(l));
                }
                self.top_logprobs.push(Value::Object(map));
            }
        }
        self.text_offset.push(json!(*offset));
        *offset += token.text.chars().count();
    }

    /// Generated tokens.
    fn extend(&mut self, entries: &[LogprobEntry], offset: &mut usize) {
        for e in entries {
            self.push(&e.token, Some((e.logprob, &e.top)), offset);
        }
    }

    fn json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

#[cfg(test)]
mod tests;
