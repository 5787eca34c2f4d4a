"""The admin page in a real headless Chromium (Playwright) against the real app, engine and SQLite.

Skipped only where Debian's /usr/bin/chromium is absent (`.ci/run` installs it).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from api.services import SERVICES
from engine.model_runner import CacheConfig
from launch import EngineConfig, EngineLoader, start_workers
from scheduling.router import Router
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN
from tests.helpers import make_app

CHROMIUM = Path("/usr/bin/chromium")
DEMO = str(Path(__file__).resolve().parents[2] / "models" / "demo")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium")]


@pytest.fixture
async def site(aiohttp_server, db):
    """The demo model as versions 1 (all traffic) and 2 (registered, no traffic), auth off."""
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(max_num_seqs=8, cache=CacheConfig(kv_cache_gib=0.02))
    workers = start_workers(cfg, lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, db=db, admin_key_hash=hash_key(ADMIN), loader=EngineLoader(cfg, 16, workers))
    await app[SERVICES].models.start([ModelVersion("demo", "1", DEMO), ModelVersion("demo", "2", DEMO)])
    server = await aiohttp_server(app)
    yield server, router
    await wait_blocks_free(router, timeout_s=10)
    for worker in workers:
        worker.stop()


@pytest.fixture
async def page(tmp_path):
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        context = await browser.new_context(viewport={"width": 1400, "height": 1000})
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.errors = errors
        yield page
        await browser.close()


async def api(server, method: str, path: str, **kw):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, server.make_url(path), headers={"Authorization": f"Bearer {ADMIN}"},
                                   **kw) as resp:
            return resp.status, await resp.json()


async def traffic_for(server, seconds: float) -> None:
    """Four clients streaming completions back to back for a while."""
    deadline = asyncio.get_running_loop().time() + seconds
    body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 48, "stream": True, "ignore_eos": True}

    async def client(session):
        while asyncio.get_running_loop().time() < deadline:
            async with session.post(server.make_url("/v1/completions"), json=body) as resp:
                assert resp.status == 200
                async for _ in resp.content:
                    pass

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(4)))


async def test_admin_page_end_to_end(site, page, tmp_path):
    from playwright.async_api import expect

    server, router = site
    await page.goto(str(server.make_url("/admin")))
    # a wrong key is refused, the admin key signs in
    await page.fill("#admin-key", "gk_admin_wrong")
    await page.click("#login-button")
    await expect(page.locator("#login-error")).to_contain_text("Invalid admin key")
    await page.fill("#admin-key", ADMIN)
    await page.click("#login-button")
    await expect(page.locator("#app")).to_be_visible()
    await expect(page.locator("#status")).to_have_text("ready")
    page.errors.clear()  # the wrong key's 401 above was expected; nothing else may fail

    # the demo model is listed, with its versions and state
    await expect(page.locator('#models-table tr[data-model="demo"][data-version="1"]')).to_contain_text("ready")
    await expect(page.locator('#models-table tr[data-model="demo"][data-version="2"]')).to_contain_text("unloaded")

    # the playground streams a reply over /ws/chat
    await page.select_option("#play-model", "demo")
    await page.fill("#play-max-tokens", "40")
    await page.fill("#play-input", "Good morrow, my lord.")
    await page.click("#play-send")
    reply = page.locator("#play-transcript .msg.assistant .body").last
    await expect(reply).not_to_be_empty(timeout=20_000)
    await expect(page.locator("#play-status")).to_contain_text("done", timeout=30_000)
    text = (await reply.text_content()).strip()
    assert text  # sampled (the playground sends no temperature), so its words are the model's choice

    # the request shows up in the recent requests and the conversation in the browser
    await page.click("#requests-refresh")
    await expect(page.locator("#requests-table tbody tr").first).to_contain_text("demo@1")
    await page.click("#conversations-refresh")
    await page.locator("#conversations-list li").first.click()
    await expect(page.locator("#conversation-view")).to_contain_text("Good morrow, my lord.")
    await expect(page.locator("#conversation-view")).to_contain_text(text)  # the streamed reply, as stored

    # a traffic split moved with the slider is persisted through the deployments API
    slider = page.locator('.deployment[data-model="demo"] input[data-version="2"]')
    await slider.fill("30")
    await expect(page.locator('.deployment[data-model="demo"] input[data-version="1"]')).to_have_value("70")
    await page.locator('.deployment[data-model="demo"] [data-testid=apply-traffic]').click()

    async def traffic():
        status, body = await api(server, "GET", "/api/v1/deployments")
        return next(d for d in body["data"] if d["model_name"] == "demo")["traffic"]

    for _ in range(100):
        if await traffic() == {"1": 70, "2": 30}:
            break
        await asyncio.sleep(0.1)
    assert await traffic() == {"1": 70, "2": 30}

    # a tenant and a key: the key is shown once, then only its prefix
    await page.fill("#tenant-name", "acme")
    await page.click("#tenant-form button[type=submit]")
    await page.locator("[data-testid=new-key-acme]").click()
    await expect(page.locator("#new-key-value")).to_have_text(re.compile(r"^gk_[0-9a-f]{8}_\S+$"))
    key = (await page.locator("#new-key-value").text_content()).strip()
    status, keys = await api(server, "GET", "/admin/api/tenants/acme/keys")
    assert [k["prefix"] for k in keys["data"]] == [key.split("_")[1]]
    await expect(page.locator('#tenants-table tr[data-tenant="acme"]')).to_contain_text(key.split("_")[1])
    await page.click("#new-key-dismiss")
    assert key not in await page.content()

    await page.reload()  # still signed in (sessionStorage)
    await expect(page.locator("#app")).to_be_visible()
    load = asyncio.create_task(traffic_for(server, 6.0))  # something for the live charts to show
    await page.wait_for_timeout(6500)
    await load
    await page.evaluate("window.scrollTo(0, 0)")
    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert not page.errors, page.errors
