"""Builds `/openapi.json` from the route table and the pydantic models it names."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api.routes import Route
from api.schemas import ErrorResponse

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or unknown API key",
                  "403": "Not allowed for this key", "404": "Not found", "413": "Body too large",
                  "429": "Overloaded or over a limit; see Retry-After", "503": "Not ready, draining or queue timeout"}


def build_spec(routes: list[Route], title: str, version: str) -> dict:
    models: set[type[BaseModel]] = {ErrorResponse}
    for route in routes:
        models.update(m for m in (route.request, route.response, route.stream_response) if m is not None)
    _, schema = models_json_schema(
        [(m, "validation" if any(m is r.request for r in routes) else "serialization") for m in models],
        ref_template=REF,
    )
    paths: dict[str, dict] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "A tenant API key (or the admin key on /admin/api)"}},
        },
        "security": [{"bearer": []}],
    }


def ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def operation(route: Route) -> dict:
    content: dict[str, dict] = {}
    if route.response is not None:
        content[route.content_type] = {"schema": ref(route.response)}
    else:
        content[route.content_type] = {"schema": {}}
    if route.stream_response is not None:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
            "description": f"Each `data:` line holds a {route.stream_response.__name__} as JSON; the last is [DONE].",
        }}
    responses: dict[str, dict] = {"200": {"description": "OK", "content": content}}
    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
    for status, text in ERROR_STATUSES.items():
        if route.request is not None or status == "503":
            responses[status] = {"description": text, **error}
    op: dict = {"summary": route.summary, "operationId": route.handler.__name__, "responses": responses}
    if route.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(route.request)}}}
    return op
