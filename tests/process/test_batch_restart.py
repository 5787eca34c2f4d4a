"""A batch job survives the process: `python server.py` is killed (SIGKILL) or stopped (SIGTERM) after some
items completed, restarted on the same data dir, and the job completes with every result equal to the greedy
answer of /v1/completions; the callback receiver (a loopback HTTP server) gets the summary."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2 as httpx
import pytest

from tests.process.test_server_process import ServerProcess

PROMPTS = [f"{name}: my lord, number {i}" for i, name in
           zip(range(50), ["ROMEO", "JULIET", "KING", "HAMLET", "PORTIA"] * 10)]
PARAMS = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}


class Receiver:
    """A loopback HTTP server that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/done"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = Receiver()
    yield made
    made.close()


def status_of(server: ServerProcess, batch_id: str) -> dict:
    response = httpx.get(f"{server.url}/api/v1/batch/{batch_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(server: ServerProcess, batch_id: str, done, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(job := status_of(server, batch_id)):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_batch_job_survives_a_restart_midway(tmp_path, receiver, sig):
    config = tmp_path / "config.toml"
    config.write_text('[batch]\ncallback_allow_hosts = ["127.0.0.1"]  # the receiver is on loopback\n')
    server = ServerProcess("--config", str(config), data_dir=tmp_path)
    try:
        server.wait_ready()
        created = httpx.post(server.url + "/api/v1/batch", timeout=10, json={
            "model": "demo", "inputs": PROMPTS, "params": PARAMS, "callback_url": receiver.url}).json()
        batch_id = created["batch_id"]
        before = wait_until(server, batch_id, lambda j: j["progress"]["completed"] >= 5)
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    finally:
        server.stop()
    assert before["progress"]["completed"] < 50, "the job finished before the restart: make it longer"

    again = ServerProcess("--config", str(config), data_dir=tmp_path)
    try:
        again.wait_ready()
        assert any("resumed batch jobs after restart" in line for line in again.output)
        resumed = status_of(again, batch_id)
        assert resumed["progress"]["completed"] >= before["progress"]["completed"]  # kept, not redone
        job = wait_until(again, batch_id, lambda j: j["status"] == "completed")
        assert job["progress"] == {"total": 50, "pending": 0, "completed": 50, "failed": 0, "cancelled": 0}
        results = httpx.get(f"{again.url}/api/v1/batch/{batch_id}/results", timeout=10).json()["results"]
        with ThreadPoolExecutor(8) as pool:
            references = list(pool.map(lambda prompt: httpx.post(
                again.url + "/v1/completions", timeout=60, json={"model": "demo", "prompt": prompt, **PARAMS}).json(),
                PROMPTS))
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert result["output"] == reference["choices"][0]["text"], prompt
            counts = {k: reference["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
            assert result["usage"] == counts  # a batch item keeps no cached_tokens
        job = wait_until(again, batch_id, lambda j: j["callback"]["status"] != "pending", timeout_s=30)
        assert job["callback"]["status"] == "delivered"
        assert [(b["batch_id"], b["status"]) for b in receiver.bodies] == [(batch_id, "completed")]
        assert receiver.bodies[0]["progress"]["completed"] == 50
    finally:
        assert again.stop() == 0
