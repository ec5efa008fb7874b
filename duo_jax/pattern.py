"""DuoAttention patterns: one gate value (alpha) per layer and KV head, and their binarisation.

A gate near 1 marks a *retrieval head* (attends to every past token), a gate near 0 a *streaming head* (attention
sinks plus a recent window). On disk a pattern is the original DuoAttention format: a folder with
`full_attention_heads.tsv` (one row per layer, one tab-separated gate per KV head) and an optional `config.json`
(the training arguments). `Pattern.retrieval_mask(sparsity)` keeps the heads whose gates reach the `sparsity`
quantile of all gates, as the original does: `N - ceil(sparsity * (N - 1))` of the N heads (none at sparsity 1),
those with the largest gates, exact ties broken by the fixed order `tie_order`, so the cache size depends only on
the sparsity. Design: docs/training.md, "Patterns".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from duo_jax import config as config_lib
from duo_jax.errors import DuoJaxError

GATES_FILE = "full_attention_heads.tsv"
META_FILE = "config.json"
DEFAULT_SPARSITY = 0.5  # the share of streaming heads a head pattern is binarised at unless told otherwise
# config.json "kind" of HeadKV head scores, saved in a pattern's format; a gate pattern's config.json (train_gates' or
# DuoAttention's training arguments) names no kind.
SCORES_KIND = "headkv_head_scores"
_WRITTEN_BY = {None: "train_gates.py", SCORES_KIND: "python -m duo_jax.head_scores"}


class PatternError(DuoJaxError, ValueError):
    """A pattern that cannot be read, does not fit the model, or a bad binarisation argument."""


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Pattern:
    """Per-(layer, KV head) DuoAttention gates, float32 `[num_layers, num_kv_heads]`, clipped to [0, 1].

    `gates` accepts any 2-D array-like of finite numbers (numpy, JAX, nested lists). It is copied, clipped to
    [0, 1] (the range training clamps the gates to) and stored read-only. `meta` holds the training arguments
    (the original's `config.json`) when known.
    """

    gates: np.ndarray
    meta: dict[str, Any] | None = None

    def __post_init__(self):
        try:
            gates = np.array(self.gates, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise PatternError(f"pattern gates must be a 2-D array of numbers: {e}") from None
        if gates.ndim != 2 or 0 in gates.shape:
            raise PatternError(
                f"pattern gates must be a non-empty 2-D array [layers, kv_heads], got shape {gates.shape}"
            )
        if not np.isfinite(gates).all():
            layer, head = np.argwhere(~np.isfinite(gates))[0]
            raise PatternError(
                f"pattern gate of layer {layer}, KV head {head} is {gates[layer, head]}; gates must be finite"
            )
        if self.meta is not None and not isinstance(self.meta, dict):
            raise PatternError(f"pattern meta must be a dict or None, got {type(self.meta).__name__}")
        np.clip(gates, 0.0, 1.0, out=gates)
        gates.flags.writeable = False
        object.__setattr__(self, "gates", gates)
        object.__setattr__(self, "meta", None if self.meta is None else dict(self.meta))

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (rows of `gates`)."""
        return self.gates.shape[0]

    @property
    def num_kv_heads(self) -> int:
        """Number of KV heads per layer (columns of `gates`)."""
        return self.gates.shape[1]

    def __repr__(self) -> str:
        return (
            f"Pattern({self.num_layers}x{self.num_kv_heads}, mean gate {self.gates.mean():.3f}, "
            f"{(self.gates > 0.5).mean():.0%} of gates > 0.5)"
        )

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int) -> Pattern:
        """Every gate 1.0: every head is a retrieval head (plain full attention)."""
        return cls(np.ones((num_layers, num_kv_heads), dtype=np.float32))

    @classmethod
    def load(cls, path: str | Path, what: str = "pattern", kind: str | None = None) -> Pattern:
        """Read a pattern folder (`full_attention_heads.tsv` plus optional `config.json`) or the TSV file itself;
        `what` it holds names it in the errors ("HeadKV scores" are saved in the same format). `kind`: the config.json
        "kind" it must hold (None: a gate pattern's, none; `SCORES_KIND`: HeadKV scores), so that scores are not
        read as gates nor gates as scores. A TSV without a config.json is taken for what it is asked to be.

        Given the TSV file, a `config.json` beside it is read as `meta`. Gates are clipped to [0, 1]: the
        published files hold values such as -2e-4.
        """
        path = Path(path)
        if path.is_dir():
            tsv = path / GATES_FILE
            if not tsv.is_file():
                raise PatternError(f"{what} folder {path} holds no {GATES_FILE}")
        elif path.is_file():
            tsv = path
        else:
            raise PatternError(
                f"{what} path {path} does not exist; pass a folder holding {GATES_FILE} or the TSV file itself"
            )
        meta = _read_meta(tsv.parent / META_FILE)
        found = (meta or {}).get("kind")
        if meta is not None and found != kind:
            holds = "a gate pattern" if found is None else "HeadKV head scores" if found == SCORES_KIND else repr(found)
            raise PatternError(
                f"{path} holds {holds} (its {META_FILE}), not {what}: pass a folder written by "
                f"{_WRITTEN_BY.get(kind, kind)}, or 'default' for the model's own"
            )
        done, steps = (meta or {}).get("steps_done"), (meta or {}).get("num_steps")
        if isinstance(done, int) and isinstance(steps, int) and done < steps:
            warnings.warn(
                f"{path} holds the gates of an unfinished training run (step {done} of {steps}); rerun its "
                "train_gates.py command to finish it",
                stacklevel=2,
            )
        return cls(_read_gates(tsv, what), meta)

    @classmethod
    def for_model(cls, name: str, key: str = "pattern") -> Pattern | None:
        """The default pattern of a named model, checked against its config; None when it names none, or when
        `name` is not a named config (a model loaded from a path: its config takes the folder's or file's name).

        `configs/<name>.json` names its pattern with `"pattern": "patterns/<name>"`, relative to the configs folder
        (key="scores": its HeadKV head scores, `"scores": "scores/<name>"`, saved in the same format).
        """
        if name not in config_lib.named_configs():
            return None
        relative = config_lib.read_named(name).get(key)
        if relative is None:
            return None
        scores = key == "scores"
        pattern = cls.load(config_lib.CONFIGS_DIR / relative, *(("HeadKV scores", SCORES_KIND) if scores else ()))
        pattern.validate(config_lib.get_config(name))
        return pattern

    def save(self, directory: str | Path) -> Path:
        """Write the original format into `directory` (created if needed) and return it.

        Writes `full_attention_heads.tsv` (`%.18e`, tab-separated; float32 gates load back bit-identical) and,
        when `meta` is set, `config.json`. Without meta, a folder that already holds a `config.json` (an earlier
        save's, or any other file's: it is not removed) is refused, since `load` would return it as this pattern's
        meta. The meta is serialised before anything is written.
        """
        meta_text = None if self.meta is None else _meta_json(self.meta)
        directory = Path(directory)
        if meta_text is None and (directory / META_FILE).exists():
            raise PatternError(
                f"{directory / META_FILE} exists, and a pattern saved there without meta would be read back with it "
                "as its meta: save into another folder, delete that file, or give the pattern its meta"
            )
        directory.mkdir(parents=True, exist_ok=True)
        np.savetxt(directory / GATES_FILE, self.gates, fmt="%.18e", delimiter="\t")
        if meta_text is not None:
            (directory / META_FILE).write_text(meta_text)
        return directory

    def digest(self) -> str:
        """A short hash of the gates (their float32 bytes): which pattern a result was made with, recorded beside
        it so that results of different patterns are not merged as one (`duo_jax.eval.ruler.merge_results`)."""
        return hashlib.sha256(np.ascontiguousarray(self.gates, np.float32).tobytes()).hexdigest()[:16]

    def validate(self, config: config_lib.ModelConfig) -> None:
        """Raise PatternError unless the pattern has one gate per layer and KV head of `config`."""
        if self.gates.shape != (config.num_layers, config.num_kv_heads):
            raise PatternError(
                f"pattern has shape {self.num_layers}x{self.num_kv_heads} (layers x kv_heads) but model "
                f"{config.name or '(unnamed)'!r} has {config.num_layers}x{config.num_kv_heads}"
            )

    def tie_order(self) -> np.ndarray:
        """int [num_layers * num_kv_heads]: each head's rank (row-major) among exactly tied gates, lower wins:
        `np.random.default_rng(0).permutation(N)`, fixed for a given N (docs/training.md, "Patterns")."""
        return np.random.default_rng(0).permutation(self.gates.size)

    def retrieval_mask(self, sparsity: float) -> np.ndarray:
        """Binarise: bool `[num_layers, num_kv_heads]`, True for retrieval heads, False for streaming heads.

        `sparsity` is the fraction of streaming heads, in [0, 1]. The original keeps the heads with
        `alpha >= np.quantile(alpha, sparsity)` (after 1e-6 of noise that makes the gates distinct); with N
        distinct gates, numpy's quantile lies at sorted index `sparsity * (N - 1)`, so that keeps exactly
        `n = N - ceil(sparsity * (N - 1))` heads, and none at sparsity 1 (its threshold there is 2). The count is
        computed in exact rational arithmetic on the shortest decimal form of `sparsity` (0.3 is read as 3/10),
        so float error cannot flip it. The n heads with the largest gates are chosen; heads with exactly equal
        gates are taken in `tie_order`.
        """
        exact = exact_sparsity(sparsity)
        N = self.gates.size
        n_retrieval = 0 if exact == 1 else N - math.ceil(exact * (N - 1))
        order = np.lexsort((self.tie_order(), -self.gates.ravel()))  # by gate, descending, then by tie rank
        mask = np.zeros(self.gates.size, dtype=bool)
        mask[order[:n_retrieval]] = True
        return mask.reshape(self.gates.shape)

    def heatmap(self, path: str | Path, title: str | None = None) -> Path:
        """Write a PNG heatmap of the gates (layers on y, KV heads on x, viridis, colorbar) and return its path."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure = Figure(figsize=(min(16.0, 3.0 + 0.35 * self.num_kv_heads), min(16.0, 2.0 + 0.2 * self.num_layers)))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        image = axes.imshow(self.gates, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        figure.colorbar(image, ax=axes, label="gate (alpha)")
        axes.set_xlabel("KV head")
        axes.set_ylabel("layer")
        axes.set_title(title if title is not None else repr(self))
        figure.savefig(path, format="png", dpi=100, bbox_inches="tight")
        return path


def _read_gates(tsv: Path, what: str = "pattern") -> np.ndarray:
    """Parse a `full_attention_heads.tsv`: one row per layer, one float per KV head, every row the same length
    (`what` the file holds, for the errors: a "pattern", or "HeadKV scores" in the same format)."""
    try:
        lines = tsv.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PatternError(f"cannot read {what} file {tsv}: {e}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise PatternError(f"{what} file {tsv} is empty; expected one row of tab-separated gates per layer")
    rows: list[list[float]] = []
    for line_no, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields:
            raise PatternError(f"{what} file {tsv}, line {line_no}: empty line; expected one row per layer")
        row = []
        for column, field in enumerate(fields, start=1):
            try:
                value = float(field)
            except ValueError:
                raise PatternError(
                    f"{what} file {tsv}, line {line_no}, column {column}: {field!r} is not a number"
                ) from None
            if not math.isfinite(value):
                raise PatternError(f"{what} file {tsv}, line {line_no}, column {column}: gate {field} is not finite")
            row.append(value)
        if rows and len(row) != len(rows[0]):
            raise PatternError(
                f"{what} file {tsv}, line {line_no}: ragged rows, {len(row)} gates but line 1 has {len(rows[0])}; "
                "every layer needs one gate per KV head"
            )
        rows.append(row)
    return np.array(rows, dtype=np.float32)


def _numpy_scalar(value: Any) -> Any:
    """numpy scalars (np.int64, np.float32, np.bool_) as the Python numbers JSON holds; anything else refused."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _meta_json(meta: dict[str, Any]) -> str:
    """`meta` as `config.json` text; PatternError naming the key whose value JSON cannot hold."""
    for key, value in meta.items():
        if not isinstance(key, str):
            raise PatternError(f"pattern meta keys must be strings (config.json's keys), got {key!r}")
        try:
            json.dumps(value, default=_numpy_scalar)
        except (TypeError, ValueError) as e:
            raise PatternError(
                f"pattern meta {key!r} cannot be written to {META_FILE}: {e}; pass JSON values (numbers, strings, "
                "lists, dicts) or drop the key"
            ) from None
    return json.dumps(meta, indent=2, default=_numpy_scalar) + "\n"


def _read_meta(path: Path) -> dict[str, Any] | None:
    """The training arguments in `config.json` beside the gates, or None when there is no such file."""
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PatternError(f"cannot read pattern metadata {path}: {e}") from None
    if not isinstance(meta, dict):
        raise PatternError(f"pattern metadata {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def exact_sparsity(sparsity: Any) -> Fraction:
    """`sparsity` as an exact fraction of its shortest decimal form; PatternError unless it is a number in [0, 1]."""
    allowed = "sparsity (the fraction of streaming heads) must be a number in [0, 1]"
    value = np.asarray(sparsity)
    if isinstance(sparsity, (bool, np.bool_)) or value.ndim != 0 or value.dtype.kind not in "iuf":
        raise PatternError(f"{allowed}, got {sparsity!r}")
    if value.dtype.kind == "f":
        if not np.isfinite(value):
            raise PatternError(f"{allowed}, got {sparsity!r}")
        exact = Fraction(np.format_float_positional(value[()], unique=True, trim="-"))
    else:
        exact = Fraction(int(value))
    if not 0 <= exact <= 1:
        raise PatternError(f"{allowed}, got {sparsity!r}")
    return exact


def resolve_pattern(pattern: Pattern | str | os.PathLike | None, config: config_lib.ModelConfig) -> Pattern | None:
    """A Pattern, a path to one, "default" (the model's shipped pattern) or None (full attention), checked against
    `config`: what every `pattern=` takes (`generate`, the methods' builders, the evaluations)."""
    if pattern is None or isinstance(pattern, Pattern):
        resolved = pattern
    elif str(pattern) == "default":
        resolved = Pattern.for_model(config.name)
        if resolved is None:
            raise PatternError(
                f"model {config.name!r} ships no default pattern (a named config may; a model loaded from a path has "
                "none): pass pattern=PATH, a folder with full_attention_heads.tsv (python train_gates.py writes one)"
            )
    elif isinstance(pattern, (str, os.PathLike)):
        resolved = Pattern.load(pattern)
    else:
        raise PatternError(
            f"pattern must be a Pattern, a path to one, 'default' or None, got {type(pattern).__name__} (gates as an "
            "array: duo_jax.Pattern(gates))"
        )
    if resolved is not None:
        resolved.validate(config)
    return resolved
