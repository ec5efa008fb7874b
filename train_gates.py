r"""Train DuoAttention gates (one per layer and KV head) for a frozen model on synthetic passkey retrieval.

    python train_gates.py --model smollm2-135m --out runs/gates/smollm2-135m
    python train_gates.py --model llama3-8b --mesh seq=8             # 8 devices, sequence-parallel
    python train_gates.py --model llama3-8b --mesh fsdp=2,seq=8 --batch-size 2   # 16 devices
    python train_gates.py --model llama3-8b --mesh fsdp=2,seq=8 --batch-size 2 \
        --coordinator host0:1234 --num-processes 2 --process-id I     # on each of 2 hosts of 8 devices (I = 0, 1)

Defaults are those of the original DuoAttention training run: AdamW lr 0.02, 2000 steps,
batch 1, sink 128 / recent 256, L1 weight 0.05, ten 32-word passkeys, 50 context lengths from --min-len
(1000, raised to what the passkeys need) to --max-len (the model's context). The run folder gets the pattern
(full_attention_heads.tsv + config.json), loss.json, gates.png and checkpoints/; re-running the same
command continues from the last checkpoint. Before the first step it prints the per-device memory of a
--max-len step (weights, gates, optimiser state, batch, and the compiled step's temporaries).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

# What shrinks a train step's memory, for `duo_jax.device_memory`'s errors.
MEMORY_FIXES = (
    "train on shorter samples (--max-len) or fewer per step (--batch-size), spread each sample over more devices "
    "(--mesh seq=N, or fsdp=N for the weights), or keep the weights in bf16 (--dtype bf16)"
)


def build_parser() -> argparse.ArgumentParser:
    from duo_jax.distributed import add_launch_options
    from duo_jax.errors import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--model", required=True, help="config name (see configs/), Hugging Face directory or .gguf file")
    add("--out", help="run folder (default: runs/gates/<model name>)")
    add(
        "--dtype",
        type=lambda name: {"bfloat16": "bf16", "float32": "fp32"}.get(name, name),  # the other commands' spelling
        choices=("bf16", "fp32"),
        default="bf16",
        help="dtype of the frozen weights, bf16 (bfloat16) or fp32 (float32); gates are fp32",
    )
    add(
        "--resume",
        action="store_true",
        help="require a checkpoint to continue from (without it a run continues when there is one)",
    )

    group = parser.add_argument_group("objective")
    group.add_argument("--sink", type=int, default=128, help="attention-sink tokens of the streaming branch")
    group.add_argument("--recent", type=int, default=256, help="recent-window tokens of the streaming branch")
    group.add_argument("--reg-weight", type=float, default=0.05, help="weight of the L1 term mean |alpha|")
    group.add_argument("--initial-value", type=float, default=1.0, help="initial value of every gate")
    group.add_argument(
        "--impl",
        choices=("auto", "pallas", "cudnn", "mosaic", "cpu", "xla", "reference"),  # duo_jax.attention.IMPLS
        default="auto",
        help="attention implementation (auto: chosen per backend and case, cuDNN where Triton is missing; "
        "docs/attention.md)",
    )

    group = parser.add_argument_group("optimisation")
    group.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    group.add_argument("--batch-size", type=int, default=1, help="samples per step")
    group.add_argument("--lr", type=float, default=0.02, help="peak AdamW learning rate (weight decay 0)")
    group.add_argument("--warmup-ratio", type=float, default=0.2, help="fraction of steps of linear warm-up")
    group.add_argument("--decay-ratio", type=float, default=0.2, help="fraction of steps of linear decay at the end")
    group.add_argument("--min-lr-ratio", type=float, default=0.1, help="floor of the schedule, as a fraction of --lr")
    group.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (the last 2 are kept)")

    group = parser.add_argument_group("data")
    group.add_argument(
        "--haystack",
        default="paul_graham:calibration",
        help="paul_graham:calibration (the essays' half that evaluations do not use), paul_graham, "
        "austen, a directory of .txt files, or tfds:<name>",
    )
    group.add_argument(
        "--min-len", type=int, help="shortest context (default 1000; raised, with a note, to what the passkeys need)"
    )
    group.add_argument("--max-len", type=int, help="longest context (default and limit: the model's context length)")
    group.add_argument("--num-lengths", type=int, default=50, help="evenly spaced context lengths")
    group.add_argument("--num-passkeys", type=int, default=10, help="passkeys per sample")
    group.add_argument("--passkey-words", type=int, default=32, help="words per passkey")
    group.add_argument("--min-depth", type=float, default=0.05, help="shallowest passkey depth")
    group.add_argument("--max-depth", type=float, default=0.95, help="deepest passkey depth")
    group.add_argument(
        "--supervise",
        choices=("qa", "answers"),
        default="qa",
        help="positions the loss compares: every question/answer token (the original's labels), "
        "or the answer tokens only",
    )
    group.add_argument("--seed", type=int, default=42, help="sample i depends only on (seed, i)")

    group = parser.add_argument_group("devices")
    group.add_argument(
        "--mesh",
        help="device mesh 'data=A,fsdp=B,seq=C', sizes of 1 may be left out (default: "
        "seq=all devices). The batch is split over data x fsdp, the sequence over "
        "seq, the frozen weights over fsdp x seq; attention over seq uses Ulysses "
        "when seq divides the KV heads, else an all-gather of K/V",
    )
    add_launch_options(parser)
    return parser


def model_config(model: str):
    """The model's config where reading it loads no weights (a name in configs/, a Hugging Face folder), else None:
    a .gguf's is read as it loads, as is a config.json that loading then reports unreadable."""
    from duo_jax.config import get_config, named_configs
    from duo_jax.errors import DuoJaxError
    from duo_jax.loading import read_hf_config

    path = Path(model)
    if not path.exists():
        return get_config(model) if model in named_configs() else None
    try:
        return read_hf_config(path)[1]
    except (OSError, DuoJaxError):  # a file, or no readable config.json in the folder: loading says why
        return None


def with_max_len(cfg, max_len: int | None, config, min_len_given: bool = True):
    """`cfg` with its max_len: --max-len, else the model's context (`config`'s; None: not read yet, cfg as it is).
    TrainingError when --min-len (`min_len_given`: typed, else its default) exceeds it."""
    from duo_jax.training import TrainingError

    if max_len is not None:
        limit, fix = f"--max-len {max_len}", "lower --min-len or raise --max-len"
    elif config is None:
        return cfg
    else:
        max_len = config.max_position_embeddings
        limit = f"--max-len, which defaults to the model's context of {max_len} tokens"
        fix = f"lower --min-len to at most {max_len}"
    if cfg.min_len > max_len:
        raise TrainingError(
            f"--min-len {cfg.min_len}{'' if min_len_given else ' (its default)'} exceeds {limit}: "
            f"the training contexts run from the one to the other; {fix}"
        )
    return dataclasses.replace(cfg, max_len=max_len)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax import device_memory, distributed, gates, sharding, training
    from duo_jax.data import load_haystack
    from duo_jax.errors import check_output_folder
    from duo_jax.tokenizer import require

    try:
        # before anything touches the devices
        distributed.initialize_from_args(args)
        name = Path(args.model).stem if Path(args.model).exists() else args.model
        out = check_output_folder(args.out or f"runs/gates/{name}")  # before the weights load
        mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh or f"seq={jax.device_count()}"))
        min_len = training.TrainConfig.min_len if args.min_len is None else args.min_len
        cfg = training.TrainConfig(  # every option checked before the weights load
            objective=gates.Objective(sink=args.sink, recent=args.recent, reg_weight=args.reg_weight, impl=args.impl),
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup_ratio=args.warmup_ratio,
            decay_ratio=args.decay_ratio,
            min_lr_ratio=args.min_lr_ratio,
            initial_value=args.initial_value,
            haystack=args.haystack,
            min_len=min_len,
            # the model's context when not given: min_len stands in for it until the config is read
            max_len=min_len if args.max_len is None else args.max_len,
            num_lengths=args.num_lengths,
            num_passkeys=args.num_passkeys,
            passkey_words=args.passkey_words,
            min_depth=args.min_depth,
            max_depth=args.max_depth,
            supervise=args.supervise,
            seed=args.seed,
            save_every=args.save_every,
        )
        training.check_mesh(mesh, cfg.batch_size)
        config = model_config(args.model)  # the model's context, where it is known before the weights
        cfg = with_max_len(cfg, args.max_len, config, args.min_len is not None)
        if config is not None:
            training.check_max_len(config, cfg)
        elif args.max_len is not None:  # else max_len is the model's context, known once it loads
            training.check_window(cfg)
        load_haystack(cfg.haystack, max_chars=1)  # the source exists (it is read whole once the tokenizer is here)
        model = duo_jax.load(
            args.model,
            dtype=jnp.bfloat16 if args.dtype == "bf16" else jnp.float32,
            shardings=lambda shapes: sharding.weight_shardings(shapes, mesh),  # this host's slices
            layout="stacked",
        )  # the scanned layers' layout
        tokenizer = require(model.tokenizer, "training on text samples")
        cfg = with_max_len(cfg, args.max_len, model.config, args.min_len is not None)
        log = lambda message: print(message, file=sys.stderr)
        training.check_max_len(model.config, cfg)  # before the memory report compiles a step at max_len
        report = training.memory_report(model.config, cfg, mesh, model.params, cfg.max_len)
        log(str(report))
        step = f"a train step on {cfg.batch_size} x {cfg.max_len} tokens"
        if report.total is not None:  # the weights are on the devices already
            device_memory.check_fits(report.total - report.weights, mesh.devices.flat, step, MEMORY_FIXES)
        with device_memory.explain_out_of_memory(f"running {step}", MEMORY_FIXES):
            pattern = training.train(
                model.params,
                model.config,
                tokenizer,
                cfg,
                out,
                mesh,
                model_name=args.model,
                dtype=args.dtype,
                resume=args.resume,
                log=log,
            )
    except (duo_jax.DuoJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{pattern!r} written to {out} (full_attention_heads.tsv, config.json, loss.json, gates.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
