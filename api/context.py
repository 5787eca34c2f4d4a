"""Typed application keys shared by the handlers (aiohttp's AppKey pattern)."""

from __future__ import annotations

from aiohttp import web

from scheduling.router import Router
from services.batch.runner import BatchRunner
from services.cache.responses import ResponseCache
from services.deployments.manager import ModelManager
from services.deployments.shadow import ShadowMirror
from services.inference.admission import Admission
from services.inference.encoders import Encoders
from services.inference.generation import Inference
from services.observability.alerts import AlertManager
from services.observability.metrics import Metrics
from services.observability.profiling import Profiler
from services.observability.status import ServerStatus
from services.observability.telemetry import ObservabilityConfig, RecentRequests
from services.server_state import ServerState
from services.streams.hub import StreamHub
from storage.db import Database

ROUTER = web.AppKey("router", Router)
STATE = web.AppKey("state", ServerState)
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", Metrics)
MODELS = web.AppKey("models", ModelManager)
SHADOWS = web.AppKey("shadows", ShadowMirror)
RECENT = web.AppKey("recent_requests", RecentRequests)
ALERTS = web.AppKey("alerts", AlertManager)
OBSERVABILITY = web.AppKey("observability", ObservabilityConfig)
TRACING = web.AppKey("tracing", object)  # a telemetry.Tracing, or None when tracing is off
PROFILER = web.AppKey("profiler", Profiler)
STATUS = web.AppKey("status", ServerStatus)  # readiness and the admin page's live stats
HUB = web.AppKey("stream_hub", StreamHub)
INFERENCE = web.AppKey("inference", Inference)
RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
ENCODERS = web.AppKey("encoders", Encoders)
BATCH = web.AppKey("batch_runner", BatchRunner)
DATABASE = web.AppKey("database", Database)  # the wiring's, and readiness reads its write errors
