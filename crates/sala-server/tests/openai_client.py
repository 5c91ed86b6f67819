"""Drives a sala server with the official `openai` client; prints what it got as JSON.

Usage: python openai_client.py BASE_URL MODEL_ID TOOLS_BASE_URL (the Rust test
`openai_client` runs it); TOOLS_BASE_URL serves the same model with a context long enough
for tool definitions.
"""

import json
import sys

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

base_url, model, tools_url = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
out = {"version": openai.__version__}
messages = [{"role": "user", "content": "Tell me about the sea."}]
fixed = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def usage(u):
    return [u.prompt_tokens, u.completion_tokens, u.total_tokens]


def chat_logprobs(content):
    return [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": t.bytes,
            "top": [[a.token, a.logprob] for a in t.top_logprobs],
        }
        for t in content
    ]


r = client.chat.completions.create(
    model=model, messages=messages, logprobs=True, top_logprobs=2, **fixed
)
choice = r.choices[0]
out["chat"] = {
    "id": r.id,
    "object": r.object,
    "model": r.model,
    "role": choice.message.role,
    "content": choice.message.content,
    "finish": choice.finish_reason,
    "usage": usage(r.usage),
    "logprobs": chat_logprobs(choice.logprobs.content),
}

text, finish, final_usage, logprobs, roles = "", [], None, [], []
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    stream=True,
    stream_options={"include_usage": True},
    logprobs=True,
    top_logprobs=2,
    **fixed,
)
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.usage is not None:
        final_usage = usage(chunk.usage)
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            text += c.delta.content
        if c.finish_reason:
            finish.append(c.finish_reason)
        if c.logprobs and c.logprobs.content:
            logprobs += chat_logprobs(c.logprobs.content)
out["chat_stream"] = {
    "content": text,
    "roles": roles,
    "finish": finish,
    "usage": final_usage,
    "logprobs": logprobs,
}

c = client.completions.create(model=model, prompt="Once upon a time", logprobs=2, **fixed)
lp = c.choices[0].logprobs
out["completion"] = {
    "object": c.object,
    "text": c.choices[0].text,
    "finish": c.choices[0].finish_reason,
    "usage": usage(c.usage),
    "tokens": lp.tokens,
    "token_logprobs": lp.token_logprobs,
    "text_offset": lp.text_offset,
}

text, finish = "", []
for chunk in client.completions.create(
    model=model, prompt="Once upon a time", stream=True, **fixed
):
    for ch in chunk.choices:
        text += ch.text
        if ch.finish_reason:
            finish.append(ch.finish_reason)
out["completion_stream"] = {"text": text, "finish": finish}

out["models"] = [m.id for m in client.models.list().data]


def error(call):
    try:
        call()
    except openai.APIStatusError as e:
        return {
            "class": type(e).__name__,
            "status": e.status_code,
            "message": e.message,
            "param": e.param,
            "code": e.code,
            "type": e.type,
        }
    return None


out["unknown_model"] = error(
    lambda: client.chat.completions.create(model="no-such-model", messages=messages)
)
out["n2"] = error(
    lambda: client.chat.completions.create(model=model, messages=messages, n=9)
)
out["empty_messages"] = error(
    lambda: client.chat.completions.create(model=model, messages=[])
)

# Tools: a call and its result in the history, the next call forced by name. The random
# model does not finish the call, so the reply is content that begins with the call's start.
tools_client = openai.OpenAI(base_url=tools_url, api_key="unused", max_retries=0, timeout=60)
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
history = [
    {"role": "user", "content": "Weather in Paris, then in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
]
forced = {"type": "function", "function": {"name": "get_weather"}}
ask = {
    "model": model,
    "messages": history,
    "tools": tools,
    "tool_choice": forced,
    "parallel_tool_calls": False,
    **fixed,
}


def tool_reply(m, finish, u):
    return {
        "role": m.role,
        "content": m.content,
        "tool_calls": [c.to_dict() for c in m.tool_calls or []],
        "finish": finish,
        "usage": usage(u),
    }


r = tools_client.chat.completions.create(**ask)
out["tools"] = tool_reply(r.choices[0].message, r.choices[0].finish_reason, r.usage)
# Accumulated as the client's helpers do (they refuse to finish a reply cut by its length,
# so the state is fed by hand and its snapshot read).
state = ChatCompletionStreamState()
for chunk in tools_client.chat.completions.create(
    stream=True, stream_options={"include_usage": True}, **ask
):
    state.handle_chunk(chunk)
final = state.current_completion_snapshot
out["tools_stream"] = tool_reply(
    final.choices[0].message, final.choices[0].finish_reason, final.usage
)
out["tool_choice_alone"] = error(
    lambda: tools_client.chat.completions.create(
        model=model, messages=messages, tool_choice="required"
    )
)
out["too_many_tools"] = error(
    lambda: tools_client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)
        ],
    )
)


# A strict function made by the client from a pydantic model (nested, with `$defs`), forced:
# even the random model's call comes back whole, and the client validates its arguments.
from typing import Literal

from pydantic import BaseModel, Field


class Place(BaseModel):
    lat: float = Field(ge=-90, le=90)
    kind: Literal["city", "village"]


class Lookup(BaseModel):
    place: Place
    days: int = Field(ge=1, le=7)
    metric: bool


r = tools_client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Look it up."}],
    tools=[openai.pydantic_function_tool(Lookup)],
    tool_choice="required",
    parallel_tool_calls=False,
    max_tokens=300,
    temperature=1.0,
    seed=5,
)
call = r.choices[0].message.tool_calls[0]
out["strict_parsed"] = {
    "name": call.function.name,
    "arguments": call.function.parsed_arguments.model_dump(),
    "finish": r.choices[0].finish_reason,
}

print(json.dumps(out))
