"""Evaluation of DuoAttention against full attention and StreamingLLM at the same KV budget.

- `duo_jax.eval.niah.run_niah`: needle in a haystack over depths x context lengths, heat maps per mode;
- `duo_jax.eval.passkey.run_passkey`: numeric passkey retrieval accuracy per length;
- `duo_jax.eval.perplexity.run_perplexity`: perplexity per position bucket on long text;
- `duo_jax.eval.modes`: the compared modes and the budget matching of the streaming mode;
- `duo_jax.eval.report`: Markdown tables, JSON and figures (shared with `benchmarks/`).

Command line: ``python -m duo_jax.eval {niah,passkey,perplexity} --help``.
"""

from duo_jax.eval.modes import MODES, ModeSettings, mode_settings, streaming_budget
from duo_jax.eval.niah import run_niah
from duo_jax.eval.passkey import run_passkey
from duo_jax.eval.perplexity import run_perplexity

__all__ = ["MODES", "ModeSettings", "mode_settings", "run_niah", "run_passkey", "run_perplexity", "streaming_budget"]
