"""duo_jax.flax: the NNX module holds the functional core's arrays, trains gates as the functional trainer does,
generates through the engine and saves its gates with orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import duo_jax
from duo_jax import gates as gates_lib
from duo_jax import sharding, training
from duo_jax.errors import DuoJaxError
from duo_jax.flax import WEIGHTS, CausalLM, Gate, restore_gates, save_gates, train_step
from duo_jax.loading import Model
from duo_jax.pattern import Pattern, PatternError
from tests.conftest import tiny_config

OBJECTIVE = gates_lib.Objective(sink=2, recent=4, reg_weight=0.05)


def tiny_model(seed: int = 0, **overrides) -> Model:
    config = tiny_config(**overrides)
    return Model(config, duo_jax.init_params(config, jax.random.key(seed), scale=0.1), None, "random")


def random_gates(config, seed: int) -> np.ndarray:
    """Gates in [0, 1] with one exact 0 and one exact 1, float32 [L, K]."""
    values = np.random.default_rng(seed).uniform(0.1, 0.9, (config.num_layers, config.num_kv_heads))
    values[0, 0], values[-1, -1] = 0.0, 1.0
    return values.astype(np.float32)


def same_arrays(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(x is y for x, y in zip(leaves_a, leaves_b))


@pytest.mark.parametrize(
    "overrides", [{}, dict(tie_word_embeddings=True, qkv_bias=True, qk_norm=True)], ids=["llama", "tied-bias-qknorm"]
)
@pytest.mark.slow
def test_logits_equal_forward_on_the_same_arrays(overrides):
    model = tiny_model(**overrides)
    lm = CausalLM.from_model(model)
    assert same_arrays(lm.to_params(), model.params)  # no copies, either way
    assert (lm.lm_head is None) == overrides.get("tie_word_embeddings", False)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, model.config.vocab_size)
    expected = duo_jax.forward(model.params, model.config, tokens)
    np.testing.assert_array_equal(lm(tokens), expected)

    graphdef, state = nnx.split(lm)
    merged = nnx.merge(graphdef, state)
    assert isinstance(merged, CausalLM) and merged.config == model.config
    assert same_arrays(merged.to_params(), model.params)
    np.testing.assert_array_equal(merged(tokens), expected)
    np.testing.assert_array_equal(merged.gates, np.ones((2, 2), np.float32))


def test_int8_weights_are_refused_up_front():
    """A module built over them failed at its first call, `'QuantizedWeight' object is not subscriptable`."""
    import dataclasses

    from duo_jax.model import quantize_weights, stack_layers

    model = tiny_model()
    int8 = dataclasses.replace(model, params=quantize_weights(model.params))
    with pytest.raises(DuoJaxError, match="CausalLM does not take int8 weights .* load the model without weights="):
        CausalLM.from_model(int8)
    with pytest.raises(DuoJaxError, match="int8"):
        CausalLM(int8.config, stack_layers(int8.params))


def test_gates_are_their_own_variable_type():
    model = tiny_model()
    gates = random_gates(model.config, 0)
    lm = CausalLM.from_model(model, gates=gates)
    (gate,) = jax.tree.leaves(nnx.state(lm, Gate))
    assert gate.dtype == jnp.float32 and gate.shape == (2, 2)
    np.testing.assert_array_equal(gate, gates)
    assert same_arrays(nnx.state(lm, WEIGHTS), nnx.state(lm, nnx.All(nnx.Param, nnx.Not(Gate))))
    assert len(jax.tree.leaves(nnx.state(lm, WEIGHTS))) == len(jax.tree.leaves(model.params))
    assert len(jax.tree.leaves(nnx.state(lm, nnx.Param))) == len(jax.tree.leaves(model.params)) + 1
    np.testing.assert_array_equal(CausalLM.from_model(model, gates=Pattern(gates)).gates, gates)
    np.testing.assert_array_equal(CausalLM.from_model(model, gates=0.25).gates, np.full((2, 2), 0.25, np.float32))
    with pytest.raises(PatternError, match=r"shape \[layers, kv_heads\] = \(2, 2\)"):
        CausalLM.from_model(model, gates=np.ones((2, 3)))
    with pytest.raises(PatternError, match="model 'tiny' has 2x2"):
        CausalLM.from_model(model, gates=Pattern(np.ones((3, 2))))
    with pytest.raises(DuoJaxError, match=r"\[0, 1\]"):
        CausalLM.from_model(model, gates=1.5)
    with pytest.raises(DuoJaxError, match=r"\[0, 1\]"):  # NaN is in no range
        CausalLM.from_model(model, gates=float("nan"))
    with pytest.raises(DuoJaxError, match="gates must be None, a number, a Pattern or an array"):
        CausalLM.from_model(model, gates="0.5 everywhere")  # was numpy's ValueError


@pytest.mark.slow
def test_one_optimizer_step_on_the_gates_equals_the_functional_trainer(tmp_path):
    model = tiny_model()
    config, params = model.config, model.params
    gates0 = random_gates(config, 1)
    B, T = 2, 16
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (B, T), 0, config.vocab_size), np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    supervise = np.random.default_rng(3).uniform(size=(B, T)) < 0.6
    cfg = training.TrainConfig(objective=OBJECTIVE, steps=4, lr=0.2)
    tx, _ = training.make_optimizer(cfg)

    # The functional trainer, sharded over a 1 x 1 mesh; and the NNX way: an nnx.Optimizer over the gates only.
    mesh = sharding.make_mesh()
    batch = training.shard_batch(training.Batch(tokens, positions, supervise), mesh)
    frozen, specs = training.frozen_weights(params, mesh)
    step = training.make_train_step(config, OBJECTIVE, tx, mesh, specs)
    alpha = training.replicate(jnp.asarray(gates0), mesh)
    opt_state = tx.init(alpha)
    lm = CausalLM.from_model(model, gates=gates0)
    optimizer = nnx.Optimizer(lm, tx, wrt=Gate)
    for i in range(2):  # the second step checks that the optimiser's state (moments, count) was kept
        alpha, opt_state, terms = step(alpha, opt_state, frozen, batch)
        nnx_terms = train_step(
            lm, optimizer, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(supervise), OBJECTIVE
        )
        np.testing.assert_allclose(lm.gates, alpha, atol=1e-6, rtol=0, err_msg=f"step {i}")
        if i == 0:
            assert np.abs(np.asarray(alpha) - gates0).max() > 0.01  # the step moved the gates ...
            assert np.isin(np.asarray(alpha), [0.0, 1.0]).sum() >= 1  # ... and the clamp mattered for some
    # Adam's moments hold the gradient itself: the two gradients agree, not only their signs.
    nnx_moments = [x for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if np.shape(x) == gates0.shape]
    moments = [x for x in jax.tree.leaves(opt_state) if np.shape(x) == gates0.shape]
    assert len(moments) == len(nnx_moments) == 2
    for ours, theirs in zip(nnx_moments, moments):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-12)
    for name in ("loss", "distill", "l1"):
        np.testing.assert_allclose(getattr(nnx_terms, name), getattr(terms, name), rtol=1e-6)
    assert same_arrays(lm.to_params(), params)  # the frozen weights are untouched, not even copied
    with pytest.raises(DuoJaxError, match="wrt=Gate"):
        train_step(lm, nnx.Optimizer(lm, tx, wrt=nnx.Param), tokens, positions, supervise, OBJECTIVE)

    # The trained gates as a pattern in the original format.
    written = Pattern.load(lm.pattern({"model_name": "tiny"}).save(tmp_path / "pattern"))
    np.testing.assert_array_equal(written.gates, np.asarray(lm.gates))
    assert written.meta == {"model_name": "tiny"}


@pytest.mark.slow
def test_gates_saved_and_restored_with_orbax(tmp_path):
    model = tiny_model()
    trained = CausalLM.from_model(model, gates=random_gates(model.config, 4))
    path = save_gates(trained, tmp_path / "gates")
    with pytest.raises(DuoJaxError, match="already exists"):
        save_gates(trained, path)
    fresh = CausalLM.from_model(model)
    restore_gates(fresh, path)
    assert fresh.gates.dtype == jnp.float32
    np.testing.assert_array_equal(fresh.gates, trained.gates)
    assert same_arrays(fresh.to_params(), model.params)  # only the gates were restored
    with pytest.raises(DuoJaxError, match="no gate checkpoint"):
        restore_gates(fresh, tmp_path / "missing")
    other = CausalLM.from_model(tiny_model(num_layers=3))
    with pytest.raises(DuoJaxError, match=r"shape\(s\) \[\(2, 2\)\].*\(3, 2\)"):
        restore_gates(other, path)


@pytest.mark.slow
def test_generate_runs_the_engine_with_the_modules_gates():
    model = tiny_model(max_position_embeddings=64)
    gates = random_gates(model.config, 5)
    lm = CausalLM.from_model(model, gates=gates)
    prompt = list(np.random.default_rng(6).integers(0, model.config.vocab_size, 20))
    options = dict(sparsity=0.5, sink=2, recent=4, max_new_tokens=4, chunk_size=16)
    out = lm.generate([prompt], **options)
    expected = duo_jax.generate(model, [prompt], pattern=Pattern(gates), **options)
    assert out.stats["method"] == "duo" and out.stats["retrieval_heads"] == 2
    assert out.tokens == expected.tokens and len(out.tokens[0]) == 4
    full = lm.generate([prompt], method="full", max_new_tokens=4)  # takes no pattern: the gates are not passed
    assert full.stats["retrieval_heads"] == full.stats["kv_heads"] == 4


def test_generate_refuses_gates_that_hold_no_head_split():
    """Fresh gates (all 1) ran DuoAttention with the streaming heads chosen by the tie-break order alone."""
    model = tiny_model(max_position_embeddings=64)
    fresh = CausalLM.from_model(model)
    for options in ({}, dict(sparsity=0.5), dict(method="duo")):
        with pytest.raises(DuoJaxError, match=r"untrained or all equal \(every gate 1\).*train_step.*pattern=None"):
            fresh.generate([[1, 2, 3]], max_new_tokens=2, **options)
    with pytest.raises(DuoJaxError, match="every gate 0.25"):
        CausalLM.from_model(model, gates=0.25).generate([[1, 2, 3]], sparsity=0.5)


@pytest.mark.slow
def test_gates_that_hold_no_split_generate_where_no_split_is_needed():
    """Sparsity 0 keeps every head, whatever the gates; methods without a pattern and pattern=None ignore them."""
    fresh = CausalLM.from_model(tiny_model(max_position_embeddings=64))
    options = dict(max_new_tokens=2, sink=1, recent=2)
    assert fresh.generate([[1, 2, 3]], sparsity=0, **options).stats["retrieval_heads"] == 4
    assert fresh.generate([[1, 2, 3]], pattern=None, **options).stats["retrieval_heads"] == 4


def test_train_step_refuses_a_batch_it_would_train_on_wrongly():
    """Ids past the vocabulary were clamped and trained on; a supervise mask selecting nothing left only the L1
    term; shapes that differ failed inside the compiled step with broadcasting errors."""
    model = tiny_model()
    lm = CausalLM.from_model(model, gates=random_gates(model.config, 7))
    optimizer = nnx.Optimizer(lm, training.make_optimizer(training.TrainConfig(objective=OBJECTIVE))[0], wrt=Gate)
    tokens = np.ones((2, 8), np.int32)
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))
    supervise = np.ones((2, 8), bool)
    before = np.asarray(lm.gates)
    with pytest.raises(DuoJaxError, match=r"token ids must lie in \[0, 128\), got 1..500"):
        train_step(lm, optimizer, np.where(np.eye(2, 8, dtype=bool), 500, 1), positions, supervise, OBJECTIVE)
    with pytest.raises(DuoJaxError, match="supervise selects no position"):
        train_step(lm, optimizer, tokens, positions, np.zeros((2, 8), bool), OBJECTIVE)
    with pytest.raises(DuoJaxError, match=r"positions must be an integer array shaped like tokens, .* = \(2, 8\)"):
        train_step(lm, optimizer, tokens, positions[:, :4], supervise, OBJECTIVE)
    with pytest.raises(DuoJaxError, match=r"positions .* got float32 of shape \(2, 8\)"):
        lm.gate_loss(tokens, positions.astype(np.float32), supervise, OBJECTIVE)
    with pytest.raises(DuoJaxError, match=r"supervise must be a bool array shaped like tokens"):
        train_step(lm, optimizer, tokens, positions, supervise[0], OBJECTIVE)
    with pytest.raises(DuoJaxError, match="rows of one length"):
        train_step(lm, optimizer, [[1, 2], [3]], positions, supervise, OBJECTIVE)
    np.testing.assert_array_equal(lm.gates, before)  # no step was taken


@pytest.mark.slow
def test_train_step_takes_lists_as_call_does():
    """A nested list of tokens failed with AttributeError ('list' has no 'ndim'); `lm(...)` takes one."""
    model = tiny_model()
    gates = random_gates(model.config, 8)
    tokens = np.asarray(jax.random.randint(jax.random.key(9), (2, 8), 0, model.config.vocab_size), np.int32)
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))
    supervise = np.ones((2, 8), bool)
    tx = training.make_optimizer(training.TrainConfig(objective=OBJECTIVE))[0]
    terms = []
    for batch in ((tokens, positions, supervise), (tokens.tolist(), positions.tolist(), supervise.tolist())):
        lm = CausalLM.from_model(model, gates=gates)
        terms.append(train_step(lm, nnx.Optimizer(lm, tx, wrt=Gate), *batch, OBJECTIVE))
    np.testing.assert_allclose(terms[1].loss, terms[0].loss, rtol=1e-6)


def test_call_refuses_tokens_past_the_models_context():
    """`lm(tokens)` ran past max_position_embeddings silently, while generate refuses such prompts."""
    lm = CausalLM.from_model(tiny_model(max_position_embeddings=16))
    with pytest.raises(DuoJaxError, match="tokens .17 positions. exceed the model's context of 16 tokens"):
        lm(np.zeros((1, 17), np.int32))
    with pytest.raises(DuoJaxError, match="rows of one length"):
        lm([[1, 2], [3]])


@pytest.mark.parametrize("gates", ["0.5", True, np.ones((2, 2), bool), [["1", "0"], ["0", "1"]]])
def test_gates_that_are_not_numbers_are_refused(gates):
    """A string or a bool converted to a number ("0.5" to 0.5, True to 1) and was taken as gates."""
    with pytest.raises(DuoJaxError, match=r"array \[layers, kv_heads\] of numbers \(not strings or bools\)"):
        CausalLM.from_model(tiny_model(), gates=gates)
