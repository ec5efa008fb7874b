"""Chat templates: a conversation rendered into an instruct model's prompt, exactly as transformers renders it.

`render` runs the model's Jinja chat template (from its GGUF metadata or Hugging Face files, read by
`duo_jax.tokenizer`) in the environment transformers' ``apply_chat_template`` builds, with
``add_generation_prompt=True``; the result is tokenized without adding special tokens. `chat_prompts` is what
`generate(..., chat=)` calls, with the rule of Hugging Face's text-generation pipeline and vLLM: a plain string is
completion text, a conversation gets the template, chat=True wraps plain strings too; token-id prompts are never
wrapped. `is_chat_model` is the command lines' default. Design: docs/engine.md, "Chat templates".
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from duo_jax.errors import DuoJaxError
from duo_jax.tokenizer import require

Message = dict[str, Any]  # {"role": "system" | "developer" | "user" | "assistant", "content": str}

# The roles a conversation may use, each to the role the template renders (OpenAI's developer is the system
# message of the templates here); the server checks requests against the same table.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TOOL_KEYS = ("tool_calls", "tool_call_id", "function_call")

_CHAT_NAME = re.compile(r"instruct|chat", re.IGNORECASE)


def is_chat_model(model) -> bool:
    """Whether the command lines apply the chat template by default: the model has a template and one of its names
    (named config's Hugging Face repo, GGUF general.name / finetune / file name, config.json's _name_or_path,
    directory name) says "instruct" or "chat"."""
    return (
        getattr(model.tokenizer, "chat_template", None) is not None  # None too for duck-typed tokenizers
        and any(_CHAT_NAME.search(name) for name in model.names)
    )


def render(
    template: str, messages: Sequence[Message], *, add_generation_prompt: bool = True, **special_tokens: str
) -> str:
    """The prompt text of conversation `messages` (checked by `check_messages`: developer renders as system) under
    chat `template`; special_tokens: bos_token, eos_token. `tools` and `documents` are None, as transformers'
    `apply_chat_template` passes them without tools: a template that tests `tools is not none` renders as there.
    Any error the template raises is a DuoJaxError naming it (the template is code shipped with the model)."""
    import jinja2

    messages = check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **special_tokens,
        )
    except jinja2.TemplateError as e:
        raise DuoJaxError(f"the model's chat template rejected the conversation: {e}") from None
    except Exception as e:  # a template bug (e.g. a TypeError from a filter): not a traceback into Jinja
        raise DuoJaxError(
            f"the model's chat template failed on the conversation ({type(e).__name__}: {e}); the template does "
            "not handle it: fix the template, or send the text without it (chat=False, --no-chat, /v1/completions)"
        ) from None


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise DuoJaxError(f"the model's chat template is not valid Jinja: {e}") from None


def check_messages(messages: Sequence[Message]) -> list[Message]:
    """`messages` checked and with their roles as rendered (`ROLES`: developer becomes system). Refused, rather than
    rendered literally or dropped by a template: an unknown role, and any key but role and content (tool calls)."""
    out = []
    for message in messages:
        if isinstance(message, dict) and (message.get("role") == "tool" or any(k in message for k in _TOOL_KEYS)):
            raise DuoJaxError(
                f"tool calls are not supported (no tools run here), got {message!r:.80}; send the conversation as "
                "system, user and assistant messages of text"
            )
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise DuoJaxError(f"a chat message must be a dict with 'role' and 'content', got {message!r:.80}")
        role = message["role"]
        if role not in ROLES:
            raise DuoJaxError(f"a chat message's role must be one of {', '.join(ROLES)}, got {role!r}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise DuoJaxError(
                f"a chat message takes 'role' and 'content' only, got {extra[0]!r} in {message!r:.80}; remove it"
            )
        if not isinstance(message["content"], str):
            raise DuoJaxError(
                f"a chat message's content must be a string, got {type(message['content']).__name__} in {message!r:.80}"
            )
        out.append({"role": ROLES[role], "content": message["content"]})
    return out


def _conversation(prompt) -> list[Message] | None:
    """`prompt` as a conversation: a string is one user message; a list of messages is itself (checked); else
    None."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return check_messages(prompt)
    return None


def chat_prompts(model, prompts, chat: bool | None):
    """`prompts` for `generate` with chat applied: each conversation (and, with chat=True, each text) becomes
    the token ids of its rendered template; token-id prompts pass unchanged. chat=None: conversations get the
    template, texts are completion text (on a chat model, with a FutureWarning for one release: the template was
    the default); chat=False: texts pass unchanged and conversations are an error."""
    if chat is not None and not isinstance(chat, bool):  # chat=0 would pass for False, "no" for True
        raise DuoJaxError(f"chat must be None, True or False, got {chat!r}")
    # A batch is a list of texts, conversations or token-id lists; anything else is one prompt.
    is_batch = isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (str, list, tuple))
    batch = list(prompts) if is_batch else [prompts]
    conversations = [_conversation(p) for p in batch]
    has_messages = any(c is not None and not isinstance(p, str) for c, p in zip(conversations, batch))
    if all(c is None for c in conversations):
        if chat:
            raise DuoJaxError("chat=True needs text prompts or messages; token-id prompts are never wrapped")
        return prompts
    if chat is None and is_chat_model(model) and any(isinstance(p, str) for p in batch):
        # stacklevel 4: chat_prompts <- plan_generation <- generate <- the caller
        warnings.warn(
            f"generate() treats a plain-string prompt as completion text, without {model.config.name}'s chat "
            "template; pass chat=True or a list of messages for the template, chat=False to silence this warning",
            FutureWarning,
            stacklevel=4,
        )
    if chat is False:
        if has_messages:
            raise DuoJaxError("chat messages need the chat template; pass chat=True (or leave chat unset)")
        return prompts
    if chat is None and not has_messages:
        return prompts
    tokenizer = require(model.tokenizer, "chat")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DuoJaxError(
            "this model ships no chat template (GGUF tokenizer.chat_template, chat_template.jinja or "
            "tokenizer_config.json); pass chat=False (--no-chat) to send the raw text"
        )
    wrap = [c is not None and (chat or not isinstance(p, str)) for p, c in zip(batch, conversations)]
    return [
        p
        if not w
        else tokenizer.encode(render(tokenizer.chat_template, c, **tokenizer.special_tokens), add_special_tokens=False)
        for p, c, w in zip(batch, conversations, wrap)
    ]
