"""Metrics, request records, traces, alerts, profiling and the shipped Prometheus/Grafana files,
on the real app with the real engine on a tiny model and real clients."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from engine.model_runner import CacheConfig, kv_bytes_per_block
from launch import EngineConfig
from scheduling.router import Router
from services.observability.alerts import DEFAULT_ALERTS, AlertManager, AlertRule, MetricsWindow
from services.observability.telemetry import ObservabilityConfig, TracingConfig
from storage.tenants import hash_key
from tests.api.test_api import scrape, wait_blocks_free
from tests.api.test_auth import ADMIN
from tests.helpers import make_app, start_models, wait_until

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(5, 15))  # 10 prompt tokens
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


async def serve(aiohttp_server, path, *, max_num_seqs=8, max_waiting=64, num_blocks: int | None = None, **app_kw):
    """The tiny model on one CPU worker behind the real app; `num_blocks` sizes the KV pool exactly."""
    loop = asyncio.get_running_loop()
    router = Router()
    cache = CacheConfig(kv_cache_gib=0.05)
    if num_blocks is not None:
        from engine.loader import load_model

        per_block = kv_bytes_per_block(load_model(str(path)).model, cache.block_size, __import__("torch").float32)
        cache = CacheConfig(kv_cache_gib=(num_blocks + 0.5) * per_block / 2**30)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, cache=cache)
    workers = await loop.run_in_executor(None, start_models, [("tiny", str(path))], cfg, max_waiting, router,
                                         lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, admin_key_hash=hash_key(ADMIN), **app_kw)
    server = await aiohttp_server(app)
    return server, router, workers, app


async def get_json(session, url, **kw):
    async with session.get(url, headers=ADMIN_HEADERS, **kw) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def read_sse(resp) -> int:
    """Tokens seen in a streamed completion (one chunk with text per token here)."""
    count = 0
    async for line in resp.content:
        if line.startswith(b"data: {"):
            count += bool(json.loads(line[6:])["choices"][0]["text"] or True)
    return count


async def test_metrics_match_a_known_set_of_requests(aiohttp_server, llama_path):
    """Two streams that cannot both fit in 6 KV blocks (one is preempted), one refused by the
    queue bound, one short request: every counter and histogram count says exactly that."""
    server, router, workers, app = await serve(aiohttp_server, llama_path, max_num_seqs=2, max_waiting=0,
                                               num_blocks=6)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            url = server.make_url("/v1/completions")
            a = await session.post(url, json=body)
            b = await session.post(url, json=body)
            assert a.status == b.status == 200
            c = await session.post(url, json=body)  # 2 in flight is the bound: refused
            assert c.status == 429 and (await c.json())["error"]["code"] == "queue_full"
            await asyncio.gather(read_sse(a), read_sse(b))
            d = await session.post(url, json={**body, "stream": False, "max_tokens": 5})
            assert (await d.json())["usage"]["completion_tokens"] == 5
            await wait_blocks_free(router)
            m = scrape(await (await session.get(server.make_url("/metrics"))).text())
            records = (await get_json(session, server.make_url("/admin/api/requests")))["data"]
    finally:
        for worker in workers:
            worker.stop()
    tiny = (("model", "tiny"), ("version", "1"))
    replica = (("model", "tiny"), ("replica", "cpu#0"), ("version", "1"))
    requests = {k[1]: v for k, v in m.items() if k[0] == "galley_requests_total"}
    assert requests == {(("model", "tiny"), ("status", "length"), ("version", "1")): 3,
                        (("model", "tiny"), ("status", "rejected"), ("version", "1")): 1}
    assert m[("galley_rejected_total", (("model", "tiny"), ("reason", "queue_full")))] == 1
    assert m[("galley_admitted_total", (("model", "tiny"), ("priority", "normal"), ("tenant", "default")))] == 3
    tenant = (("model", "tiny"), ("tenant", "default"), ("version", "1"))
    assert m[("galley_generation_tokens_total", tenant)] == 60 + 60 + 5
    assert m[("galley_prompt_tokens_total", tenant)] == 3 * len(PROMPT)
    assert m[("galley_time_to_first_token_seconds_count", tiny)] == 3
    assert m[("galley_inter_token_latency_seconds_count", tiny)] == 59 + 59 + 4
    assert m[("galley_request_duration_seconds_count", tiny)] == 3
    assert m[("galley_queue_wait_seconds_count", (("model", "tiny"), ("priority", "normal")))] == 3
    preemptions = m[("galley_preemptions_total", replica)]
    assert preemptions >= 1  # 2 x 70 tokens > 6 blocks x 16
    assert preemptions == sum(r["preemptions"] for r in records)
    assert m[("galley_batch_tokens_count", replica)] == m[("galley_engine_steps_total", replica)]
    assert m[("galley_engine_graph_steps_total", replica)] == 0  # no CUDA here: every step ran op by op
    assert 1 <= m[("galley_cpu_threads", (("worker", "cpu#0"),))] <= os.cpu_count()
    assert m[("galley_batch_tokens_sum", replica)] == m[("galley_batched_tokens_total", replica)]
    assert m[("galley_batch_tokens_bucket", tuple(sorted((*replica, ("le", "+Inf")))))] == \
        m[("galley_engine_steps_total", replica)]
    assert m[("galley_kv_blocks_used", replica)] == 0 and m[("galley_kv_blocks_total", replica)] == 6
    # a and d each woke the idle worker (b may have joined a's burst); c never reached it
    assert m[("galley_worker_burst_requests_count", (("worker", "cpu#0"),))] == 2
    assert m[("galley_worker_burst_requests_sum", (("worker", "cpu#0"),))] in (2, 3)
    # the ring holds the same story, newest first
    assert [r["status"] for r in records] == ["length", "length", "length", "rejected"]
    assert [r["output_tokens"] for r in records[:3]] == [5, 60, 60]
    for r in records[:3]:
        assert r["model"] == "tiny@1" and r["tenant"] == "default" and r["prompt_tokens"] == len(PROMPT)
        assert 0 <= r["queue_s"] and 0 <= r["prefill_s"] and 0 <= r["decode_s"] <= r["total_s"]
        assert "prompt" not in r and "output" not in r  # log_prompts is off


async def test_log_prompts_puts_text_in_the_record(aiohttp_server, llama_path):
    server, router, workers, app = await serve(aiohttp_server, llama_path,
                                               observability=ObservabilityConfig(log_prompts=True))
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.make_url("/v1/completions"), headers={"X-Request-Id": "req-text-1"},
                                      json={"model": "tiny", "prompt": "The quick brown", "max_tokens": 6,
                                            "temperature": 0, "ignore_eos": True})
            out = (await resp.json())["choices"][0]["text"]
            records = (await get_json(session, server.make_url("/admin/api/requests?limit=1")))["data"]
        assert records[0]["request_id"] == "req-text-1"
        assert records[0]["prompt"] == "The quick brown" and records[0]["output"] == out
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


async def test_spans_for_queue_prefill_decode_and_the_request(aiohttp_server, llama_path):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    server, router, workers, app = await serve(aiohttp_server, llama_path, tracing=TracingConfig(enabled=True),
                                               span_exporter=exporter)
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.make_url("/v1/completions"), headers={"X-Request-Id": "trace-me"},
                                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                            "ignore_eos": True, "stream": True})
            await read_sse(resp)
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"generation", "queue", "prefill", "decode"}
    root = spans["generation"]
    assert root.attributes["galley.request_id"] == "trace-me"
    assert root.attributes["galley.output_tokens"] == 8 and root.attributes["galley.model_version"] == "1"
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert root.start_time <= spans[name].start_time <= spans[name].end_time <= root.end_time
    assert spans["queue"].end_time <= spans["prefill"].start_time + 1000
    assert spans["prefill"].end_time <= spans["decode"].start_time + 1000


async def test_alerts_fire_and_resolve_from_live_metrics(aiohttp_server, llama_path):
    rules = (AlertRule("KVInUse", "kv_usage", threshold=0.0),
             AlertRule("AnyTTFT", "ttft_p99", threshold=0.0, window_seconds=60.0),
             AlertRule("Backlog", "queue_depth", threshold=1000.0))
    server, router, workers, app = await serve(aiohttp_server, llama_path, alerts=rules,
                                               observability=ObservabilityConfig(alert_interval_seconds=0.05))

    async def alerts(session):
        return await get_json(session, server.make_url("/admin/api/alerts"))

    async def until(session, predicate, timeout_s=10.0):
        async def met():
            data = await alerts(session)
            return data if predicate(data) else None

        return await wait_until(met, timeout_s=timeout_s, what="the alerts to change")

    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.make_url("/v1/completions"), json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True})
            data = await until(session, lambda d: {a["name"] for a in d["firing"]} == {"KVInUse", "AnyTTFT"})
            kv = next(a for a in data["firing"] if a["name"] == "KVInUse")
            assert 0 < kv["value"] <= 1 and kv["kind"] == "kv_usage"
            resp.close()  # the client leaves: the request is cancelled, its blocks freed
            await wait_blocks_free(router)
            data = await until(session, lambda d: {a["name"] for a in d["firing"]} == {"AnyTTFT"})
            assert [h["state"] for h in data["history"] if h["name"] == "KVInUse"] == ["resolved", "firing"]
            assert next(r for r in data["rules"] if r["name"] == "Backlog")["state"] == "inactive"
            stats = await get_json(session, server.make_url("/admin/api/stats"))
            assert stats["alerts_firing"] == ["AnyTTFT"] and stats["requests"] == {"cancelled": 1}
    finally:
        for worker in workers:
            worker.stop()


def test_alert_rules_wait_for_their_duration_and_need_enough_requests():
    """The rule logic on a real registry with explicit clocks: error rate over a window, `for_seconds`."""
    registry = CollectorRegistry()
    requests = Counter("galley_requests", "", ["model", "version", "status"], registry=registry)
    rule = AlertRule("Errors", "error_rate", threshold=0.1, for_seconds=10.0, window_seconds=60.0, min_requests=5)
    manager = AlertManager((rule,), MetricsWindow(registry, keep_s=60.0))
    t0 = manager.window.snapshots[0][0]
    requests.labels("m", "1", "error").inc(2)
    requests.labels("m", "1", "rejected").inc(50)  # refusals are not server errors
    manager.evaluate(t0 + 1)
    assert manager.states[0].state == "inactive" and manager.states[0].value is None  # 2 < min_requests
    requests.labels("m", "1", "stop").inc(8)
    manager.evaluate(t0 + 2)
    assert manager.states[0].state == "pending" and manager.states[0].value == pytest.approx(0.2)
    manager.evaluate(t0 + 11)
    assert manager.states[0].state == "pending"
    manager.evaluate(t0 + 12.5)
    assert manager.states[0].state == "firing"
    requests.labels("m", "1", "stop").inc(100)
    manager.evaluate(t0 + 13)
    assert manager.states[0].state == "inactive"
    assert [h["state"] for h in manager.to_dict()["history"]] == ["resolved", "firing"]


async def test_profile_returns_a_chrome_trace_of_engine_steps(aiohttp_server, llama_path):
    server, router, workers, app = await serve(aiohttp_server, llama_path)
    try:
        async with aiohttp.ClientSession() as session:
            url = server.make_url("/admin/api/profile")
            assert (await session.post(url, params={"seconds": "1"})).status == 401
            for bad in ("0", "-1", "x"):  # above max_profile_seconds: it records that long
                assert (await session.post(url, params={"seconds": bad}, headers=ADMIN_HEADERS)).status == 400
            stream = await session.post(server.make_url("/v1/completions"), json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True})
            first = asyncio.create_task(session.post(url, params={"seconds": "0.6"}, headers=ADMIN_HEADERS))
            await asyncio.sleep(0.2)
            busy = await session.post(url, params={"seconds": "0.5"}, headers=ADMIN_HEADERS)
            assert busy.status == 409
            resp = await first
            assert resp.status == 200
            assert resp.headers["Content-Disposition"].startswith('attachment; filename="galley-profile-cpu-0-')
            trace = await resp.json()
            await read_sse(stream)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "step tiny@1" in names, sorted(names)[:40]
        assert any(n.startswith("aten::") for n in names)
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


# ---- the shipped Prometheus rules and Grafana dashboard -------------------------------------


async def exposed_names(aiohttp_server, llama_path) -> set[str]:
    """Every metric name a real server exposes (after one request, so labelled series exist)."""
    server, router, workers, app = await serve(aiohttp_server, llama_path)
    try:
        async with aiohttp.ClientSession() as session:
            await session.post(server.make_url("/v1/completions"), json={"model": "tiny", "prompt": "hi",
                                                                        "max_tokens": 2})
            text = await (await session.get(server.make_url("/metrics"))).text()
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
    from prometheus_client.parser import text_string_to_metric_families

    names = {name for name, _ in scrape(text)}
    for family in text_string_to_metric_families(text):  # families with no series yet count too
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
        names.update(family.name + suffix for suffix in suffixes)
    return names


LIFECYCLE_ONLY = {"galley_model_load_seconds_bucket", "galley_device_memory_used_bytes",
                  "galley_device_memory_total_bytes"}  # after a registry load / on CUDA only


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bgalley_[a-z_]+", expr))


async def test_prometheus_rules_parse_and_use_real_metrics(aiohttp_server, llama_path):
    path = ROOT / "deploy" / "prometheus" / "alerts.yml"
    doc = yaml.safe_load(path.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert {r["alert"] for r in rules} == {r.name for r in DEFAULT_ALERTS}  # the in-process defaults
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    names = await exposed_names(aiohttp_server, llama_path)
    used = set().union(*(metric_names(r["expr"]) for r in rules))
    assert used - LIFECYCLE_ONLY <= names, used - names
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


async def test_grafana_dashboard_parses_and_uses_real_metrics(aiohttp_server, llama_path):
    doc = json.loads((ROOT / "deploy" / "grafana" / "galley.json").read_text())
    assert doc["uid"] and doc["panels"]
    exprs = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    ids = [panel["id"] for panel in doc["panels"]]
    assert len(ids) == len(set(ids))
    names = await exposed_names(aiohttp_server, llama_path)
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - LIFECYCLE_ONLY - {"galley_models_loaded"} <= names, used - names


# ---- logs of a real `python server.py` ------------------------------------------------------


def test_request_log_lines_carry_the_request_id_and_never_a_key(tmp_path, monkeypatch):
    """One JSON line per generation with its phases; the same id as the response header; no API key
    (admin or tenant) anywhere in the output, even when sent in a query string or refused."""
    import httpx2 as httpx

    from tests.process.test_server_process import ServerProcess

    admin_key = "gk_admin_log-test-secret-0123456789"
    monkeypatch.setenv("GALLEY_ADMIN_KEY", admin_key)
    server = ServerProcess("--auth", data_dir=tmp_path)
    try:
        server.wait_ready()
        admin = {"Authorization": f"Bearer {admin_key}"}
        assert httpx.post(server.url + "/admin/api/tenants", json={"name": "acme"}, headers=admin).status_code == 201
        key = httpx.post(server.url + "/admin/api/tenants/acme/keys", headers=admin).json()["key"]
        tenant = {"Authorization": f"Bearer {key}"}
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(server.url + "/v1/completions", json=body, headers={**tenant, "X-Request-Id": "req-abc-1"})
        assert resp.status_code == 200 and resp.headers["X-Request-Id"] == "req-abc-1"
        streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True,
                              "galley": {"cache": False}}, headers=tenant)  # the same request: not from cache
        assert streamed.status_code == 200
        generated_id = streamed.headers["X-Request-Id"]
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}x"}).status_code == 401
        assert httpx.get(server.url + f"/api/v1/conversations?token={key}").status_code == 401
        records = httpx.get(server.url + "/admin/api/requests", headers=admin).json()["data"]
        assert [r["request_id"] for r in records] == [generated_id, "req-abc-1"]
    finally:
        assert server.stop() == 0
    output = "".join(server.output)
    assert key not in output and key.split("_", 2)[2] not in output  # the secret may hold "_" itself
    assert admin_key not in output and "log-test-secret" not in output
    lines = [json.loads(line) for line in server.output if line.startswith("{")]
    generation = [line for line in lines if line["event"] == "generation"]
    assert {line["request_id"] for line in generation} == {"req-abc-1", generated_id}
    line = next(g for g in generation if g["request_id"] == "req-abc-1")
    assert line["tenant"] == "acme" and line["model"] == "demo@1" and line["status"] == "length"
    assert line["finish_reason"] == "length" and line["output_tokens"] == 12 and line["prompt_tokens"] > 0
    for phase in ("queue_s", "prefill_s", "decode_s", "total_s"):
        assert line[phase] >= 0
    assert line["queue_s"] + line["prefill_s"] + line["decode_s"] <= line["total_s"] + 0.002
    assert "prompt" not in line and "output" not in line
    http_lines = [x for x in lines if x["event"] == "request" and x.get("request_id") == "req-abc-1"]
    assert [x["path"] for x in http_lines] == ["/v1/completions"]
