"""Reads tool-call replies of a sala server with the official `openai` client.

Usage: python openai_tool_replies.py DIR, where DIR holds `whole.json` (a chat completion),
`stream.sse` (the same reply streamed) and `tools.json` (the request's tools). A mock
transport serves those bodies to the client, which reads them as it would a server's; prints
what it read as JSON. Run by the Rust test `the_openai_client_reads_the_tool_calls`.
"""

import json
import os
import sys

import openai

try:  # the HTTP library of the pinned client; older ones use httpx
    import httpx2 as httpx
except ImportError:
    import httpx
from openai.lib.streaming.chat import ChatCompletionStreamState

folder = sys.argv[1]


def read(name):
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


whole, sse, tools = read("whole.json"), read("stream.sse"), json.loads(read("tools.json"))


def serve(request):
    if json.loads(request.content).get("stream"):
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=sse
        )
    return httpx.Response(200, headers={"content-type": "application/json"}, content=whole)


client = openai.OpenAI(
    base_url="http://sala.invalid/v1",
    api_key="unused",
    max_retries=0,
    http_client=httpx.Client(transport=httpx.MockTransport(serve)),
)
ask = {
    "model": "m",
    "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
    "tools": tools,
}


def message(m, finish):
    calls = m.tool_calls or []
    return {
        "content": m.content,
        "finish": finish,
        "calls": [[c.function.name, json.loads(c.function.arguments)] for c in calls],
        "ids": [c.id for c in calls],
        "types": [c.type for c in calls],
    }


out = {}
r = client.chat.completions.create(**ask)
out["whole"] = message(r.choices[0].message, r.choices[0].finish_reason)

state = ChatCompletionStreamState()
for chunk in client.chat.completions.create(stream=True, **ask):
    state.handle_chunk(chunk)
final = state.get_final_completion()
out["accumulated"] = message(final.choices[0].message, final.choices[0].finish_reason)

done = []
with client.chat.completions.stream(**ask) as stream:
    for event in stream:
        if event.type == "tool_calls.function.arguments.done":
            done.append([event.name, event.parsed_arguments])
    final = stream.get_final_completion()
out["helper"] = message(final.choices[0].message, final.choices[0].finish_reason)
out["helper"]["done_events"] = done

print(json.dumps(out))
