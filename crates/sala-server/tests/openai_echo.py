"""Scores prompts through the official `openai` client as evaluation harnesses do (`echo`,
`logprobs`, `max_tokens` 0), and asks for vLLM's `prompt_logprobs`; prints what it got as
JSON.

Usage: python openai_echo.py BASE_URL MODEL_ID TOKEN_IDS (the Rust test `echo` runs it;
TOKEN_IDS is a JSON list of token ids to score as a token prompt).
"""

import json
import sys

import openai

base_url, model, token_ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
out = {"version": openai.__version__}


def legacy(lp):
    return {
        "tokens": lp.tokens,
        "token_logprobs": lp.token_logprobs,
        "top_logprobs": lp.top_logprobs,
        "text_offset": lp.text_offset,
    }


def usage(u):
    return [u.prompt_tokens, u.completion_tokens, u.total_tokens]


# A text prompt scored: its text back, each token's logprob, nothing generated.
r = client.completions.create(
    model=model, prompt="The harbour lights flickered on", echo=True, logprobs=3, max_tokens=0
)
c = r.choices[0]
out["text"] = {
    "text": c.text,
    "finish": c.finish_reason,
    "usage": usage(r.usage),
    "logprobs": legacy(c.logprobs),
}

# Token prompts in a list, one greedy token each (lm-evaluation-harness's loglikelihood).
r = client.completions.create(
    model=model,
    prompt=[token_ids, token_ids[: len(token_ids) // 2]],
    echo=True,
    logprobs=1,
    max_tokens=1,
    temperature=0,
)
out["tokens"] = [
    {"index": c.index, "text": c.text, "logprobs": legacy(c.logprobs)} for c in r.choices
]

# Streamed: the prompt first, then the completion.
text, chunks, lp = "", [], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
for chunk in client.completions.create(
    model=model,
    prompt="A quiet harbour at dawn",
    echo=True,
    logprobs=2,
    max_tokens=4,
    temperature=0,
    stream=True,
    extra_body={"ignore_eos": True},
):
    for ch in chunk.choices:
        chunks.append(ch.text)
        text += ch.text
        if ch.logprobs is not None:
            for k, v in legacy(ch.logprobs).items():
                lp[k] += v
out["stream"] = {"text": text, "first": chunks[0], "logprobs": lp}

# vLLM's prompt_logprobs, an extension the client passes through and keeps.
r = client.completions.create(
    model=model,
    prompt="Seven swans",
    max_tokens=0,
    extra_body={"prompt_logprobs": 2},
)
out["prompt_logprobs"] = r.choices[0].to_dict().get("prompt_logprobs")


def error(call):
    try:
        call()
    except openai.APIStatusError as e:
        return {"class": type(e).__name__, "status": e.status_code, "param": e.param}
    return None


out["too_many_logprobs"] = error(
    lambda: client.completions.create(
        model=model, prompt="hi", echo=True, logprobs=21, max_tokens=0
    )
)
out["no_tokens_without_echo"] = error(
    lambda: client.completions.create(model=model, prompt="hi", max_tokens=0)
)
out["prompt_logprobs_on_chat"] = error(
    lambda: client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"prompt_logprobs": 1},
    )
)
print(json.dumps(out))
