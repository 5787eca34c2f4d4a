"""A lean HTTP/1.1 keep-alive client for load generation, in the spirit of `wrk`.

On a small machine the load generator shares the CPU cores with the server it measures, so
every millisecond it spends per request is taken from the server's result. aiohttp's client
costs about 0.3 to 0.4 ms of CPU per request; this one, one asyncio protocol per connection
writing pre-built request bytes and reading `Content-Length` bodies, about 0.1 ms. It speaks
only what the benchmarks need: one request at a time per connection, responses with a
`Content-Length` (galley's JSON responses), no redirects or compression.
"""

from __future__ import annotations

import asyncio

import orjson


class Connection(asyncio.Protocol):
    """One keep-alive connection; `post` sends a request and returns (status, body bytes)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        _, connection = await asyncio.get_running_loop().create_connection(cls, host, port)
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection closed mid-response: {exc}"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if "content-length" not in fields:
            self.waiter.set_exception(ValueError(f"response without Content-Length: {head[0]}"))
            return
        total = end + 4 + int(fields["content-length"])
        if len(self.buffer) < total:
            return
        body = bytes(self.buffer[end + 4:total])
        del self.buffer[:total]
        self.waiter.set_result((int(head[0].split()[1]), body))

    async def post(self, path: str, payload: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        body = orjson.dumps(payload)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
