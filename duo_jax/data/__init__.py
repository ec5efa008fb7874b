"""Synthetic data: haystacks, DuoAttention's multi-passkey training samples, and NIAH / passkey prompts."""

from duo_jax.data.haystack import (
    CALIBRATION_HAYSTACK,
    EVALUATION_HAYSTACK,
    CalibrationOverlapWarning,
    DataError,
    encode,
    haystack_tokens,
    load_haystack,
    overlaps,
)
from duo_jax.data.niah import (
    NeedlePrompt,
    grid,
    make_needle_prompt,
    make_passkey_prompt,
    score_contains,
    score_needle,
    score_passkey,
)
from duo_jax.data.passkey import (
    Sample,
    SampleStream,
    check_sample_options,
    context_lengths,
    make_sample,
    min_context_len,
)

__all__ = [
    "check_sample_options",
    "CALIBRATION_HAYSTACK",
    "EVALUATION_HAYSTACK",
    "CalibrationOverlapWarning",
    "DataError",
    "NeedlePrompt",
    "Sample",
    "SampleStream",
    "context_lengths",
    "encode",
    "grid",
    "haystack_tokens",
    "load_haystack",
    "make_needle_prompt",
    "make_passkey_prompt",
    "make_sample",
    "min_context_len",
    "overlaps",
    "score_contains",
    "score_needle",
    "score_passkey",
]
