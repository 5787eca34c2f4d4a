"""The import direction of DESIGN.md, checked on the source: server -> api -> scheduling -> engine types."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_ENGINE = {"engine.types", "engine.kv_cache", "engine.block_pool"}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", modules("engine"), ids=str)
def test_engine_never_imports_the_server_side(path):
    bad = {n for n in imports(path) if top(n) in {"aiohttp", "scheduling", "storage", "api"}}
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", modules("scheduling") + modules("api"), ids=str)
def test_scheduling_and_api_stay_torch_free(path):
    bad = {n for n in imports(path) if top(n) == "torch" or (top(n) == "engine" and n not in TORCH_FREE_ENGINE)}
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", modules("scheduling"), ids=str)
def test_scheduling_never_imports_aiohttp_or_api(path):
    bad = {n for n in imports(path) if top(n) in {"aiohttp", "api", "storage"}}
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", modules("storage"), ids=str)
def test_storage_uses_only_stdlib_and_sqlite_utils(path):
    allowed = set(sys.stdlib_module_names) | {"sqlite_utils", "storage", "__future__"}
    bad = {n for n in imports(path) if top(n) not in allowed}
    assert not bad, f"{path.name} imports {bad}"


def test_torch_free_engine_modules_really_are():
    for name in TORCH_FREE_ENGINE:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert not {n for n in imports(path) if top(n) == "torch" or n.startswith("engine.") and
                    n not in TORCH_FREE_ENGINE}, name
