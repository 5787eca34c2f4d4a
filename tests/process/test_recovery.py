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


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}])
def test_sigkill_mid_stream_then_restart_resumes_to_the_same_answer(tmp_path, sampling):
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 300, "ignore_eos": True, **sampling}
    server = ServerProcess(data_dir=tmp_path)
    try:
        server.wait_ready()
        conv = httpx.post(server.url + "/api/v1/conversations", json={"model": "demo"}).json()["id"]
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                          json={**body, "stream": True, "conversation_id": conv}) as response:
            stream_id = response.headers["X-Stream-Id"]
            seen = sse_events(response, limit=10)
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
        reference = httpx.post(again.url + "/v1/chat/completions", json=body, timeout=120).json()
        expected = reference["choices"][0]["message"]["content"]
        assert chat_text(seen) + chat_text(rest) == expected
        for _ in range(100):
            messages = httpx.get(f"{again.url}/api/v1/conversations/{conv}").json()["messages"]
            if len(messages) == 2:
                break
            time.sleep(0.1)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[1]["content"] == expected and messages[1]["completion_tokens"] == 300
    finally:
        assert again.stop() == 0
