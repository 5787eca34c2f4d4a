from __future__ import annotations

import pytest

from storage.db import Database
from tests.models import FAMILIES, save_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture
def db(tmp_path):
    """A real SQLite file in the test's data dir."""
    database = Database(tmp_path / "data" / "galley.db")
    yield database
    database.close()
