"""OpenAI-shaped errors: one exception type carrying status, type, param, code; its JSON body.

Handlers raise ApiError; the error middleware in gateway/app.py turns it (and aiohttp's own
HTTP exceptions, and anything unexpected) into {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import random

import msgspec
from aiohttp import web

RETRY_JITTER = 0.5  # a retry delay is drawn from [1 - j, 1 + j] x the configured one, so clients do not retry in step

# status -> (type, default code), as the OpenAI API names them
KINDS = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", None),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable_error", "service_unavailable"),
    504: ("timeout_error", "request_timeout"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        kind, default_code = KINDS.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
        self.type = type or kind
        self.code = code if code is not None else default_code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def retry_headers(self) -> dict[str, str]:
        """Retry-After, jittered so rejected clients spread their retries; retry-after-ms (read by the openai SDK)
        carries it exactly, Retry-After in whole seconds (at least 1). None ({}) without retry_after."""
        if self.retry_after is None:
            return {}
        ms = max(1, round(self.retry_after * random.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER) * 1000))
        return {"Retry-After": str(max(1, round(ms / 1000))),  # (from ms: 1499.6 ms was 1 s but 1,500 ms)
                "retry-after-ms": str(ms)}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.retry_headers())

    def sse(self) -> bytes:
        """The error as an SSE event, for a stream that already began (the openai SDK raises it)."""
        return b"data: " + msgspec.json.encode(self.body()) + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
