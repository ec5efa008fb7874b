"""duo_jax.training: schedule, mesh checks, sequence-parallel loss and gradients, learning, run folders."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

import duo_jax
from duo_jax import gates, training
from duo_jax.data.passkey import NATO_ALPHABET
from duo_jax.pattern import Pattern
from duo_jax.tokenizer import Tokenizer
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
_WORDS = ("the a of and to in is was that it for on with as by at from this be are or an have not but had his her "
          "they we you one all book story long very words").split()


def prose(n_words: int, seed: int) -> str:
    return " ".join(np.random.default_rng(seed).choice(_WORDS, n_words))


def tiny_tokenizer() -> Backend:
    """A byte-level BPE of at most VOCAB tokens trained on toy prose plus the passkey templates' words."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    templates = ("Remember this sequence of words, it's the first second passkey to the vault: Based on the "
                 "content of the book, what is the passkey? This is a very long story book: <book> </book>.\n\n")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator([prose(2000, 0), " ".join(NATO_ALPHABET) * 5, templates * 20], trainer)
    return backend


def write_haystack(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "essay.txt").write_text(prose(3000, 1))
    return directory


# --- schedule, mesh, batches ------------------------------------------------------------------------


def test_lr_schedule_is_the_originals():
    steps, lr = 2000, 0.02
    schedule = training.lr_schedule(lr, steps)
    original = lambda s: lr * min(1, max((s + 1) / (steps // 5), 0.1), max((steps - s) / (steps // 5), 0.1))
    for s in (0, 1, 39, 40, 399, 400, 1000, 1599, 1600, 1800, 1999):
        assert float(schedule(s)) == pytest.approx(original(s), rel=1e-6)
    assert float(schedule(0)) == pytest.approx(0.1 * lr) and float(schedule(1999)) == pytest.approx(0.1 * lr)


def test_parse_mesh():
    assert training.parse_mesh("data=2,seq=4") == {"data": 2, "seq": 4}
    for bad in ("seq=8", "data=1,seq=0", "data=1,seq=x", "data=1,model=2", "data=1,data=2"):
        with pytest.raises(training.TrainingError, match="bad mesh"):
            training.parse_mesh(bad)
    with pytest.raises(training.TrainingError, match="needs 8 devices"):
        training.make_mesh(2, 4)


def test_defaults_calibrate_on_held_out_text_as_the_original():
    cfg = training.TrainConfig()
    assert cfg.haystack == "paul_graham:calibration" and cfg.supervise == "qa"


def test_make_batch_pads_to_the_seq_axis_and_never_supervises_padding(tmp_path):
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
    cfg = training.TrainConfig(haystack=str(write_haystack(tmp_path)), min_len=1, max_len=400, num_lengths=5,
                               num_passkeys=2, passkey_words=4, batch_size=3)
    stream, cfg, note = training.sample_stream(tokenizer, cfg)
    assert note is not None and "the lengths start at" in note and cfg.min_len > 1
    batch, n_tokens = training.make_batch(stream, 6, 3, multiple=8)
    samples = [stream[i] for i in (6, 7, 8)]
    T = batch.tokens.shape[1]
    assert T % 8 == 0 and T - 8 < max(len(s.tokens) for s in samples) <= T
    assert n_tokens == sum(len(s.tokens) for s in samples)
    for b, s in enumerate(samples):
        np.testing.assert_array_equal(batch.tokens[b, :len(s.tokens)], s.tokens)
        np.testing.assert_array_equal(batch.supervise[b, :len(s.tokens)], s.supervise)
        assert not batch.supervise[b, len(s.tokens):].any()
        qa = np.flatnonzero(s.supervise)  # the default supervision: the whole question-and-answer span
        assert s.supervise[qa[0]:].all() and len(s.tokens) - qa[0] == len(qa)
    np.testing.assert_array_equal(batch.positions, np.broadcast_to(np.arange(T), (3, T)))
    with pytest.raises(training.TrainingError, match="raise --max-len"):
        training.sample_stream(tokenizer, dataclasses.replace(cfg, min_len=10, max_len=20))


# --- sequence parallelism on 8 host CPU devices -------------------------------------------------------

_SHARDED_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import duo_jax
from duo_jax import gates, training
from tests.conftest import tiny_config

assert jax.device_count() == 8
config = tiny_config(num_heads=16, num_kv_heads=8, head_dim=8)  # GQA, 2 query heads per KV head
params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
objective = gates.Objective(sink=4, recent=8)
B, T = 2, 61  # 61 is padded to 64 for the sharded runs
rng = np.random.default_rng(0)
tokens = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
supervise = rng.random((B, T)) < 0.4
alpha = jnp.asarray(rng.uniform(0.1, 0.9, (config.num_layers, config.num_kv_heads)), jnp.float32)
positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

single = jax.jit(jax.value_and_grad(gates.loss, has_aux=True), static_argnums=(2, 6))
(_, terms), grad = single(alpha, params, config, tokens, positions, supervise, objective)
result = {"single": {"loss": float(terms.loss), "distill": float(terms.distill), "grad": np.asarray(grad).tolist()}}

pad = 64 - T
padded = training.Batch(np.pad(tokens, ((0, 0), (0, pad))),
                        np.broadcast_to(np.arange(64, dtype=np.int32), (B, 64)).copy(),
                        np.pad(supervise, ((0, 0), (0, pad))))
for data, seq in ((1, 8), (2, 4)):
    mesh = training.make_mesh(data, seq)
    fn = jax.jit(training.sharded_loss_and_grad(config, objective, mesh))
    grad, terms = fn(training.replicate(alpha, mesh), training.replicate(params, mesh),
                     training.shard_batch(padded, mesh))
    result[f"data={data},seq={seq}"] = {"loss": float(training.fetch(terms.loss)),
                                        "distill": float(training.fetch(terms.distill)),
                                        "grad": training.fetch(grad).tolist()}
try:
    training.check_mesh(tiny_config(), training.make_mesh(1, 8), 1)  # 2 KV heads over seq=8
except training.TrainingError as e:
    result["error"] = str(e)
print(json.dumps(result))
"""


def test_sequence_sharded_loss_and_grads_equal_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    single = result.pop("single")
    assert "must divide 2" in result.pop("error")
    grad = np.asarray(single["grad"])
    assert np.abs(grad).max() > 1e-4  # the comparison is not between two near-zero gradients
    for mesh, sharded in result.items():
        np.testing.assert_allclose(sharded["loss"], single["loss"], rtol=1e-5, err_msg=mesh)
        np.testing.assert_allclose(sharded["distill"], single["distill"], rtol=1e-5, err_msg=mesh)
        np.testing.assert_allclose(np.asarray(sharded["grad"]), grad, rtol=1e-5, atol=1e-5 * np.abs(grad).max(),
                                   err_msg=mesh)


# --- learning ---------------------------------------------------------------------------------------


def _train_steps(params, config, objective, cfg, tokens, n):
    """n train steps on one device and one fixed batch (every position supervised)."""
    mesh = training.make_mesh(1, 1)
    optimizer, _ = training.make_optimizer(cfg)
    step = training.make_train_step(config, objective, optimizer, mesh)
    alpha = training.replicate(gates.init_gates(config), mesh)
    opt_state = optimizer.init(alpha)
    T = tokens.shape[1]
    batch = training.Batch(tokens, np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape).copy(),
                           np.ones(tokens.shape, bool))
    history = []
    for _ in range(n):
        alpha, opt_state, terms = step(alpha, opt_state, params, training.shard_batch(batch, mesh))
        history.append((float(terms.loss), float(terms.distill)))
    return np.asarray(alpha), history


@pytest.fixture(scope="module")
def tiny_model():
    config = tiny_config()
    return config, duo_jax.init_params(config, jax.random.key(0), scale=0.1)


def test_gates_of_silenced_heads_go_to_zero(tiny_model):
    """KV heads whose query heads have all-zero o_proj rows contribute nothing: only the L1 term acts on them."""
    config, params = tiny_model
    silenced = [(0, 1), (1, 0)]  # (layer, KV head)
    wo = params.layers.wo
    for layer, kv_head in silenced:
        wo = wo.at[layer, kv_head * config.group_size:(kv_head + 1) * config.group_size].set(0.0)
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, wo=wo))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 48)).astype(np.int32)
    cfg = training.TrainConfig(steps=40, lr=0.05)
    alpha, history = _train_steps(params, config, gates.Objective(sink=4, recent=8), cfg, tokens, 40)
    assert all(np.isfinite(history).ravel())
    for layer, kv_head in silenced:
        assert alpha[layer, kv_head] == 0.0
    live = [alpha[l, k] for l, k in np.ndindex(alpha.shape) if (l, k) not in silenced]
    assert min(live) > 0.0 and history[-1][1] > 0.0


def test_l1_pulls_every_gate_down_when_distillation_is_zero(tiny_model):
    """A window covering the whole sequence makes streaming = full attention: the gradient is the L1 term's."""
    config, params = tiny_model
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 24)).astype(np.int32)
    cfg = training.TrainConfig(steps=10, lr=0.02)
    alpha, history = _train_steps(params, config, gates.Objective(sink=4, recent=24), cfg, tokens, 10)
    assert all(distill < 1e-10 for _, distill in history)  # alpha * f + (1 - alpha) * f rounds, barely
    losses = [loss for loss, _ in history]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    # Adam's normalised step on a constant gradient is the learning rate itself.
    expected = 1.0 - sum(float(training.lr_schedule(cfg.lr, cfg.steps)(s)) for s in range(10))
    np.testing.assert_allclose(alpha, np.full(alpha.shape, expected), atol=1e-5)


# --- run folders ------------------------------------------------------------------------------------


def test_train_writes_the_run_folder_and_continues_it(tmp_path):
    config = tiny_config(vocab_size=VOCAB)
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
    cfg = training.TrainConfig(objective=gates.Objective(sink=8, recent=16), steps=5, save_every=2,
                               haystack=str(write_haystack(tmp_path / "hay")), min_len=1, max_len=300,
                               num_lengths=2, num_passkeys=2, passkey_words=4)
    out = tmp_path / "run"
    mesh = training.make_mesh(1, 1)
    messages = []
    run = lambda cfg, **kw: training.train(params, config, tokenizer, cfg, out, mesh, model_name="tiny",
                                           dtype="fp32", log=messages.append, progress_bar=False, **kw)
    pattern = run(cfg)
    assert any("the lengths start at" in m for m in messages)

    loaded = Pattern.load(out)
    np.testing.assert_array_equal(loaded.gates, pattern.gates)
    assert loaded.gates.shape == (config.num_layers, config.num_kv_heads) and loaded.gates.min() < 1
    assert loaded.meta["num_steps"] == 5 and loaded.meta["sink_size"] == 8 and loaded.meta["lr"] == 0.02
    history = json.loads((out / "loss.json").read_text())
    assert [h["step"] for h in history] == list(range(5))
    assert {"loss", "distill", "l1", "lr", "tokens_per_s"} <= set(history[0])
    assert (out / "gates.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "5"]

    again = run(cfg)  # finished: nothing to train, same outputs
    np.testing.assert_array_equal(again.gates, pattern.gates)
    assert messages[-1].startswith(f"resuming {out} at step 5")
    with pytest.raises(training.TrainingError, match="other arguments.*num_steps: 5 -> 6"):
        run(dataclasses.replace(cfg, steps=6))
    with pytest.raises(training.TrainingError, match="nothing to resume"):
        training.train(params, config, tokenizer, cfg, tmp_path / "empty", mesh, model_name="tiny", dtype="fp32",
                       resume=True, progress_bar=False)
