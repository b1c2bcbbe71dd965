"""Errors as OpenAI's error object, with the HTTP status the gRPC API's code maps to.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``: the
shape the official clients parse (``openai.BadRequestError`` and friends).
"""

from __future__ import annotations

from http import HTTPStatus

import grpc
from fastapi.responses import JSONResponse

from services.frontend.async_llm import RequestFailedError
from services.frontend.auth import AuthError
from services.common.validation import ValidationError

# The gRPC API's status codes (ARCHITECTURE.md) and the HTTP status of each.
HTTP_STATUS_BY_GRPC_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}


class HTTPError(Exception):
    """A request the HTTP layer itself refuses (e.g. an unknown model)."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: HTTPStatus, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": code if code is not None else int(status)}}


def error_of(exc: Exception) -> HTTPError:
    """The HTTP error for what the shared code paths raise (anything else: 500)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ValidationError):
        return HTTPError(HTTPStatus.BAD_REQUEST, str(exc), param=exc.field)
    if isinstance(exc, RequestFailedError):
        status = HTTP_STATUS_BY_GRPC_CODE.get(exc.code, HTTPStatus.INTERNAL_SERVER_ERROR)
        return HTTPError(status, exc.message)
    if isinstance(exc, AuthError):
        if exc.forbidden:
            return HTTPError(HTTPStatus.FORBIDDEN, exc.message)
        return HTTPError(HTTPStatus.UNAUTHORIZED, exc.message, code="invalid_api_key")
    return HTTPError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}")


def error_response(exc: Exception, headers: dict[str, str] | None = None) -> JSONResponse:
    error = error_of(exc)
    if error.status == HTTPStatus.UNAUTHORIZED:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=headers)
