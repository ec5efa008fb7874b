"""duo-jax: DuoAttention (retrieval + streaming heads) for JAX."""

from duo_jax.config import ModelConfig, RopeScaling, get_config, named_configs
from duo_jax.errors import ConfigError, DuoJaxError, LoadError, WeightsNotFoundError
from duo_jax.loading import Model, load
from duo_jax.model import Params, LayerParams, forward, hidden_states, init_params

__all__ = [
    "ConfigError", "DuoJaxError", "LayerParams", "LoadError", "ModelConfig", "Params", "RopeScaling",
    "WeightsNotFoundError", "forward", "get_config", "hidden_states", "init_params", "load", "Model", "named_configs",
]
