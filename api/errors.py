"""Domain errors and the one middleware that turns any error into OpenAI-shaped JSON.

Every error body is `{"error": {"message", "type", "param", "code"}}` with the right status.
"""

from __future__ import annotations

import orjson
import structlog
from aiohttp import web
from pydantic import ValidationError

log = structlog.get_logger(__name__)


class APIError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if code is not None:
            self.code = code


class InvalidRequestError(APIError):
    status = 400
    type = "invalid_request_error"


class NotFoundError(APIError):
    status = 404
    type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    type = "invalid_request_error"
    code = "model_not_found"


class ConflictError(APIError):
    status = 409
    type = "conflict_error"


class PayloadTooLargeError(APIError):
    status = 413
    type = "invalid_request_error"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"


class PermissionDeniedError(APIError):
    status = 403
    type = "permission_error"


class RateLimitError(APIError):
    status = 429
    type = "rate_limit_error"


def rate_limited(rejection) -> RateLimitError:
    """A tenant limit's refusal (`scheduling.admission.Rejected`) as its 429 with Retry-After."""
    return RateLimitError(str(rejection), code=rejection.reason, headers={"Retry-After": str(rejection.retry_after_s)})


class QueueFullError(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class ServiceUnavailableError(APIError):
    status = 503
    type = "service_unavailable"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(exc: APIError) -> web.Response:
    return json_response(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, exc.headers)


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first problem, named by its parameter path (`messages.0.role`)."""
    first = exc.errors()[0]
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
    except APIError as exc:
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


SHUTTING_DOWN = "server_shutting_down"  # the code of what the end of a drain interrupts: 503, retry elsewhere or later

CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never sent


def client_gone(request: web.Request) -> bool:
    """The client has closed the connection (a write to it fails; a stream it stopped reading ends)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def client_closed() -> web.Response:
    """What a handler whose client left ends with: the access log shows 499, and aiohttp, finding
    the connection closed when it writes this, drops it quietly."""
    return web.Response(status=CLIENT_CLOSED, reason="Client Closed Request")
