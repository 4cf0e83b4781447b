"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every refusal the server makes is an `APIError`; `InvalidInput` from the door of the engine becomes a 400
naming its field (mapped to the request's own parameter name), and a request body that does not parse is a
400 naming the first offending key.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from jaxinfer.errors import InvalidInput


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def unauthorized() -> APIError:
    return APIError(401, "Missing or wrong API key: send it as 'Authorization: Bearer <key>'.",
                    type="authentication_error", code="invalid_api_key")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist here; this server serves {served!r}.",
                    param="model", code="model_not_found")


def context_too_long(tokens: int, max_model_len: int, param: str) -> APIError:
    return APIError(413, f"The prompt has {tokens} tokens; this model's context is {max_model_len} tokens, and at "
                         f"least one must be left to generate (at most {max_model_len - 1} prompt tokens).",
                    param=param, code="context_length_exceeded")


def overloaded(waiting: int, limit: int) -> APIError:
    return APIError(503, f"The server is overloaded: {waiting} requests are waiting (at most {limit}); retry later.",
                    type="server_error", code="server_overloaded")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type="server_error", code="shutting_down")


def engine_dead(error: BaseException) -> APIError:
    return APIError(503, f"The engine is not running ({error}); see the server's log.", type="server_error",
                    code="engine_dead")


def from_invalid_input(error: InvalidInput, rename: dict[str, str] | None = None) -> APIError:
    """A 400 naming the request's own parameter (`rename` maps SamplingParams names to the request's)."""
    field = error.field
    if field is not None and rename:
        head, dot, rest = field.partition(".")
        # structured.<kind> came from one request parameter (response_format, guided_regex, ...): name that.
        field = rename[head] if head == "structured" and head in rename else rename.get(head, head) + dot + rest
    return bad_request(" ".join(str(error).split()), param=field)


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def validation_error(error: RequestValidationError) -> APIError:
    """The first problem pydantic found in the body, as OpenAI words it: a 400 naming the parameter."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request body"}
    param = _loc(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}.", param=param)
    if first.get("type") == "json_invalid":
        return bad_request(f"The request body is not valid JSON ({first.get('msg')}).")
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg')} (got {first.get('input')!r:.120}).", param=param or None)


async def api_error_handler(_: Request, error: Exception) -> JSONResponse:
    return error.response() if isinstance(error, APIError) else server_error(error).response()


async def engine_dead_handler(_: Request, error: Exception) -> JSONResponse:
    return engine_dead(error).response()


async def validation_error_handler(_: Request, error: Exception) -> JSONResponse:
    return validation_error(error).response()  # type: ignore[arg-type]


def server_error(error: BaseException) -> APIError:
    return APIError(500, f"Internal error: {type(error).__name__}: {error}", type="server_error", code="internal_error")
