"""The HTTP side of batch callbacks: aiohttp sessions that keep to a `CallbackPolicy`
(`services.batch.webhooks` decides where a callback may go and signs it).

Names the operator allow-listed get a plain session; every other URL goes through a connector
whose socket factory checks each address it connects to (after DNS, for every record tried).
Redirects are never followed and proxies from the environment are never used.
"""

from __future__ import annotations

from urllib.parse import urlparse

import aiohttp

from services.batch import BatchConfig, CallbackPolicy, CallbackUnreachable, WebhookClient


class AiohttpTransport:
    def __init__(self, policy: CallbackPolicy, timeout_s: float) -> None:
        self.policy = policy
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._guarded: aiohttp.ClientSession | None = None
        self._trusted: aiohttp.ClientSession | None = None  # allow-listed host names only

    def _session(self, url: str) -> aiohttp.ClientSession:
        if self.policy.allows_host(urlparse(url).hostname or ""):
            if self._trusted is None:
                self._trusted = aiohttp.ClientSession(timeout=self.timeout)
            return self._trusted
        if self._guarded is None:
            connector = aiohttp.TCPConnector(socket_factory=self.policy.socket_factory, use_dns_cache=False)
            self._guarded = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._guarded

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        try:
            async with self._session(url).post(url, data=body, headers=headers, allow_redirects=False) as response:
                return response.status
        except aiohttp.ClientError as exc:
            raise CallbackUnreachable(str(exc)) from exc

    async def close(self) -> None:
        for session in (self._guarded, self._trusted):
            if session is not None:
                await session.close()


def webhook_client(config: BatchConfig) -> WebhookClient:
    """The batch runner's callback client for `[batch]`'s allow-list and timeout."""
    policy = CallbackPolicy.from_entries(config.callback_allow_hosts)
    return WebhookClient(policy, AiohttpTransport(policy, config.callback_timeout_seconds))
