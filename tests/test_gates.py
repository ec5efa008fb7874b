"""The gated (mixed-attention) forward and the distillation loss of duo_jax.gates, on tiny random models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax import gates
from duo_jax.model import rms_norm
from tests.conftest import tiny_config
from tests.reference_decoder import decode

SINK, RECENT, T = 4, 8, 40
OBJECTIVE = gates.Objective(sink=SINK, recent=RECENT)
# Jitted once per test module (config and objective are static): eager scans are slow.
hidden_states = jax.jit(gates.gated_hidden_states, static_argnums=(1, 5))
dense_hidden_states = jax.jit(duo_jax.hidden_states, static_argnums=1)
loss = jax.jit(gates.loss, static_argnums=(2, 6))


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    return config, params, tokens, positions


def lambda_reference(params, config, tokens, positions, windows=None):
    """The dense model with every head on the Λ mask, built from an explicit mask: normed [B, T, D].
    windows[l]: layer l's sliding window (i - j < window as well), None for none."""

    def hidden(row, pos):
        i, j = pos[:, None], pos[None, :]
        mask = (j <= i) & ((j < SINK) | (i - j < RECENT))  # [T, S]

        def layer_mask(layer):
            window = None if windows is None else windows[layer.index]
            return mask if window is None else mask & (i - j < window)

        rope = None if (pos == np.arange(len(pos))).all() else (pos, np.broadcast_to(pos, (len(pos),) * 2))
        return decode(params, config, row, layer_mask, positions=rope).hidden

    return np.stack([hidden(row, pos) for row, pos in zip(np.asarray(tokens), np.asarray(positions))])


@pytest.mark.slow
def test_all_gates_one_is_the_full_model(setup):
    config, params, tokens, positions = setup
    teacher, student = hidden_states(params, config, gates.init_gates(config), tokens, positions, OBJECTIVE)
    full = rms_norm(dense_hidden_states(params, config, tokens), params.final_norm, config.rms_norm_eps)
    np.testing.assert_allclose(teacher, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(student, teacher)
    value, terms = loss(
        gates.init_gates(config), params, config, tokens, positions, jnp.ones(tokens.shape, bool), OBJECTIVE
    )
    assert float(terms.distill) == 0.0 and float(terms.l1) == 1.0
    assert float(value) == pytest.approx(OBJECTIVE.reg_weight)


def test_all_gates_zero_is_the_lambda_masked_model(setup):
    config, params, tokens, positions = setup
    teacher, student = hidden_states(params, config, gates.init_gates(config, 0.0), tokens, positions, OBJECTIVE)
    reference = lambda_reference(params, config, tokens, positions)
    np.testing.assert_allclose(student, reference, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(student) - np.asarray(teacher)).max() > 1e-2  # the Λ mask does change the model


@pytest.mark.slow
def test_gate_gradient_matches_finite_differences(setup):
    config, params, tokens, positions = setup
    supervise = jnp.asarray(np.random.default_rng(0).random(tokens.shape) < 0.3)
    alpha = jnp.asarray([[0.7, 0.4], [0.2, 0.9]], jnp.float32)
    value = jax.jit(lambda g: gates.loss(g, params, config, tokens, positions, supervise, OBJECTIVE)[0])
    grad = jax.jit(jax.grad(value))(alpha)
    eps = 1e-3
    for l, k in [(0, 1), (1, 0)]:
        step = jnp.zeros_like(alpha).at[l, k].set(eps)
        numeric = (value(alpha + step) - value(alpha - step)) / (2 * eps)
        np.testing.assert_allclose(grad[l, k], numeric, rtol=2e-3, atol=1e-6)


def test_a_gate_covers_its_group_of_query_heads(setup):
    """Zeroing KV head 1's gate in layer 1 (the last) changes only the attention of query heads 2 and 3."""
    config, params, tokens, positions = setup
    alpha = gates.init_gates(config).at[1, 1].set(0.0)
    wo = params.layers.wo.at[1, 2:].set(0.0)  # remove query heads 2, 3 (group of KV head 1) from layer 1
    silenced = dataclasses.replace(params, layers=dataclasses.replace(params.layers, wo=wo))
    teacher, student = hidden_states(silenced, config, alpha, tokens, positions, OBJECTIVE)
    np.testing.assert_array_equal(student, teacher)
    teacher, student = hidden_states(params, config, alpha, tokens, positions, OBJECTIVE)
    assert np.abs(np.asarray(student) - np.asarray(teacher)).max() > 1e-3


def test_unsupervised_positions_do_not_count(setup):
    config, params, tokens, positions = setup
    alpha = gates.init_gates(config, 0.5)
    supervise = jnp.zeros(tokens.shape, bool).at[:, -5:].set(True)
    _, terms = loss(alpha, params, config, tokens, positions, supervise, OBJECTIVE)
    teacher, student = hidden_states(params, config, alpha, tokens, positions, OBJECTIVE)
    expected = np.mean((np.asarray(teacher) - np.asarray(student))[:, -5:] ** 2)
    np.testing.assert_allclose(terms.distill, expected, rtol=1e-5)
    _, terms = loss(alpha, params, config, tokens, positions, jnp.zeros(tokens.shape, bool), OBJECTIVE)
    assert float(terms.distill) == 0.0


@pytest.mark.slow
def test_bf16_weights_keep_fp32_gates_and_gradients(setup):
    config, params, tokens, positions = setup
    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    (value, terms), grad = jax.jit(jax.value_and_grad(gates.loss, has_aux=True), static_argnums=(2, 6))(
        gates.init_gates(config, 0.5), params16, config, tokens, positions, jnp.ones(tokens.shape, bool), OBJECTIVE
    )
    assert grad.dtype == jnp.float32 and value.dtype == jnp.float32
    assert np.isfinite(np.asarray(grad)).all() and float(terms.distill) > 0


def test_gate_gradient_through_cudnn_without_triton(setup, monkeypatch):
    """Gate training on a GPU where Triton does not work: the full and Λ attention through cuDNN's calls, forward and
    backward (the XLA stand-ins, counted), none on the XLA path, give the loss and gate gradient of the XLA path."""
    from duo_jax.attention import cudnn, dispatch, xla

    config, params, tokens, positions = setup
    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[1])  # the call's keys
        return cudnn.xla_part(*args, **kwargs)

    def value_and_grad(impl):
        objective = dataclasses.replace(OBJECTIVE, impl=impl)
        args = (gates.init_gates(config, 0.5), params16, config, tokens, positions, jnp.ones(tokens.shape, bool))
        return jax.jit(jax.value_and_grad(gates.loss, has_aux=True), static_argnums=(2, 6))(*args, objective)

    (want, _), want_grad = value_and_grad("xla")
    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: impl)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "lambda_unavailable", lambda at_offset=False: None)
    monkeypatch.setattr(cudnn, "_cudnn", counted)
    monkeypatch.setattr(cudnn, "_cudnn_backward", cudnn.xla_part_backward)
    monkeypatch.setattr(xla, "attention", lambda *args, **kwargs: pytest.fail("attention on the XLA path"))
    (got, _), got_grad = value_and_grad("cudnn")
    assert set(calls) == {T, SINK}  # full attention and Λ's window over the T keys, Λ's sinks

    assert abs(float(got) - float(want)) < 2e-3 * abs(float(want))
    assert float(jnp.max(jnp.abs(got_grad - want_grad)) / jnp.max(jnp.abs(want_grad))) < 1e-2


def test_rejects_gates_of_the_wrong_shape(setup):
    config, params, tokens, positions = setup
    with pytest.raises(ValueError, match="gates must have shape"):
        gates.gated_hidden_states(params, config, jnp.ones((3, 2)), tokens, positions, OBJECTIVE)


def test_loss_checks_token_ids(setup):
    """Ids past the vocabulary were clamped to its last row: every token the same, distillation exactly 0."""
    config, params, tokens, positions = setup
    supervise = jnp.ones(tokens.shape, bool)
    alpha = jnp.full((config.num_layers, config.num_kv_heads), 0.5)
    with pytest.raises(duo_jax.DuoJaxError, match=r"token ids must lie in \[0, "):
        gates.loss(alpha, params, config, tokens + config.vocab_size, positions, supervise, OBJECTIVE)
    jax.jit(gates.loss, static_argnames=("config", "objective"))(
        alpha, params, config, tokens, positions, supervise, OBJECTIVE
    )  # traced: not checked, and no error


@pytest.mark.slow
def test_sliding_window_on_some_layers(setup):
    """A window (shorter than the sequence, and than RECENT) on layer 1 only: the teacher is the model's own
    forward (tested against transformers in tests/test_sliding_window.py), the student at gates 0 is Λ within
    each layer's window, and a windowed layer's gate gets its gradient."""
    _, params, tokens, positions = setup
    config = tiny_config(sliding_window=6, window_layers=(1,))
    teacher, student = hidden_states(params, config, gates.init_gates(config), tokens, positions, OBJECTIVE)
    full = rms_norm(dense_hidden_states(params, config, tokens), params.final_norm, config.rms_norm_eps)
    np.testing.assert_allclose(teacher, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(student, teacher)
    _, student = hidden_states(params, config, gates.init_gates(config, 0.0), tokens, positions, OBJECTIVE)
    reference = lambda_reference(params, config, tokens, positions, windows=[None, 6])
    np.testing.assert_allclose(student, reference, atol=1e-5, rtol=1e-5)
    supervise = jnp.ones(tokens.shape, bool)
    value = jax.jit(lambda g: gates.loss(g, params, config, tokens, positions, supervise, OBJECTIVE)[0])
    alpha = jnp.asarray([[0.7, 0.4], [0.2, 0.9]], jnp.float32)
    grad, eps = jax.jit(jax.grad(value))(alpha), 1e-3
    step = jnp.zeros_like(alpha).at[1, 0].set(eps)
    numeric = (value(alpha + step) - value(alpha - step)) / (2 * eps)
    assert abs(float(numeric)) > 1e-4
    np.testing.assert_allclose(grad[1, 0], numeric, rtol=2e-3, atol=1e-6)


def test_l1_term_has_the_originals_gradient():
    """The original's L1 (`duo_attn/loss.py`: x.abs().sum() / numel in PyTorch) has gradient 0 at a gate of exactly 0,
    which clamping makes common; jnp.abs has gradient 1 there, so zero gates kept being pushed down."""
    import torch

    values = np.array([[0.0, 0.25, 1.0], [0.0, 0.5, 0.75]], np.float32)
    x = torch.tensor(values, requires_grad=True)
    (x.abs().sum() / x.numel()).backward()
    value, grad = jax.value_and_grad(gates.l1_term)(jnp.asarray(values))
    assert float(value) == pytest.approx(float(np.abs(values).mean()))
    np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=0, atol=1e-7)
    assert np.asarray(grad)[0, 0] == 0
