"""Evaluations that compare KV-cache methods on one model at the same KV budget: `niah`, `passkey`, `perplexity`,
`longbench` and `ruler` (one module each, `run_<task>`), over the modes of `modes`, with the resumable per-sample
runs of `samples` and the tables and figures of `report` (shared with `benchmarks/`). Command line:
``python -m duo_jax.eval TASK --help``; design: docs/evaluation.md.
"""

from duo_jax.eval.modes import MODES, ModeSettings, mode_settings, streaming_budget
from duo_jax.eval.niah import run_niah
from duo_jax.eval.passkey import run_passkey
from duo_jax.eval.perplexity import run_perplexity

__all__ = ["MODES", "ModeSettings", "mode_settings", "run_niah", "run_passkey", "run_perplexity", "streaming_budget"]
