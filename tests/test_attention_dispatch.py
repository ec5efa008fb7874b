"""duo_jax.attention.dispatch: "pallas", "xla" and "reference" agree and validate alike."""

import jax
import jax.numpy as jnp
import pytest

from duo_jax import attention
from tests.conftest import random_attention_inputs, rel_err

IMPLS = ("pallas", "mosaic", "xla", "reference")


def test_auto_is_xla_on_cpu():
    if jax.default_backend() == "cpu":
        assert attention.resolve_impl("auto") == "xla"
    assert attention.resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="impl"):
        attention.resolve_impl("triton")


def test_lambda_implementations_agree():
    q, k, v, _ = random_attention_inputs(1, 40, 40, 4, 2, 64)
    outs = [attention.lambda_attention(q, k, v, sink=4, recent=8, impl=impl) for impl in IMPLS]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5


def test_flash_implementations_agree():
    q, k, v, _ = random_attention_inputs(2, 16, 48, 4, 2, 64)
    outs = [attention.flash_attention(q, k, v, q_offset=jnp.array([24, 3]), kv_len=jnp.array([40, 19]), impl=impl)
            for impl in IMPLS]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5


def test_decode_implementations_agree():
    q, k, v, _ = random_attention_inputs(3, 1, 256, 4, 2, 64)
    lengths = jnp.array([256, 37, 0], jnp.int32)
    outs = [attention.decode_attention(q[:, 0], k, v, lengths, impl=impl) for impl in IMPLS]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5
    assert float(jnp.max(jnp.abs(outs[1][2]))) == 0.0  # an empty cache attends to nothing


def test_specs_without_a_kernel_fall_back_to_xla():
    """Sliding windows and explicit key positions have no Pallas kernel: "pallas" still gives the right answer."""
    q, k, v, _ = random_attention_inputs(2, 8, 64, 4, 2, 32)
    spec = attention.prefix_spec(2, 8, q_offset=jnp.array([40, 9]), kv_len=jnp.array([48, 17]), num_keys=64, window=6)
    assert rel_err(attention.attend(q, k, v, spec, impl="pallas"),
                   attention.attend(q, k, v, spec, impl="reference")) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_value_error(impl):
    q, k, v, _ = random_attention_inputs(1, 16, 16, 4, 2, 64)
    for kwargs, message in [(dict(sink=-1, recent=8), "sink must be"), (dict(sink=4, recent=0), "recent must be")]:
        with pytest.raises(ValueError, match=message):
            attention.lambda_attention(q, k, v, impl=impl, **kwargs)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        attention.flash_attention(q[:, :, :3], k, v, impl=impl)
    with pytest.raises(ValueError, match="sliding window"):
        attention.prefix_spec(1, 16, num_keys=16, window=0)


def test_engine_with_mosaic_kernels_matches_xla():
    """The TPU kernels (interpreted on CPU) through the engine: the same greedy tokens as the XLA path, full and
    duo, chunked prefill + decode."""
    import numpy as np

    from duo_jax.methods import make_method
    from duo_jax.pattern import Pattern
    from tests.conftest import run_method, tiny_config

    config = tiny_config(num_layers=2)
    params = __import__("duo_jax").init_params(config, jax.random.key(0), scale=0.2)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 20).tolist()
    gates = np.array([[0.9, 0.1], [0.2, 0.8]])
    for method in (make_method("full", config, context=128),
                   make_method("duo", config, context=128, pattern=Pattern(gates), sparsity=0.5, sink=2, recent=6)):
        ours, logits, _, _ = run_method(params, config, method, prompt, chunk=8, decode_steps=4, impl="mosaic")
        ref, ref_logits, _, _ = run_method(params, config, method, prompt, chunk=8, decode_steps=4, impl="xla")
        assert ours == ref
        assert rel_err(jnp.asarray(logits), jnp.asarray(ref_logits)) <= 1e-5


@pytest.mark.parametrize("chunk", [128, 1], ids=["prefill-chunk", "decode-step"])
def test_extend_exported_for_tpu_attends_through_mosaic(chunk):
    """`extend` lowered for TPU from this CPU host with impl="auto": every layer's attention is a Mosaic
    kernel (one tpu_custom_call per layer) and no XLA attention loop is left in the module."""
    import functools

    from jax import export

    from duo_jax.engine import extend
    from duo_jax.model import unstack_layers
    from duo_jax.methods import make_method
    from duo_jax.model import init_params
    from pallas_kernels._backend import lowering_for
    from tests.conftest import tiny_config

    config = tiny_config(num_layers=2, head_dim=128)
    method = make_method("full", config, context=256)
    params = jax.eval_shape(lambda: unstack_layers(init_params(config, jax.random.key(0))))
    ints = jax.ShapeDtypeStruct((1,), jnp.int32)
    step = jax.jit(functools.partial(extend, config=config, method=method))
    with lowering_for("tpu"):
        exported = export.export(step, platforms=["tpu"])(params, method.cache_spec(1, jnp.float32), ints,
                                                          jax.ShapeDtypeStruct((1, chunk), jnp.int32), ints)
    module = exported.mlir_module()
    assert module.count("tpu_custom_call") == config.num_layers
    assert "stablehlo.while" not in module
