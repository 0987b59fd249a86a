"""The daemon's HTTP listener: OpenAI's API (`http_listen`), in the daemon's own event loop.

aiohttp serves it (`web.AppRunner` + `TCPSite`): it runs inside an event loop it did not make,
beside grpc.aio, without taking over the process's signals, and it writes a stream's chunks
straight to the transport (an ASGI stack, FastAPI on uvicorn, passes each through message
queues); the bodies are pydantic models (h3d.daemon.http.schemas), as FastAPI's would be.

Every request goes through one middleware (`HttpApi._around`): a request id, the caller
(`Authorization: Bearer`, the same tokens and owners as gRPC: h3d.daemon.auth), every error as
OpenAI's error object with its status (h3d.daemon.status decides: `http_status_of`), a schema
error as a 400 naming the parameter (never a framework's 422), and at the end one `rpc` log event
and the RPC metrics, labelled `api="http"`. A client that disconnects cancels its handler
(`handler_cancellation`), and with it the generation on the engine. What must stay true: no
traceback reaches a client; a stored response is seen only by its creator's token.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from h3d.daemon.auth import Caller
from h3d.daemon.config import split_address
from h3d.daemon.http.schemas import ModelCard, ModelList, dump, error_body
from h3d.daemon.rpc import State
from h3d.daemon.status import BadParam, MessageTooLarge, NotFound, Overloaded, Unauthenticated, http_status_of
from h3d.errors import H3Error, clip

log = structlog.get_logger("h3d.http")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SHUTDOWN_GRACE_S = 5.0  # connections still open at stop (streams have drained by then)


class HttpApi:
    """The routes of OpenAI's API over the daemon's `State`; `start` binds `http_listen`."""

    def __init__(self, state: State, model_name: str) -> None:
        from h3d.daemon.http.completions import Completions
        from h3d.daemon.http.responses import Responses

        self.s = state
        self.model = model_name
        self.created = int(time.time())
        self.completions = Completions(self)
        self.responses = Responses(self)
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.s.config.max_message_bytes, middlewares=[self._around])
        r = app.router
        r.add_get("/v1/models", self.list_models, name="ListModels")
        r.add_get("/v1/models/{model}", self.get_model, name="GetModel")
        r.add_post("/v1/chat/completions", self.completions.chat, name="ChatCompletions")
        r.add_post("/v1/completions", self.completions.text, name="Completions")
        r.add_post("/v1/responses", self.responses.create, name="CreateResponse")
        r.add_get("/v1/responses/{response_id}", self.responses.get, name="GetResponse")
        r.add_delete("/v1/responses/{response_id}", self.responses.delete, name="DeleteResponse")
        r.add_get("/health", self.health, name="Health")
        return app

    async def start(self, listen: str, tls: tuple[str, str] | None) -> str:
        """Serve on `listen` (HOST:PORT; port 0 picks one); returns the bound HOST:PORT."""
        host, port = split_address("http_listen", listen)
        context = None
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(certfile=tls[0], keyfile=tls[1])
        runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=context, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise H3Error(f"http_listen: cannot bind {listen}: {exc.strerror or exc}") from exc
        self._runner = runner
        bound = runner.addresses[0]
        return f"{host}:{bound[1]}"

    async def stop(self) -> None:
        """Close the listener and its connections (streams have drained or been cancelled)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- what every request goes through -----------------------------------------------------

    @web.middleware
    async def _around(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rid, t0, status = next(self.s.request_ids), time.perf_counter(), 500
        route = request.match_info.route.name or "Unknown"
        try:
            if route not in ("Health", "Unknown"):
                request["caller"] = self._caller(request)
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client closed the connection (nginx's code): nobody reads an answer
            raise
        except ConnectionResetError:  # a stream written after its client left (before the cancellation)
            status = 499
            return web.Response(status=499)
        except web.HTTPException as exc:  # the router's 404 and 405, the body's 413
            status = exc.status
            return self._framework_error(exc)
        except Exception as exc:
            response = self.error_response(exc, rid, route)
            status = response.status
            return response
        finally:
            self._record(request, route, rid, status, t0)

    def _caller(self, request: web.Request) -> Caller:
        header = request.headers.get("Authorization")
        return self.s.auth.caller([("authorization", header)] if header else [], admin_call=False)

    def error_response(self, exc: BaseException, rid: int, route: str) -> web.Response:
        status, kind, code = http_status_of(exc)
        if not isinstance(exc, H3Error):
            log.error("rpc_internal_error", api="http", method=route, request_id=rid, exc_info=exc)
            message = f"internal error (request {rid}); the daemon's log has the details"
        else:
            message = str(exc)
        param = getattr(exc, "param", None) if isinstance(exc, H3Error) else None
        headers = {}
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_ms / 1000)))
        if isinstance(exc, Unauthenticated):
            headers["WWW-Authenticate"] = "Bearer"
        return json_response(error_body(message, kind, param, code), status=status, headers=headers)

    def _framework_error(self, exc: web.HTTPException) -> web.Response:
        """aiohttp's own refusals, in OpenAI's error object."""
        if exc.status == 413:
            cap = self.s.config.max_message_bytes
            error: H3Error = MessageTooLarge(f"the request body is larger than max_message_bytes ({cap} bytes)")
        elif exc.status == 404:
            error = NotFound(
                "not found: the OpenAI API is under /v1 (models, chat/completions, completions, responses)"
            )
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            body = error_body(
                f"method {exc.method} not allowed here", "invalid_request_error", None, "method_not_allowed"
            )
            return json_response(body, status=405, headers={"Allow": ",".join(sorted(exc.allowed_methods))})
        else:
            return json_response(error_body(exc.reason, "invalid_request_error"), status=exc.status)
        status, kind, code = http_status_of(error)
        return json_response(error_body(str(error), kind, None, code), status=status)

    def _record(self, request: web.Request, route: str, rid: int, status: int, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1000
        self.s.metrics.rpc(route, str(status), ms / 1000, api="http")
        level = log.info if status < 400 or status == 499 else log.warning
        if route in ("ListModels", "GetModel", "GetResponse", "Health") and status == 200:
            level = log.debug
        level("rpc", api="http", method=route, request_id=rid, session_id=request.get("session_id"), code=status,
              ms=round(ms, 2))  # fmt: skip

    # ---- helpers the handlers share ----------------------------------------------------------

    async def body(self, request: web.Request, model: type[M]) -> M:
        """The request's JSON body as `model`; any failure a 400 naming the parameter."""
        raw = await request.read()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadParam(None, f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadParam(None, "the body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _schema_error(exc) from None
        name = getattr(parsed, "model", None)
        if name is not None and name != self.model:
            raise NotFound(
                f"model: {clip(str(name))!r} is not served here; this daemon serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        return parsed

    def caller(self, request: web.Request) -> Caller:
        caller = request["caller"]
        assert isinstance(caller, Caller)
        return caller

    # ---- the small routes --------------------------------------------------------------------

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model, created=self.created)

    async def list_models(self, request: web.Request) -> web.Response:
        return json_response(ModelList(data=[self._model_card()]))

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model:
            raise NotFound(f"model: {clip(name)!r} is not served here; this daemon serves {self.model!r}",
                           code="model_not_found")  # fmt: skip
        return json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, 503 while draining (for load balancers; no token needed)."""
        if self.s.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "serving"})


def _schema_error(exc: ValidationError) -> BadParam:
    """The first of a validation's errors, as a 400 naming its parameter (`messages[2].role`)."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "list[", "str", "int"))]
    param = ""
    for part in loc:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    kind = first.get("type", "")
    message = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return BadParam(param or None, "unknown parameter (h3d implements OpenAI's, listed in docs/OPERATIONS.md)",
                        code="unknown_parameter")  # fmt: skip
    if kind == "missing":
        return BadParam(param or None, "is required", code="missing_required_parameter")
    return BadParam(param or None, message[0].lower() + message[1:] if message else "invalid value")


def json_response(body: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=dump(body), status=status, headers=headers, content_type="application/json")


def model_name(model_dir: str) -> str:
    """The name requests give as `model`: the served folder's name."""
    return Path(model_dir.rstrip("/")).name
