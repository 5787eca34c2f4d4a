"""A loading model's progress on the admin API: the real app, engine and SQLite; the loader is the
real one with a hook that holds the load in the middle of its weights until the test has looked."""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field

import aiohttp
import pytest

from api.services import SERVICES
from engine.load_progress import ProgressCallback
from engine.model_runner import CacheConfig
from launch import EngineConfig, EngineLoader, start_workers
from scheduling.router import Router, Served
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api.test_admin_page import CHROMIUM, page  # noqa: F401 - the page fixture
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.helpers import make_app
from tests.models import save_tiny_model


@dataclass
class HoldingLoader(EngineLoader):
    """Loads as EngineLoader does, recording every progress report; a load of `hold` stops inside
    its weights (in the progress callback, on the loading thread) until `release` is set."""

    hold: str = ""
    reports: list[tuple[str, float]] = field(default_factory=list)
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def load(self, spec: ModelVersion, on_progress: ProgressCallback | None = None) -> Served:
        def report(phase: str, fraction: float) -> None:
            on_progress(phase, fraction)
            if spec.ref != self.hold:
                return
            self.reports.append((phase, fraction))
            if phase == "reading weights" and fraction > 0.3 and not self.held.is_set():
                self.held.set()
                assert self.release.wait(60), "the test never released the load"

        return super().load(spec, report)


async def version_state(client: Client, ref: str) -> dict:
    status, body = await client.admin("GET", "/models")
    assert status == 200, body
    return next(v for v in body["data"] if f"{v['name']}@{v['version']}" == ref)


@pytest.fixture
async def held(aiohttp_server, db, tmp_path):
    """The app with tiny@1 loaded and tiny@2 registered; its load is started and held mid-weights."""
    model = str(save_tiny_model("llama", tmp_path / "tiny"))
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(max_num_seqs=4, cache=CacheConfig(kv_cache_gib=0.02))
    workers = start_workers(cfg, lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    loader = HoldingLoader(cfg, 16, workers, hold="tiny@2")
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN), loader=loader)
    await app[SERVICES].models.start([ModelVersion("tiny", "1", model)])
    server = await aiohttp_server(app)
    client = Client(aiohttp.ClientSession(base_url=server.make_url("/")))
    try:
        assert (await version_state(client, "tiny@1"))["load_phase"] == "ready"
        status, made = await client.admin("POST", "/models", json={"name": "tiny", "version": "2", "source": model})
        assert status == 201 and (made["load_phase"], made["load_progress"]) == (None, None)
        assert (await client.admin("POST", "/models/tiny/versions/2/load"))[0] == 202
        assert await asyncio.to_thread(loader.held.wait, 60), "the load never reached its weights"
        yield app, loader, client, server
    finally:
        loader.release.set()
        await wait_blocks_free(router, timeout_s=10)
        await client.session.close()
        for worker in workers:
            worker.stop()


async def test_the_admin_api_shows_a_loading_models_phase_and_progress(held):
    app, loader, client, _ = held
    loading = await version_state(client, "tiny@2")
    assert loading["state"] == "loading" and loading["load_phase"] == "reading weights"
    assert 0.3 < loading["load_progress"] < 0.85

    loader.release.set()
    manager = app[SERVICES].models
    await asyncio.wait_for(asyncio.shield(manager.loading.task(manager.versions["tiny@2"])), 60)
    ready = await version_state(client, "tiny@2")
    assert (ready["state"], ready["load_phase"], ready["load_progress"]) == ("ready", "ready", 1.0)
    fractions = [f for _, f in loader.reports]
    assert fractions == sorted(fractions) and loader.reports[-1] == ("loaded", 1.0)
    assert list(dict.fromkeys(p for p, _ in loader.reports))[:2] == ["reading metadata", "reading weights"]

    assert (await client.admin("POST", "/models/tiny/versions/2/unload"))[0] == 202
    await manager.loading.unload(manager.versions["tiny@2"], "test")  # waits for the admin's (or does it)
    unloaded = await version_state(client, "tiny@2")
    assert (unloaded["state"], unloaded["load_phase"], unloaded["load_progress"]) == ("unloaded", None, None)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium")
async def test_the_admin_page_shows_a_loading_models_progress(held, page):  # noqa: F811 - the fixture
    from playwright.async_api import expect

    _, loader, _, server = held
    await page.goto(str(server.make_url("/admin")))
    await page.fill("#admin-key", ADMIN)
    await page.click("#login-button")
    row = page.locator('#models-table tr[data-model="tiny"][data-version="2"]')
    await expect(row).to_contain_text(re.compile(r"loading \d+% \(reading weights\)"))
    loader.release.set()
    await page.evaluate("loadModels()")  # the page polls every 5 s; ask now
    await expect(row).to_contain_text("ready", timeout=30_000)
    assert not page.errors, page.errors
