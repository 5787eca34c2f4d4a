import threading

import pytest

from services.deployments.offload import in_fresh_thread


async def test_runs_on_a_thread_that_then_exits_and_passes_errors_back():
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x * 2

    assert await in_fresh_thread(work, 21) == 42
    assert seen[0] is not threading.main_thread()
    seen[0].join(timeout=5)
    assert not seen[0].is_alive()  # its OpenMP team dies with it

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await in_fresh_thread(fail)
