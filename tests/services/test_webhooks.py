"""Batch callbacks as a hostile tenant would aim them: loopback by name (the address is only known at
connect time), private and special addresses, redirects into the private network; and the signature a
receiver verifies with the secret it got once at job creation. The real app and engine, real loopback
receivers (allow-listed where a test needs delivery)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest
from aiohttp import web

from services.batch.runner import BatchConfig
from services.batch.webhooks import CallbackPolicy, is_public, parse_ip
from tests.api import test_batch
from tests.api.test_batch import GREEDY, wait_for

make_stack = test_batch.make_stack  # the fixture: (client, router, a tenant key) for a BatchConfig

LOOPBACK = ("127.0.0.1",)
FAST = {"callback_backoff_seconds": 0.01, "callback_max_attempts": 2}


class Receiver:
    """A loopback HTTP server that records every request it gets and answers `reply(request)`."""

    def __init__(self, reply=lambda request: web.Response(status=204)) -> None:
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.reply = reply
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((request.path, dict(request.headers), await request.read()))
        return self.reply(request)


async def start_receiver(aiohttp_server, reply=lambda request: web.Response(status=204)):
    receiver = Receiver(reply)
    server = await aiohttp_server(receiver.app)
    return receiver, server


async def submit(client, key: str, callback_url: str) -> tuple[int, dict]:
    return await client.call("POST", "/api/v1/batch", key, json={
        "model": "tiny", "inputs": ["The quick brown"], "params": {**GREEDY, "max_tokens": 2},
        "callback_url": callback_url})


async def settled_callback(client, key: str, batch_id: str) -> dict:
    job = await wait_for(client, key, batch_id, until=lambda j: j["callback"]["status"] != "pending")
    return job["callback"]


async def test_the_callback_is_signed_with_the_secret_returned_once_at_creation(make_stack, aiohttp_server):
    receiver, hook = await start_receiver(aiohttp_server)
    client, _, key = await make_stack(BatchConfig(callback_allow_hosts=LOOPBACK))
    status, created = await submit(client, key, str(hook.make_url("/hook")))
    assert status == 200, created
    secret = created["callback_secret"]
    assert secret.startswith("whsec_") and len(secret) > 40
    assert (await settled_callback(client, key, created["batch_id"]))["status"] == "delivered"

    [(path, headers, raw)] = receiver.received
    assert path == "/hook" and headers["Content-Type"] == "application/json"
    fields = dict(part.split("=", 1) for part in headers["X-Galley-Signature"].split(","))
    assert abs(int(fields["t"]) - time.time()) < 300
    expected = hmac.new(secret.encode(), f"{fields['t']}.".encode() + raw, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(fields["v1"], expected)
    assert json.loads(raw)["batch_id"] == created["batch_id"] == headers["X-Galley-Batch-Id"]

    _, shown = await client.call("GET", f"/api/v1/batch/{created['batch_id']}", key)
    _, listed = await client.call("GET", "/api/v1/batch", key)
    assert secret not in json.dumps([shown, listed])  # shown once, at creation
    status, other = await submit(client, key, str(hook.make_url("/hook")))
    assert status == 200 and other["callback_secret"] != secret  # one secret per job
    _, plain = await client.call("POST", "/api/v1/batch", key, json={"model": "tiny", "inputs": ["a"],
                                                                     "params": GREEDY})
    assert plain["callback_secret"] is None


async def test_a_host_name_that_resolves_to_loopback_is_refused_at_connect_time(make_stack, aiohttp_server):
    receiver, hook = await start_receiver(aiohttp_server)
    client, _, key = await make_stack(BatchConfig(**FAST))
    status, created = await submit(client, key, f"http://localhost:{hook.port}/hook")
    assert status == 200, created  # a name: its address is checked on every connection, not here
    callback = await settled_callback(client, key, created["batch_id"])
    assert callback["status"] == "failed" and callback["attempts"] == 2
    assert receiver.received == []


async def test_an_allow_listed_host_name_is_delivered(make_stack, aiohttp_server):
    receiver, hook = await start_receiver(aiohttp_server)
    client, _, key = await make_stack(BatchConfig(callback_allow_hosts=("localhost",), **FAST))
    status, created = await submit(client, key, f"http://localhost:{hook.port}/hook")
    assert status == 200, created
    assert (await settled_callback(client, key, created["batch_id"]))["status"] == "delivered"
    assert len(receiver.received) == 1


async def test_redirects_are_not_followed(make_stack, aiohttp_server):
    inner, inner_server = await start_receiver(aiohttp_server)
    target = str(inner_server.make_url("/internal"))
    outer, outer_server = await start_receiver(
        aiohttp_server, lambda request: web.Response(status=307, headers={"Location": target}))
    client, _, key = await make_stack(BatchConfig(callback_allow_hosts=LOOPBACK, **FAST))
    status, created = await submit(client, key, str(outer_server.make_url("/hook")))
    assert status == 200, created
    callback = await settled_callback(client, key, created["batch_id"])
    assert callback["status"] == "failed" and callback["attempts"] == 2  # a 3xx is not a delivery
    assert len(outer.received) == 2 and inner.received == []


SPECIAL_URLS = [
    "http://127.0.0.1:9/x", "http://127.8.9.10/x", "http://10.1.2.3/x", "http://172.16.0.1/x", "http://192.168.0.1/x",
    "http://100.64.0.1/x", "http://169.254.169.254/latest/meta-data/", "http://224.0.0.1/x", "http://240.0.0.1/x",
    "http://0.0.0.0:9/x", "http://[::]:9/x", "http://[::1]:9/x", "http://[::ffff:127.0.0.1]:9/x",
    "http://[::ffff:a00:1]/x", "http://[fe80::1]/x", "http://[fd00::1]/x", "http://[ff02::1]/x",
    "http://[2002:7f00:1::]/x", "http://[64:ff9b::a00:1]/x",
]


async def test_special_addresses_and_other_schemes_are_refused_at_submit(make_stack):
    client, _, key = await make_stack(BatchConfig())
    for url in [*SPECIAL_URLS, "ftp://example.com/x", "file:///etc/passwd", "gopher://example.com/x", "http:///x"]:
        status, body = await submit(client, key, url)
        assert status == 400 and body["error"]["param"] == "callback_url", (url, body)
    _, listed = await client.call("GET", "/api/v1/batch", key)
    assert listed["data"] == []


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "172.31.255.255", "192.168.1.1", "100.64.0.1",
                                     "169.254.169.254", "224.0.0.251", "240.0.0.1", "255.255.255.255", "0.0.0.0",
                                     "::", "::1", "::ffff:127.0.0.1", "::ffff:192.168.0.1", "fe80::1%eth0",
                                     "fc00::1", "fec0::1", "ff02::1", "2002:c0a8:101::1", "64:ff9b::7f00:1",
                                     "2001:db8::1", "192.0.2.1"])
def test_only_public_unicast_addresses_pass_the_connect_check(address):
    ip = parse_ip(address)
    assert not is_public(ip)
    assert not CallbackPolicy().allows_address(ip)
    with pytest.raises(OSError):
        CallbackPolicy().socket_factory((2, 1, 6, "", (address, 80)))


def test_public_addresses_and_allow_listed_ranges_pass():
    for address in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2002:808:808::1"]:
        assert CallbackPolicy().allows_address(parse_ip(address)), address
    policy = CallbackPolicy.from_entries(("10.0.0.0/8", "::1", "Hooks.Internal."))
    assert policy.allows_address(parse_ip("10.2.3.4")) and policy.allows_address(parse_ip("::1"))
    assert not policy.allows_address(parse_ip("127.0.0.1")) and not policy.allows_address(parse_ip("192.168.0.1"))
    assert policy.allows_host("hooks.internal") and not policy.allows_host("hooks.internal.evil.com")
