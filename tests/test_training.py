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
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

import duo_jax
from duo_jax import distributed, gates, sharding, training
from duo_jax.data.passkey import NATO_ALPHABET
from duo_jax.pattern import Pattern
from duo_jax.tokenizer import Tokenizer
from tests.conftest import tiny_config, xla_flags

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
_WORDS = (
    "the a of and to in is was that it for on with as by at from this be are or an have not but had his her "
    "they we you one all book story long very words"
).split()


def prose(n_words: int, seed: int) -> str:
    return " ".join(np.random.default_rng(seed).choice(_WORDS, n_words))


def tiny_tokenizer() -> Backend:
    """A byte-level BPE of at most VOCAB tokens trained on toy prose plus the passkey templates' words."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    templates = (
        "Remember this sequence of words, it's the first second passkey to the vault: Based on the "
        "content of the book, what is the passkey? This is a very long story book: <book> </book>.\n\n"
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
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
    assert sharding.parse_mesh("data=2,seq=4") == {"data": 2, "fsdp": 1, "seq": 4}
    assert sharding.parse_mesh("fsdp=8") == {"data": 1, "fsdp": 8, "seq": 1}
    assert sharding.parse_mesh("data=2,fsdp=2,seq=2") == {"data": 2, "fsdp": 2, "seq": 2}
    for bad in ("seq=8,", "data=1,seq=0", "data=1,seq=x", "data=1,model=2", "data=1,data=2"):
        with pytest.raises(sharding.MeshError, match="bad mesh"):
            sharding.parse_mesh(bad)
    with pytest.raises(sharding.MeshError, match="needs 8 devices"):
        sharding.make_mesh(data=2, fsdp=2, seq=2)


def test_defaults_calibrate_on_held_out_text_as_the_original():
    cfg = training.TrainConfig()
    assert cfg.haystack == "paul_graham:calibration" and cfg.supervise == "qa"


def test_padded_length_buckets_lengths_with_bounded_padding():
    lengths = range(1000, 8193)
    for multiple in (1, 8, 6):
        padded = [training.padded_length(n, multiple) for n in lengths]
        assert all(p % multiple == 0 and n <= p for n, p in zip(lengths, padded))
        assert all(p - n < n / 4 + multiple for n, p in zip(lengths, padded))
        assert len(set(padded)) <= 16  # about four buckets per octave over 1k-8k, one compiled step each
    assert [training.padded_length(n, 1) for n in (1, 5, 17, 1024, 1025, 1300)] == [1, 5, 20, 1024, 1280, 1536]


def test_make_batch_pads_to_the_seq_axis_and_never_supervises_padding(tmp_path):
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
    cfg = training.TrainConfig(
        haystack=str(write_haystack(tmp_path)),
        min_len=1,
        max_len=400,
        num_lengths=5,
        num_passkeys=2,
        passkey_words=4,
        batch_size=3,
    )
    stream, cfg, note = training.sample_stream(tokenizer, cfg)
    assert note is not None and "the lengths start at" in note and cfg.min_len > 1
    batch, n_tokens = training.make_batch(stream, 6, 3, multiple=8)
    samples = [stream[i] for i in (6, 7, 8)]
    T = batch.tokens.shape[1]
    assert T % 8 == 0 and T == training.padded_length(max(len(s.tokens) for s in samples), 8)
    assert n_tokens == sum(len(s.tokens) for s in samples)
    for b, s in enumerate(samples):
        np.testing.assert_array_equal(batch.tokens[b, : len(s.tokens)], s.tokens)
        np.testing.assert_array_equal(batch.supervise[b, : len(s.tokens)], s.supervise)
        assert not batch.supervise[b, len(s.tokens) :].any()
        qa = np.flatnonzero(s.supervise)  # the default supervision: the whole question-and-answer span
        assert s.supervise[qa[0] :].all() and len(s.tokens) - qa[0] == len(qa)
    np.testing.assert_array_equal(batch.positions, np.broadcast_to(np.arange(T), (3, T)))
    with pytest.raises(training.TrainingError, match="raise --max-len"):
        training.sample_stream(tokenizer, dataclasses.replace(cfg, min_len=10, max_len=20))


@pytest.mark.parametrize("reg_weight", [-0.05, float("nan"), float("inf")])
def test_a_negative_or_non_finite_l1_weight_is_an_error(reg_weight):
    """A negative weight rewards large gates (every head a retrieval head): train_gates ran with it before."""
    with pytest.raises(training.TrainingError, match="reg_weight .* must be a finite number >= 0"):
        training.TrainConfig(objective=gates.Objective(reg_weight=reg_weight))
    training.TrainConfig(objective=gates.Objective(reg_weight=0))  # no L1 term: allowed


def test_training_contexts_stay_within_the_models():
    config = tiny_config()  # a context of 512 tokens
    training.check_max_len(config, training.TrainConfig(max_len=512))
    with pytest.raises(training.TrainingError, match="max_len 513 exceeds the model's context of 512 tokens"):
        training.check_max_len(config, training.TrainConfig(max_len=513))  # trained past its positions before
    # A window that covers every context: distillation is 0, the gates only fell under L1 (exit 0 before).
    covering = training.TrainConfig(objective=gates.Objective(sink=64, recent=448), min_len=100, max_len=512)
    with pytest.raises(training.TrainingError, match="covers every training context"):
        training.check_max_len(config, covering)


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(lr=float("inf")), "finite lr"),  # trained to gates of exactly 0 or 1, exit 0
        (dict(lr=float("nan")), "finite lr"),
        (dict(seed=-1), "seed must be an integer >= 0"),  # numpy's traceback after the model loaded
        (dict(steps=2.5), "steps must be an integer >= 1"),
        (dict(max_len=0), "max_len must be an integer >= 1"),
        (dict(batch_size=True), "batch_size must be an integer"),
        (dict(num_passkeys=0), "num_passkeys must be between 1"),  # were checked only after the model loaded
        (dict(passkey_words=0), "passkey_words must be >= 1"),
        (dict(min_depth=0.9, max_depth=0.1), "min_depth <= max_depth"),
        (dict(supervise="all"), "supervise must be one of"),
    ],
)
def test_bad_training_options_are_refused_when_the_config_is_made(option, message):
    with pytest.raises(duo_jax.DuoJaxError, match=message):
        training.TrainConfig(**option)


# --- sharded weights and sequences on 8 host CPU devices ----------------------------------------------

_SHARDED_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import duo_jax
from duo_jax import gates, sharding, training
from tests.conftest import tiny_config

assert jax.device_count() == 8
objective = gates.Objective(sink=4, recent=8)
B, T = 8, 61  # 61 is padded to 64 for the sharded runs
rng = np.random.default_rng(0)
tokens = rng.integers(0, 128, (B, T)).astype(np.int32)
supervise = rng.random((B, T)) < 0.4
positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
padded = training.Batch(np.pad(tokens, ((0, 0), (0, 3))),
                        np.broadcast_to(np.arange(64, dtype=np.int32), (B, 64)).copy(),
                        np.pad(supervise, ((0, 0), (0, 3))))
single = jax.jit(jax.value_and_grad(gates.loss, has_aux=True), static_argnums=(2, 6))
result = {}
# (config, meshes): 8 KV heads (Ulysses divides them), 2 KV heads (seq=8 needs the all-gather variant) with a
# sliding window of 12 tokens, wider than a sequence shard: the window crosses shards
cases = {"kv8": (tiny_config(num_heads=16, num_kv_heads=8, head_dim=8), [dict(fsdp=8), dict(data=2, fsdp=2, seq=2)]),
         "kv2": (tiny_config(sliding_window=12), [dict(seq=8)])}
for name, (config, meshes) in cases.items():
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
    alpha = jnp.asarray(rng.uniform(0.1, 0.9, (config.num_layers, config.num_kv_heads)), jnp.float32)
    (_, terms), grad = single(alpha, params, config, tokens, positions, supervise, objective)
    result[name] = {"single": {"loss": float(terms.loss), "distill": float(terms.distill),
                               "grad": np.asarray(grad).tolist()}}
    for sizes in meshes:
        mesh = sharding.make_mesh(**sizes)
        weights, specs = training.frozen_weights(params, mesh)
        fn = jax.jit(training.sharded_loss_and_grad(config, objective, mesh, specs))
        grad, terms = fn(training.replicate(alpha, mesh), weights, training.shard_batch(padded, mesh))
        result[name][sharding.format_mesh(mesh)] = {
            "loss": float(training.fetch(terms.loss)), "distill": float(training.fetch(terms.distill)),
            "grad": training.fetch(grad).tolist(), "attention": training.sequence_parallelism(config, mesh)}

# per-device weight bytes on fsdp=8, read from the arrays' own shards
config = tiny_config()
params = duo_jax.init_params(config, jax.random.key(0))
mesh = sharding.make_mesh(fsdp=8)
weights, _ = training.frozen_weights(params, mesh)
per_device = {str(d): 0 for d in jax.devices()}
for x in jax.tree.leaves(weights):
    for shard in x.addressable_shards:
        per_device[str(shard.device)] += shard.data.nbytes
result["bytes"] = {"per_device": list(per_device.values()), "helper": sharding.device_bytes(weights),
                   "total": sum(x.nbytes for x in jax.tree.leaves(weights)),
                   "final_norm": weights.final_norm.nbytes, "lm_head": weights.lm_head is None}
try:
    training.check_mesh(sharding.make_mesh(data=2, fsdp=4), 4)
except training.TrainingError as e:
    result["error"] = str(e)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_sharded_loss_and_grads_equal_single_device():
    """FSDP weights (gathered per layer), data and sequence shards (Ulysses, all-gather KV, the latter with a
    sliding window): the loss and gate gradients of one device, to float32 rounding; per-device weight bytes
    1/8 on fsdp=8."""
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    run = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "multiple of 8" in result.pop("error")

    size = result.pop("bytes")
    replicated = size["final_norm"]  # the only replicated weight of the tiny model; the LM head is not kept
    assert size["lm_head"] and size["helper"] == size["per_device"][0]
    assert size["per_device"] == [(size["total"] - replicated) // 8 + replicated] * 8

    expected_attention = {
        "kv8": {"data=1,fsdp=8,seq=1": "none", "data=2,fsdp=2,seq=2": "ulysses"},
        "kv2": {"data=1,fsdp=1,seq=8": "all-gather"},
    }
    for name, runs in result.items():
        single = runs.pop("single")
        grad = np.asarray(single["grad"])
        assert np.abs(grad).max() > 1e-4  # the comparison is not between two near-zero gradients
        assert {mesh: r["attention"] for mesh, r in runs.items()} == expected_attention[name]
        for mesh, sharded in runs.items():
            where = f"{name} {mesh}"
            np.testing.assert_allclose(sharded["loss"], single["loss"], rtol=1e-5, err_msg=where)
            np.testing.assert_allclose(sharded["distill"], single["distill"], rtol=1e-5, err_msg=where)
            np.testing.assert_allclose(
                np.asarray(sharded["grad"]), grad, rtol=1e-5, atol=1e-5 * np.abs(grad).max(), err_msg=where
            )


# --- learning ---------------------------------------------------------------------------------------


def _train_steps(params, config, objective, cfg, tokens, n, mesh=None):
    """n train steps on one device (`mesh`: make_mesh's) and one fixed batch (every position supervised)."""
    mesh = sharding.make_mesh() if mesh is None else mesh
    optimizer, _ = training.make_optimizer(cfg)
    step = training.make_train_step(config, objective, optimizer, mesh, sharding.weight_specs(params, mesh))
    alpha = training.replicate(gates.init_gates(config), mesh)
    opt_state = optimizer.init(alpha)
    T = tokens.shape[1]
    batch = training.Batch(
        tokens, np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape).copy(), np.ones(tokens.shape, bool)
    )
    history = []
    for _ in range(n):
        alpha, opt_state, terms = step(alpha, opt_state, params, training.shard_batch(batch, mesh))
        history.append((float(terms.loss), float(terms.distill)))
    return np.asarray(alpha), history


@pytest.fixture(scope="module")
def tiny_model():
    config = tiny_config()
    return config, duo_jax.init_params(config, jax.random.key(0), scale=0.1)


def test_a_mesh_with_explicit_axes_trains_like_auto(tiny_model):
    """`jax.make_mesh` gives Explicit axes, under which shard_map checks every input's sharding against its specs:
    with the batch and gates placed by `shard_batch` / `replicate`, the train step gives the gates of
    `sharding.make_mesh`'s Auto axes."""
    from jax.sharding import AxisType

    config, params = tiny_model
    explicit = jax.make_mesh(
        (1, 1, 1), sharding.MESH_AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:1]
    )
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 32)).astype(np.int32)
    cfg = training.TrainConfig(objective=gates.Objective(sink=4, recent=8))
    want = _train_steps(params, config, cfg.objective, cfg, tokens, 2)
    got = _train_steps(params, config, cfg.objective, cfg, tokens, 2, mesh=explicit)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.slow
def test_gates_of_silenced_heads_go_to_zero(tiny_model):
    """KV heads whose query heads have all-zero o_proj rows contribute nothing: only the L1 term acts on them."""
    config, params = tiny_model
    silenced = [(0, 1), (1, 0)]  # (layer, KV head)
    wo = params.layers.wo
    for layer, kv_head in silenced:
        wo = wo.at[layer, kv_head * config.group_size : (kv_head + 1) * config.group_size].set(0.0)
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, wo=wo))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 48)).astype(np.int32)
    cfg = training.TrainConfig(steps=40, lr=0.05)
    alpha, history = _train_steps(params, config, gates.Objective(sink=4, recent=8), cfg, tokens, 40)
    assert all(np.isfinite(history).ravel())
    for layer, kv_head in silenced:
        assert alpha[layer, kv_head] == 0.0
    live = [alpha[l, k] for l, k in np.ndindex(alpha.shape) if (l, k) not in silenced]
    assert min(live) > 0.0 and history[-1][1] > 0.0


@pytest.mark.slow
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


@pytest.mark.slow
def test_train_writes_the_run_folder_and_continues_it(tmp_path):
    config = tiny_config(vocab_size=VOCAB)
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
    cfg = training.TrainConfig(
        objective=gates.Objective(sink=8, recent=16),
        steps=5,
        save_every=2,
        haystack=str(write_haystack(tmp_path / "hay")),
        min_len=1,
        max_len=300,
        num_lengths=2,
        num_passkeys=2,
        passkey_words=4,
    )
    out = tmp_path / "run"
    mesh = sharding.make_mesh()
    messages = []
    run = lambda cfg, **kw: training.train(
        params,
        config,
        tokenizer,
        cfg,
        out,
        mesh,
        model_name="tiny",
        dtype="fp32",
        log=messages.append,
        progress_bar=False,
        **kw,
    )
    pattern = run(cfg)
    assert any("the lengths start at" in m for m in messages)

    loaded = Pattern.load(out)
    np.testing.assert_array_equal(loaded.gates, pattern.gates)
    assert loaded.gates.shape == (config.num_layers, config.num_kv_heads) and loaded.gates.min() < 1
    assert loaded.meta["num_steps"] == 5 and loaded.meta["sink_size"] == 8 and loaded.meta["lr"] == 0.02
    assert loaded.meta["steps_done"] == 5  # a finished run (a stopped one's pattern warns when loaded)
    history = json.loads((out / "loss.json").read_text())
    assert [h["step"] for h in history] == list(range(5))
    assert {"loss", "distill", "l1", "lr", "tokens_per_s"} <= set(history[0])
    assert (out / "gates.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "5"]

    (out / "loss.json").unlink()
    again = run(cfg)  # finished: nothing to train, same outputs
    np.testing.assert_array_equal(again.gates, pattern.gates)
    assert messages[-1].startswith(f"resuming {out} at step 5")
    assert Pattern.load(out).meta["steps_done"] == 5  # was 0 (from the loss history), and loading it warned
    # A model of another shape: its name differs (refused before the arrays are read, which raised orbax's error),
    # or the same name holds other weights.
    bigger = tiny_config(vocab_size=VOCAB, num_layers=3)
    other = duo_jax.init_params(bigger, jax.random.key(0), scale=0.1)
    for name, match in (
        ("tiny-3", "other arguments.*model_name: 'tiny' -> 'tiny-3'"),
        ("tiny", r"gates of shape \[2, 2\].*this model has \[3, 2\]"),
    ):
        with pytest.raises(training.TrainingError, match=match):
            training.train(other, bigger, tokenizer, cfg, out, mesh, model_name=name, dtype="fp32", progress_bar=False)
    with pytest.raises(training.TrainingError, match="other arguments.*num_steps: 5 -> 6"):
        run(dataclasses.replace(cfg, steps=6))
    with pytest.raises(training.TrainingError, match="nothing to resume"):
        training.train(
            params,
            config,
            tokenizer,
            cfg,
            tmp_path / "empty",
            mesh,
            model_name="tiny",
            dtype="fp32",
            resume=True,
            progress_bar=False,
        )


def _checkpoints(out, shape=(2, 2), steps=(2, 3), gates_shape=True):
    """A run folder `out` with checkpoints of a gate state of `shape` at `steps` (no model: the arrays are
    small); returns (Checkpoints, state, meta)."""
    import optax

    mesh = sharding.make_mesh()
    gates_ = training.replicate(np.ones(shape, np.float32), mesh)
    state = {"gates": gates_, "opt_state": training.replicate(optax.adamw(0.1).init(gates_), mesh)}
    meta = {"model_name": "tiny"}
    checkpoints = training.Checkpoints(out / "checkpoints")
    for step in steps:
        progress = {"step": step, "next_sample": 10 * step, "meta": meta}
        if gates_shape:
            progress["gates_shape"] = list(shape)
        checkpoints.save(step, jax.tree.map(lambda x: x + step, state), progress)
    checkpoints.close()
    return training.Checkpoints(out / "checkpoints"), state, meta


def _truncate(folder, name="*"):
    for path in folder.rglob(name):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damaged", ["*", "_METADATA", "manifest.ocdbt", "metadata"])
def test_a_damaged_checkpoint_is_set_aside_for_the_one_before_it(tmp_path, damaged):
    """Truncated files in checkpoint 3 (its arrays' or its progress item's) were reported as another model's
    checkpoint ("does not fit this model's gates"), with checkpoint 2 intact."""
    out = tmp_path / "run"
    _checkpoints(out)
    _truncate(out / "checkpoints" / "3", damaged)
    checkpoints, state, meta = _checkpoints(out, steps=())
    messages = []
    restored, start, next_sample, _ = training.resume_point(
        checkpoints, out, state, meta, required=True, log=messages.append
    )
    assert (start, next_sample) == (2, 20)
    np.testing.assert_array_equal(np.asarray(restored["gates"]), np.full((2, 2), 3.0))  # checkpoint 2's: 1 + 2
    (message,) = messages
    assert f"checkpoint 3 in {out / 'checkpoints' / '3'} cannot be read" in message
    assert "damaged" in message and "resuming from checkpoint 2" in message
    assert checkpoints.steps() == [2] and (out / "checkpoints-damaged" / "3").is_dir()


def test_no_readable_checkpoint_is_an_error_that_moves_nothing(tmp_path):
    out = tmp_path / "run"
    _checkpoints(out)
    for step in ("2", "3"):
        _truncate(out / "checkpoints" / step)
    checkpoints, state, meta = _checkpoints(out, steps=())
    with pytest.raises(training.TrainingError, match=r"no checkpoint in .* can be read: checkpoint 3 .*checkpoint 2"):
        training.resume_point(checkpoints, out, state, meta, required=False)
    assert checkpoints.steps() == [3, 2] and not (out / "checkpoints-damaged").exists()


def test_with_several_processes_a_damaged_checkpoint_is_left_to_the_user(tmp_path, monkeypatch):
    """Moving it aside would need every process to agree: the error names the folder to delete."""
    out = tmp_path / "run"
    _checkpoints(out)
    _truncate(out / "checkpoints" / "3")
    checkpoints, state, meta = _checkpoints(out, steps=())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        training.TrainingError, match=r"checkpoint 3 in .*checkpoints/3 cannot be read.*delete that folder"
    ):
        training.resume_point(checkpoints, out, state, meta, required=False)
    assert checkpoints.steps() == [3, 2]


def test_a_run_whose_last_checkpoint_is_truncated_resumes_from_the_one_before(tmp_path):
    """The same run again after checkpoint 3's array files were truncated: it said the checkpoint was another
    model's; it trains step 2 again from checkpoint 2 and ends with the gates it had."""
    config = tiny_config(vocab_size=VOCAB)
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.1)
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
    cfg = training.TrainConfig(
        objective=gates.Objective(sink=8, recent=16),
        steps=3,
        save_every=1,
        haystack=str(write_haystack(tmp_path / "hay")),
        min_len=1,
        max_len=300,
        num_lengths=1,
        num_passkeys=2,
        passkey_words=4,
    )
    out, messages = tmp_path / "run", []
    run = lambda: training.train(  # noqa: E731
        params,
        config,
        tokenizer,
        cfg,
        out,
        sharding.make_mesh(),
        model_name="tiny",
        dtype="fp32",
        log=messages.append,
        progress_bar=False,
    )
    finished = run()
    _truncate(out / "checkpoints" / "3" / "state")
    again = run()
    assert any("checkpoint 3" in m and "cannot be read" in m and "from checkpoint 2" in m for m in messages)
    assert any(m.startswith(f"resuming {out} at step 2") for m in messages)
    np.testing.assert_array_equal(again.gates, finished.gates)
    assert [h["step"] for h in json.loads((out / "loss.json").read_text())] == [0, 1, 2]


def test_a_checkpoint_of_other_shapes_still_does_not_fit(tmp_path):
    """Without the recorded gate shape, the stored arrays' shapes (read from orbax's metadata) tell another
    model's checkpoint from a damaged one."""
    out = tmp_path / "run"
    _checkpoints(out, shape=(2, 2), gates_shape=False)
    checkpoints, state, meta = _checkpoints(out, shape=(3, 2), steps=())
    with pytest.raises(training.TrainingError, match=r"checkpoint 3 .*does not fit.*gates: \(2, 2\) -> \(3, 2\)"):
        training.resume_point(checkpoints, out, state, meta, required=False)
    assert checkpoints.steps() == [3, 2]


@pytest.mark.parametrize("address", ["nonsense", "host0:", ":1234", "host0:0", "host0:65536", "host0:http", "h:²"])
def test_a_coordinator_that_is_not_host_port_is_refused_before_jax_is_called(monkeypatch, address):
    """JAX answered "nonsense" with IndexError: list index out of range."""
    called = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: called.append(args))
    with pytest.raises(distributed.LaunchError, match=r"--coordinator .* is not HOST:PORT.*1 to 65535"):
        distributed.initialize_distributed(False, address, 1, 0)
    assert not called


@pytest.mark.parametrize("address", ["host0:1234", "10.0.0.1:80", "[::1]:65535"])
def test_a_host_port_coordinator_reaches_jax(monkeypatch, address):
    called = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: called.append(args))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    distributed.initialize_distributed(False, address, 2, 1)
    assert called == [(address, 2, 1)]


def test_zero_processes_is_refused():
    with pytest.raises(distributed.LaunchError, match="--num-processes must be at least 1, got 0"):
        distributed.initialize_distributed(False, "host0:1234", 0, 0)


_RESUME_SCRIPT = r"""
import json, os, signal, sys, time
from pathlib import Path
import jax, numpy as np
import duo_jax
from duo_jax import gates, sharding, training
from duo_jax.tokenizer import Tokenizer
from tests.conftest import tiny_config
from tests.test_training import VOCAB, tiny_tokenizer, write_haystack

root, phase = Path(sys.argv[1]), sys.argv[2]
mesh = sharding.make_mesh(data=2, fsdp=2, seq=2)
model = duo_jax.load(root / "model", dtype=np.float32, shardings=lambda shapes: sharding.weight_shardings(shapes, mesh),
                     layout="stacked")
config, params = model.config, model.params
plain = duo_jax.load(root / "model", dtype=np.float32, layout="stacked").params
specs = sharding.weight_specs(plain, mesh)
for x, y, spec in zip(jax.tree.leaves(params), jax.tree.leaves(plain), jax.tree.leaves(specs)):
    assert x.sharding.spec == spec and np.array_equal(np.asarray(x), np.asarray(y))
    if spec != jax.sharding.PartitionSpec():  # loaded straight into 1/4 slices (fsdp x seq)
        assert all(s.data.size * 4 == x.size for s in x.addressable_shards)
tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=(), add_bos=False)
cfg = training.TrainConfig(objective=gates.Objective(sink=8, recent=16), steps=6, save_every=2, batch_size=4,
                           haystack=str(write_haystack(root / "hay")), min_len=1, max_len=300, num_lengths=2,
                           num_passkeys=2, passkey_words=4)
messages = []
run = lambda out: training.train(params, config, tokenizer, cfg, root / out, mesh, model_name="tiny", dtype="fp32",
                                 log=messages.append, progress_bar=False)
if phase == "kill":  # SIGKILL this process when step 4 asks for its batch, once checkpoint 4 is on disk
    make_batch = training.make_batch

    def make_batch_or_die(stream, first_sample, *args):
        if first_sample == 4 * cfg.batch_size:
            while not (root / "killed" / "checkpoints" / "4").is_dir():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return make_batch(stream, first_sample, *args)

    training.make_batch = make_batch_or_die
    run("killed")
else:
    resumed, straight = run("killed"), run("straight")
    print(json.dumps({"messages": messages, "resumed": resumed.gates.tolist(), "straight": straight.gates.tolist(),
                      "losses": [[h["loss"] for h in json.loads((root / out / "loss.json").read_text())]
                                 for out in ("killed", "straight")]}))
"""


@pytest.mark.slow
def test_killed_sharded_run_resumes_bit_identically(tmp_path):
    """A run on data=2, fsdp=2, seq=2 whose weights are loaded straight into their shards, killed after its
    step-4 checkpoint, then resumed, ends with the gates and losses of an uninterrupted run, bit for bit."""
    import transformers

    from tests.test_model import write_random_hf_model

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    write_random_hf_model(tmp_path / "model", transformers.LlamaConfig, fields)
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    run = lambda phase: subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, str(tmp_path), phase],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    killed = run("kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert len(json.loads((tmp_path / "killed" / "loss.json").read_text())) == 4
    finished = run("resume")
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert any(m.startswith(f"resuming {tmp_path / 'killed'} at step 4") for m in result["messages"])
    assert any("sequence parallelism: ulysses" in m for m in result["messages"])
    assert result["resumed"] == result["straight"] and np.min(result["straight"]) < 1
    assert result["losses"][0] == result["losses"][1] and len(result["losses"][0]) == 6
