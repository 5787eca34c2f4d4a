from __future__ import annotations

import faulthandler
import os
import signal
import threading

import aiohttp.web_app
import pytest

# servers the tests start (python server.py) serve no gRPC unless a test asks: two on one machine would both
# want port 8001
os.environ.setdefault("GALLEY_GRPC_PORT", "0")

from storage.db import Database
from tests.models import FAMILIES, GENERIC_FAMILIES, save_generic_model, save_tiny_model

HUNG_TEST_S = 600  # the slowest test takes about a minute on 2 cores
_real_stderr = []  # the stderr from before pytest captures it, for faulthandler's dumps


def pytest_configure(config):
    """A hung test ends the run at once with every thread's stack, instead of at CI's time limit with
    nothing to go on; a SIGTERM from outside (a CI timeout) dumps them too. faulthandler, not a Python
    thread: it dumps even while a thread holds the GIL."""
    _real_stderr.append(os.fdopen(os.dup(2), "w"))
    faulthandler.register(signal.SIGTERM, file=_real_stderr[0], all_threads=True, chain=True)


@pytest.fixture(autouse=True)
def _exit_if_hung(request):
    stderr = _real_stderr[0]
    # names the test first (the stacks of an async test show only the event loop), unless the GIL is stuck
    name = threading.Timer(HUNG_TEST_S - 5, lambda: print(f"\nstill running after {HUNG_TEST_S - 5} s: "
                                                          f"{request.node.nodeid}", file=stderr, flush=True))
    name.daemon = True
    name.start()
    faulthandler.dump_traceback_later(HUNG_TEST_S, exit=True, file=stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
    name.cancel()


@pytest.fixture(autouse=True)
def _release_apps():
    """aiohttp memoises each route's middleware chain, keyed by (handler, apps), in a module-level
    lru_cache of 1024 entries, so every test's app stayed alive, and with it its engines and KV
    caches: the test process grew by ~25 MB a test, to 16 GB in a full run. A server builds one app,
    so only tests need this."""
    yield
    cache = getattr(aiohttp.web_app, "_cached_build_middleware", None)
    if cache is not None:
        cache.cache_clear()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def generic_models(tmp_path_factory) -> dict:
    """Tiny random models of the families beyond the dense native ones (tests.models.GENERIC_FAMILIES)."""
    root = tmp_path_factory.mktemp("generic")
    return {family: save_generic_model(family, root / family) for family in GENERIC_FAMILIES}


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def kernels():
    """The C++ CPU kernels (`torch.ops.galley_cpu`), built once; the test skips where they cannot be."""
    from engine.cpu_kernels import CPU_KERNELS

    if not CPU_KERNELS.wait(timeout_s=900):
        pytest.skip("the C++ kernels could not be built here (no compiler?)")
    return CPU_KERNELS.ops


@pytest.fixture
def db(tmp_path):
    """A real SQLite file in the test's data dir."""
    database = Database(tmp_path / "data" / "galley.db")
    yield database
    database.close()
