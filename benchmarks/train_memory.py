"""Per-device memory of a gate-training step on device meshes, for a model's shapes (default Llama-3-8B).

For each mesh, `duo_jax.training.memory_report`: the train step lowered and compiled from shapes only
(`jax.eval_shape`, nothing allocated) on N host CPU devices (`--xla_force_host_platform_device_count=N`,
one subprocess per device count), giving the bytes one device holds for the weights, gates, optimiser state
and batch (from their shardings) and the compiled step's temporaries (XLA's memory analysis of the CPU
executable: the buffer assignment of the same program a GPU or TPU would run, with the blocked XLA attention
in place of the Pallas kernels). Then whether that fits a 16 GiB chip (TPU v5e) and an 80 GiB GPU.

    python benchmarks/train_memory.py                                   # Llama-3-8B, 32k tokens, 8/16/64 devices
    python benchmarks/train_memory.py --model smollm2-135m --seq-len 4096 --meshes seq=8 fsdp=8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import common

# mesh -> samples per step (the batch splits over data x fsdp: one 32k-token sample per data x fsdp slot)
DEFAULT_MESHES = ("data=8", "seq=8", "fsdp=8", "fsdp=2,seq=8", "seq=16", "fsdp=8,seq=8", "seq=64")
CHIPS_GIB = (16, 80)


def _worker(model: str, seq_len: int, meshes: list[str]) -> None:
    """In a process with the right number of host devices: one JSON line per mesh."""
    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax import config as config_lib
    from duo_jax import sharding, training

    config = config_lib.get_config(model)
    params = jax.eval_shape(lambda: duo_jax.init_params(config, jax.random.key(0), dtype=jnp.bfloat16))
    for spec in meshes:
        sizes = sharding.parse_mesh(spec)
        mesh = sharding.make_mesh(**sizes)
        cfg = training.TrainConfig(batch_size=sizes["data"] * sizes["fsdp"], max_len=seq_len)
        report = training.memory_report(config, cfg, mesh, params, seq_len)
        print(
            json.dumps(
                dict(
                    mesh=sharding.format_mesh(mesh),
                    devices=mesh.size,
                    batch=cfg.batch_size,
                    attention=training.sequence_parallelism(config, mesh),
                    seq_len=report.seq_len,
                    weights=report.weights,
                    gates=report.gates,
                    optimizer=report.optimizer,
                    batch_bytes=report.batch,
                    temp=report.temp,
                    total=report.total,
                    full_weights=sharding.total_bytes(dataclasses.replace(params, lm_head=None)),
                )
            ),
            flush=True,
        )


def main(argv=None) -> int:
    p = common.parser(__doc__, "train_memory")
    p.set_defaults(out=common.REPO / "benchmarks" / "results")
    p.add_argument("--model", default="llama3-8b", help="a config name (only its shapes are used)")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per training sample")
    p.add_argument(
        "--meshes",
        nargs="+",
        default=DEFAULT_MESHES,
        help="meshes 'data=A,fsdp=B,seq=C'; the batch is data x fsdp samples",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.seq_len, args.meshes)
        return 0

    from duo_jax import sharding

    results = common.run_workers(
        __file__, args.meshes, sharding.MESH_AXES, ["--model", args.model, "--seq-len", str(args.seq_len)]
    )
    if results is None:
        return 1

    gib = lambda b: round(b / 2**30, 3)
    headers = [
        "devices",
        "mesh",
        "batch",
        "seq attention",
        "weights GiB",
        "gates + optimiser GiB",
        "batch GiB",
        "step temp GiB",
        "total GiB",
        *(f"fits {c} GiB" for c in CHIPS_GIB),
    ]
    rows = [
        [
            r["devices"],
            r["mesh"],
            r["batch"],
            r["attention"],
            gib(r["weights"]),
            gib(r["gates"] + r["optimizer"]),
            gib(r["batch_bytes"]),
            gib(r["temp"]),
            gib(r["total"]),
            *("yes" if r["total"] <= c * 2**30 else "no" for c in CHIPS_GIB),
        ]
        for r in results
    ]
    notes = [
        f"{args.model} shapes in bf16 (weights without the LM head, which gate training never reads: "
        f"{gib(results[0]['full_weights'])} GiB in full), {args.seq_len}-token samples, one sample per "
        "data x fsdp slot; compiled for host CPU devices (memory analysis of the CPU executable)."
    ]
    common.write_result(
        args.out,
        f"train_memory_{args.model}",
        title=f"Gate-training step memory per device: {args.model}, {args.seq_len} tokens per sample",
        headers=headers,
        rows=rows,
        data=dict(results=results),
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
