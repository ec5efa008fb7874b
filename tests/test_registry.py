"""The method registry: names resolve to each method's own builder; a new method is one registration."""

import ast
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.methods import METHODS, Method, entry, make_method, registry
from duo_jax.methods.streaming_llm import StreamingLLM
from tests.conftest import tiny_config

CONFIG = tiny_config()


def test_every_method_is_registered_by_its_module():
    """A module of duo_jax/methods that registers a method is imported by the package (the registration runs on
    import: a module left out registers nothing, silently); the methods shipped so far stay registered, first."""
    folder = Path(duo_jax.methods.__file__).parent
    registering = sorted(p.stem for p in folder.glob("*.py") if re.search(r"^@register\(", p.read_text(), re.M))
    # read from the package's own imports (sys.modules would hold a module a test file imported)
    tree = ast.parse((folder / "__init__.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    missing = [stem for stem in registering if stem not in imported]
    assert not missing, f"import {missing} in duo_jax/methods/__init__.py: their methods are not registered"
    shipped = ("full", "duo", "streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "headkv", "duo_headkv")
    assert METHODS[: len(shipped) + 1] == (*shipped, "infinigen")
    assert entry("duo").takes_pattern and entry("duo_headkv").takes_pattern and not entry("h2o").takes_pattern
    assert entry("streaming_llm").windows == {"sink": "start", "recent": "recent"}
    assert entry("infinigen").needs_model and not entry("snapkv").needs_model
    # What a method takes is read from its builder's keyword-only parameters.
    assert (
        entry("h2o").options == ("kv_budget", "recent", "budget_slots", "scores_from") and entry("full").options == ()
    )
    # Every method quantizes its cache (docs/adding-a-method.md: the builder takes kv_dtype).
    assert [name for name in METHODS if not entry(name).quantized_kv] == []
    # The evaluations prefill the eviction methods' prompts in one chunk (their entry says so, not a list elsewhere).
    assert [name for name in METHODS if entry(name).one_chunk_prefill] == ["h2o", "tova"]
    with pytest.raises(DuoJaxError, match="calibrates on the model"):
        make_method("infinigen", CONFIG, context=32, kv_budget=4)
    with pytest.raises(DuoJaxError, match="registered twice"):
        registry.register("duo", summary="")(lambda config, *, context: None)
    with pytest.raises(DuoJaxError, match="must take config and a keyword-only context"):
        registry.register("no_context", summary="")(lambda config, size=4: None)


def test_a_method_is_named_by_what_it_runs():
    """Full attention is duo's code with every head a retrieval head: it reports "full" (stats, the server's
    banner), whether built by name or as a pattern at sparsity 0; a paged cache keeps the name."""
    from duo_jax.methods.paged import paged

    pattern = duo_jax.Pattern(np.full((CONFIG.num_layers, CONFIG.num_kv_heads), 0.5), {})
    full = make_method("full", CONFIG, context=32)
    none_streaming = make_method("duo", CONFIG, context=32, pattern=pattern, sparsity=0.0)
    duo = make_method("duo", CONFIG, context=32, pattern=pattern, sparsity=0.5)
    assert (full.name, none_streaming.name, duo.name) == ("full", "full", "duo")
    assert (paged(full).name, paged(duo).name) == ("full_paged", "duo_paged")


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("h2o", dict(context=32, kv_budget=8.5), r"kv_budget must be an integer >= 1 .*got 8.5"),  # ran as 8
        ("snapkv", dict(context=32, kv_budget="8"), r"kv_budget must be an integer >= 1 .*got '8'"),
        ("h2o", dict(context=32, kv_budget=0), "kv_budget must be an integer >= 1"),
        ("full", dict(context=0), "context must be an integer >= 1"),
        ("streaming_llm", dict(context=40.5), "context must be an integer >= 1"),
    ],
)
def test_budgets_and_capacities_are_whole_tokens(name, options, message):
    with pytest.raises(DuoJaxError, match=message):
        make_method(name, CONFIG, **options)
    assert make_method("h2o", CONFIG, context=np.int64(32), kv_budget=np.int32(8)).budget == 8


@pytest.mark.slow
def test_a_new_method_is_one_registration(monkeypatch):
    """A method registered from outside the package runs through generate by name, windows mapped by its entry;
    the evaluations name its missing budget rule (a bare "'NoneType' object is not callable" before)."""
    from duo_jax.eval import modes

    @registry.register("sinks_only", windows={"sink": "sinks"}, summary="only the sinks")
    def build(config, *, context, sinks=4):
        return StreamingLLM(config.num_layers, config.num_kv_heads, config.head_dim, sinks, 1)

    try:
        model = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), None, "random")
        prompt = np.arange(1, 20).tolist()
        out = duo_jax.generate(model, prompt, method="sinks_only", sink=3, max_new_tokens=4, stop_at_eos=False)
        same = duo_jax.generate(
            model, prompt, method="streaming_llm", sink=3, recent=1, max_new_tokens=4, stop_at_eos=False
        )
        assert out.tokens == same.tokens and out.stats["method"] == "streaming_llm"
        with pytest.raises(DuoJaxError, match="does not take recent"):
            duo_jax.generate(model, prompt, method="sinks_only", recent=3, max_new_tokens=4)
        monkeypatch.setattr(modes, "MODES", (*modes.MODES, "sinks_only"))  # as a module of the package would be
        with pytest.raises(DuoJaxError, match="'sinks_only' has no KV-budget rule.*budget="):
            modes.mode_settings("sinks_only", CONFIG, None, sparsity=0.5, sink=4, recent=8, context=64, kv_budget=8)
    finally:
        del registry._ENTRIES["sinks_only"]


def test_a_builder_that_returns_no_usable_method_is_named(monkeypatch):
    """What a newcomer's builder gets wrong is an error naming the fix at make_method, not a TypeError inside
    jax.jit (an unhashable method) nor a method reported as "method" (no name)."""
    import dataclasses

    @dataclasses.dataclass  # not frozen
    class Unfrozen(Method):
        size: int = 1
        name = "unfrozen"
        init_cache = attend = expected_cache_bytes = lambda self, *args: None

    @dataclasses.dataclass(frozen=True)
    class Nameless(StreamingLLM):
        name = "method"  # the base class's

    for name, result, message in [
        ("unfrozen", Unfrozen(), r"Unfrozen is not hashable: declare it @dataclasses.dataclass\(frozen=True\)"),
        ("nameless", Nameless(2, 2, 16), r"Nameless sets no name: give the class one \(name = 'nameless'\)"),
        ("not_a_method", object(), "the builder of method 'not_a_method' returned a object, not a Method"),
    ]:
        monkeypatch.setitem(
            registry._ENTRIES,
            name,
            dataclasses.replace(entry("full"), name=name, build=lambda c, *, context, kv_dtype=None, r=result: r),
        )
        with pytest.raises(DuoJaxError, match=message):
            make_method(name, CONFIG, context=32)


def test_the_method_lists_come_from_the_registry():
    """`describe()` (infer.py's --method help) has a line per registered method with its summary, and the docs
    that list the methods by hand (README's table, docs/methods.md's sections) name every one."""
    from pathlib import Path

    import infer
    from duo_jax.methods import describe

    lines = describe().splitlines()
    assert [line.split()[0] for line in lines] == list(METHODS)
    assert all(entry(name).summary in line for name, line in zip(METHODS, lines))
    assert describe() in infer._parser().format_help()
    root = Path(__file__).resolve().parent.parent
    readme, methods_md = (root / "README.md").read_text(), (root / "docs" / "methods.md").read_text()
    for name in METHODS:
        assert f"| `{name}` |" in readme and f"\n## {name}\n" in methods_md, name


def test_a_builder_takes_every_form_of_pattern_generate_takes():
    """`make_method("duo", pattern="default" | a path)` was an AttributeError ('str' has no retrieval_mask): the
    builders resolve a pattern as `generate` does."""
    from duo_jax.config import CONFIGS_DIR, get_config

    config = get_config("smollm2-135m")
    by_name = make_method("duo", config, context=512, pattern="default")
    by_path = make_method("duo", config, context=512, pattern=CONFIGS_DIR / "patterns" / "smollm2-135m")
    built = make_method("duo", config, context=512, pattern=duo_jax.Pattern.for_model("smollm2-135m"))
    assert by_name == by_path == built and by_name.stats()["retrieval_heads"] == 45
    both = make_method("duo_headkv", config, context=512, pattern="default", scores="default", kv_budget=64)
    assert both.name == "duo_headkv"
