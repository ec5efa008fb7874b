"""Gate-training step time for a model's shapes on the devices present (default Llama-3-8B, 32k tokens).

The step `train_gates.py` runs (`duo_jax.training.run_train_step`: teacher and gated student side by side in
one scanned, rematerialised layer loop, the gates' AdamW update), on random bf16 weights and random tokens
(timings do not depend on the values), over a mesh of every device (default `seq=` all of them, as
`train_gates.py`). Reports the compilation, the median step time over --steps timed steps, tokens per second,
and the device memory: XLA's estimate before the first step (`duo_jax.training.memory_report`) and, where the
backend reports it, the peak the device saw.

The original (DuoAttention) trains 2,000 steps on one 8 x A100 server; at the step time measured here one
device takes 2,000 x step seconds.

    python benchmarks/train_step.py                                      # Llama-3-8B, 32k tokens, all devices
    python benchmarks/train_step.py --model smollm2-135m --seq-len 8192
    DUO_JAX_DISABLE_TRITON=1 python benchmarks/train_step.py   # as a GPU without Triton runs it (through cuDNN)
    python benchmarks/train_step.py --impl pallas       # the Triton kernels everywhere
"""

from __future__ import annotations

import statistics
import sys
import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "train_step")
    p.add_argument("--model", default="llama3-8b", help="a config name (only its shapes are used)")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per sample")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one that compiles)")
    p.add_argument("--mesh", help="device mesh 'data=A,fsdp=B,seq=C' (default: seq= every device)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per step")
    p.add_argument(
        "--impl",
        default="auto",
        help="attention implementation (duo_jax.attention.IMPLS; DUO_JAX_DISABLE_TRITON=1 in the environment "
        "runs auto as a GPU without Triton does)",
    )
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import duo_jax
    from duo_jax import config as config_lib
    from duo_jax import gates as gates_lib
    from duo_jax import sharding, training

    config = config_lib.get_config(args.model)
    mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh or f"seq={jax.device_count()}"))
    objective = gates_lib.Objective(impl=args.impl)
    cfg = training.TrainConfig(objective=objective, batch_size=args.batch_size, max_len=args.seq_len)
    training.check_mesh(mesh, cfg.batch_size)
    params = duo_jax.init_params(config, jax.random.key(0), dtype=jnp.bfloat16)
    report = training.memory_report(config, cfg, mesh, params, args.seq_len)
    print(report, flush=True)
    params, state, step_fn, _ = training.prepare(params, config, cfg, mesh)
    gates, opt_state = state["gates"], state["opt_state"]

    rng = np.random.default_rng(0)
    T = report.seq_len
    tokens = rng.integers(0, config.vocab_size, (cfg.batch_size, T)).astype(np.int32)
    supervise = np.zeros((cfg.batch_size, T), bool)
    supervise[:, -min(T, 512) :] = True  # a question-and-answer span at the end, as the passkey samples have
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (cfg.batch_size, T)).copy()
    batch = training.shard_batch(training.Batch(tokens, positions, supervise), mesh)

    times = []
    for _ in range(args.steps + 1):  # the first compiles
        start = time.perf_counter()
        gates, opt_state, terms = step_fn(gates, opt_state, params, batch)
        jax.block_until_ready((gates, terms))
        times.append(time.perf_counter() - start)
        if not np.isfinite(float(training.fetch(terms.loss))):
            raise training.TrainingError(f"the loss is not finite: {terms}")
    step_s = statistics.median(times[1:])
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    gib = lambda b: None if b is None else round(b / 2**30, 2)
    tokens_per_step = cfg.batch_size * T
    row = [
        args.model,
        common.attention_label(args.impl),
        sharding.format_mesh(mesh),
        tokens_per_step,
        round(times[0], 1),
        round(step_s, 3),
        round(tokens_per_step / step_s),
        round(2000 * step_s / 60, 1),
        gib(report.total),
        gib(peak),
    ]
    headers = [
        "model",
        "attention",
        "mesh",
        "tokens / step",
        "first step s (compiles)",
        "step s",
        "tokens / s",
        "2,000 steps, min",
        "XLA estimate GiB / device",
        "peak GiB (device 0)",
    ]
    notes = [
        f"{jax.devices()[0].device_kind} x {mesh.size}, JAX {jax.__version__}; random bf16 weights and tokens; "
        f"median of {args.steps} steps after the compiling one"
    ]
    common.write_result(
        args.out,
        f"train_step_{args.model}"
        + ("" if args.impl == "auto" else f"_{args.impl}")
        + ("_notriton" if common.triton_disabled() else ""),
        title=f"Gate-training step: {args.model}, {T} tokens per sample",
        headers=headers,
        rows=[row],
        data=dict(
            args={k: str(v) for k, v in vars(args).items()},
            step_seconds=times,
            memory_report=dict(weights=report.weights, temp=report.temp, total=report.total),
            peak_bytes=peak,
        ),
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
