"""Shared test helpers: tiny model configs and random Hugging Face checkpoints written to disk."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from duo_jax.config import ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(**overrides) -> ModelConfig:
    """2 layers, hidden 64, GQA 4 query / 2 KV heads: small enough to compile in seconds."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512, name="tiny")
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def tiny():
    return tiny_config()


class BPETokenizer:
    """A real byte-level BPE tokenizer (vocab 2000) trained in memory on the start of the essays."""

    def __init__(self):
        from tokenizers import ByteLevelBPETokenizer

        from duo_jax.data import load_haystack

        self.backend = ByteLevelBPETokenizer()
        self.backend.train_from_iterator([load_haystack(max_chars=200_000)], vocab_size=2000, show_progress=False)

    def encode(self, text):
        return self.backend.encode(text).ids

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids])


@pytest.fixture(scope="session")
def tokenizer():
    """Token lengths like a real model's, without loading one."""
    return BPETokenizer()
