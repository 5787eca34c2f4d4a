"""Domain errors: what a service refuses, or could not finish, in words a caller may read.

Services raise these and know nothing of HTTP; `api/errors.py` maps each class to its status
and OpenAI-shaped body (`{"error": {"message", "type", "param", "code"}}`). The names follow
the OpenAI SDK's error classes, so a reader of either side recognises them.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A failure with a message safe to show the caller (never exception text of ours)."""

    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s  # when retrying may succeed (overload, a model loading, a drain)
        if code is not None:
            self.code = code


class InvalidRequestError(ServiceError):
    type = "invalid_request_error"


class NotFoundError(ServiceError):
    type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    type = "invalid_request_error"
    code = "model_not_found"


class ConflictError(ServiceError):
    type = "conflict_error"


class PayloadTooLargeError(ServiceError):
    type = "invalid_request_error"


class AuthenticationError(ServiceError):
    type = "authentication_error"


class PermissionDeniedError(ServiceError):
    type = "permission_error"


class RateLimitError(ServiceError):
    type = "rate_limit_error"


class QueueFullError(RateLimitError):
    code = "queue_full"


class ServiceUnavailableError(ServiceError):
    type = "service_unavailable"


class NotImplementedFeatureError(ServiceError):
    type = "not_implemented"


def rate_limited(rejection) -> RateLimitError:
    """A tenant limit's refusal (`scheduling.limiter.Rejected`) as a rate-limit error with its wait."""
    return RateLimitError(str(rejection), code=rejection.reason, retry_after_s=rejection.retry_after_s)


SHUTTING_DOWN = "server_shutting_down"  # the code of what the end of a drain interrupts: retry elsewhere or later

DRAINING_RETRY_AFTER_S = 5  # a draining server's Retry-After: about a restart's time
