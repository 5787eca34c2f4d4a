"""A model version whose source cannot be loaded is refused when it is registered (the admin API) or
before the server starts (config / --model), not later as a 503 on every request that names it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from storage.registry import ModelVersion
from tests.api.test_auth import assert_error
from tests.api.test_deployments import start_stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def stack(aiohttp_server, db, llama_path):
    made, _ = await start_stack(aiohttp_server, db, [ModelVersion("tiny", "1", str(llama_path))])
    yield made
    await made.client.session.close()
    for worker in made.workers:
        worker.stop()


async def test_a_source_that_cannot_load_is_refused_at_registration(stack, tmp_path, llama_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [  # (source, options, words the message must have)
        (str(tmp_path / "missing"), {}, "does not exist"),
        (str(empty), {}, "config.json"),
        ("nobody-here/no-such-model", {}, "hub"),
        (str(llama_path), {"device": "cuda:7"}, "not configured"),
    ]
    for i, (source, options, words) in enumerate(cases):
        body = {"name": f"bad{i}", "source": source, "options": options}
        error = assert_error(*await stack.client.admin("POST", "/models", json=body), 400, "invalid_request_error")
        assert (error["param"], error["code"]) == ("source", "model_not_loadable") and words in error["message"]
    status, made = await stack.client.admin("POST", "/models", json={"name": "good", "source": str(llama_path)})
    assert status == 201, made
    status, listed = await stack.client.admin("GET", "/models")
    assert sorted(v["name"] for v in listed["data"]) == ["good", "tiny"]  # nothing half-registered


def test_the_server_refuses_a_model_flag_whose_folder_does_not_exist(tmp_path):
    missing = tmp_path / "nowhere"
    run = subprocess.run([sys.executable, "server.py", "--model", f"x={missing}", "--data-dir", str(tmp_path),
                          "--port", "18790"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "config error: model `x`" in run.stderr and str(missing) in run.stderr and "does not exist" in run.stderr
