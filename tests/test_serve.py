"""The HTTP server on localhost, driven by a real HTTP client (httpx): concurrent streaming and non-streaming
completions give the text each prompt gets alone (greedy), bad requests get 4xx JSON and the server keeps
serving, and shutdown finishes the responses in flight."""

import concurrent.futures
import json
import socket
import threading
import time

import jax
import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import duo_jax  # noqa: E402
from duo_jax.cache import make_layout  # noqa: E402
from duo_jax.engine import Engine  # noqa: E402
from duo_jax.methods.duo import DuoAttention  # noqa: E402
from duo_jax.methods.paged import paged  # noqa: E402
from duo_jax.serve import Scheduler  # noqa: E402
from duo_jax.serve.server import Server, held_back  # noqa: E402
from tests.conftest import BPETokenizer, tiny_config  # noqa: E402

CONFIG = tiny_config(vocab_size=2000)
CHUNK, NEW = 8, 6
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


class ChatTokenizer(BPETokenizer):
    chat_template, special_tokens = TEMPLATE, {}

    def encode(self, text, add_special_tokens=True):
        return super().encode(text)


class Running:
    """A uvicorn server on a free localhost port, in a thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        while httpx.get(f"{self.url}/health").status_code != 200:  # 503 "starting" while warm-up compiles
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served():
    model = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), ChatTokenizer(), "tiny")
    method = DuoAttention(make_layout(CONFIG, np.array([[True, False], [False, True]]), sink=2, recent=5, context=64))
    scheduler = Scheduler(
        Engine.of(model),
        paged(method, page_size=4, num_pages=40),
        slots=3,
        chunk=CHUNK,
        impl="xla",
        detokenize=model.tokenizer.decode,
    )
    server = Server(scheduler, model, "tiny")
    running = Running(server.app)
    running.scheduler = scheduler

    def solo(ids):
        out = duo_jax.generate(model, ids, method=method, max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False)
        return model.tokenizer.decode(out.tokens[0])

    yield running, model, solo
    if running.thread.is_alive():
        running.stop()


def complete(url, body):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def stream(url, path, body):
    """The deltas of a streamed completion and its last chunk."""
    deltas, chunks = [], []
    with httpx.stream("POST", f"{url}{path}", json=dict(body, stream=True), timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line.removeprefix("data: ")))
        choice = chunks[-1]["choices"][0]
        deltas.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
    return "".join(deltas), chunks[-1]


@pytest.mark.slow
def test_concurrent_completions_match_solo_generation(served):
    running, model, solo = served
    texts = ["The best thing to do in San Francisco", "It was a bright cold day", "Startups grow"]
    ids = [model.tokenizer.encode(t) for t in texts]
    greedy = dict(max_tokens=NEW, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = pool.submit(complete, running.url, dict(greedy, prompt=texts[0], model="tiny"))
        by_ids = pool.submit(complete, running.url, dict(greedy, prompt=ids[1]))
        streamed = pool.submit(stream, running.url, "/v1/completions", dict(greedy, prompt=texts[2]))
        chat = pool.submit(
            stream, running.url, "/v1/chat/completions", dict(greedy, messages=[{"role": "user", "content": texts[0]}])
        )
        plain, by_ids, (streamed, last), (chat_text, chat_last) = (f.result() for f in (plain, by_ids, streamed, chat))
    assert plain.status_code == 200 and by_ids.status_code == 200
    assert plain.json()["choices"][0]["text"] == solo(ids[0])
    assert plain.json()["usage"] == dict(
        prompt_tokens=len(ids[0]), completion_tokens=NEW, total_tokens=len(ids[0]) + NEW
    )
    assert by_ids.json()["choices"][0]["text"] == solo(ids[1])
    assert streamed == solo(ids[2]) and last["choices"][0]["finish_reason"] == "length"
    chat_ids = model.tokenizer.encode(f"<user>{texts[0]}\n<assistant>")
    assert chat_text == solo(chat_ids) and chat_last["object"] == "chat.completion.chunk"
    metrics = httpx.get(f"{running.url}/metrics").text
    assert "duo_jax_requests_finished_total 4" in metrics and "duo_jax_pages_in_use 0" in metrics


@pytest.mark.parametrize(
    "body, status, message",
    [
        ("{not json", 400, "not JSON"),
        ({"max_tokens": 4}, 400, "'prompt'"),
        ({"prompt": "hi", "max_tokens": 500}, 400, "exceeds"),
        ({"prompt": "hi", "max_tokens": "four"}, 400, "integer"),
        ({"prompt": "hi", "n": 2}, 400, "n = 1"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "'stop'"),
        ({"prompt": "hi", "stop": [""]}, 400, "'stop'"),
        ({"prompt": [1, 99999]}, 400, "token ids"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "not served"),
    ],
)
@pytest.mark.slow
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(served, body, status, message):
    running, model, solo = served
    kwargs = (
        dict(content=body, headers={"content-type": "application/json"}) if isinstance(body, str) else dict(json=body)
    )
    response = httpx.post(f"{running.url}/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status and message in response.json()["error"]["message"]
    assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}


def metric(url, name):
    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(f"duo_jax_{name} "))
    return int(line.split()[1])


@pytest.mark.slow
def test_stop_strings_end_the_text_before_them_streamed_or_not(served):
    """A stop string (spanning tokens) ends generation: the text is the solo text up to it, whole or streamed
    (no chunk shows the stop string or a part of it), with finish_reason "stop"."""
    running, model, solo = served
    ids = model.tokenizer.encode("It was a bright cold day")
    text = solo(ids)
    assert len(text) >= 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    body = dict(prompt=ids, max_tokens=NEW, temperature=0, stop=["never in it \x00", stop])
    plain = complete(running.url, body).json()
    streamed, last = stream(running.url, "/v1/completions", body)
    assert plain["choices"][0]["text"] == streamed == expected
    assert plain["choices"][0]["finish_reason"] == last["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < NEW or text.endswith(stop)
    single = complete(running.url, dict(body, stop=stop)).json()  # a string, not a list
    assert single["choices"][0]["text"] == expected
    # What a stream holds back: the longest tail that begins a stop string (it may still complete).
    assert held_back("the end", ["end.", "xx"]) == 3 and held_back("abx", ["xyz", "bx!"]) == 2
    assert held_back("abc", ["zz", "c"]) == 0  # a whole stop string is cut, not held


def test_a_client_that_disconnects_mid_stream_frees_its_pages(served, monkeypatch):
    """A real streaming client closes the connection after its first chunk: the request is cancelled (not run
    to its 50 tokens) and its pages go back to the pool. Steps are slowed to 100 ms here, so that the tiny
    model cannot finish the 50 tokens before the disconnect reaches the server."""
    running, model, _ = served
    step = running.scheduler.step
    monkeypatch.setattr(running.scheduler, "step", lambda: time.sleep(0.1) or step())
    cancelled, tokens = metric(running.url, "cancelled_total"), metric(running.url, "generated_tokens_total")
    body = dict(prompt=model.tokenizer.encode("A client that leaves early"), max_tokens=50, temperature=0, stream=True)
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()  # held: closing it (even by garbage collection) closes the connection
        first = next(line for line in lines if line)
        assert first.startswith("data: ") and metric(running.url, "pages_in_use") > 0
        assert metric(running.url, "cancelled_total") == cancelled
    deadline = time.monotonic() + 60
    while metric(running.url, "cancelled_total") == cancelled or metric(running.url, "pages_in_use"):
        assert time.monotonic() < deadline, "the disconnected request kept its pages"
        time.sleep(0.02)
    assert metric(running.url, "requests_running") == 0
    assert metric(running.url, "generated_tokens_total") < tokens + 50


def test_shutdown_finishes_responses_in_flight(served, monkeypatch):
    """Shutdown while two requests of 40 tokens run: both responses come back whole, then the port closes. Each
    scheduler step is slowed by 20 ms, so that on a loaded machine too the first request cannot finish before
    the second is admitted."""
    running, model, _ = served
    step = running.scheduler.step
    monkeypatch.setattr(running.scheduler, "step", lambda: time.sleep(0.02) or step())
    body = dict(prompt=model.tokenizer.encode("A last request before closing"), max_tokens=40, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream, running.url, "/v1/completions", body)
        plain = pool.submit(complete, running.url, body)
        deadline = time.monotonic() + 60
        while "duo_jax_requests_running 2" not in httpx.get(f"{running.url}/metrics").text:
            assert time.monotonic() < deadline and not plain.done(), "the two requests never ran together"
            time.sleep(0.01)
        running.stop()
        (text, last), plain = streamed.result(), plain.result()
    assert plain.status_code == 200 and text == plain.json()["choices"][0]["text"]
    assert last["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"] == 40
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health")
