"""Tokenizers: a thin wrapper over Hugging Face `tokenizers`, built from `tokenizer.json` or GGUF metadata,
with the model's chat template when it ships one (rendered by `duo_jax.chat`)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from duo_jax.errors import DuoJaxError, LoadError

# llama.cpp's pre-tokenizer names (GGUF `tokenizer.ggml.pre`) -> the split regex its vocabulary was
# trained with, as the model's own tokenizer.json writes it. Qwen's differs from Llama 3's in one place:
# every digit is its own piece (\p{N}, not \p{N}{1,3}); its tokenizer.json also NFC-normalises first.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_NFC = {"qwen2"}
# llama.cpp's LLAMA3 pre-tokenizer type (llama-vocab.cpp): a word that is one vocabulary entry is that token, even
# where the merges cannot build it (tokenizer.json's BPE `ignore_merges`), and BOS is added unless the GGUF says not.
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3"}
# Pre-tokenizers without a split regex of their own: GPT-2's byte-level regex, SmolLM's digit splitting.
_OTHER_PRE = ("gpt-2", "smollm")


class Tokenizer:
    """Text <-> token ids. `encode` adds BOS only when the model's tokenizer is configured to.

    chat_template: the model's Jinja chat template, or None. special_tokens: what the template may name
    (bos_token, eos_token), as transformers passes them.
    """

    def __init__(
        self,
        backend,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        clean_up_spaces: bool | None = False,
    ):
        self.backend = backend  # a `tokenizers.Tokenizer`
        # transformers' clean_up_tokenization_spaces (`decode`); None: the tokenizer's config does not say, and
        # decode does not clean up, as transformers has not since 4.45 (`cleaning_up_unless_set`: as before)
        self.clean_up_spaces = clean_up_spaces
        self.clean_up_assumed = False
        self.tokenizer_class: str | None = None  # tokenizer_config.json's, where there is one
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        if special_tokens is None:
            special_tokens = {
                name: backend.id_to_token(i)
                for name, i in (("bos_token", bos_id), ("eos_token", self.eos_ids[0] if self.eos_ids else None))
                if i is not None and backend.id_to_token(i) is not None
            }
        self.special_tokens = special_tokens

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the backend's error: "TextInputSequence must be str"
            raise DuoJaxError(
                f"the text is not valid Unicode: {e.reason} at character {e.start} ({text[e.start : e.end]!r}); a "
                "lone surrogate comes from bytes that are not UTF-8 (e.g. a command-line argument in another encoding)"
            ) from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def cleaning_up_unless_set(self) -> Tokenizer:
        """This tokenizer, decoding with the spaces cleaned up where its config does not say (None) and its
        `tokenizer_class` has no default of its own: what transformers did before 4.45, e.g. the 4.31 that
        LongBench's requirements pin (whose Llama and Code Llama tokenizers default to no clean-up)."""
        if self.clean_up_spaces is not None or self.tokenizer_class in NO_CLEAN_UP_CLASSES:
            return self
        tokenizer = copy.copy(self)
        tokenizer.clean_up_spaces = True
        tokenizer.clean_up_assumed = True  # its text differs from this one's (`samples.sample_fingerprint`)
        return tokenizer

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up_spaces else text

    @classmethod
    def from_file(cls, path: Path, *, bos_id: int | None, eos_ids: Sequence[int]) -> Tokenizer:
        """A `tokenizer.json`; BOS is added when its post-processor adds it (Llama) and not otherwise.

        The chat template comes from `chat_template.jinja` next to it, else from `tokenizer_config.json`
        (its `chat_template`: a string, or a list of {name, template} of which "default" is used), where
        the `bos_token` / `eos_token` strings the template sees are read too, as transformers reads them.
        """
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise LoadError(
                f"{path} is not a tokenizer.json that Hugging Face tokenizers can read ({e}); re-download it "
                "with the model, or remove it to load the model without a tokenizer"
            ) from None
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and len(probe) > 0 and probe[0] == bos_id
        config_path = path.parent / "tokenizer_config.json"
        tokenizer_config = {}
        if config_path.is_file():
            try:
                tokenizer_config = json.loads(config_path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise LoadError(f"{config_path} is not valid JSON ({e})") from None
            if not isinstance(tokenizer_config, dict):
                raise LoadError(f"{config_path} is not a JSON object")
        jinja = path.parent / "chat_template.jinja"  # transformers' newer form, read before the config's field
        template = (
            jinja.read_text()
            if jinja.is_file()
            else _config_template(tokenizer_config.get("chat_template"), config_path)
        )
        clean_up = tokenizer_config.get("clean_up_tokenization_spaces")
        tokenizer = cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=template,
            # what transformers' decode does when the config asks (Llama 3's does): " ." -> "." and the like
            clean_up_spaces=clean_up if isinstance(clean_up, bool) else None,
        )
        if isinstance(tokenizer_config.get("tokenizer_class"), str):
            tokenizer.tokenizer_class = tokenizer_config["tokenizer_class"]
        for name in ("bos_token", "eos_token"):
            token = tokenizer_config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                tokenizer.special_tokens[name] = token
        return tokenizer

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer | None:
        """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from GGUF metadata; None for other kinds.

        The pre-tokenizer is the one `tokenizer.ggml.pre` names; a name duo-jax does not know is an error,
        since splitting text differently from training gives other tokens.
        """
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        if fields.get("tokenizer.ggml.model") != "gpt2":
            return None
        pre = fields.get("tokenizer.ggml.pre")
        if pre not in _SPLITS and pre not in _OTHER_PRE:
            raise LoadError(
                f"the GGUF's BPE pre-tokenizer (tokenizer.ggml.pre) is {pre!r}, which duo-jax does "
                f"not know (it knows {', '.join([*_SPLITS, *_OTHER_PRE])}); load the model's Hugging "
                "Face directory, whose tokenizer.json states its pre-tokenizer, instead"
            )
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if not isinstance(fields.get(key), list):
                raise LoadError(
                    f"the GGUF's BPE tokenizer (tokenizer.ggml.model gpt2) lacks {key}; the file is incomplete: "
                    "convert it again, or load the model's Hugging Face directory"
                )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = Backend(
            models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE)
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
        if pre in _SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level]
            )
        elif pre == "smollm":  # SmolLM's tokenizer.json: every digit its own token, then GPT-2 splitting
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:  # gpt-2
            backend.pre_tokenizer = byte_level
        if pre in _NFC:
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        # Control tokens (type 3) are matched whole and skipped on decode, as in the original tokenizer;
        # user-defined ones (type 4, e.g. Qwen3's <think>) are matched whole and kept on decode.
        token_types = fields.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(token_types) if kind == 3]
        )
        backend.add_tokens(
            [AddedToken(tokens[i], special=False, normalized=False) for i, kind in enumerate(token_types) if kind == 4]
        )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_ids=() if eos is None else (eos,),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRE)),
            chat_template=fields.get("tokenizer.chat_template"),
        )


def _config_template(template, config_path: Path) -> str | None:
    """tokenizer_config.json's chat template: a string, or from a list of {name, template} the one named
    "default" (None without one); any other value is a LoadError, not a model without a template."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    ):  # named templates (e.g. "default", "tool_use")
        return next((t["template"] for t in template if t["name"] == "default"), None)
    raise LoadError(
        f"{config_path}: its chat_template is malformed (a {type(template).__name__}; expected a string, or a list of "
        '{"name", "template"} strings); re-download it, or remove the chat_template field'
    )


# Tokenizer classes whose constructors default clean_up_tokenization_spaces to False (Llama 2's, Mistral's)
NO_CLEAN_UP_CLASSES = frozenset(
    {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast"}
)

# transformers' `clean_up_tokenization` (PreTrainedTokenizerBase), in its order
_CLEAN_UP = (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m")
_CLEAN_UP += (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")


def clean_up_spaces(text: str) -> str:
    """The spaces before punctuation and English contractions removed, as transformers' decode does for a
    tokenizer whose tokenizer_config.json sets `clean_up_tokenization_spaces` (Llama 3's)."""
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


PROMPT_CONTEXT = 8  # prompt ids decoded before a generation's: its text is what they add to the prompt's text
MAX_CONTEXT = 64  # ids a stream's context may widen to over text-less ids (a run of special tokens stays linear)


class TextStream:
    """The text a growing list of token ids adds after `after` (the prompt's ids; default none), equal at every
    step to `decode(after + ids)` past `decode(after)`, at a cost per added id that does not grow with the ids
    before it (decoding them all every step makes a generation's text quadratic in its length: the server's streams
    and stop strings).

    Only the ids after the last settled point are decoded, with the settled ids since the point before it as
    context: a decoder may change a sequence's first piece (SentencePiece's drops its leading space), so the new
    text is the window's decode minus the context's. The prompt's last `PROMPT_CONTEXT` ids are the first context,
    so a generation's first word keeps the space that separates it from the prompt's last (" cold" after "a
    bright", where decoding the new ids alone gives "cold"), as Hugging Face's pipelines, vLLM and OpenAI return it.
    A point settles when the text up to it ends in a whole character (a UTF-8 character split across ids decodes to
    U+FFFD until its last byte arrives). Why not `tokenizers.decoders.DecodeStream`: it returns only settled text,
    while a stop string is matched against the text as `decode` gives it, pending tail included; and any decoder
    whose window does not extend its context's text gets the whole decode after the prompt's tail instead (exact, at
    the quadratic cost)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], after: Sequence[int] = ()):
        self._decode = decode
        self._ids = [int(i) for i in list(after)[-PROMPT_CONTEXT:]]  # the prompt's tail, then the new ids
        self._start = len(self._ids)
        self._settled = ""  # the text of _ids[_start:_read]
        self._tail = ""  # the rest, a split character's U+FFFD at its end
        self._context, self._read = 0, self._start  # _ids[_context:_read]: the context decoded before the new ids
        self._context_text = decode(self._ids) if self._ids else ""

    @property
    def ids(self) -> list[int]:
        """The ids added so far."""
        return self._ids[self._start :]

    @property
    def text(self) -> str:
        return self._settled + self._tail

    @property
    def settled(self) -> str:
        """The text up to the last id after which it ended in a whole character: later ids only extend it, unless
        the decoder rewrites earlier text (then it starts again from the whole decode)."""
        return self._settled

    @property
    def pending(self) -> bool:
        """Whether the text ends inside a character (U+FFFD until its last byte arrives)."""
        return bool(self._tail)

    def extend(self, ids: Sequence[int]) -> str:
        """Add ids; the whole text so far."""
        self._ids.extend(int(i) for i in ids)
        window = self._decode(self._ids[self._context :])
        if window.startswith(self._context_text):
            self._tail = window[len(self._context_text) :]
        else:  # the context's text changed with what follows it: decode again from the prompt's tail
            head = self._decode(self._ids[: self._start]) if self._start else ""
            whole = self._decode(self._ids)
            if whole.startswith(head):
                self._tail, self._context, self._context_text = whole[len(head) :], 0, head
            else:  # the prompt's own text changed: the new ids' text alone
                self._tail, self._context, self._context_text = self._decode(self.ids), self._start, ""
            self._settled, self._read = "", self._start
        if self._tail and not self._tail.endswith("\ufffd"):
            self._settled += self._tail
            context, text = self._read, self._decode(self._ids[self._read :])
            if not text and len(self._ids) - self._context <= MAX_CONTEXT:
                # an empty context (a lone space SentencePiece strips, a skipped special token) is a prefix of any
                # window, so a byte group that the next ids make invalid would go unseen: keep the context before it
                context, text = self._context, self._decode(self._ids[self._context :])
            self._context, self._read, self._context_text = context, len(self._ids), text
            self._tail = ""
        return self.text


def generated_text(decode: Callable[[Sequence[int]], str], prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text generated `ids` add after `prompt` (`TextStream`): decoded alone, a SentencePiece decoder drops the
    first piece's leading space ("cold" for " cold")."""
    return TextStream(decode, after=prompt).extend(ids)


def require(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    """The tokenizer, or a clear error when the model was loaded without one."""
    if tokenizer is None:
        raise LoadError(
            f"{what} needs a tokenizer, but this model has none (no tokenizer.json next to the "
            "weights, or a GGUF tokenizer kind duo-jax cannot build); pass token ids instead"
        )
    return tokenizer
