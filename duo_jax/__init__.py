"""duo-jax: DuoAttention (retrieval + streaming heads) for JAX."""

from duo_jax.config import ModelConfig, RopeScaling, get_config, named_configs
from duo_jax.errors import ConfigError, DeviceMemoryError, DuoJaxError, LoadError, WeightsNotFoundError
from duo_jax.generation import Generation, generate
from duo_jax.loading import Model, load
from duo_jax.model import LayerParams, Params, forward, hidden_states, init_params
from duo_jax.pattern import Pattern, PatternError

__all__ = [
    "ConfigError",
    "DeviceMemoryError",
    "DuoJaxError",
    "Generation",
    "LayerParams",
    "LoadError",
    "Model",
    "ModelConfig",
    "Params",
    "Pattern",
    "PatternError",
    "RopeScaling",
    "WeightsNotFoundError",
    "forward",
    "generate",
    "get_config",
    "hidden_states",
    "init_params",
    "load",
    "named_configs",
]
