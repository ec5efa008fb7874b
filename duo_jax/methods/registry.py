"""KV-cache methods by name: each method's module registers its builder here, and nothing else matches names.

`register(name, summary=...)` decorates a builder `build(config, *, context, <options>) -> Method`; what the
method takes is read from the builder's keyword-only parameters: its options, `pattern` (it builds on a
DuoAttention head pattern), `model` (it calibrates on the model, as InfiniGen) and `kv_dtype` (it can quantize
its cache). `make_method(name, config, context=..., **options)` checks the options and builds; `entry(name)` is
all a front door (`generate`, the CLIs, the equal-budget evaluation) needs to know of a method.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method
from duo_jax.quant import check_kv_dtype
from duo_jax.sampling import check_number

# A builder's keyword-only parameters that are inputs, not options of the method.
_INPUTS = ("context", "model", "kv_dtype")


@dataclasses.dataclass(frozen=True)
class MethodEntry:
    name: str
    build: Callable
    options: tuple[str, ...]  # the keyword options `build` takes (besides config, context, model and kv_dtype)
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
    # The evaluations prefill its prompt in one chunk: exact attention, compressed once at the prompt's end (the
    # eviction methods' protocol, docs/evaluation.md, "Modes and budgets"), not chunk by chunk.
    one_chunk_prefill: bool = False
    # Its builder meets a kv_budget at the capacity it is built for (duo's sparsity), so `generate` keeps that capacity
    # rather than fall back to a smaller one that fits memory (the tokens would depend on the memory free).
    budget_fits_capacity: bool = False


_ENTRIES: dict[str, MethodEntry] = {}


def register(
    name: str,
    *,
    summary: str,
    windows: dict[str, str] | None = None,
    budget: Callable | None = None,
    calibrated_on: str | None = None,
    one_chunk_prefill: bool = False,
    budget_fits_capacity: bool = False,
) -> Callable:
    """Decorator: register `build(config, *, context, <options>)` as method `name`, described by `summary`.
    `windows` maps generate's "sink" / "recent" to the method's own option names (default: the options of those
    names). `budget`, `calibrated_on`, `one_chunk_prefill` and `budget_fits_capacity`: see `MethodEntry`."""

    def decorate(build: Callable) -> Callable:
        if name in _ENTRIES:
            raise DuoJaxError(f"KV-cache method {name!r} is registered twice")
        params = inspect.signature(build).parameters
        keyword = [p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY]
        if "context" not in keyword:
            raise DuoJaxError(
                f"the builder of KV-cache method {name!r} must take config and a keyword-only context: "
                "def build(config, *, context, <options>)"
            )
        options = tuple(p for p in keyword if p not in _INPUTS)
        own = {w: w for w in ("sink", "recent") if w in options} if windows is None else dict(windows)
        _ENTRIES[name] = MethodEntry(
            name,
            build,
            options,
            summary,
            own,
            takes_pattern="pattern" in options,
            needs_model="model" in keyword,
            budget=budget,
            calibrated_on=calibrated_on,
            quantized_kv="kv_dtype" in keyword,
            one_chunk_prefill=one_chunk_prefill,
            budget_fits_capacity=budget_fits_capacity,
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
    context = check_number("context", context, integer=True, minimum=1, hint=" (the cache's capacity in tokens)")
    if options.get("kv_budget") is not None:
        options["kv_budget"] = check_number(
            "kv_budget", options["kv_budget"], integer=True, minimum=1, hint=" (tokens kept per KV head)"
        )
    if e.needs_model:
        if model is None:
            raise DuoJaxError(f"method {name!r} calibrates on the model: pass model= (generate does)")
        options["model"] = model
    return _checked(name, e.build(config, context=context, **options))


def _checked(name: str, method):
    """What method `name`'s builder returned, if it is what the engine needs: a named, hashable `Method` (a
    builder that is not says so to whoever writes it, not later as a bare TypeError inside jax.jit)."""
    if not isinstance(method, Method):
        raise DuoJaxError(f"the builder of method {name!r} returned a {type(method).__name__}, not a Method")
    if method.name == Method.name:
        raise DuoJaxError(
            f"{type(method).__name__} sets no name: give the class one (name = {name!r}), which stats report"
        )
    try:
        hash(method)
    except TypeError:
        raise DuoJaxError(
            f"{type(method).__name__} is not hashable: declare it @dataclasses.dataclass(frozen=True) (a method is a "
            "static argument of the compiled steps)"
        ) from None
    return method


def kv_budget_only(config: ModelConfig, kv_budget: int, **inputs) -> dict:
    """The budget rule of methods whose `kv_budget` option is the budget itself."""
    return dict(kv_budget=kv_budget)
