"""The import direction of DESIGN.md, checked on the source:
server.py -> api -> services -> scheduling -> torch-free engine.types; storage below services."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_ENGINE = {"engine.types", "engine.kv_cache", "engine.block_pool", "engine.prefix_hash", "engine.grammar"}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports count too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from api import x`
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


def torch_or_engine_internals(name: str) -> bool:
    return top(name) == "torch" or (top(name) == "engine" and not any(
        name == m or name.startswith(m + ".") for m in TORCH_FREE_ENGINE) and name != "engine")


def violations(path: Path, forbidden: set[str], torch_free: bool = True) -> set[str]:
    found = {n for n in imports(path) if top(n) in forbidden}
    if torch_free:
        found |= {n for n in imports(path) if torch_or_engine_internals(n)}
    return found


@pytest.mark.parametrize("path", modules("api"), ids=str)
def test_api_speaks_http_and_calls_only_services(path):
    """A handler parses, makes one service call, renders: it never reaches past the services."""
    bad = violations(path, {"storage", "scheduling", "launch", "config"})
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules("services"), ids=str)
def test_services_know_no_http(path):
    """Services raise domain errors (services/errors.py) that api/errors.py maps to statuses."""
    bad = violations(path, {"aiohttp", "api", "launch", "config"})
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules("scheduling"), ids=str)
def test_scheduling_is_policy_only(path):
    bad = violations(path, {"aiohttp", "api", "services", "storage"})
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules("engine"), ids=str)
def test_engine_never_imports_the_server_side(path):
    bad = violations(path, {"aiohttp", "api", "services", "scheduling", "storage"}, torch_free=False)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules("storage"), ids=str)
def test_storage_uses_only_stdlib_and_sqlite_utils(path):
    allowed = set(sys.stdlib_module_names) | {"sqlite_utils", "storage", "__future__"}
    bad = {n for n in imports(path) if top(n) not in allowed}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_config_never_imports_api():
    bad = {n for n in imports(ROOT / "config.py") if top(n) == "api"}
    assert not bad, f"config.py imports {sorted(bad)}"


def test_torch_free_engine_modules_really_are():
    for name in TORCH_FREE_ENGINE:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert not {n for n in imports(path) if torch_or_engine_internals(n)}, name


@pytest.mark.parametrize("package", ["api", "services", "scheduling", "storage", "engine"])
def test_the_rules_see_every_module(package):
    """A package the rules above would silently skip (a folder without __init__.py) is a defect."""
    for folder in {p.parent for p in modules(package)}:
        assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has no __init__.py"


def test_a_violation_is_caught(tmp_path):
    """The checker itself: a service importing aiohttp, an api module importing storage."""
    bad = tmp_path / "bad.py"
    bad.write_text("import aiohttp\ndef f():\n    from storage import db\n    from engine.worker import X\n")
    assert violations(bad, {"aiohttp"}) == {"aiohttp", "engine.worker", "engine.worker.X"}
    assert violations(bad, {"storage"}) >= {"storage", "storage.db"}
