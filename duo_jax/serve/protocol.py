"""The request bodies the server accepts, checked before anything is admitted: the fields of `/v1/completions`
and `/v1/chat/completions` as OpenAI defines them; and the server's request defaults (body size, Host names).
A bad field is a `BadRequest` (HTTP 400) whose message names it and says what it takes; a field this server
does not know, or an option it cannot honour (`n` > 1, logprobs, penalties, tools, a `response_format` other
than text), is refused rather than ignored. Sampling values are checked by `duo_jax.sampling.check_sampling`,
as `infer.py` and `generate` check theirs.

Chat messages: role system, developer (rendered as system), user or assistant; content a string or a list of
text parts ({"type": "text", "text": ...}, joined with newlines, as vLLM joins them).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets

from duo_jax.chat import ROLES
from duo_jax.errors import InvalidOption
from duo_jax.sampling import Sampling, check_number, check_sampling, check_seed

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a 1M-token prompt as text or token ids fits
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_hosts(host: str) -> list[str] | None:
    """The Host names the server accepts by default when bound to `host`: the local ones on a loopback
    address (against DNS rebinding), else any (None)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return list(LOCAL_HOSTS) if loopback else None


class BadRequest(InvalidOption):
    """A request the server refuses: HTTP `status`, OpenAI error `kind`, and the field at fault (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message, param)
        self.status, self.kind = status, kind


# Options this server does not implement, with the values that ask for nothing (accepted).
INERT = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "metadata",
    "store",
    *INERT,
}
FIELDS = {False: COMMON | {"prompt"}, True: COMMON | {"messages", "response_format", "parallel_tool_calls"}}


@dataclasses.dataclass
class Parsed:
    """A checked request: `prompt` (text or token ids) for a completion, `messages` for a chat."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None  # None: not given (the server's default: `Server.max_tokens`)
    sampling: Sampling
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = True  # streamed: usage in the last chunk (stream_options may turn it off)


def text(value, name: str) -> str:
    """`value` if it is a string of valid Unicode (JSON can carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string, got {type(value).__name__}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            f"{name} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): send valid Unicode text", name
        ) from None
    return value


def _option(body: dict, name: str, default, **limits):
    value = body.get(name)
    if value is None:
        return default
    try:
        return check_number(name, value, **limits)
    except InvalidOption as e:
        raise BadRequest(str(e), name) from None


def parse(body, *, chat: bool, model: str) -> Parsed:
    """The checked request in `body` (the parsed JSON) for the chat or completions endpoint of model `model`."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise BadRequest(
            f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(FIELDS[chat]))}", unknown[0]
        )
    if body.get("model") not in (None, model):
        raise BadRequest(
            f"model {body['model']!r} is not served here (this server: {model!r})", "model", 404, "model_not_found"
        )
    for name, inert in INERT.items():
        value = body.get(name)
        if not any(value is v or value == v and isinstance(value, bool) == isinstance(v, bool) for v in inert):
            raise BadRequest(f"{name!r} is not supported by this server (leave it out)", name)
    if _option(body, "n", 1, integer=True) != 1:
        raise BadRequest("only n = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise BadRequest(
            "'stream_options' takes only {\"include_usage\": bool} (usage comes in the last chunk unless false)",
            "stream_options",
        )
    include_usage = True if options is None else options.get("include_usage", True)
    checked = (("user", str, "a string"), ("metadata", dict, "an object"), ("store", bool, "a bool"))
    checked += (("parallel_tool_calls", bool, "a bool"),)  # no tools run here, but a wrong type is a client's bug
    for name, kind, what in checked:
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise BadRequest(f"{name!r} must be {what}, got {body[name]!r:.40}", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest(
            '\'response_format\' supports only {"type": "text"}: this server does not constrain output to JSON',
            "response_format",
        )
    limits = [name for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]
    max_tokens = [_option(body, name, None, integer=True, minimum=1) for name in limits] or [None]
    if len(set(max_tokens)) > 1:
        raise BadRequest("'max_tokens' and 'max_completion_tokens' differ: send one", "max_completion_tokens")
    try:
        sampling = check_sampling(
            *(
                body[name] if body.get(name) is not None else default
                for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0))
            )
        )
    except InvalidOption as e:
        raise BadRequest(str(e), e.param) from None
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    for i, s in enumerate(stop):
        text(s, f"stop[{i}]")
    try:  # without a seed, a fresh one: sampled requests differ, as OpenAI's do
        seed = secrets.randbits(32) if body.get("seed") is None else check_seed(body["seed"])
    except InvalidOption as e:
        raise BadRequest(str(e), "seed") from None
    prompt = messages = None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    return Parsed(prompt, messages, max_tokens[0], sampling, seed, tuple(stop), stream, include_usage)


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text(prompt, "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} messages", "messages")
    out = []
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{name} must be an object {{role, content}}", name)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise BadRequest(
                f"{name}.{extra[0]} is not supported (a message takes role and content)", f"{name}.{extra[0]}"
            )
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"{name}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{name}.role")
        out.append({"role": ROLES[role], "content": _content(message.get("content"), f"{name}.content")})
    return out


def _content(content, name: str) -> str:
    if isinstance(content, str):
        return text(content, name)
    if not isinstance(content, list) or not content:
        raise BadRequest(
            f"{name} must be a string or a non-empty list of text parts "
            f'[{{"type": "text", "text": ...}}], got {content!r:.40}',
            name,
        )
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) - {"type", "text"}:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f'{name}[{j}] must be a text part {{"type": "text", "text": ...}} (this server '
                f"reads text only), got {kind!r}",
                f"{name}[{j}]",
            )
        parts.append(text(part.get("text"), f"{name}[{j}].text"))
    return "\n".join(parts)
