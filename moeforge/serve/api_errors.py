"""HTTP errors in the OpenAI API's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; ``install_error_handlers`` turns it, FastAPI's request-validation errors (a 400
here, as OpenAI answers, not FastAPI's 422) and any unexpected exception (500) into that body.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeforge.serve.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

# The engine's SamplingParams field -> the request field the client sent.
_PARAM_NAMES = {"stop_strings": "stop"}


class APIError(Exception):
    """An error response: HTTP ``status``, OpenAI ``type`` / ``code``, the offending ``param`` if any."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code, self.headers = code, headers

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, param=param)

    @classmethod
    def from_engine(cls, exc: Exception) -> APIError:
        """A request the engine refused (``RequestError``, ``SamplingParamsError``): a 400 with its reason."""
        field = getattr(exc, "param", None)  # SamplingParamsError, RequestError: the field at fault
        param = _PARAM_NAMES.get(field, field) if isinstance(field, str) else None
        return cls(400, str(exc), param=param)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                              headers=self.headers)


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# Refusals counted in request_rejected_total, by status (a 499 is the client leaving, a 500 a request that ran).
_REJECT_REASONS = {400: "invalid", 404: "invalid", 413: "invalid", 429: "queue_full", 503: "shutting_down"}


def _count_rejection(request: Request, status: int) -> None:
    """A refused API request (``/v1/*``: not a probe of another path, such as /favicon.ico) counts by reason."""
    server = getattr(request.app.state, "server", None)
    reason = _REJECT_REASONS.get(status)
    if server is not None and reason is not None and request.url.path.startswith("/v1/"):
        server.metrics.reject(reason)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        _count_rejection(request, exc.status)
        return exc.response()

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        _count_rejection(request, 400)
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [part for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        # loc is ("body", field, [union member], ...): the field is the param; a union reports once per member.
        param = str(loc[0]) if loc and isinstance(loc[0], str) else None
        same = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
        detail = "; ".join(dict.fromkeys(str(e.get("msg")) for e in same[:4]))
        return error_response(400, f"invalid {param or 'request'}: {detail}", param=param)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        _count_rejection(request, exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__}: {exc})", type="server_error")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
