"""Several processes as one program: JAX's multi-controller runtime (`jax.distributed`), for gate training and
generation on devices of several hosts (a TPU pod slice, GPU nodes). Every process runs the same program over the
global mesh; each loads only its devices' slices of the weights (`duo_jax.load(..., shardings=)`).
"""

from __future__ import annotations

import argparse
import os

import jax

from duo_jax.errors import DuoJaxError


class LaunchError(DuoJaxError, ValueError):
    """A multi-process launch that cannot start as asked; the message says why and what to pass."""


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """--distributed, --coordinator, --num-processes, --process-id: the options `initialize_distributed` takes."""
    group = parser.add_argument_group("several processes (hosts)")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="run as one of several processes: jax.distributed.initialize() finds the others on "
        "Cloud TPU, SLURM, Open MPI and Kubernetes (automatic under SLURM / Open MPI with "
        "several tasks); elsewhere also pass the three options below to every process",
    )
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0's coordinator, for a launch JAX cannot detect (implies --distributed)",
    )
    group.add_argument("--num-processes", type=int, help="number of processes of an explicit launch")
    group.add_argument("--process-id", type=int, help="this process's index (0 to --num-processes - 1)")


def initialize_from_args(args: argparse.Namespace) -> None:
    """`initialize_distributed` with the options `add_launch_options` added."""
    initialize_distributed(args.distributed, args.coordinator, args.num_processes, args.process_id)


def check_coordinator(address: str) -> None:
    """LaunchError unless `address` is HOST:PORT with a port in 1-65535 (JAX fails on others with an
    IndexError, or only once it tries to connect)."""
    host, colon, port = address.rpartition(":")  # rpartition: an IPv6 host "[::1]" holds colons itself
    if not (colon and host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(
            f"--coordinator {address!r} is not HOST:PORT: give process 0's host name or address and a free port "
            "number from 1 to 65535, e.g. --coordinator host0:1234"
        )


def initialize_distributed(
    requested: bool, coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """`jax.distributed.initialize` (JAX's multi-controller runtime: every process runs the same program on
    the global mesh; on CPU its collectives are Gloo's) when `requested`, when `coordinator` is given, or when
    this process was launched as one of several (SLURM or Open MPI with more than one task, or a JAX
    coordinator address in the environment). Call before touching devices.

    Without `coordinator`, JAX finds the coordinator, the number of processes and this process's index by
    itself on Cloud TPU, SLURM, Open MPI and Kubernetes. Anywhere else (a few GPU hosts, or processes on one
    host) pass all three: `coordinator` "host:port" of process 0, `num_processes`, `process_id` (0-based)."""
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise LaunchError(
            "an explicit multi-process launch needs all of --coordinator HOST:PORT, "
            "--num-processes N and --process-id I (or none of them, to let JAX detect the "
            "cluster: Cloud TPU, SLURM, Open MPI, Kubernetes)"
        )
    if coordinator is not None:
        check_coordinator(coordinator)
    if num_processes is not None and num_processes < 1:
        raise LaunchError(f"--num-processes must be at least 1, got {num_processes}")
    if process_id is not None and not 0 <= process_id < num_processes:
        raise LaunchError(
            f"--process-id {process_id} is not in [0, {num_processes}) (--num-processes "
            f"{num_processes}); number the processes 0 to {num_processes - 1}"
        )
    env = os.environ
    launched = (
        "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    )
    if not (requested or launched or coordinator is not None) or jax.distributed.is_initialized():
        return
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except ValueError as e:  # JAX could not detect the cluster
        raise LaunchError(
            f"jax.distributed.initialize failed: {e}; outside Cloud TPU / SLURM / Open MPI / "
            "Kubernetes pass --coordinator HOST:PORT (process 0's), --num-processes N and "
            "--process-id I to every process"
        ) from None
