"""Structured output through the official `openai` client; prints what it got as JSON.

Usage: python openai_structured.py BASE_URL MODEL_ID (the Rust test `structured` runs it).
"""

import json
import sys
from typing import Annotated, Literal

import openai
import pydantic

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": "Describe a pet as JSON."}]
schema = json.loads(sys.stdin.read())
response_format = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": schema, "strict": True},
}
out = {}

r = client.chat.completions.create(
    model=model, messages=messages, temperature=0, response_format=response_format
)
out["create"] = {
    "content": r.choices[0].message.content,
    "finish": r.choices[0].finish_reason,
}

text, finish = "", []
for chunk in client.chat.completions.create(
    model=model,
    messages=messages,
    temperature=0,
    response_format=response_format,
    stream=True,
):
    for c in chunk.choices:
        text += c.delta.content or ""
        if c.finish_reason:
            finish.append(c.finish_reason)
out["stream"] = {"content": text, "finish": finish}


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=8)
    age: int = pydantic.Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool
    toys: list[Annotated[str, pydantic.Field(max_length=5)]] = pydantic.Field(max_length=2)


parsed = client.chat.completions.parse(
    model=model, messages=messages, temperature=0.8, seed=3, response_format=Pet
)
message = parsed.choices[0].message
out["parse"] = {
    "parsed": message.parsed.model_dump() if message.parsed else None,
    "content": message.content,
    "finish": parsed.choices[0].finish_reason,
}

c = client.completions.create(
    model=model,
    prompt="A JSON object:",
    temperature=0,
    extra_body={"response_format": {"type": "json_object"}},
)
out["completion_json_object"] = {
    "text": c.choices[0].text,
    "finish": c.choices[0].finish_reason,
}

try:
    client.chat.completions.create(
        model=model,
        messages=messages,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": {"type": "strin"}, "strict": True},
        },
    )
    out["bad_schema"] = None
except openai.APIStatusError as e:
    out["bad_schema"] = {
        "class": type(e).__name__,
        "status": e.status_code,
        "message": e.message,
        "param": e.param,
    }

print(json.dumps(out))
