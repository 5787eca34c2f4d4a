"""The model registry and deployments: tables `model_versions`, `deployments`, `deployment_events`,
`deployment_shadows`.

A model version is (name, version) with its source (a local folder or a hub id), its kind
(generate / embed / classify), its options and its lifecycle state. A deployment maps a
model name to its traffic split {version: percent} (summing to 100), its stable version and
the stable version before that (what a rollback returns to); every change is appended to
`deployment_events`. A deployment may have a shadow (`deployment_shadows`): a version that
gets a copy of some of its traffic. Sync functions over a `sqlite_utils.Database` (writes belong
on the writer thread), and `RegistryStore`, through which the rest of galley reaches them. Must
not import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlite_utils

from storage.tenants import utc_now

if TYPE_CHECKING:
    from storage.db import Database  # storage.db imports this module for its migrations

KINDS = ("generate", "embed", "classify", "onnx", "tabular", "image-classify", "torch")
STATES = ("unloaded", "loading", "ready", "failed")
EVENT_KINDS = ("deploy", "traffic", "rollback", "auto_rollback")


class VersionExistsError(Exception):
    pass


class VersionNotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class ModelVersion:
    """Invariant: kind in KINDS, state in STATES; `error` set only when failed. Its options were checked
    where they came in (`services.deployments.options`)."""

    name: str
    version: str
    source: str
    kind: str = "generate"
    options: dict[str, Any] = field(default_factory=dict)
    state: str = "unloaded"
    error: str | None = None
    created_at: str = field(default_factory=utc_now)
    updated_at: str = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        if not self.name or "@" in self.name or not self.version or "@" in self.version:
            raise ValueError("name and version must be non-empty and must not contain '@'")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def pinned(self) -> bool:
        return bool(self.options.get("pinned", False))


@dataclass(frozen=True)
class Deployment:
    """Invariant: traffic percents are >= 0 and sum to 100; stable is in traffic."""

    model_name: str
    traffic: dict[str, int]
    stable_version: str
    previous_stable_version: str | None = None
    updated_at: str = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        check_traffic(self.traffic)
        if self.stable_version not in self.traffic:
            raise ValueError(f"stable version {self.stable_version!r} is not in the traffic split")


@dataclass(frozen=True)
class DeploymentEvent:
    id: int
    model_name: str
    kind: str
    traffic_before: dict[str, int] | None
    traffic_after: dict[str, int]
    reason: str | None
    created_at: str


def check_traffic(traffic: Mapping[str, int]) -> None:
    if not traffic:
        raise ValueError("the traffic split is empty")
    if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in traffic.values()):
        raise ValueError("traffic percents must be integers >= 0")
    if sum(traffic.values()) != 100:
        raise ValueError(f"traffic percents must sum to 100, not {sum(traffic.values())}")


# ---- schema ----------------------------------------------------------------------------


def widen_model_kinds(db: sqlite_utils.Database) -> None:
    """Migration: `model_versions.kind` takes every kind of KINDS (SQLite cannot change a CHECK in place,
    so the table is copied into one with the new check)."""
    kinds = ", ".join(f"'{k}'" for k in KINDS)
    states = ", ".join(f"'{s}'" for s in STATES)
    db.execute(f"""
        CREATE TABLE model_versions_widened (
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            source TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ({kinds})),
            options TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ({states})),
            error TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            PRIMARY KEY (name, version)
        )""")
    db.execute("INSERT INTO model_versions_widened SELECT name, version, source, kind, options, state, error, "
               "created_at, updated_at FROM model_versions")
    db.execute("DROP TABLE model_versions")
    db.execute("ALTER TABLE model_versions_widened RENAME TO model_versions")


def create_registry_tables(db: sqlite_utils.Database) -> None:
    """Migration: model versions, deployments and their change log (kinds as they were then:
    `widen_model_kinds` allows today's)."""
    kinds = "'generate', 'embed', 'classify'"
    states = ", ".join(f"'{s}'" for s in STATES)
    events = ", ".join(f"'{e}'" for e in EVENT_KINDS)
    db.execute(f"""
        CREATE TABLE model_versions (
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            source TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ({kinds})),
            options TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ({states})),
            error TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            PRIMARY KEY (name, version)
        )""")
    db.execute("""
        CREATE TABLE deployments (
            model_name TEXT PRIMARY KEY,
            traffic TEXT NOT NULL,
            stable_version TEXT NOT NULL,
            previous_stable_version TEXT,
            updated_at TEXT NOT NULL
        )""")
    db.execute(f"""
        CREATE TABLE deployment_events (
            id INTEGER PRIMARY KEY,
            model_name TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ({events})),
            traffic_before TEXT,
            traffic_after TEXT NOT NULL,
            reason TEXT,
            created_at TEXT NOT NULL
        )""")
    db.execute("CREATE INDEX deployment_events_model ON deployment_events(model_name, id)")


# ---- model versions --------------------------------------------------------------------


def version_from_row(row: Mapping[str, Any]) -> ModelVersion:
    return ModelVersion(**{**row, "options": json.loads(row["options"])})


def add_version(db: sqlite_utils.Database, version: ModelVersion) -> ModelVersion:
    """Registers a version; VersionExistsError if (name, version) is taken."""
    if get_version(db, version.name, version.version) is not None:
        raise VersionExistsError(version.ref)
    row = {**version.__dict__, "options": json.dumps(version.options, sort_keys=True)}
    db.table("model_versions").insert(row)
    return version


def get_version(db: sqlite_utils.Database, name: str, version: str) -> ModelVersion | None:
    rows = list(db.query("SELECT * FROM model_versions WHERE name = ? AND version = ?", [name, version]))
    return version_from_row(rows[0]) if rows else None


def list_versions(db: sqlite_utils.Database, name: str | None = None) -> list[ModelVersion]:
    """Every version (of `name`, if given), by name then registration order."""
    where, args = ("WHERE name = ?", [name]) if name is not None else ("", [])
    rows = db.query(f"SELECT * FROM model_versions {where} ORDER BY name, created_at, rowid", args)
    return [version_from_row(row) for row in rows]


def set_state(db: sqlite_utils.Database, name: str, version: str, state: str,
              error: str | None = None) -> ModelVersion:
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}")
    cursor = db.execute("UPDATE model_versions SET state = ?, error = ?, updated_at = ? WHERE name = ? AND version = ?",
                        [state, error if state == "failed" else None, utc_now(), name, version])
    if cursor.rowcount == 0:
        raise VersionNotFoundError(f"{name}@{version}")
    return get_version(db, name, version)


def set_options(db: sqlite_utils.Database, name: str, version: str, options: Mapping[str, Any]) -> ModelVersion:
    cursor = db.execute("UPDATE model_versions SET options = ?, updated_at = ? WHERE name = ? AND version = ?",
                        [json.dumps(dict(options), sort_keys=True), utc_now(), name, version])
    if cursor.rowcount == 0:
        raise VersionNotFoundError(f"{name}@{version}")
    return get_version(db, name, version)


def reset_states(db: sqlite_utils.Database) -> None:
    """At startup nothing is loaded yet: every version is unloaded (failures keep their error)."""
    db.execute("UPDATE model_versions SET state = 'unloaded', updated_at = ? WHERE state IN ('loading', 'ready')",
               [utc_now()])


# ---- deployments -----------------------------------------------------------------------


def deployment_from_row(row: Mapping[str, Any]) -> Deployment:
    return Deployment(**{**row, "traffic": json.loads(row["traffic"])})


def get_deployment(db: sqlite_utils.Database, model_name: str) -> Deployment | None:
    rows = list(db.query("SELECT * FROM deployments WHERE model_name = ?", [model_name]))
    return deployment_from_row(rows[0]) if rows else None


def list_deployments(db: sqlite_utils.Database) -> list[Deployment]:
    return [deployment_from_row(row) for row in db.query("SELECT * FROM deployments ORDER BY model_name")]


def save_deployment(db: sqlite_utils.Database, deployment: Deployment, kind: str,
                    reason: str | None = None) -> Deployment:
    """Writes the deployment and appends the change to its event log, in one transaction."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind must be one of {EVENT_KINDS}")
    before = get_deployment(db, deployment.model_name)
    row = {**deployment.__dict__, "traffic": json.dumps(deployment.traffic, sort_keys=True), "updated_at": utc_now()}
    db.table("deployments").upsert(row, pk="model_name")
    db.table("deployment_events").insert({
        "model_name": deployment.model_name, "kind": kind,
        "traffic_before": json.dumps(before.traffic, sort_keys=True) if before else None,
        "traffic_after": row["traffic"], "reason": reason, "created_at": row["updated_at"],
    })
    return get_deployment(db, deployment.model_name)


def list_events(db: sqlite_utils.Database, model_name: str | None = None, limit: int = 100) -> list[DeploymentEvent]:
    """The most recent changes first."""
    where, args = ("WHERE model_name = ?", [model_name]) if model_name is not None else ("", [])
    rows = db.query(f"SELECT * FROM deployment_events {where} ORDER BY id DESC LIMIT ?", [*args, limit])
    return [DeploymentEvent(**{**row, "traffic_before": json.loads(row["traffic_before"] or "null"),
                               "traffic_after": json.loads(row["traffic_after"])}) for row in rows]


# ---- shadow traffic --------------------------------------------------------------------


@dataclass(frozen=True)
class Shadow:
    """A deployment's mirror: `percent` of its stable version's requests also run on `version`,
    whose outputs are logged, never returned. Invariant: 1 <= percent <= 100."""

    model_name: str
    version: str
    percent: int
    updated_at: str = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        if isinstance(self.percent, bool) or not isinstance(self.percent, int) or not 1 <= self.percent <= 100:
            raise ValueError(f"shadow percent must be an integer in [1, 100], not {self.percent!r}")


def create_shadow_table(db: sqlite_utils.Database) -> None:
    """Migration: one shadow per deployment at most (no row: none)."""
    db.execute("""
        CREATE TABLE deployment_shadows (
            model_name TEXT PRIMARY KEY,
            version TEXT NOT NULL,
            percent INTEGER NOT NULL CHECK (percent BETWEEN 1 AND 100),
            updated_at TEXT NOT NULL
        )""")


def set_shadow(db: sqlite_utils.Database, shadow: Shadow) -> Shadow:
    db.table("deployment_shadows").upsert({**shadow.__dict__, "updated_at": utc_now()}, pk="model_name")
    return get_shadow(db, shadow.model_name)


def clear_shadow(db: sqlite_utils.Database, model_name: str) -> None:
    db.execute("DELETE FROM deployment_shadows WHERE model_name = ?", [model_name])


def get_shadow(db: sqlite_utils.Database, model_name: str) -> Shadow | None:
    rows = list(db.query("SELECT * FROM deployment_shadows WHERE model_name = ?", [model_name]))
    return Shadow(**rows[0]) if rows else None


def list_shadows(db: sqlite_utils.Database) -> list[Shadow]:
    return [Shadow(**row) for row in db.query("SELECT * FROM deployment_shadows ORDER BY model_name")]


# ---- the store -------------------------------------------------------------------------


class RegistryStore:
    """Model versions, deployments and shadows in one database: the only way the rest of galley
    reaches these tables.

    Reads block (from asyncio, call them through `asyncio.to_thread`); writes run on the
    writer thread and return its `Future`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def restore(self, seed: Sequence[ModelVersion], reason: str) -> Future[tuple[list[ModelVersion], list[Deployment]]]:
        """At startup, in one transaction: every version unloaded (`reset_states`), each seed version
        registered unless it is, a model with no deployment deployed at its seed version (all of the
        traffic, `reason` in the event log); then every version and deployment."""
        specs = list(seed)

        def restore(db: sqlite_utils.Database) -> tuple[list[ModelVersion], list[Deployment]]:
            reset_states(db)
            for spec in specs:
                if get_version(db, spec.name, spec.version) is None:
                    add_version(db, spec)
                if get_deployment(db, spec.name) is None:
                    save_deployment(db, Deployment(spec.name, {spec.version: 100}, spec.version), "deploy", reason)
            return list_versions(db), list_deployments(db)

        return self.db.write(restore)

    def register(self, spec: ModelVersion, deploy_reason: str | None = None) -> Future[Deployment | None]:
        """Registers a version (VersionExistsError if taken); with `deploy_reason`, also deploys it
        with all of its model's traffic, in the same transaction, and returns that deployment."""
        def register(db: sqlite_utils.Database) -> Deployment | None:
            add_version(db, spec)
            if deploy_reason is None:
                return None
            return save_deployment(db, Deployment(spec.name, {spec.version: 100}, spec.version), "deploy",
                                   deploy_reason)

        return self.db.write(register)

    def set_state(self, name: str, version: str, state: str, error: str | None = None) -> Future[ModelVersion]:
        return self.db.write(lambda db: set_state(db, name, version, state, error))

    def set_options(self, name: str, version: str, options: Mapping[str, Any]) -> Future[ModelVersion]:
        return self.db.write(lambda db: set_options(db, name, version, options))

    def save_deployment(self, deployment: Deployment, kind: str, reason: str | None = None) -> Future[Deployment]:
        return self.db.write(lambda db: save_deployment(db, deployment, kind, reason))

    def events(self, model_name: str | None = None, limit: int = 100) -> list[DeploymentEvent]:
        return self.db.read(lambda db: list_events(db, model_name, limit))

    def shadows(self) -> list[Shadow]:
        return self.db.read(list_shadows)

    def set_shadow(self, shadow: Shadow) -> Future[Shadow]:
        return self.db.write(lambda db: set_shadow(db, shadow))

    def clear_shadow(self, model_name: str) -> Future[None]:
        return self.db.write(lambda db: clear_shadow(db, model_name))
