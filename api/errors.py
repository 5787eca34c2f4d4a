"""Domain errors to HTTP: each `services.errors` class's status, and the one middleware that turns
any error into OpenAI-shaped JSON.

Every error body is `{"error": {"message", "type", "param", "code"}}` with the right status.
"""

from __future__ import annotations

import orjson
import structlog
from aiohttp import web
from pydantic import ValidationError

from services.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    NotImplementedFeatureError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceError,
    ServiceUnavailableError,
)

log = structlog.get_logger(__name__)


STATUS: dict[type[ServiceError], int] = {
    InvalidRequestError: 400, AuthenticationError: 401, PermissionDeniedError: 403, NotFoundError: 404,
    ConflictError: 409, PayloadTooLargeError: 413, RateLimitError: 429, NotImplementedFeatureError: 501,
    ServiceUnavailableError: 503,
}


def status_of(exc: ServiceError) -> int:
    """The HTTP status of a domain error: that of its nearest mapped class, else 500."""
    return next((STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), 500)


def error_headers(exc: ServiceError) -> dict[str, str]:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(exc: ServiceError) -> web.Response:
    return json_response(error_body(exc.message, exc.type, exc.param, exc.code), status_of(exc), error_headers(exc))


class ParamError(ValueError):
    """A check across fields (a model validator) that one parameter fails: `param` names it in the
    400, as a field's own check would by its path."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first problem, named by its parameter path (`messages.0.role`)."""
    first = exc.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ParamError):
        return InvalidRequestError(str(cause), param=cause.param)
    param = ".".join(str(part) for part in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


HTTP_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error",
}


def kept_headers(exc: web.HTTPException) -> dict[str, str]:
    """The exception's own headers (`Allow` on a 405, as RFC 9110 requires), less those of its text body."""
    body_headers = ("content-type", "content-length")
    return {name: value for name, value in exc.headers.items() if name.lower() not in body_headers}


class StreamEnded(Exception):
    """A streamed response the server ended early and already finished on the wire (a final
    error event, then the end of the body): the handler unwinds, the response stands."""

    def __init__(self, response: web.StreamResponse, reason: str) -> None:
        super().__init__(reason)
        self.response = response


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except StreamEnded as exc:
        return exc.response
    except ServiceError as exc:
        return error_response(exc)
    except ValidationError as exc:
        return error_response(validation_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = HTTP_ERROR_TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return json_response(error_body(message, type_), exc.status, kept_headers(exc))
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and client_gone(request):
            return client_closed()  # it left mid-response: a normal end, not a server error
        log.exception("unhandled error", path=request.path)
        return json_response(error_body("internal server error", "internal_error"), 500)


CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never sent


def client_gone(request: web.Request) -> bool:
    """The client has closed the connection (a write to it fails; a stream it stopped reading ends)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def client_closed() -> web.Response:
    """What a handler whose client left ends with: the access log shows 499, and aiohttp, finding
    the connection closed when it writes this, drops it quietly."""
    return web.Response(status=CLIENT_CLOSED, reason="Client Closed Request")
