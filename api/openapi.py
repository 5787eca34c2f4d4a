"""Builds `/openapi.json` from the route table and the pydantic models it names.

The document is the contract the handlers keep (a schemathesis run in tests/api/test_openapi_contract.py
holds them to it): bodies, query strings and headers are the models `api.validation` parses them
with, path parameters come from the route's template, each operation lists the statuses it can
answer and the key it needs under this server's auth setting (see `api.auth.auth_middleware`).
WebSocket routes are left out: OpenAPI cannot describe a conversation over a socket (docs/api.md has it).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api.auth import ADMIN_PATH, DEPLOYMENTS_PATH, PUBLIC_PATHS, TENANT_PATHS, WS_PATH
from api.openai.objects import ErrorResponse
from api.routes import Route

REF = "#/components/schemas/{model}"
STATUS_TEXT = {
    200: "OK", 201: "Created", 202: "Accepted: it runs in the background",
    400: "Invalid request: the body, a parameter, or a rule the model or key sets (context length, vocabulary, "
         "the key's max_tokens)",
    401: "Missing, unknown or revoked key", 403: "Not allowed for this key (a tenant key on the admin API, "
    "a model or priority the tenant may not use)", 404: "Not found", 409: "Conflicts with the current state",
    413: "Body too large", 429: "Over a rate, token or concurrency limit, or the queue is full; see Retry-After",
    503: "Not ready or draining, or the model is loading, unloading or failed to load",
}
PATH_PARAM = re.compile(r"{(\w+)(?::[^{}]+)?}")  # aiohttp's `{name}` or `{name:regex}`


def build_spec(routes: list[Route], title: str, version: str, auth_enabled: bool = False) -> dict:
    routes = [r for r in routes if not r.path.startswith(WS_PATH)]
    request_models = {m for r in routes for m in (r.request, r.query, r.headers) if m is not None}
    models = request_models | {ErrorResponse} | {
        m for r in routes for m in (r.response, r.stream_response, r.error_body) if m}
    _, schema = models_json_schema(
        [(m, "validation" if m in request_models else "serialization") for m in models], ref_template=REF)
    components = {name: drop_null_defaults(s) for name, s in schema.get("$defs", {}).items()}
    paths: dict[str, dict] = {}
    for route in routes:
        path = PATH_PARAM.sub(r"{\1}", route.path)
        paths.setdefault(path, {})[route.method.lower()] = operation(route, components, auth_enabled)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "A tenant API key, or the admin key on /admin/api/ "
                                           "(and on deployment changes when auth is on)"}},
        },
    }


def drop_null_defaults(schema: Any) -> Any:
    """`Field(None)` on a field that may be left out but never sent as null: pydantic writes
    `"default": null` beside a type that excludes null; the default is "absent", so drop it."""
    if isinstance(schema, dict):
        schema = {key: drop_null_defaults(value) for key, value in schema.items()}
        if "default" in schema and schema["default"] is None and not admits_null(schema):
            del schema["default"]
    elif isinstance(schema, list):
        schema = [drop_null_defaults(item) for item in schema]
    return schema


def admits_null(schema: dict) -> bool:
    types = schema.get("type")
    if types == "null" or (isinstance(types, list) and "null" in types):
        return True
    return any(admits_null(option) for option in schema.get("anyOf", []) + schema.get("oneOf", []))


def ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def key_needed(route: Route, auth_enabled: bool) -> str | None:
    """"admin", "tenant" or None: what `auth_middleware` asks of this route."""
    if route.path.startswith(ADMIN_PATH):
        return "admin"
    if auth_enabled and route.path.startswith(DEPLOYMENTS_PATH) and route.method not in ("GET", "HEAD"):
        return "admin"
    if auth_enabled and route.path.startswith(TENANT_PATHS) and not route.path.startswith(PUBLIC_PATHS):
        return "tenant"
    return None


def names_model(route: Route) -> bool:
    """A generation or encoder route: the body or the path names a model the tenant must be allowed."""
    in_body = route.request is not None and "model" in route.request.model_fields
    return in_body or route.path.startswith("/api/v1/models/")


def error_statuses(route: Route, key: str | None) -> set[int]:
    statuses = set(route.errors)
    if route.request or route.query or route.headers:
        statuses.add(400)
    if route.request:
        statuses.add(413)
    if key:
        statuses.add(401)
    if key == "admin" or names_model(route):
        statuses.add(403)
    if "{" in route.path or names_model(route):
        statuses.add(404)
    if names_model(route) and route.method == "POST":
        statuses |= {429, 503}  # 503: models loading at startup, a version that failed to load, draining
    return statuses


def parameters(route: Route, components: dict[str, dict]) -> list[dict]:
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[^/]+$"}}
              for name in PATH_PARAM.findall(route.path)]
    for where, model in (("query", route.query), ("header", route.headers)):
        if model is None:
            continue
        for name, prop in components[model.__name__]["properties"].items():
            param = {"name": name, "in": where, "required": name in components[model.__name__].get("required", ()),
                     "schema": {k: v for k, v in prop.items() if k not in ("title", "description")}}
            if "description" in prop:
                param["description"] = prop["description"]
            params.append(param)
    return params


def success_content(route: Route) -> dict[str, dict]:
    if route.response is not None:
        content = {route.content_type: {"schema": ref(route.response)}}
    elif route.content_type == "text/html":
        content = {route.content_type: {"schema": {"type": "string"}}}
    else:
        content = {route.content_type: {"schema": {}}}
    if route.stream_response is not None:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
            "description": f"Each `data:` line holds a {route.stream_response.__name__} as JSON; the last is [DONE].",
        }}
    return content


def operation(route: Route, components: dict[str, dict], auth_enabled: bool) -> dict:
    key = key_needed(route, auth_enabled)
    responses: dict[str, dict] = {str(route.status): {"description": STATUS_TEXT[route.status],
                                                      "content": success_content(route)}}
    error = {"content": {"application/json": {"schema": ref(route.error_body or ErrorResponse)}}}
    for status in sorted(error_statuses(route, key)):
        responses[str(status)] = {"description": STATUS_TEXT[status], **error}
    op: dict = {"summary": route.summary, "operationId": route.handler.__name__, "responses": responses,
                "security": [{"bearer": []}] if key else []}
    if key is None and route.path.startswith(DEPLOYMENTS_PATH):
        op["security"] = [{}, {"bearer": []}]  # the admin key, if sent, shows every deployment in full
    params = parameters(route, components)
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(route.request)}}}
    return op
