"""Tokens a client received survive a crash unchanged: `python server.py --auth` is killed with
SIGKILL (twice) while streams of every kind run, seeded and unseeded, at different points between
checkpoints; after each restart the streams resume, and what any client received before a kill
is a prefix of the final stream and of the stored answer. Streams resume only for their owners
as they are at the restart: not for a deleted tenant, one whose keys are revoked, one no longer
allowed the model, nor for a new tenant given a deleted one's name."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx2 as httpx

from storage import tenants
from storage.db import Database
from storage.tenants import Tenant
from tests.api.test_auth import ADMIN
from tests.process.test_server_process import ROOT, ServerProcess

# Long enough that no stream can finish in the seconds between a restart and the kill, even when a
# resumed stream regenerates on its own from start-up (80 did finish on a fast CI machine); the demo
# model's context is 512.
MAX_TOKENS = 400
CONFIG = f"""
[streams]
checkpoint_tokens = 8          # a kill between two checkpoints leaves up to 7 sent tokens to regenerate
checkpoint_seconds = 3600.0

[[models]]
name = "demo"
path = "{ROOT / 'models' / 'demo'}"
"""


def finish_of(chunk: dict) -> str | None:
    return chunk["choices"][0]["finish_reason"] if chunk.get("choices") else None


def delta_text(chunk: dict) -> str:
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


class Reader(threading.Thread):
    """Reads one SSE stream until it ends or the server dies; `texts[n]` is what chunk n carried
    (chunks are numbered from 1: counted on a /v1 stream, which has no `id:` lines; the resume
    endpoint's `id:` lines say the same numbers)."""

    def __init__(self, method: str, url: str, **kw) -> None:
        super().__init__(daemon=True)
        self.method, self.url, self.kw = method, url, kw
        self.texts: dict[int, str] = {}
        self.stream_id: str | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream(self.method, self.url, timeout=300, **self.kw) as response:
                assert response.status_code == 200, response.read()
                self.stream_id = response.headers["X-Stream-Id"]
                self.started.set()
                event_id, number = None, 0
                for line in response.iter_lines():
                    if line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        number = event_id if event_id is not None else number + 1
                        self.texts[number] = delta_text(chunk)
                        self.finish_reason = self.finish_reason or finish_of(chunk)
                        event_id = None
        except httpx.TransportError:
            pass  # the server was killed: what was read so far is what it sent
        finally:
            self.started.set()

    def wait_for(self, num_events: int, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.texts) < num_events and not self.done:
            assert self.is_alive() and time.monotonic() < deadline, f"{len(self.texts)} events of {num_events}"
            time.sleep(0.02)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(server: ServerProcess, key: str, content: str, **extra) -> Reader:
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, **extra}
    return Reader("POST", server.url + "/v1/chat/completions", json=body, headers=bearer(key))


def completion(server: ServerProcess, key: str, prompt: str, **extra) -> Reader:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **extra}
    return Reader("POST", server.url + "/v1/completions", json=body, headers=bearer(key))


def follow(server: ServerProcess, key: str, stream_id: str) -> Reader:
    return Reader("GET", f"{server.url}/api/v1/streams/{stream_id}", headers=bearer(key))


def new_key(server: ServerProcess, tenant: str) -> str:
    admin = bearer(ADMIN)
    assert httpx.post(server.url + "/admin/api/tenants", json={"name": tenant}, headers=admin).status_code == 201
    return httpx.post(f"{server.url}/admin/api/tenants/{tenant}/keys", headers=admin).json()["key"]


def change_tenants_offline(data_dir: Path) -> str:
    """While the server is down: delete bob, revoke carol's keys, give dave's name to a new tenant,
    take the model from erin. Returns the new dave's key."""
    def change(db) -> str:
        tenants.delete_tenant(db, "bob")
        for key in tenants.list_keys(db, "carol"):
            tenants.revoke_key(db, key.prefix)
        tenants.delete_tenant(db, "dave")
        tenants.create_tenant(db, Tenant("dave"))
        tenants.update_tenant(db, "erin", {"allowed_models": ("other",)})
        return tenants.create_key(db, "dave")[0]

    db = Database(data_dir / "galley.db")
    try:
        return db.write(change).result()
    finally:
        db.close()


def stream_state(data_dir: Path, stream_id: str) -> tuple[str, int]:
    with sqlite3.connect(data_dir / "galley.db") as conn:
        status, token_ids = conn.execute("SELECT status, token_ids FROM streams WHERE id = ?", [stream_id]).fetchone()
    return status, len(json.loads(token_ids))


def kill(server: ServerProcess, readers: list[Reader]) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    for reader in readers:
        reader.join(timeout=30)  # each has read what was in flight before the kill
        assert not reader.is_alive()


def start(tmp_path: Path) -> ServerProcess:
    config = tmp_path / "galley.toml"
    config.write_text(CONFIG)
    server = ServerProcess("--config", str(config), "--auth", data_dir=tmp_path / "data")
    server.wait_ready()
    return server


def test_tokens_sent_before_sigkill_are_a_prefix_of_the_resumed_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("GALLEY_ADMIN_KEY", ADMIN)
    data_dir = tmp_path / "data"
    received: dict[str, list[dict[int, str]]] = {}  # stream id -> what each reader got before a kill

    def keep(*readers: Reader) -> None:
        for reader in readers:
            assert reader.stream_id is not None and not reader.done, "finished before the kill: too fast?"
            received.setdefault(reader.stream_id, []).append(reader.texts)

    server = start(tmp_path)
    try:  # round 1: three streams at different points between checkpoints
        keys = {name: new_key(server, name) for name in ("alice", "bob", "carol", "dave", "erin")}
        alice = keys["alice"]
        conversation = httpx.post(server.url + "/api/v1/conversations", json={"model": "demo"},
                                  headers=bearer(alice)).json()["id"]
        first = chat(server, alice, "Good morrow, my lord.", temperature=1.0, conversation_id=conversation)
        first.wait_for(13)
        second = completion(server, alice, "KING:", temperature=1.0, seed=11)
        second.wait_for(5)
        third = completion(server, alice, "ROMEO:", temperature=1.3, top_p=0.95)
        third.wait_for(1)
        kill(server, [first, second, third])
        keep(first, second, third)
    finally:
        server.stop()

    server = start(tmp_path)
    try:  # round 2: the resumed streams crash again, beside new ones, of other tenants too
        follower = follow(server, alice, first.stream_id)
        fourth = chat(server, alice, "What news?", temperature=1.0, top_k=40)
        others = {name: chat(server, keys[name], "Speak.", temperature=0) for name in ("bob", "carol", "dave", "erin")}
        for reader in others.values():
            reader.wait_for(1)
        fourth.wait_for(6)
        follower.wait_for(len(first.texts) + 5)
        kill(server, [follower, fourth, *others.values()])
        keep(follower, fourth)
    finally:
        server.stop()
    before = {name: stream_state(data_dir, reader.stream_id) for name, reader in others.items()}
    new_dave = change_tenants_offline(data_dir)

    server = start(tmp_path)
    try:  # round 3: every stream runs to its end; what was sent before a kill did not change
        for name, reader in others.items():  # ... but none of these: their owners are not who they were
            assert stream_state(data_dir, reader.stream_id) == ("cancelled", before[name][1]), name
        response = httpx.get(f"{server.url}/api/v1/streams/{others['dave'].stream_id}", headers=bearer(new_dave))
        assert response.status_code == 404  # not the new dave's
        for stream_id, partials in received.items():
            final = follow(server, alice, stream_id)
            final.join(timeout=300)
            assert final.done and final.finish_reason == "length", stream_id
            for partial in partials:
                changed = {i: (text, final.texts.get(i)) for i, text in partial.items() if final.texts.get(i) != text}
                assert not changed, f"{stream_id}: chunks sent before the kill changed: {changed}"
        answer = "".join(final_texts(server, alice, first.stream_id))
        messages = wait_for_messages(server, alice, conversation, 2)
        assert messages[1]["content"] == answer and messages[1]["completion_tokens"] == MAX_TOKENS

        # an unseeded request is still random from one request to the next
        body = {"model": "demo", "prompt": "KING:", "max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
        texts = {httpx.post(server.url + "/v1/completions", json=body, timeout=120, headers=bearer(alice)).json()[
            "choices"][0]["text"] for _ in range(3)}
        assert len(texts) > 1
    finally:
        assert server.stop() == 0


def final_texts(server: ServerProcess, key: str, stream_id: str) -> list[str]:
    reader = follow(server, key, stream_id)
    reader.join(timeout=120)
    return [reader.texts[i] for i in sorted(reader.texts)]


def wait_for_messages(server: ServerProcess, key: str, conversation: str, count: int,
                      timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        messages = httpx.get(f"{server.url}/api/v1/conversations/{conversation}", headers=bearer(key)).json()[
            "messages"]
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        time.sleep(0.1)
