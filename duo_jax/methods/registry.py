"""KV-cache methods by name: each method's module registers its builder here, and nothing else matches names.

`register(name, options=..., summary=...)` decorates a builder `build(config, *, context, **options) ->
Method` (with `needs_model=True`, it also gets `model=`: InfiniGen calibrates on the model's weights and
text). `make_method(name, config, context=..., **options)` checks the options and builds; `entry(name)` says
what a method takes (its options, whether it takes a head pattern, how `generate`'s `sink` / `recent` map to
its own window options, how it meets a KV budget), which is all a front door (`generate`, the CLIs, the
evaluation's equal-budget comparison) needs to know of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.quant import check_kv_dtype


@dataclasses.dataclass(frozen=True)
class MethodEntry:
    name: str
    build: Callable
    options: tuple[str, ...]  # the keyword options `build` takes (besides config and context)
    summary: str  # one line for help texts
    windows: dict[str, str]  # generate's window arguments ("sink", "recent") -> this method's option names
    takes_pattern: bool  # builds on a DuoAttention head pattern (generate resolves and passes `pattern`)
    needs_model: bool  # calibrates on the model itself (build gets model=)
    # How the method meets a KV budget (average tokens per KV head): budget(config, kv_budget, **inputs) -> its
    # options; inputs: context, sink, recent, sparsity, pattern, scores, fitted (False: kv_budget is duo's own
    # at its sink / recent / sparsity, which duo then keeps). None: the method has no budget (full attention).
    budget: Callable | None = None
    calibrated_on: str | None = None  # the text the method calibrates itself on when built (a haystack source)
    quantized_kv: bool = False  # build takes kv_dtype ("int8" / "int4": a quantized cache, `duo_jax.quant`)


_ENTRIES: dict[str, MethodEntry] = {}


def register(
    name: str,
    *,
    options: tuple[str, ...],
    summary: str,
    windows: dict[str, str] | None = None,
    takes_pattern: bool = False,
    needs_model: bool = False,
    budget: Callable | None = None,
    calibrated_on: str | None = None,
    quantized_kv: bool = False,
) -> Callable:
    """Decorator: register `build` as method `name`. `windows` defaults to the window options the method
    has among its options (sink / recent under their own names)."""

    def decorate(build: Callable) -> Callable:
        if name in _ENTRIES:
            raise DuoJaxError(f"KV-cache method {name!r} is registered twice")
        own = {w: w for w in ("sink", "recent") if w in options} if windows is None else dict(windows)
        _ENTRIES[name] = MethodEntry(
            name, build, tuple(options), summary, own, takes_pattern, needs_model, budget, calibrated_on, quantized_kv
        )
        return build

    return decorate


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_ENTRIES)


def describe(indent: str = "  ") -> str:
    """Every registered method on a line of its own: its name and its summary (the help texts' list)."""
    width = max(map(len, _ENTRIES), default=0)
    return "\n".join(f"{indent}{name:<{width}}  {e.summary}" for name, e in _ENTRIES.items())


def entry(name: str) -> MethodEntry:
    if name not in _ENTRIES:
        raise DuoJaxError(f"unknown method {name!r}; choose one of {', '.join(_ENTRIES)}")
    return _ENTRIES[name]


def make_method(name: str, config: ModelConfig, *, context: int, model=None, **options):
    """The method `name` for `config` with a retrieval capacity of `context` tokens; `options` are its own
    (`entry(name).options`, plus `kv_dtype` for the methods with a quantized cache); `model` for the methods
    that calibrate on it."""
    e = entry(name)
    kv_dtype = check_kv_dtype(options.pop("kv_dtype", None))
    if kv_dtype is not None and not e.quantized_kv:
        supported = ", ".join(n for n, x in _ENTRIES.items() if x.quantized_kv)
        raise DuoJaxError(
            f"method {name!r} does not support a quantized KV cache (kv_dtype={kv_dtype!r}); use one "
            f"of {supported}, or kv_dtype=None"
        )
    if e.quantized_kv:
        options["kv_dtype"] = kv_dtype
    unknown = set(options) - set(e.options) - ({"kv_dtype"} if e.quantized_kv else set())
    if unknown:
        allowed = ", ".join(e.options) or "none"
        raise DuoJaxError(f"method {name!r} does not take {', '.join(sorted(unknown))} (its options: {allowed})")
    budget = options.get("kv_budget")
    if budget is not None and not 0 < budget:
        raise DuoJaxError(f"kv_budget (tokens kept per KV head) must be positive, got {budget}")
    if e.needs_model:
        if model is None:
            raise DuoJaxError(f"method {name!r} calibrates on the model: pass model= (generate does)")
        return e.build(config, context=context, model=model, **options)
    return e.build(config, context=context, **options)


def kv_budget_only(config: ModelConfig, kv_budget: int, **inputs) -> dict:
    """The budget rule of methods whose `kv_budget` option is the budget itself."""
    return dict(kv_budget=kv_budget)
