"""SIGKILL in the middle of a conversation stream: after a restart on the same data dir the
stream resumes from its checkpoint and the stored answer equals an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx2 as httpx

from tests.process.test_server_process import ServerProcess

MESSAGES = [{"role": "user", "content": "Good morrow, my lord."}]


def sse_events(response: httpx.Response, limit: int | None = None) -> list[tuple[int | None, object]]:
    """(id or None, data) per event, stopping after `limit` events."""
    events, event_id = [], None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
            events.append((event_id, data if data == "[DONE]" else json.loads(data)))
            if limit is not None and len(events) >= limit:
                break
            event_id = None
    return events


def chat_text(events) -> str:
    return "".join((d["choices"][0]["delta"].get("content") or "") for _, d in events
                   if isinstance(d, dict) and d.get("choices"))


LONG_TEXT = {"type": "string", "minLength": 200, "maxLength": 220}  # an answer still running at the kill
NOTE = {"type": "object", "properties": {"text": LONG_TEXT}, "required": ["text"], "additionalProperties": False}
SHORT_NOTE = {**NOTE, "properties": {"text": {"type": "string", "minLength": 90, "maxLength": 100}}}  # the tools
TOOLS = [{"type": "function", "function": {"name": "write_note", "parameters": SHORT_NOTE}}]  # fill the context
ANSWERS = {  # what the answer is made of: plain text (greedy, seeded), a JSON document, a forced tool call
    "greedy": {"temperature": 0, "max_tokens": 300, "ignore_eos": True},
    "seeded": {"temperature": 1.0, "seed": 1234, "max_tokens": 300, "ignore_eos": True},
    "structured": {"temperature": 0, "max_tokens": 300, "response_format": {
        "type": "json_schema", "json_schema": {"name": "note", "schema": NOTE, "strict": True}}},
    "tool_call": {"temperature": 0, "max_tokens": 140, "tools": TOOLS, "tool_choice": "required",
                  "parallel_tool_calls": False},
}


def tool_calls(events) -> list[tuple[str | None, str, str]]:
    """(id, name, arguments) of each call put together from a stream's deltas."""
    calls: dict[int, list] = {}
    for _, d in events:
        if isinstance(d, dict) and d.get("choices"):
            for part in d["choices"][0]["delta"].get("tool_calls") or []:
                call = calls.setdefault(part["index"], [part.get("id"), None, ""])
                call[1] = part["function"].get("name") or call[1]
                call[2] += part["function"].get("arguments", "")
    return [tuple(c) for c in calls.values()]


def test_sigkill_mid_stream_then_restart_resumes_to_the_same_answer(tmp_path):
    """Four conversation streams at once (plain greedy and seeded text, a forced tool call, a JSON
    document), SIGKILLed mid-answer; after the restart each resumes to the uninterrupted answer. One
    kill for all four: each kill and restart costs seconds of the suite."""
    server = ServerProcess(data_dir=tmp_path)
    started: dict[str, tuple[str, str, list]] = {}  # answer -> (conversation, stream id, chunks seen)
    try:
        server.wait_ready()
        streams = contextlib.ExitStack()
        with streams:
            for answer in ANSWERS:  # the longest first: the tool call, last, is the shortest
                conv = httpx.post(server.url + "/api/v1/conversations", json={"model": "demo"}).json()["id"]
                body = {"model": "demo", "messages": MESSAGES, **ANSWERS[answer], "stream": True,
                        "conversation_id": conv}
                response = streams.enter_context(httpx.stream("POST", server.url + "/v1/chat/completions",
                                                              timeout=60, json=body))
                started[answer] = (conv, response.headers["X-Stream-Id"], sse_events(response, limit=4))
            server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
    finally:
        server.stop()

    again = ServerProcess(data_dir=tmp_path)
    try:
        again.wait_ready()
        resumed = [json.loads(line) for line in again.output if "resumed streams after restart" in line]
        assert resumed and resumed[0]["count"] == len(ANSWERS), resumed  # none had finished before the kill
        for answer, (conv, stream_id, seen) in started.items():
            check_resumed(again, answer, conv, stream_id, seen)
    finally:
        assert again.stop() == 0


def check_resumed(server: ServerProcess, answer: str, conv: str, stream_id: str, seen: list) -> None:
    """The stream resumed after the chunks `seen` (their count is the resume point: a /v1 stream has no
    `id:` lines) equals the uninterrupted answer, and so does the conversation's stored message."""
    with httpx.stream("GET", f"{server.url}/api/v1/streams/{stream_id}", headers={"Last-Event-ID": str(len(seen))},
                      timeout=120) as response:
        assert response.status_code == 200
        rest = sse_events(response)
    assert rest[-1][1] == "[DONE]", answer
    with httpx.stream("GET", f"{server.url}/api/v1/streams/{stream_id}", timeout=120) as response:
        whole = sse_events(response)  # the finished stream from the start: the uninterrupted view
    assert [d for _, d in whole] == [d for _, d in seen + rest], answer
    body = {"model": "demo", "messages": MESSAGES, **ANSWERS[answer], "galley": {"cache": False}}
    reference = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert chat_text(seen) + chat_text(rest) == (reference["message"]["content"] or ""), answer
    calls = tool_calls(seen + rest)
    assert [c[1:] for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                      for c in reference["message"].get("tool_calls") or []]
    if answer == "tool_call":
        assert calls and rest[-2][1]["choices"][0]["finish_reason"] == "tool_calls"
    if answer == "structured":
        assert len(json.loads(chat_text(seen + rest))["text"]) >= 200
    for _ in range(100):
        messages = httpx.get(f"{server.url}/api/v1/conversations/{conv}").json()["messages"]
        if len(messages) == 2:
            break
        time.sleep(0.1)
    assert [m["role"] for m in messages] == ["user", "assistant"], answer
    assert messages[1]["content"] == (reference["message"]["content"] or ""), answer
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in messages[1].get("tool_calls") or []] == calls  # the stored calls are the ones streamed
