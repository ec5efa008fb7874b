"""The server against requests meant to break it, over real HTTP (uvicorn on localhost): every bad field is a
400 naming it and the next request is served; a failing scheduler step fails only its requests; a scheduler
that cannot go on answers 503 at once and calls on_fatal; the security defaults (API key, Content-Type, Host
allow-list, body limit read no further than needed); OpenAI's content parts, /v1/models,
max_completion_tokens and response_format; tokenization off the event loop; one compiled sampler."""

import concurrent.futures
import json
import logging
import socket
import threading
import time

import jax
import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import duo_jax  # noqa: E402
from duo_jax import sampling as sampling_module  # noqa: E402
from duo_jax.cache import make_layout  # noqa: E402
from duo_jax.engine import Engine  # noqa: E402
from duo_jax.methods.duo import DuoAttention  # noqa: E402
from duo_jax.methods.paged import paged  # noqa: E402
from duo_jax.serve import Scheduler  # noqa: E402
from duo_jax.serve.server import Server  # noqa: E402
from tests.test_serve import CHUNK, CONFIG, ChatTokenizer, Running  # noqa: E402

KEY = "sesame"
LIMIT = 4096
AUTH = {"authorization": f"Bearer {KEY}"}


def build(tokenizer="chat", **options):
    tokenizer = ChatTokenizer() if tokenizer == "chat" else tokenizer
    model = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), tokenizer, "tiny")
    method = DuoAttention(make_layout(CONFIG, np.array([[True, False], [False, True]]), sink=2, recent=5, context=64))
    scheduler = Scheduler(
        Engine.of(model),
        paged(method, page_size=4, num_pages=40),
        slots=3,
        chunk=CHUNK,
        impl="xla",
        detokenize=None if tokenizer is None else tokenizer.decode,
    )
    return Server(scheduler, model, "tiny", **options)


@pytest.fixture(scope="module")
def guarded():
    server = build(api_key=KEY, allowed_hosts=["localhost", "127.0.0.1", "::1"], max_request_bytes=LIMIT)
    running = Running(server.app)
    with httpx.Client(base_url=running.url, headers=AUTH, timeout=120) as client:
        yield server, running, client
    running.stop()


def post(client, body, path="/v1/completions", **kwargs):
    return client.post(path, json=body, **kwargs)


def assert_serves(client):
    """A plain request still gets its tokens."""
    response = post(client, {"prompt": "still here", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_top_k_above_the_vocabulary_then_a_normal_request(guarded):
    server, running, client = guarded
    response = post(client, {"prompt": "Hi", "top_k": 50000, "temperature": 1, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert_serves(client)
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_sampling_values_share_one_compiled_sampler(guarded):
    server, running, client = guarded
    before = sampling_module.sample_seeded._cache_size()
    for rule in [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5), dict(temperature=0.2, top_k=9)]:
        assert post(client, dict(rule, prompt="vary", max_tokens=2)).status_code == 200
    assert sampling_module.sample_seeded._cache_size() == before


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "banana"}, "parallel_tool_calls", "bool"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature", "finite"),
    ({"prompt": "hi", "temperature": float("inf")}, "temperature", "finite"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "> 0"),
    ({"prompt": "hi", "top_k": 2.5}, "top_k", "integer"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "hi", "seed": "x"}, "seed", "integer"),
    ({"prompt": "hi", "seed": 2**32}, "seed", "<= 4294967295"),  # JAX's seeds are 32-bit: it would be seed 0
    ({"prompt": "hi", "seed": -1}, "seed", ">= 0"),
    ({"prompt": "hi", "temperature": 10**400}, "temperature", "finite"),  # past float's range: was a 500
    ({"prompt": "hi", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs", "not supported"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"prompt": "\ud800"}, "prompt", "lone surrogate"),
    ({"prompt": "hi", "stop": "\udc00"}, "stop[0]", "lone surrogate"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "one prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options", "bool"),
    ({"prompt": "hi", "user": 5}, "user", "a string"),
    ({"prompt": "hi", "metadata": "x"}, "metadata", "an object"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "text parts"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "text parts"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "text parts"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "text part",
    ),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name", "not supported"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        "response_format",
        "text",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 4},
        "max_completion_tokens",
        "differ",
    ),
]


@pytest.mark.slow
def test_json_nested_too_deeply_is_a_400(guarded):
    """2,000 nested arrays (4 KB) exceed Python's decoder's recursion: a 400 saying so, not a 500."""
    server, running, client = guarded
    body = "[" * 2000 + "]" * 2000
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]
    assert_serves(client)


def test_an_integer_python_will_not_read_is_a_bad_request(guarded):
    """A JSON integer of 5,000 digits passes Python's decoder's digit limit (4,300): a BadRequest (a 400), which
    was a 500. (Read by the body's parser directly: the fixture's body limit is 4 KB.)"""
    from duo_jax.serve.protocol import BadRequest

    server, running, client = guarded
    body = b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"
    with pytest.raises(BadRequest, match="cannot be read"):
        server._prepare(body, chat=False)


def test_requests_without_a_seed_sample_differently_and_a_seed_repeats(guarded):
    """OpenAI's semantics: a sampled request without a seed gets a fresh one (every such request once got seed 0's
    text); the same seed gives the same text."""
    server, running, client = guarded
    rule = {"prompt": "sample", "max_tokens": 12, "temperature": 2.0}
    unseeded = {post(client, rule).json()["choices"][0]["text"] for _ in range(4)}
    assert len(unseeded) > 1
    seeded = {post(client, dict(rule, seed=123)).json()["choices"][0]["text"] for _ in range(2)}
    assert len(seeded) == 1


def test_max_tokens_left_out_is_openais_default(guarded):
    """A chat without max_tokens runs to the end of what its sequence holds (the method's positions, the model's
    and the page pool's); a completion gets 16 tokens, or what is left; a prompt that fills the sequence is a 400
    naming it."""
    from duo_jax.serve.protocol import parse

    server, running, client = guarded
    method = server.scheduler.method
    holds = min(method.max_tokens, CONFIG.max_position_embeddings, 40 * method.page_size + 1)
    chat = parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True, model="tiny")
    completion = parse({"prompt": "hi"}, chat=False, model="tiny")
    assert chat.max_tokens is None and completion.max_tokens is None
    assert server.max_tokens(chat, 10, chat=True) == holds - 10 and server.max_tokens(completion, 10, chat=False) == 16
    assert server.max_tokens(completion, holds - 4, chat=False) == 4
    with pytest.raises(Exception, match="leaves no room"):
        server.max_tokens(completion, holds, chat=False)
    response = post(client, {"prompt": list(range(1, holds - 3)), "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 4
    response = post(client, {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}, "/v1/chat/completions")
    usage = response.json()["usage"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "stop" or usage["total_tokens"] == holds


@pytest.mark.parametrize("body, param, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_a_bad_field_is_a_400_naming_it(guarded, body, param, message):
    server, running, client = guarded
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    # json.dumps writes NaN / Infinity and lone surrogates as Python's json module (and JavaScript's) do.
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"] and param.split("[")[0] in error["message"]
    assert_serves(client)


SCHEDULER_REFUSES = [
    ("/v1/completions", {"prompt": ""}, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "token ids must lie in [0, 2000)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 500}, "max_tokens", "exceeds the 128 tokens"),
    ("/v1/completions", {"prompt": list(range(1, 200)), "max_tokens": 1}, "prompt", "exceeds the 128 tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500},
        "max_tokens",
        "exceeds",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 60}], "max_tokens": 1},
        "messages",
        "exceeds",
    ),
]


@pytest.mark.parametrize("path, body, param, message", SCHEDULER_REFUSES)
def test_a_request_the_scheduler_refuses_names_the_field(guarded, path, body, param, message):
    """The scheduler's own checks (an empty prompt, token ids past the vocabulary, a sequence past the context) were
    400s with param null; a chat's prompt is its messages."""
    server, running, client = guarded
    response = post(client, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


@pytest.mark.parametrize(
    "options, usage", [(None, True), ({}, True), ({"include_usage": True}, True), ({"include_usage": False}, False)]
)
def test_stream_options_include_usage_false_sends_no_usage(guarded, options, usage):
    """Usage comes in the last chunk unless stream_options says include_usage: false (OpenAI sends none then; it was
    sent regardless)."""
    server, running, client = guarded
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, **({} if options is None else {"stream_options": options})}
    events = post(client, body).text
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [usage]
    if usage:
        assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_a_client_gone_while_its_body_is_read_is_one_log_line(guarded, caplog):
    """A client that disconnects before sending its whole body was logged as a failed request with a traceback."""
    server, running, client = guarded
    caplog.set_level(logging.INFO, logger="duo_jax.serve")
    host, port = running.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '.encode()
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while not any("disconnected" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    records = [r for r in caplog.records if r.name == "duo_jax.serve"]
    assert [r.getMessage().split(": ", 1)[1] for r in records] == ["the client disconnected before its body was read"]
    assert records[0].levelno == logging.INFO and records[0].exc_info is None
    assert_serves(client)


def test_settings_that_refuse_every_request_are_refused():
    """max_request_bytes 0 (every POST a 413) and an allowed_hosts naming no host (every request a 421, /health
    included) served nothing; an empty name among others would admit a request without a Host."""
    from duo_jax.errors import DuoJaxError
    from duo_jax.serve.server import Guard

    with pytest.raises(DuoJaxError, match=r"max_request_bytes \(--max-request-bytes\) must be a positive integer"):
        build(max_request_bytes=0)
    for hosts in ([], [""], [" ", ""]):
        with pytest.raises(DuoJaxError, match=r"allowed_hosts \(--allowed-hosts\) names no host"):
            build(allowed_hosts=hosts)
    assert Guard(None, allowed_hosts=["localhost:8000", ""]).allowed_hosts == {"localhost"}


def test_content_parts_are_the_text_they_hold(guarded):
    server, running, client = guarded
    greedy = {"max_tokens": 4, "temperature": 0}
    plain = post(client, dict(greedy, messages=[{"role": "user", "content": "hi\nthere"}]), "/v1/chat/completions")
    parts = post(
        client,
        dict(
            greedy,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        ),
        "/v1/chat/completions",
    )
    assert plain.status_code == parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert parts.json()["usage"] == plain.json()["usage"]


def test_max_completion_tokens_and_response_format_text(guarded):
    server, running, client = guarded
    body = {
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "temperature": 0,
        "response_format": {"type": "text"},
    }
    response = post(client, body, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_models(guarded):
    server, running, client = guarded
    listing = client.get("/v1/models")
    assert listing.status_code == 200 and [m["id"] for m in listing.json()["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny").json()["object"] == "model"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    unknown_route = client.get("/v1/nothing")
    assert unknown_route.status_code == 404 and "error" in unknown_route.json()


def test_api_key_is_required_on_v1_only(guarded):
    server, running, client = guarded
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.post(f"{running.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{running.url}/v1/models").status_code == 401
    assert httpx.get(f"{running.url}/health").status_code == 200


def test_a_post_that_is_not_json_is_refused(guarded):
    server, running, client = guarded
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        response = client.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
        assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]
    assert_serves(client)


def test_the_host_header_must_be_local(guarded):
    server, running, client = guarded
    response = client.post("/v1/completions", json={"prompt": "hi"}, headers={"host": "evil.example"})
    assert response.status_code == 421 and "evil.example" in response.json()["error"]["message"]
    assert client.get("/health", headers={"host": "localhost:8000"}).status_code == 200


def test_no_cors_unless_asked(guarded):
    server, running, client = guarded
    response = client.options(
        "/v1/completions", headers={"origin": "https://evil.example", "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in response.headers


def raw(url: str, data: bytes, responses: int = 1) -> list[bytes]:
    """The raw responses read from one connection after sending `data`."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(data)
        got = b""
        while got.count(b"HTTP/1.1 ") < responses or not got.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return [b"HTTP/1.1 " + part for part in got.split(b"HTTP/1.1 ")[1:]]


def test_a_body_over_the_limit_is_refused_before_it_is_read(guarded):
    """Content-Length over the limit: 413 while the client has sent none of the body. Without a length
    (chunked), the count stops the read at the limit."""
    server, running, client = guarded
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {100 * LIMIT}\r\n\r\n"
    ).encode()
    (response,) = raw(running.url, head)
    assert response.startswith(b"HTTP/1.1 413") and b"request_too_large" not in response.split(b"\r\n\r\n")[0]
    assert b"max-request-bytes" in response

    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 512 + 2):
            yield b"x" * 512
        yield b'"}'

    chunked = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    assert_serves(client)


def test_an_unexpected_error_is_a_json_500_on_a_kept_connection(guarded, monkeypatch):
    server, running, client = guarded

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "_prepare", broken)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f'Content-Type: application/json\r\nContent-Length: 15\r\n\r\n{{"prompt": "x"}}'
    ).encode()
    first, second = raw(running.url, request + request, responses=2)  # two requests, one connection
    for response in (first, second):
        assert response.startswith(b"HTTP/1.1 500") and b"connection: close" not in response.lower()
        head, body = response.split(b"\r\n\r\n", 1)
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and error["code"] in head.decode() and error["code"] in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failing_step_fails_only_its_requests(guarded, monkeypatch, stream):
    """The request a failing step ran gets a 500 (streamed: an error event, then [DONE]); the next is served."""
    server, running, client = guarded
    scheduler, step, calls = server.scheduler, server.scheduler.step, []

    def flaky():
        if any(scheduler.running) and not calls:
            calls.append(1)
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(scheduler, "step", flaky)
    body = {"prompt": "doomed", "max_tokens": 3, "stream": stream}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
    else:
        response = post(client, body)
        assert response.status_code == 500
        error = response.json()["error"]
    assert "device lost" in error["message"] and error["type"] == "server_error"
    assert_serves(client)
    assert client.get("/health").status_code == 200 and scheduler.pages_in_use() == 0


def test_tokenization_runs_off_the_event_loop(guarded, monkeypatch):
    server, running, client = guarded
    encode = server.tokenizer.encode
    monkeypatch.setattr(server.tokenizer, "encode", lambda text, **kw: time.sleep(2) or encode(text, **kw))
    slow = threading.Thread(target=post, args=(client, {"prompt": "slow", "max_tokens": 1}))
    slow.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - start < 1.0
    slow.join()


def test_health_is_starting_until_warm_up_is_done(monkeypatch):
    server = build(allowed_hosts=None)
    release = threading.Event()
    monkeypatch.setattr(server.scheduler, "warm_up", lambda: release.wait(60))
    import uvicorn  # started by hand: `Running` waits for /health 200

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    web = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=web.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.02)
    assert httpx.get(f"{url}/health").json() == {"status": "starting"}
    release.set()
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    web.should_exit = True
    thread.join(30)


def test_a_scheduler_that_cannot_go_on_refuses_at_once_and_calls_on_fatal(monkeypatch):
    fatal = threading.Event()
    server = build(warm_up=False, on_fatal=fatal.set)

    def broken():
        if scheduler.inbox.qsize() or any(scheduler.running) or scheduler.queue:
            raise RuntimeError("the device is gone")
        return False

    scheduler = server.scheduler
    monkeypatch.setattr(scheduler, "step", broken)
    running = Running(server.app)
    try:
        first = httpx.post(f"{running.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert first.status_code == 500 and "the device is gone" in first.json()["error"]["message"]
        assert fatal.wait(30)
        start = time.monotonic()
        refused = httpx.post(f"{running.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 503 and time.monotonic() - start < 5
        assert httpx.get(f"{running.url}/health").status_code == 503
    finally:
        running.stop()


def test_a_full_queue_answers_429_with_retry_after_and_serves_again_once_it_drains(monkeypatch):
    """With `max_queued` requests waiting (here the scheduler's loop is held back), the next one is a 429 with
    Retry-After that names the cause, before its body is read, counted in /metrics; the waiting one is served
    once the loop runs, and so is the refused one sent again."""
    server = build(warm_up=False)
    scheduler, gate = server.scheduler, threading.Event()
    scheduler.max_queued = 1
    serve_forever = scheduler.serve_forever
    monkeypatch.setattr(scheduler, "serve_forever", lambda stop, **kw: (gate.wait(), serve_forever(stop, **kw)))
    running = Running(server.app)
    body = {"prompt": "queued", "max_tokens": 2}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{running.url}/v1/completions", json=body, timeout=60)
            while scheduler.num_queued < 1:
                time.sleep(0.01)
            refused = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and "1 requests are waiting" in error["message"]
            unread = httpx.post(  # refused before its body is read, so not a 400
                f"{running.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert unread.status_code == 429
            assert "duo_jax_refused_busy_total 2" in httpx.get(f"{running.url}/metrics").text
            gate.set()
            assert first.result().status_code == 200
        assert httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        gate.set()
        running.stop()


def test_a_model_without_a_tokenizer_serves_token_ids_whole_or_streamed():
    server = build(tokenizer=None, warm_up=False)
    running = Running(server.app)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    try:
        whole = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["text"] == "" and whole["usage"]["completion_tokens"] == 4
        events = httpx.post(f"{running.url}/v1/completions", json=dict(body, stream=True), timeout=60).text
        chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == 4 and events.rstrip().endswith("data: [DONE]")
        text = httpx.post(f"{running.url}/v1/completions", json=dict(body, prompt="words"), timeout=60)
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]
    finally:
        running.stop()


def test_the_default_host_allow_list_follows_the_bind_address():
    from duo_jax.serve.protocol import default_hosts

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert "localhost" in default_hosts(host)
    assert default_hosts("0.0.0.0") is None and default_hosts("192.168.1.5") is None


@pytest.mark.slow
def test_memory_is_released_once_after_a_burst():
    """on_quiet (release_memory by default) runs once the API has been quiet for QUIET_S, not per request,
    and not for /health polls."""
    from duo_jax.serve import server as server_module

    quiet = []
    server = build(warm_up=False, on_quiet=lambda: quiet.append(time.monotonic()))
    running = Running(server.app)
    try:
        for _ in range(3):
            assert (
                httpx.post(
                    f"{running.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=120
                ).status_code
                == 200
            )
        end = time.monotonic()
        time.sleep(server_module.QUIET_S + 0.5)
        assert len(quiet) == 1 and quiet[0] - end >= server_module.QUIET_S * 0.9
        httpx.get(f"{running.url}/health")
        time.sleep(server_module.QUIET_S + 0.3)
        assert len(quiet) == 1
    finally:
        running.stop()
    server_module.release_memory()  # the real one runs (glibc or not)
