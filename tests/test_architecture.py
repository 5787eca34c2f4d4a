"""The import direction of docs/architecture.md, checked on the source:
server.py -> api -> services -> scheduling -> torch-free engine.types; storage below services.
Inside services/, areas form layers (no two import each other); api/ reaches each area through its
façade (`services.<area>`); no source file holds more than 400 lines."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_ENGINE = {"engine.types", "engine.kv_cache", "engine.block_pool", "engine.prefix_hash", "engine.grammar"}


def imports(path: Path, with_names: bool = True) -> set[str]:
    """Every module a file imports, at any depth (function-local imports count too); `with_names`:
    and each name imported from one (`from api import x` -> `api.x`, which may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if with_names:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


def api_reaches_past_a_facade(path: Path) -> set[str]:
    """The services modules `path` imports below an area's façade (`services.<area>`)."""
    return {n for n in imports(path, with_names=False) if top(n) == "services" and len(n.split(".")) > 2}


@pytest.mark.parametrize("path", modules("api"), ids=str)
def test_api_reaches_services_through_their_facades(path):
    """`from services.inference import ChatInput`, never `from services.inference.requests import ...`:
    an area's package (its `__init__`) is what api/ may see of it."""
    bad = api_reaches_past_a_facade(path)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def area_of(name: str) -> str | None:
    """The services area a module name belongs to: `services.inference.generation` -> `inference`."""
    parts = name.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 else None


def area_imports() -> dict[str, dict[str, set[str]]]:
    """area -> the other areas it imports -> the files that do."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in modules("services"):
        relative = path.relative_to(ROOT).with_suffix("")
        area = relative.parts[1]
        for name in imports(path):
            other = area_of(name)
            if other is not None and other != area:
                found.setdefault(area, {}).setdefault(other, set()).add(str(relative))
    return found


def test_services_areas_never_import_each_other_back():
    """A primitive two areas share sits below both (services.answers, .admission, .sampling, .errors),
    not inside the area that sits on top of them."""
    found = area_imports()
    cycles = [(a, b, sorted(files), sorted(found[b][a])) for a, others in found.items() for b, files in others.items()
              if a < b and a in found.get(b, {})]
    assert not cycles, cycles


SOURCE_GLOBS = ("*.py", "*.js", "*.html", "*.css", "*.sh")
KERNELS = ("engine/csrc",)  # C++ kernels: one op per file, a file may be long


def test_no_source_file_over_400_lines():
    tracked = subprocess.run(["git", "ls-files", *SOURCE_GLOBS], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    long = {name: n for name in tracked if not name.startswith(KERNELS) and (ROOT / name).exists()
            and (n := len((ROOT / name).read_text().splitlines())) > 400}
    assert not long, long


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


SOURCE_PACKAGES = ("api", "services", "scheduling", "storage", "engine")


def source_modules() -> list[Path]:
    return [p for package in SOURCE_PACKAGES for p in modules(package)] + [
        ROOT / name for name in ("server.py", "launch.py", "config.py")]


def test_no_two_classes_share_a_name():
    """One word per concept (the glossary in docs/architecture.md): two classes of one name are one
    concept written twice, or two concepts under one word."""
    seen: dict[str, list[str]] = {}
    for path in source_modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


def test_modules_share_a_name_only_as_the_glossary_says():
    """A module name used twice is one idea in two layers (or two front doors), listed in the glossary."""
    names: dict[str, list[str]] = {}
    for path in source_modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    repeated = {name for name, paths in names.items() if len(paths) > 1}
    glossary = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`([a-z_]+\.py)`", glossary.split("MODULES NAMED ALIKE:")[1].split("(the test")[0]))
    assert repeated == listed, {"not in the glossary": sorted(repeated - listed),
                                "no longer repeated": sorted(listed - repeated)}
