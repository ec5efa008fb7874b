"""An OpenAI-compatible HTTP server over the scheduler (Starlette; run by uvicorn in `duo_jax.serve.__main__`).

  POST /v1/completions        prompt (text or token ids), max_tokens, temperature, top_p, top_k, seed, stop, stream
  POST /v1/chat/completions   messages (rendered with the model's chat template), the same options
  GET  /health                {"status": "ok"}
  GET  /metrics               Prometheus text: requests, tokens, steps, preemptions, pages, queue

The scheduler steps in a thread of its own; each HTTP request submits a `Request` whose tokens reach the
handler through an asyncio queue, streamed as server-sent events (`stream: true`) or returned whole. A bad
request gets a 4xx JSON error ({"error": {"message", "type"}}) and changes nothing else. On shutdown the
server stops taking connections and the responses in flight finish (uvicorn waits for them; the scheduler's
thread then drains and stops). Options that would change what is generated and that this server does not
implement (`n` > 1, `logprobs`, penalties) are refused rather than ignored.

`stop` (a string or a list of up to 4): the scheduler ends the request once its detokenized text contains
one, and the text returned ends before it. Streamed, a chunk never shows text that could still turn out to
begin a stop string: a tail that is a prefix of one is held back until the next tokens settle it. A client
that disconnects (mid-stream, or while waiting for a whole response) cancels its request: the scheduler frees
its pages before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from duo_jax.chat import chat_prompts
from duo_jax.errors import DuoJaxError
from duo_jax.sampling import Sampling
from duo_jax.serve.scheduler import Request, Scheduler, find_stop

UNSUPPORTED = ("logprobs", "top_logprobs", "best_of", "suffix", "presence_penalty", "frequency_penalty",
               "logit_bias", "tools")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _number(body: dict, name: str, kind, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{name!r} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    return kind(value)


def _request_options(body: dict) -> dict:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], 0, 0.0):
            raise BadRequest(f"{name!r} is not supported by this server")
    if _number(body, "n", int, 1) != 1:
        raise BadRequest("only n = 1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    sampling = Sampling(_number(body, "temperature", float, 1.0), _number(body, "top_p", float, 1.0),
                        _number(body, "top_k", int, 0))
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them")
    return dict(max_tokens=_number(body, "max_tokens", int, 16), sampling=sampling,
                seed=_number(body, "seed", int, 0) % (1 << 32), stop=tuple(stop), stream=stream)


def held_back(text: str, stops) -> int:
    """How many characters at the end of `text` could begin one of `stops` (not to be shown yet)."""
    return max((k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:k])), default=0)


class Server:
    """The routes over one scheduler; `app` is the Starlette application."""

    def __init__(self, scheduler: Scheduler, model, name: str):
        self.scheduler, self.model, self.name = scheduler, model, name
        self.tokenizer = model.tokenizer
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._stop.clear()
        self._thread = threading.Thread(target=self.scheduler.serve_forever, args=(self._stop,), daemon=True,
                                        name="duo-jax-scheduler")
        self._thread.start()
        yield
        self._stop.set()  # requests already submitted finish first (serve_forever drains)
        await asyncio.to_thread(self._thread.join)

    # --- routes ---------------------------------------------------------------------------------------

    async def health(self, request: HttpRequest):
        alive = self._thread is not None and self._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    async def metrics(self, request: HttpRequest):
        s, c = self.scheduler, self.scheduler.counters
        lines = []
        for name, kind, help_, value in [
            ("requests_total", "counter", "requests accepted", c["requests"]),
            ("requests_finished_total", "counter", "requests finished", c["finished"]),
            ("generated_tokens_total", "counter", "tokens generated", c["tokens"]),
            ("prompt_tokens_total", "counter", "prompt tokens prefilled (recomputed ones included)",
             c["prompt_tokens"]),
            ("steps_total", "counter", "scheduler steps run", c["steps"]),
            ("step_calls_total", "counter", "compiled calls run (a split mixed step makes two)", c["calls"]),
            ("step_row_tokens_total", "counter", "positions computed: batch x T of every call, padding included",
             c["row_tokens"]),
            ("preemptions_total", "counter", "requests preempted for pages", c["preemptions"]),
            ("cancelled_total", "counter", "requests cancelled (client gone)", c["cancelled"]),
            ("prefix_reused_tokens_total", "counter", "prompt tokens not prefilled: shared prefix pages",
             c["prefix_tokens"]),
            ("requests_running", "gauge", "requests in a slot", sum(1 for slot in s.running if slot)),
            ("requests_queued", "gauge", "requests waiting for a slot or pages", len(s.queue) + s.inbox.qsize()),
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
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("the body is not JSON")
        try:
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            if body.get("model") not in (None, self.name):
                raise BadRequest(f"model {body['model']!r} is not served here (this server: {self.name!r})", 404,
                                 "model_not_found")
            options = _request_options(body)
            prompt = self._prompt(body, chat)
            stream = options.pop("stream")
            tokens: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            job = Request(prompt, **options, on_token=lambda r, t: loop.call_soon_threadsafe(tokens.put_nowait, t))
            self.scheduler.submit(job)
        except BadRequest as e:
            return _error(str(e), e.status, e.kind)
        except DuoJaxError as e:
            return _error(str(e))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{job.id}"
        if stream:
            return StreamingResponse(self._events(job, tokens, ident, chat), media_type="text/event-stream")
        if not await self._collect(http, job, tokens):
            return _error("the client disconnected", 499, "cancelled")
        text = self._text(job)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        return JSONResponse(self._envelope(ident, chat, dict(choice, finish_reason=job.finish_reason), job))

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
        return find_stop(self._decode(job.tokens), job.stop)[0]

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list of {role, content} messages")
            if self.tokenizer is None:
                raise BadRequest("this model has no tokenizer")
            return list(chat_prompts(self.model, [messages], True)[0])
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest("this model has no tokenizer: send the prompt as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")

    def _decode(self, ids) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def _envelope(self, ident: str, chat: bool, choice: dict, job: Request | None = None, chunk: bool = False):
        out = {"id": ident, "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat
                                                                                          else ""),
               "created": int(time.time()), "model": self.name, "choices": [choice]}
        if job is not None:
            out["usage"] = {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                            "total_tokens": len(job.prompt) + len(job.tokens)}
        return out

    async def _events(self, job: Request, tokens: asyncio.Queue, ident: str, chat: bool):
        """Server-sent events: each chunk the text the new tokens add (held back while it ends inside a
        multi-byte character or could begin a stop string), then a chunk with the finish reason, then [DONE].
        If the client goes away (the response task is cancelled, or the generator closed), the job is
        cancelled."""
        sent, ids = "", []
        try:
            if chat:
                yield self._event(ident, chat, {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
            while (token := await tokens.get()) is not None:
                ids.append(token)
                text, stopped = find_stop(self._decode(ids), job.stop)
                if not stopped:
                    text = text[:len(text) - held_back(text, job.stop)]
                if text.endswith("\ufffd") or len(text) <= len(sent) or not text.startswith(sent):
                    continue
                delta, sent = text[len(sent):], text
                yield self._event(ident, chat, {"index": 0, "delta": {"content": delta}, "finish_reason": None}
                                  if chat else {"index": 0, "text": delta, "logprobs": None, "finish_reason": None})
        finally:
            if not job.done.is_set():
                self.scheduler.cancel(job)
        text = self._text(job)
        rest = text[len(sent):] if text.startswith(sent) else ""
        last = ({"index": 0, "delta": {"content": rest} if rest else {}, "finish_reason": job.finish_reason} if chat
                else {"index": 0, "text": rest, "logprobs": None, "finish_reason": job.finish_reason})
        yield self._event(ident, chat, last, job)
        yield "data: [DONE]\n\n"

    def _event(self, ident: str, chat: bool, choice: dict, job: Request | None = None) -> str:
        return f"data: {json.dumps(self._envelope(ident, chat, choice, job, chunk=True))}\n\n"
