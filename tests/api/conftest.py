"""The live server most HTTP tests share: the real app and engine on the tiny model on a loopback
port (`served`) and the real openai SDK pointed at it (`sdk`). A file whose prompts need more room
(tool definitions in the chat template) overrides `model_dir` with `long_context_dir`."""

from __future__ import annotations

import pytest

from tests.api.test_api import client, start_server, wait_blocks_free
from tests.helpers import long_context_copy


@pytest.fixture
def model_dir(llama_path):
    return llama_path


@pytest.fixture(scope="session")
def long_context_dir(llama_path, tmp_path_factory):
    return long_context_copy(llama_path, tmp_path_factory.mktemp("long") / "tiny")


@pytest.fixture
async def served(aiohttp_server, model_dir):
    server, router, workers = await start_server(aiohttp_server, model_dir)
    yield server
    await wait_blocks_free(router)
    for worker in workers:
        worker.stop()


@pytest.fixture
async def sdk(served):
    async with client(served) as sdk:
        yield sdk
