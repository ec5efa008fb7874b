"""An OpenAI-compatible HTTP server over the scheduler (Starlette; run by uvicorn in `duo_jax.serve.__main__`).

`Server(...).app` serves POST /v1/completions and /v1/chat/completions (whole or streamed as server-sent events), GET
/v1/models, /health (200 once warm-up has compiled the serving shapes, else 503) and /metrics (Prometheus). Bad
bodies get a 4xx JSON error and change nothing; unexpected failures a 500 carrying the request id. The scheduler
steps in a thread of its own; a client that disconnects cancels its request. `Guard` holds the security defaults
(API key, Host allow-list, JSON content type, request size). Design: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import hmac
import json
import logging
import threading
import time
import uuid

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from duo_jax.chat import chat_prompts
from duo_jax.errors import DuoJaxError
from duo_jax.serve.protocol import DEFAULT_MAX_REQUEST_BYTES, BadRequest, Parsed, parse
from duo_jax.serve.scheduler import Request, Scheduler, SchedulerBusy, SchedulerClosed, find_stop
from duo_jax.tokenizer import TextStream, generated_text

log = logging.getLogger("duo_jax.serve")


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(
    message: str,
    status: int = 400,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _busy(e: Exception) -> JSONResponse:
    """A 429 for a full queue, with the time after which to try again."""
    response = _error(f"the server is busy: {e}", 429, "server_error", code="overloaded")
    response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response


QUIET_S = 1.0  # seconds without a /v1 request in flight before freed memory is handed back
RETRY_AFTER_S = 1  # a 429's Retry-After while the scheduler's queue is full
DEFAULT_COMPLETION_TOKENS = 16  # a completion without max_tokens (OpenAI's default; a chat runs to the context's end)


def release_memory() -> None:
    """Hand freed heap back to the OS (a collection, then glibc's malloc_trim; elsewhere the collection
    only). `Guard` calls it once the API has been quiet for QUIET_S, so that the resident size goes back to
    its warm level instead of keeping the peak of a burst or of a large prompt's parsing and tokenization."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim  # noqa: B018 (glibc only)
except (OSError, AttributeError):
    _libc = None


class _TooLarge(Exception):
    pass


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """ASGI middleware: request ids, the security checks (docs/serving.md), and a JSON 500 for any
    exception the routes let through (the connection stays open). `allowed_hosts` None: any Host."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None = None,
        allowed_hosts=None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        on_quiet=release_memory,
    ):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.on_quiet, self.inflight, self._quiet, self._last = on_quiet, 0, None, 0.0  # /v1 requests in flight
        self.allowed_hosts = (
            None
            if allowed_hosts is None or "*" in allowed_hosts
            else {_host_name(h) for h in allowed_hosts if h.strip()}  # an empty name would admit a missing Host
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ident = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = ident
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message, headers=list(message.get("headers", [])) + [(b"x-request-id", ident.encode())])
            await send(message)

        async def respond(status, message, kind, code=None):
            await JSONResponse(error_body(message, kind, code=code), status_code=status)(scope, receive, send_with_id)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await respond(*refusal)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_request_bytes:
                raise _TooLarge
            return message

        api = scope["path"].startswith("/v1/")
        self.inflight += api
        try:
            await self.app(scope, counted, send_with_id)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing failed here
            log.info("request %s: the client disconnected before its body was read", ident)
        except _TooLarge:
            if not started:
                await respond(
                    413,
                    f"the body is over {self.max_request_bytes} bytes (--max-request-bytes)",
                    "invalid_request_error",
                    "request_too_large",
                )
        except Exception:
            log.exception("request %s failed", ident)
            if not started:
                await respond(
                    500, f"internal error (request id {ident}); the server log has the details", "server_error", ident
                )
        finally:
            self.inflight -= api
            if api:
                self._last = time.monotonic()
                if not self.inflight and self.on_quiet is not None and (self._quiet is None or self._quiet.done()):
                    self._quiet = asyncio.ensure_future(self._when_quiet())

    async def _when_quiet(self) -> None:
        """Call `on_quiet` (in a thread) once no /v1 request has been in flight for QUIET_S: once per burst. A
        request in flight when it wakes ends the wait; that request's end starts the next one."""
        while True:
            await asyncio.sleep(max(self._last + QUIET_S - time.monotonic(), 0))
            if self.inflight:
                return
            if time.monotonic() - self._last >= QUIET_S:
                return await anyio.to_thread.run_sync(self.on_quiet)

    def _refusal(self, scope, headers) -> tuple[int, str, str] | None:
        """(status, message, kind) of a request refused before it is read, or None."""
        if self.allowed_hosts is not None and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            return (
                421,
                (
                    f"Host {headers.get('host', '')!r} is not allowed (--allowed-hosts); allowed: "
                    f"{', '.join(sorted(self.allowed_hosts))}"
                ),
                "invalid_request_error",
            )
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return (
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    "authentication_error",
                )
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, (f"Content-Type must be application/json, got {media or 'none'!r}"), "invalid_request_error"
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
                return (
                    413,
                    (f"the body ({length} bytes) is over {self.max_request_bytes} bytes (--max-request-bytes)"),
                    "invalid_request_error",
                )
        return None


def held_back(text: str, stops) -> int:
    """How many characters at the end of `text` could begin one of `stops` (not to be shown yet)."""
    return max(
        (k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), default=0
    )


class Server:
    """The routes over one scheduler; `app` is the ASGI application (the Starlette routes inside `Guard`).
    `warm_up`: compile the serving shapes before /health says ready. `on_fatal()`: called from the scheduler's
    thread when the scheduler cannot go on. `allowed_origins`: CORS, off unless given. `on_quiet()`: run in a
    thread after each burst of API requests (default: `release_memory`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        model,
        name: str,
        *,
        warm_up: bool = True,
        on_fatal=None,
        api_key: str | None = None,
        allowed_hosts=None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        allowed_origins=None,
        on_quiet=release_memory,
    ):
        if max_request_bytes < 1:
            raise DuoJaxError(
                f"max_request_bytes (--max-request-bytes) must be a positive integer, got {max_request_bytes!r}: "
                "every POST would be refused with 413"
            )
        if allowed_hosts is not None and not any(host.strip() for host in allowed_hosts):
            raise DuoJaxError(
                f"allowed_hosts (--allowed-hosts) names no host, got {list(allowed_hosts)!r}: every request, /health "
                "included, would be refused with 421; name the Host names clients use, or '*' for any"
            )
        self.scheduler, self.model, self.name = scheduler, model, name
        self.tokenizer = model.tokenizer
        self.started = time.time()
        self.warm, self.on_fatal = warm_up, on_fatal
        self.ready, self.failed = False, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        middleware = (
            [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])]
            if allowed_origins
            else []
        )
        middleware.append(
            Middleware(
                Guard,
                api_key=api_key,
                allowed_hosts=allowed_hosts,
                max_request_bytes=max_request_bytes,
                on_quiet=on_quiet,
            )
        )
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{name:path}", self.model_info, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            middleware=middleware,
            exception_handlers={HTTPException: self._http_error},
            lifespan=self.lifespan,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._stop.clear()
        self._thread = threading.Thread(target=self._schedule, daemon=True, name="duo-jax-scheduler")
        self._thread.start()
        yield
        self._stop.set()  # requests already submitted finish first (serve_forever drains)
        await asyncio.to_thread(self._thread.join)

    def _schedule(self) -> None:
        """The scheduler's thread: warm-up, then serving until shutdown or a failure it cannot get over."""
        try:
            if self.warm:
                self.scheduler.warm_up()
            self.ready = True
            self.scheduler.serve_forever(self._stop)
        except BaseException as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.exception("the scheduler stopped; new requests get 503")
            if self.scheduler.closed is None:
                self.scheduler.close(f"the scheduler stopped ({self.failed})")
            if self.on_fatal is not None:
                self.on_fatal()

    # --- routes ---------------------------------------------------------------------------------------

    async def _http_error(self, request: HttpRequest, exc: HTTPException):
        return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    async def health(self, request: HttpRequest):
        if self.scheduler.closed is not None or self._thread is None or not self._thread.is_alive():
            return JSONResponse({"status": "stopped"}, status_code=503)
        if not self.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "duo-jax",
            "max_model_len": self.scheduler.longest_sequence,
        }

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: HttpRequest):
        if request.path_params["name"] != self.name:
            return _error(
                f"model {request.path_params['name']!r} is not served here (this server: {self.name!r})",
                404,
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return JSONResponse(self._model_card())

    async def metrics(self, request: HttpRequest):
        s, c = self.scheduler, self.scheduler.counters
        lines = []
        for name, kind, help_, value in [
            ("requests_total", "counter", "requests accepted", c["requests"]),
            ("requests_finished_total", "counter", "requests finished", c["finished"]),
            ("generated_tokens_total", "counter", "tokens generated", c["tokens"]),
            (
                "prompt_tokens_total",
                "counter",
                "prompt tokens prefilled (recomputed ones included)",
                c["prompt_tokens"],
            ),
            ("steps_total", "counter", "scheduler steps run", c["steps"]),
            ("step_calls_total", "counter", "compiled calls run (a split mixed step makes two)", c["calls"]),
            (
                "step_row_tokens_total",
                "counter",
                "positions computed: batch x T of every call, padding included",
                c["row_tokens"],
            ),
            ("preemptions_total", "counter", "requests preempted for pages", c["preemptions"]),
            ("cancelled_total", "counter", "requests cancelled (client gone)", c["cancelled"]),
            ("refused_busy_total", "counter", "requests refused with 429: the queue was full", c["busy"]),
            (
                "prefix_reused_tokens_total",
                "counter",
                "prompt tokens not prefilled: shared prefix pages",
                c["prefix_tokens"],
            ),
            ("requests_running", "gauge", "requests in a slot", sum(1 for slot in s.running if slot)),
            ("requests_queued", "gauge", "requests waiting for a slot or pages", s.num_queued),
            ("pages_in_use", "gauge", "KV pages held by requests", s.pages_in_use()),
            ("pages_total", "gauge", "KV pages in the pool", s.pool.num_pages),
            ("slots", "gauge", "sequences per step", s.slots),
        ]:
            lines += [f"# HELP duo_jax_{name} {help_}", f"# TYPE duo_jax_{name} {kind}", f"duo_jax_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def completions(self, request: HttpRequest):
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: HttpRequest):
        return await self._serve(request, chat=True)

    # --- one generation -------------------------------------------------------------------------------

    async def _serve(self, http: HttpRequest, *, chat: bool):
        ident = http.state.request_id
        if self.scheduler.closed is not None:
            return _error(f"the server is not taking requests: {self.scheduler.closed}", 503, "server_error")
        try:
            self.scheduler.check_room()  # a full queue refuses before the body is read; `submit` checks again
        except SchedulerBusy as e:
            return _busy(e)
        body = await http.body()
        try:
            # Parsing, tokenization and the chat template may take a while on a large body: off the event loop.
            prompt, parsed = await anyio.to_thread.run_sync(self._prepare, body, chat)
            tokens: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            job = Request(
                prompt,
                max_tokens=self.max_tokens(parsed, len(prompt), chat),
                sampling=parsed.sampling,
                seed=parsed.seed,
                stop=parsed.stop,
                on_token=lambda r, t: loop.call_soon_threadsafe(tokens.put_nowait, t),
            )
            self.scheduler.submit(job)
        except BadRequest as e:
            return _error(str(e), e.status, e.kind, e.param)
        except SchedulerClosed as e:
            return _error(f"the server is not taking requests: {e}", 503, "server_error")
        except SchedulerBusy as e:
            return _busy(e)
        except DuoJaxError as e:  # the scheduler's check: its `param` names a Request field
            param = getattr(e, "param", None)
            return _error(str(e), param="messages" if chat and param == "prompt" else param)
        finally:
            del body
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{ident}"
        if parsed.stream:
            return StreamingResponse(
                self._events(job, tokens, ident, chat, parsed.include_usage), media_type="text/event-stream"
            )
        if not await self._collect(http, job, tokens):
            return _error("the client disconnected", 499, "cancelled")
        if job.finish_reason == "error":
            return _error(
                f"{job.error} (request id {http.state.request_id})", 500, "server_error", code=http.state.request_id
            )
        text = self._text(job)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text, "logprobs": None}
        )
        return JSONResponse(self._envelope(ident, chat, dict(choice, finish_reason=job.finish_reason), job))

    def max_tokens(self, parsed: Parsed, prompt_tokens: int, chat: bool) -> int:
        """The request's max_tokens, or when it sent none OpenAI's defaults: a chat runs to the end of what a sequence
        can hold, a completion 16 tokens (fewer where the sequence cannot hold them)."""
        if parsed.max_tokens is not None:
            return parsed.max_tokens
        room = self.scheduler.max_new_tokens(prompt_tokens)
        if room < 1:
            raise BadRequest(
                f"the prompt ({prompt_tokens} tokens) leaves no room for a new token in the "
                f"{prompt_tokens + room} a sequence can hold", "messages" if chat else "prompt"
            )  # fmt: skip
        return room if chat else min(DEFAULT_COMPLETION_TOKENS, room)

    def _prepare(self, body: bytes, chat: bool) -> tuple[list[int], Parsed]:
        """(prompt token ids, the checked request) from a request body (in a worker thread)."""
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the body is not JSON") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts (4,300)
            raise BadRequest(f"the body's JSON cannot be read: {e}") from None
        except RecursionError:  # Python's decoder recurses once per level
            raise BadRequest("the body's JSON is nested too deeply to read (a request nests a few levels)") from None
        parsed = parse(body, chat=chat, model=self.name)
        if self.tokenizer is None and (chat or isinstance(parsed.prompt, str)):
            raise BadRequest(
                "this model has no tokenizer: send the prompt as token ids", "messages" if chat else "prompt"
            )
        if chat:
            return list(chat_prompts(self.model, [parsed.messages], True)[0]), parsed
        prompt = parsed.prompt
        return (self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt), parsed

    async def _collect(self, http: HttpRequest, job: Request, tokens: asyncio.Queue) -> bool:
        """Wait for the end of `job`; False (and the job cancelled) if the client disconnects first."""

        async def disconnected():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        try:
            while True:
                token = asyncio.ensure_future(tokens.get())
                await asyncio.wait({token, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not token.done():
                    token.cancel()
                    self.scheduler.cancel(job)
                    return False
                if token.result() is None:
                    return True
        finally:
            gone.cancel()

    def _text(self, job: Request) -> str:
        """The text of the job's tokens, ending before its first stop string."""
        return (
            ""
            if self.tokenizer is None
            else find_stop(generated_text(self.tokenizer.decode, job.prompt, job.tokens), job.stop)[0]
        )

    def _envelope(self, ident: str, chat: bool, choice: dict, job: Request | None = None, chunk: bool = False):
        out = {
            "id": ident,
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else ""),
            "created": int(time.time()),
            "model": self.name,
            "choices": [choice],
        }
        if job is not None:
            out["usage"] = {
                "prompt_tokens": len(job.prompt),
                "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens),
            }
        return out

    async def _events(self, job: Request, tokens: asyncio.Queue, ident: str, chat: bool, usage: bool = True):
        """Server-sent events: each chunk the text the new tokens add (held back while it ends inside a
        multi-byte character or could begin a stop string), then a chunk with the finish reason (and, with
        `usage`, the token counts), then [DONE].
        If the client goes away (the response task is cancelled, or the generator closed), the job is
        cancelled."""
        sent, stream = "", TextStream(self.tokenizer.decode, after=job.prompt) if self.tokenizer is not None else None
        try:
            if chat:
                yield self._event(ident, chat, {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
            while (token := await tokens.get()) is not None:
                if self.tokenizer is None:  # token ids in, no text out until the last chunk's (empty) text
                    continue
                text, stopped = find_stop(stream.extend([token]), job.stop)
                if not stopped:
                    text = text[: len(text) - held_back(text, job.stop)]
                if text.endswith("\ufffd") or len(text) <= len(sent) or not text.startswith(sent):
                    continue
                delta, sent = text[len(sent) :], text
                yield self._event(
                    ident,
                    chat,
                    {"index": 0, "delta": {"content": delta}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": delta, "logprobs": None, "finish_reason": None},
                )
        finally:
            if not job.done.is_set():
                self.scheduler.cancel(job)
        if job.finish_reason == "error":
            yield f"data: {json.dumps(error_body(job.error, 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"
            return
        text = self._text(job)
        rest = text[len(sent) :] if text.startswith(sent) else ""
        last = (
            {"index": 0, "delta": {"content": rest} if rest else {}, "finish_reason": job.finish_reason}
            if chat
            else {"index": 0, "text": rest, "logprobs": None, "finish_reason": job.finish_reason}
        )
        yield self._event(ident, chat, last, job if usage else None)
        yield "data: [DONE]\n\n"

    def _event(self, ident: str, chat: bool, choice: dict, job: Request | None = None) -> str:
        return f"data: {json.dumps(self._envelope(ident, chat, choice, job, chunk=True))}\n\n"
