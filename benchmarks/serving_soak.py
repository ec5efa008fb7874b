"""Serving soak: a few hundred mixed requests against `python -m duo_jax.serve` (started here as a
subprocess), through the official `openai` client, `--concurrency` at a time:

  valid      completions and chats, whole or streamed, with random temperature / top_p / top_k (top_k beyond
             the vocabulary included), max_tokens, stop strings, text content parts
  aborted    streams closed by the client after their first chunk
  invalid    bad fields (NaN temperature, top_p 0, an unknown role, content 5, a lone surrogate, a JSON
             response_format, an unknown field), a wrong API key, a body over --max-request-bytes, a prompt
             over the context (large text, tokenized off the event loop)

Recorded: requests/s over the run, time to first token of the streamed valid requests (from the call to
the first chunk carrying text; p50 / p95), the
latency of /health polled during the run (p50 / max: whether the event loop stalls), outcomes by kind
(expected refusals by status, and anything unexpected), and the server's resident memory (VmRSS) when warm
(after warm-up, a first round of requests and a few idle seconds), at its peak during the run, and after it
(idle as long). The host's load average before and after is noted (a shared machine's figures vary with it).
The run fails (exit 1) on any unexpected outcome: a 500, a hang, a refusal of a valid request, an invalid
request accepted.

    pip install openai
    python benchmarks/serving_soak.py                              # 300 requests, 8 at a time, smollm2-135m
    python benchmarks/serving_soak.py --requests 60 --concurrency 4
    python benchmarks/serving_soak.py --concurrency 48 --max-queued 8    # a burst past the queue limit: 429s

With more clients than `--max-queued`, a request the full queue refuses (429) is an outcome of its own, and the
JSON is serving_soak_<model>_burst.json.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import common
import numpy as np

KEY = "soak-key"
IDLE_S = 5  # seconds idle before the warm and the after readings of resident memory


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "duo_jax.serve",
        "--model",
        args.model,
        "--pattern",
        args.pattern,
        "--context",
        str(args.context),
        "--kv-memory-mb",
        str(args.kv_memory_mb),
        "--slots",
        str(args.slots),
        "--chunk",
        str(args.chunk),
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--max-request-bytes",
        str(args.max_request_bytes),
        "--max-queued",
        str(args.max_queued),
    ]
    args.server_log = tempfile.NamedTemporaryFile("w", prefix="serving_soak_server_", suffix=".log", delete=False)
    log = args.server_log
    return subprocess.Popen(
        command,
        cwd=common.REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(common.REPO)),
    )


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


INVALID = {
    "temperature_nan": ("completion", dict(prompt="Hi", temperature=float("nan"))),
    "top_p_zero": ("completion", dict(prompt="Hi", top_p=0)),
    "unknown_role": ("chat", dict(messages=[{"role": "wizard", "content": "hi"}])),
    "content_number": ("chat", dict(messages=[{"role": "user", "content": 5}])),
    "lone_surrogate": ("completion", dict(prompt="\ud800")),
    "json_format": (
        "chat",
        dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}),
    ),
    "unknown_field": ("completion", dict(prompt="Hi", extra_body={"frobnicate": 1})),
}

RAW = ("temperature_nan", "lone_surrogate")


def one(kind: str, rng: random.Random, clients: dict, args) -> tuple[str, float | None]:
    """Run one request of `kind`; (outcome, TTFT seconds of a valid stream or None). A 429 (the server's queue
    full) is an outcome of its own where more clients than `--max-queued` can be waiting, else unexpected."""
    import openai

    try:
        return _one(kind, rng, clients, args)
    except openai.RateLimitError:
        return _busy(args), None


def _burst(args) -> bool:
    """Whether more clients than `--max-queued` can wait, so that a full queue's 429 is expected."""
    return args.concurrency > args.max_queued


def _busy(args) -> str:
    return "refused 429" if _burst(args) else "UNEXPECTED 429"


def _one(kind: str, rng: random.Random, clients: dict, args) -> tuple[str, float | None]:
    import openai

    client = clients["ok"]
    if kind == "valid":
        sampling = dict(
            temperature=rng.choice([0, 0, rng.uniform(0.1, 1.5)]),
            top_p=rng.choice([1, rng.uniform(0.5, 1)]),
            max_tokens=rng.randint(1, args.max_tokens),
            seed=rng.randint(0, 1000),
        )
        top_k = rng.choice([0, rng.randint(1, 100), 50000])
        extra = {"extra_body": {"top_k": top_k}} if top_k else {}
        if rng.random() < 0.3:
            sampling["stop"] = [rng.choice([".", "\n", " the"])]
        stream = rng.random() < 0.5
        text = rng.choice(args.texts)
        start = time.perf_counter()
        if rng.random() < 0.5:
            content = text if rng.random() < 0.5 else [{"type": "text", "text": text}]
            response = client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": content}], stream=stream, **sampling, **extra
            )
        else:
            response = client.completions.create(model=args.model, prompt=text, stream=stream, **sampling, **extra)
        ttft = None
        if stream:
            for chunk in response:  # the first chunk with text (a chat's first chunk holds only the role)
                choice = chunk.choices[0] if chunk.choices else None
                got = choice and (choice.delta.content if hasattr(choice, "delta") else choice.text)
                if ttft is None and got:
                    ttft = time.perf_counter() - start
        return "ok", ttft
    if kind == "aborted":
        with client.completions.create(
            model=args.model, prompt=rng.choice(args.texts), max_tokens=64, stream=True
        ) as response:
            next(iter(response))
        return "aborted", None
    if kind == "wrong_key":
        try:
            clients["wrong"].completions.create(model=args.model, prompt="Hi", max_tokens=2)
        except openai.AuthenticationError:
            return "refused 401", None
        return "UNEXPECTED accepted", None
    if kind == "too_large":
        try:
            client.completions.create(model=args.model, prompt="x" * (args.max_request_bytes + 1), max_tokens=2)
        except openai.APIStatusError as e:
            return f"refused {e.status_code}" if e.status_code == 413 else f"UNEXPECTED {e.status_code}", None
        return "UNEXPECTED accepted", None
    if kind == "over_context":
        try:
            client.completions.create(
                model=args.model, prompt="lorem ipsum " * (args.max_request_bytes // 16), max_tokens=2
            )
        except openai.BadRequestError:
            return "refused 400", None
        return "UNEXPECTED accepted", None
    endpoint, body = INVALID[kind]
    body = dict(body, max_tokens=2)
    if kind in RAW:  # what the openai client will not encode (NaN, lone surrogates), as other clients send it
        import httpx

        response = httpx.post(
            f"{client.base_url}{'chat/completions' if endpoint == 'chat' else 'completions'}",
            content=json.dumps(dict(body, model=args.model)),
            timeout=args.timeout,
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
        if response.status_code == 429:
            return _busy(args), None
        return ("refused 400" if response.status_code == 400 else f"UNEXPECTED {response.status_code}"), None
    try:
        if endpoint == "chat":
            client.chat.completions.create(model=args.model, **body)
        else:
            client.completions.create(model=args.model, **body)
    except openai.BadRequestError:
        return "refused 400", None
    return "UNEXPECTED accepted", None


def main(argv=None) -> int:
    p = common.parser(__doc__, "serving_soak")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pattern", default="default")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens of a valid request")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-memory-mb", type=float, default=64)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-queued", type=int, default=256, help="the server's queue limit (below --concurrency: 429s expected)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take before it counts as hung")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import httpx
    import openai

    args.texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "Once upon a time, in a small town,",
        "List three prime numbers:",
        "def fibonacci(n):",
        "The best thing about long context models is",
    ]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        ready_s = wait_ready(url, server, 900)
        clients = {
            name: openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=args.timeout, max_retries=0)
            for name, key in (("ok", KEY), ("wrong", "not-the-key"))
        }
        rng = random.Random(args.seed)
        for _ in range(2 * args.slots):  # the warm round
            one("valid", rng, clients, args)
        time.sleep(IDLE_S)  # idle as long as before the "after" reading (the server trims after a quiet second)
        warm = rss_mb(server.pid)
        load = [os.getloadavg()[0]]
        kinds = (
            ["valid"] * 60
            + ["aborted"] * 10
            + ["wrong_key"] * 3
            + ["too_large"] * 3
            + ["over_context"] * 4
            + list(INVALID) * 3
        )
        plan = [rng.choice(kinds) for _ in range(args.requests)]
        seeds = [rng.randrange(1 << 30) for _ in plan]
        peak, health, done = [warm], [], threading.Event()

        def watch():
            while not done.is_set():
                peak.append(rss_mb(server.pid))
                start = time.perf_counter()
                try:
                    httpx.get(f"{url}/health", timeout=60)
                    health.append(time.perf_counter() - start)
                except httpx.HTTPError:
                    health.append(float("inf"))
                time.sleep(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outcomes, ttfts, by_kind = collections.Counter(), [], collections.defaultdict(collections.Counter)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = {
                pool.submit(one, kind, random.Random(seed), clients, args): kind for kind, seed in zip(plan, seeds)
            }
            for future in concurrent.futures.as_completed(futures):
                try:
                    outcome, ttft = future.result()
                except openai.APIStatusError as e:
                    outcome, ttft = f"UNEXPECTED {e.status_code}: {str(e)[:120]}", None
                except Exception as e:  # a hang (timeout) or a dropped connection
                    outcome, ttft = f"UNEXPECTED {type(e).__name__}", None
                outcomes[outcome] += 1
                by_kind[futures[future]][outcome] += 1
                if ttft is not None:
                    ttfts.append(ttft)
        wall = time.perf_counter() - start
        done.set()
        watcher.join()
        load.append(os.getloadavg()[0])
        time.sleep(IDLE_S)
        after = rss_mb(server.pid)
        alive = server.poll() is None and httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        server.wait(60)
    unexpected = sum(n for o, n in outcomes.items() if o.startswith("UNEXPECTED"))
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else float("nan")  # noqa: E731
    rows = [
        [
            len(plan),
            args.concurrency,
            round(len(plan) / wall, 2),
            round(ms(ttfts, 50)),
            round(ms(ttfts, 95)),
            round(ms(health, 50)),
            round(max(health) * 1e3) if health else None,
            round(warm),
            round(max(peak)),
            round(after),
            unexpected,
        ]
    ]
    headers = [
        "requests",
        "concurrency",
        "req/s",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "/health p50 ms",
        "/health max ms",
        "RSS warm MB",
        "RSS peak MB",
        "RSS after MB",
        "unexpected",
    ]
    print(f"server log: {args.server_log.name}")
    notes = [
        f"server ready after {ready_s:.1f} s (load + warm-up); alive and healthy after the run: {alive}",
        f"outcomes: {dict(outcomes)}",
        f"RSS after / warm: {after / warm:.3f}",
        f"1-minute load average before / after the run: {load[0]:.1f} / {load[1]:.1f} (on {os.cpu_count()} CPUs)",
    ]
    common.write_result(
        args.out,
        f"serving_soak_{args.model}" + ("_burst" if _burst(args) else ""),
        title="Serving soak (HTTP, openai client)",
        headers=headers,
        rows=rows,
        notes=notes,
        data=dict(
            outcomes=dict(outcomes),
            by_kind={k: dict(v) for k, v in by_kind.items()},
            ready_s=ready_s,
            wall_s=wall,
            ttft_s=ttfts,
            rss_mb=dict(warm=warm, peak=max(peak), after=after),
            health_s=[h for h in health if np.isfinite(h)],
            alive=alive,
            settings={k: v for k, v in vars(args).items() if k not in ("out", "texts", "server_log")},
        ),
    )
    return 0 if unexpected == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(common.run(main))
