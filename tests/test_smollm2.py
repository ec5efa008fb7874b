"""The embedded real model: SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file.

Both sides dequantise the same Q4_1 blocks to fp32, so the remaining difference is fp32 summation order over
30 layers. Logits here reach ~35 in magnitude; we measured a max abs difference of ~9e-5 (relative ~3e-6),
and a tolerance of 1e-3 still catches any real bug (a wrong RoPE permutation or norm gives differences > 1).
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
from duo_jax.model import greedy_reference

PROMPT = (
    "Once upon a time, in a small village at the foot of the mountains, there lived an old clockmaker. "
    "Every morning he opened his shop at 7 o'clock and wound all 112 of the clocks, one after another, "
    "until the whole room was ticking like a heartbeat. The villagers said"
)


@pytest.fixture(scope="module")
def ours():
    # Stacked: `forward` scans one compiled layer (over per-layer weights it unrolls 30, ~6x the compile time;
    # tests/test_loading.py checks that both layouts load and compute the same).
    return duo_jax.load("smollm2-135m", dtype=jnp.float32, layout="stacked")


@pytest.fixture(scope="module")
def theirs(ours):
    path = Path(ours.source)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.mark.slow
def test_config_from_gguf_metadata(ours):
    named = duo_jax.get_config("smollm2-135m")  # the GGUF stores eps as float32
    assert ours.config == dataclasses.replace(named, rms_norm_eps=ours.config.rms_norm_eps)
    assert abs(ours.config.rms_norm_eps - 1e-5) < 1e-9
    assert ours.params.lm_head is None  # tied embeddings


@pytest.mark.slow
def test_tokenizer_matches_transformers(ours, theirs):
    _, tokenizer = theirs
    for text in [PROMPT, "In 2024, 12345 people", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "  spaces\ttabs\n\n"]:
        assert ours.tokenizer.encode(text) == tokenizer(text)["input_ids"], text
    ids = ours.tokenizer.encode(PROMPT)
    assert ours.tokenizer.decode(ids) == PROMPT


@pytest.mark.slow
def test_logits_and_greedy_continuation_match_transformers(ours, theirs):
    model, _ = theirs
    ids = ours.tokenizer.encode(PROMPT)
    assert 56 <= len(ids) <= 72
    logits = np.asarray(duo_jax.forward(ours.params, ours.config, jnp.asarray([ids], jnp.int32)))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
        ref_tokens = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    assert np.abs(ref).max() > 10
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-3)
    assert greedy_reference(ours.params, ours.config, ids, 16) == ref_tokens


@pytest.mark.slow
def test_generating_holds_one_copy_of_the_weights(ours, monkeypatch):
    """Per-layer weights (`duo_jax.load`'s default layout) are what the engine runs on: while `generate`
    decodes, the live device arrays exceed what they were before the call by the cache and less than a quarter
    of the weights (a per-layer copy of SmolLM2's layers would be 0.8 of them), and no call prepares weights:
    the engine's arrays are the model's own."""
    import gc

    from duo_jax.engine import Engine
    from duo_jax.model import unstack_layers

    ours = duo_jax.Model(ours.config, unstack_layers(ours.params), ours.tokenizer, ours.source, ours.names)
    weights = sum(x.nbytes for x in jax.tree.leaves(ours.params))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())  # noqa: E731
    seen, decode_loop = [], Engine.decode_loop

    def measured(self, method, cache, *args, **kwargs):  # the prefill done, the cache full, the weights in use
        seen.append((self, live(), sum(x.nbytes for x in jax.tree.leaves(cache))))
        return decode_loop(self, method, cache, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode_loop", measured)
    ids = ours.tokenizer.encode(PROMPT)
    for _ in range(2):
        gc.collect()
        before = live()
        duo_jax.generate(ours, [ids], max_new_tokens=2, chunk_size=128, stop_at_eos=False)
        engine, during, cache = seen[-1]
        assert 0 < during - before - cache < weights / 4, (during - before - cache) / weights
        assert not engine.copied and all(
            a is b for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(ours.params))
        )
