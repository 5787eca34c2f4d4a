"""SIGKILL in the middle of a conversation stream: after a restart on the same data dir the
stream resumes from its checkpoint and the stored answer equals an uninterrupted run."""

from __future__ import annotations

import json
import signal
import time

import httpx2 as httpx
import pytest

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
ANSWERS = {  # what the answer is made of: plain text (greedy, seeded), a forced tool call, a JSON document
    "greedy": {"temperature": 0, "max_tokens": 300, "ignore_eos": True},
    "seeded": {"temperature": 1.0, "seed": 1234, "max_tokens": 300, "ignore_eos": True},
    "tool_call": {"temperature": 0, "max_tokens": 140, "tools": TOOLS, "tool_choice": "required",
                  "parallel_tool_calls": False},
    "structured": {"temperature": 0, "max_tokens": 300, "response_format": {
        "type": "json_schema", "json_schema": {"name": "note", "schema": NOTE, "strict": True}}},
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


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_sigkill_mid_stream_then_restart_resumes_to_the_same_answer(tmp_path, answer):
    body = {"model": "demo", "messages": MESSAGES, **ANSWERS[answer]}
    server = ServerProcess(data_dir=tmp_path)
    try:
        server.wait_ready()
        conv = httpx.post(server.url + "/api/v1/conversations", json={"model": "demo"}).json()["id"]
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                          json={**body, "stream": True, "conversation_id": conv}) as response:
            stream_id = response.headers["X-Stream-Id"]
            seen = sse_events(response, limit=4)
            server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
    finally:
        server.stop()
    last = len(seen)  # the /v1 stream has no `id:` lines: the resume point is the count of chunks received

    again = ServerProcess(data_dir=tmp_path)
    try:
        again.wait_ready()
        assert any("resumed streams after restart" in line for line in again.output)  # not finished before the kill
        with httpx.stream("GET", f"{again.url}/api/v1/streams/{stream_id}", headers={"Last-Event-ID": str(last)},
                          timeout=120) as response:
            assert response.status_code == 200
            rest = sse_events(response)
        assert rest[-1][1] == "[DONE]"
        with httpx.stream("GET", f"{again.url}/api/v1/streams/{stream_id}", timeout=120) as response:
            whole = sse_events(response)  # the finished stream from the start: the uninterrupted view
        assert [d for _, d in whole] == [d for _, d in seen + rest]
        reference = httpx.post(again.url + "/v1/chat/completions", json={**body, "galley": {"cache": False}},
                               timeout=120).json()["choices"][0]
        assert chat_text(seen) + chat_text(rest) == (reference["message"]["content"] or "")
        calls = tool_calls(seen + rest)
        assert [c[1:] for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                          for c in reference["message"].get("tool_calls") or []]
        if answer == "tool_call":
            assert calls and rest[-2][1]["choices"][0]["finish_reason"] == "tool_calls"
        if answer == "structured":
            assert len(json.loads(chat_text(seen + rest))["text"]) >= 200
        for _ in range(100):
            messages = httpx.get(f"{again.url}/api/v1/conversations/{conv}").json()["messages"]
            if len(messages) == 2:
                break
            time.sleep(0.1)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[1]["content"] == (reference["message"]["content"] or "")
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in messages[1].get("tool_calls") or []] == calls  # the stored calls are the ones streamed
    finally:
        assert again.stop() == 0
