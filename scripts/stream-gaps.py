#!/usr/bin/env python3
"""Gaps in a streaming request's tokens while a long prompt is read beside it.

Usage: scripts/stream-gaps.py PORT REPEATS, against `sala serve` (the built-in tiny model) on
127.0.0.1:PORT: a greedy streaming completion of 1,500 tokens, then, a second later, a prompt
of REPEATS copies of a 9-word sentence (4 tokens generated); prints the long request's time
and the stream's events and longest gap while it was read. A second run on the same server
finds the long prompt in the prefix cache.
"""
import json
import sys
import threading
import time
import urllib.request

URL = f"http://127.0.0.1:{sys.argv[1]}/v1/completions"
SENTENCE = "the quick brown fox jumps over the lazy dog"


def complete(prompt, max_tokens, stream, out, key):
    body = json.dumps(
        {
            "model": "sala-builtin-tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(URL, body, {"Content-Type": "application/json"})
    out[key + "_start"] = time.time()
    events = []
    with urllib.request.urlopen(request, timeout=600) as response:
        if stream:
            for line in response:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    events.append(time.time())
        else:
            out[key + "_body"] = json.loads(response.read())
    out[key] = events
    out[key + "_end"] = time.time()


def main():
    out = {}
    short = threading.Thread(target=complete, args=("hello there", 1500, True, out, "short"))
    short.start()
    time.sleep(1.0)
    long_prompt = " ".join([SENTENCE] * int(sys.argv[2]))
    complete(long_prompt, 4, False, out, "long")
    short.join()
    start, end = out["long_start"], out["long_end"]
    events = out["short"]
    during = [t for t in events if start <= t <= end]
    gaps = [b - a for a, b in zip(events, events[1:]) if start <= b <= end + 0.5]
    tokens = out["long_body"]["usage"]["prompt_tokens"]
    print(
        f"long request {end - start:.2f} s ({tokens} prompt tokens); stream events during it: "
        f"{len(during)}, longest gap {max(gaps) * 1000:.0f} ms, "
        f"median {sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms"
    )


main()
