"""Multi-process training in process form: two real processes on this host (2 host CPU devices each), joined
by `jax.distributed` (train_gates.py --coordinator / --num-processes / --process-id; CPU collectives are
Gloo's), train on one (fsdp=2, seq=2) mesh spanning both. Each process reads only its own shards of the
safetensors checkpoint; orbax saves and restores sharded state across the processes (a run stopped after its
step-2 checkpoint resumes); the losses and gates equal a single-device run of the same command."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import duo_jax
from duo_jax.pattern import Pattern
from tests import test_train_gates
from tests.conftest import xla_flags
from tests.test_training import REPO

tiny_checkpoint = test_train_gates.tiny_checkpoint  # the fixture: a random tiny Llama with a tokenizer, a haystack

_PROCESS = r"""
import json, sys, time
from pathlib import Path
import jax, numpy as np
import duo_jax, train_gates
from duo_jax import loading, sharding, training

start = time.perf_counter()
process_id, port, root, args = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
args += ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(process_id)]
reads = []  # bytes of every block this process reads from the safetensors files
read = loading._SafetensorsTensor.__getitem__
loading._SafetensorsTensor.__getitem__ = lambda self, index: reads.append(read(self, index)) or reads[-1]


class Stop(Exception):
    pass


make_batch = training.make_batch


def stop_at_step_1(stream, first_sample, *rest):  # both processes stop once checkpoint 1 is on disk
    if first_sample == 1 * 2:
        while not (root / "run" / "checkpoints" / "1").is_dir():
            time.sleep(0.01)
        raise Stop
    return make_batch(stream, first_sample, *rest)


training.make_batch = stop_at_step_1
try:
    train_gates.main(args)
    raise AssertionError("the run was not stopped")
except Stop:
    pass
training.make_batch = make_batch
assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
sharded_reads = sum(r.nbytes for r in reads)
assert train_gates.main(args) == 0  # the same command again: resumes from checkpoint 1

# what this process's devices hold of the weights train_gates loaded, and their values
mesh = sharding.make_mesh(fsdp=2, seq=2)
reads.clear()
model = duo_jax.load(root / "model", np.float32, shardings=lambda shapes: sharding.weight_shardings(shapes, mesh),
                     layout="stacked")
assert sum(r.nbytes for r in reads) == sharded_reads  # one load reads what the one in train_gates read
plain = duo_jax.load(root / "model", np.float32, layout="stacked").params  # every byte of the checkpoint, on this host
held, equal = 0, True
for x, whole in zip(jax.tree.leaves(model.params), jax.tree.leaves(plain)):
    blocks = {tuple(i.indices(d) for i, d in zip(s.index, x.shape)): s for s in x.addressable_shards}
    held += sum(s.data.nbytes for s in blocks.values())
    equal &= all(np.array_equal(np.asarray(s.data), np.asarray(whole)[s.index]) for s in blocks.values())

# orbax: the sharded weights saved by both processes and restored onto the mesh
checkpoints = training.Checkpoints(root / "weights")
tree = {"embed": model.params.embed, "wq": model.params.layers.wq, "w_down": model.params.layers.w_down}
checkpoints.save(0, tree, {"step": 0})
checkpoints.close()
checkpoints = training.Checkpoints(root / "weights")
restored = checkpoints.restore(0, tree)
checkpoints.close()
restored_equal = all(y.sharding == x.sharding and all(np.array_equal(np.asarray(a.data), np.asarray(b.data))
                                                     for a, b in zip(x.addressable_shards, y.addressable_shards))
                     for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)))
print(json.dumps({"seconds": time.perf_counter() - start, "read": sharded_reads, "held": held,
                  "total": sum(x.nbytes for x in jax.tree.leaves(plain)),
                  "equal": bool(equal), "restored_equal": restored_equal,
                  "files": sorted(p.name for p in (root / "weights" / "0" / "state").iterdir())}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(script: str, *args: str) -> list[subprocess.Popen]:
    """`script` started as processes 0 and 1 of 2 host CPU devices each, with argv (process id, a free
    coordinator port, *args)."""
    port = str(_free_port())
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i), port, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


@pytest.mark.slow
def test_two_processes_train_like_one_device(tmp_path, tiny_checkpoint):
    model, haystack = tiny_checkpoint
    args = [
        "--model",
        model,
        "--dtype",
        "fp32",
        "--steps",
        2,
        "--save-every",
        1,
        "--sink",
        8,
        "--recent",
        16,
        "--min-len",
        160,
        "--max-len",
        160,
        "--num-lengths",
        1,
        "--num-passkeys",
        2,
        "--passkey-words",
        4,
        "--haystack",
        haystack,
        "--batch-size",
        2,
    ]
    args = list(map(str, args))
    root = tmp_path / "multi"
    root.mkdir()
    (root / "model").symlink_to(model)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    multi = args + ["--mesh", "fsdp=2,seq=2", "--out", str(root / "run")]
    processes = _two_processes(_PROCESS, str(root), json.dumps(multi))
    single = subprocess.run(
        [sys.executable, str(REPO / "train_gates.py"), *args, "--mesh", "seq=1", "--out", str(tmp_path / "single")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    outputs = [p.communicate(timeout=300) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    _, err = outputs[0]
    assert "mesh data=1,fsdp=2,seq=2" in err and "sequence parallelism: ulysses" in err
    assert "resuming" in err and "at step 1 of 2" in err
    single, multi = (json.loads((d / "loss.json").read_text()) for d in (tmp_path / "single", root / "run"))
    assert len(single) == len(multi) == 2
    np.testing.assert_allclose([h["loss"] for h in multi], [h["loss"] for h in single], rtol=1e-5)
    gates = Pattern.load(tmp_path / "single").gates
    assert gates.min() < 1.0  # the gates moved
    np.testing.assert_allclose(Pattern.load(root / "run").gates, gates, rtol=0, atol=1e-6)

    for r in results:
        assert r["equal"] and r["restored_equal"]  # loaded values, and orbax's round trip
        assert r["read"] == r["held"] < 0.6 * r["total"]  # its half of the sharded weights, plus the norms
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(r["files"])  # each process wrote its shards


_GENERATE = r"""
import contextlib, functools, io, json, sys
import numpy as np
from duo_jax import distributed
process_id, port, model, prompts = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
distributed.initialize_distributed(True, f"localhost:{port}", 2, process_id)
import jax
import duo_jax, infer
from duo_jax import sharding
from duo_jax.pattern import Pattern

mesh = sharding.make_generation_mesh(data=2, model=2)  # each process: one data slot, both model devices
loaded = duo_jax.load(model, np.float32, shardings=functools.partial(sharding.tensor_parallel_shardings, mesh=mesh))
options = dict(max_new_tokens=6, chunk_size=16, stop_at_eos=False)
gates = np.array([[0.9, 0.1], [0.1, 0.1]])  # layer retrieval counts 1, 0
tokens = dict(
    full=duo_jax.generate(loaded, prompts, mesh=mesh, **options).tokens,
    duo=duo_jax.generate(loaded, prompts, mesh=mesh, pattern=Pattern(gates), sparsity=0.75, sink=2, recent=4,
                         kv_dtype="int4", **options).tokens,
)
out = io.StringIO()
launch = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(process_id)]
with contextlib.redirect_stdout(out):
    status = infer.main(["--model", model, "--mesh", "data=2,model=2", "--no-chat", "--prompt", "one two three",
                         "--max-new-tokens", "4", "--dtype", "float32", *launch])
print(json.dumps(dict(tokens=tokens, devices=jax.device_count(), status=status, printed=out.getvalue())))
"""


@pytest.mark.slow
def test_two_processes_generate_like_one_device(tiny_checkpoint):
    """A (data=2, model=2) mesh over two processes of 2 host devices each (each process one batch slot): the
    weights loaded straight into their slices, full attention and duo over an int4 cache give one device's greedy
    tokens (the batch gathered back on every process), and `infer.py --mesh` launched as two processes prints the
    continuation once."""
    model, _ = tiny_checkpoint
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11], [5, 6], [7, 8, 9, 10]]
    processes = _two_processes(_GENERATE, str(model), json.dumps(prompts))
    one = duo_jax.load(model, np.float32)
    options = dict(max_new_tokens=6, chunk_size=16, stop_at_eos=False)
    gates = np.array([[0.9, 0.1], [0.1, 0.1]])
    single = dict(
        full=duo_jax.generate(one, prompts, **options).tokens,
        duo=duo_jax.generate(
            one, prompts, pattern=Pattern(gates), sparsity=0.75, sink=2, recent=4, kv_dtype="int4", **options
        ).tokens,
    )
    outputs = [p.communicate(timeout=300) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert single["full"] != single["duo"]
    for r in results:
        assert r["devices"] == 4 and r["tokens"] == single and r["status"] == 0
    assert results[0]["printed"].startswith("one two three") and results[1]["printed"] == ""


def test_an_incomplete_explicit_launch_is_refused(capsys):
    import train_gates

    for extra in (["--coordinator", "localhost:1"], ["--num-processes", "2", "--process-id", "0"]):
        assert train_gates.main(["--model", "tiny", *extra]) == 2
        assert "needs all of --coordinator HOST:PORT, --num-processes N and --process-id I" in capsys.readouterr().err
    assert (
        train_gates.main(
            ["--model", "tiny", "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"]
        )
        == 2
    )
    assert "--process-id 2 is not in [0, 2)" in capsys.readouterr().err
