"""Every attention call goes through here: a mask spec (`masks`), one dispatch (`dispatch`) to the Pallas
kernels, the blocked XLA path (`xla`) or a dense reference, and attention with probabilities (`probs`) for the
methods that score tokens."""

from duo_jax.attention.dispatch import (
    IMPLS,
    Impl,
    attend,
    attend_partial,
    attend_received,
    decode_attention,
    duo_decode,
    duo_prefill,
    flash_attention,
    lambda_attention,
    resolve_impl,
)
from duo_jax.attention.masks import MaskSpec, prefix_spec
from duo_jax.attention.probs import attention_probs, attention_received, masked_softmax

__all__ = [
    "IMPLS",
    "Impl",
    "MaskSpec",
    "attend",
    "attend_partial",
    "attend_received",
    "attention_probs",
    "attention_received",
    "decode_attention",
    "duo_decode",
    "duo_prefill",
    "flash_attention",
    "lambda_attention",
    "masked_softmax",
    "prefix_spec",
    "resolve_impl",
]
