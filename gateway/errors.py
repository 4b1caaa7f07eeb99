"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`).

The statuses are those of docs/architecture.md, contract 6.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragspeed.engine.protocol import EngineError

logger = logging.getLogger("ragspeed.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union-branch names ("str", "list[...]", a model's class name such as
    # "DocumentCacheIn") from the parameter path: every wire field is snake_case.
    loc = [p for p in loc if not (p[:1].islower() and ("[" in p or p in {"str", "int", "float"}))]
    loc = [p for p in loc if not p[:1].isupper()]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    if err.get("type") == "missing":
        return f"missing required parameter '{param}'", param
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"invalid value for '{param}': {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
