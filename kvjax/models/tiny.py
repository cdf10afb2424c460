"""The tiny byte-level demo models shipped in `kvjax/assets/`: presets, saving and loading.

Three presets share one size class (hidden 128, 4 layers, vocabulary 256):
"gqa" (Llama-style, 4 query / 2 KV heads), "mha" (the same with 4 KV heads,
the source of the MHA→GQA conversion demo) and "mla" (DeepSeek-style latent
attention). Weights are stored as float16 safetensors (names are the params
pytree paths) with a JSON sidecar holding the training record and a stored
greedy continuation that tests reproduce; they load as float32.
"""

import json
import os

import jax
import numpy as np

from kvjax.models.base import Model, get_family
from kvjax.models.layers import RopeConfig

__all__ = ["TINY_PRESETS", "tiny_config", "tiny_model", "forward_dense", "save_tiny",
           "load_tiny", "asset_path", "tiny_info", "param_count"]

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
TINY_PRESETS = ("gqa", "mla", "mha")


def tiny_config(name: str):
    """The config of a tiny preset ("gqa", "mla" or "mha")."""
    if name in ("gqa", "mha"):
        from kvjax.models.llama import LlamaConfig

        return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4,
                           q_heads=4, kv_heads=2 if name == "gqa" else 4, head_dim=32,
                           rope=RopeConfig(theta=10000.0, dim=32), tie_word_embeddings=True,
                           rms_norm_eps=1e-5, architecture="LlamaForCausalLM")
    if name == "mla":
        from kvjax.models.deepseek import DeepseekConfig

        return DeepseekConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                              num_layers=4, num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                              qk_nope_head_dim=32, v_head_dim=32, tie_word_embeddings=True,
                              rms_norm_eps=1e-5)
    raise ValueError(f"unknown tiny preset {name!r}; choose one of {TINY_PRESETS}.")


def _family_name(config) -> str:
    return "deepseek" if type(config).__name__ == "DeepseekConfig" else "llama"


def tiny_model(config) -> Model:
    """The `Model` bundle (for `kvjax.generate`) of a tiny config."""
    return get_family(_family_name(config)).model(config)


def forward_dense(params, config, tokens):
    """The family's cache-free causal forward: float32 logits [batch, seq, vocab]."""
    if _family_name(config) == "deepseek":
        from kvjax.models import deepseek

        return deepseek.forward_dense(params, config, tokens)
    from kvjax.models import llama

    return llama.forward_dense(params, config, tokens)


def init_tiny(config, key):
    return get_family(_family_name(config)).init_params(config, key)


def _params_template(config):
    """A params pytree with the right structure and shapes, for loading into.

    The Llama family's init is traced for shapes only (a concrete one compiles a
    random draw per tensor shape: seconds on a small machine); DeepSeek draws its
    init on the host with numpy, which cannot be traced but costs milliseconds.
    """
    if _family_name(config) == "deepseek":
        return init_tiny(config, jax.random.key(0))
    return jax.eval_shape(lambda key: init_tiny(config, key), jax.random.key(0))


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def _named_leaves(params) -> list[tuple[str, object]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def asset_path(name: str, directory: str | None = None) -> str:
    return os.path.join(directory or ASSETS, f"tiny_{name}.safetensors")


def save_tiny(name: str, params, info: dict, directory: str | None = None) -> str:
    """Writes `tiny_<name>.safetensors` (float16) and `tiny_<name>.json`; returns the path."""
    from safetensors.numpy import save_file

    path = asset_path(name, directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tensors = {k: np.asarray(v, np.float32).astype(np.float16) for k, v in _named_leaves(params)}
    save_file(tensors, path, metadata={"preset": name})
    os.chmod(path, 0o644)
    with open(path.replace(".safetensors", ".json"), "w") as f:
        json.dump(info, f, indent=1)
    return path


def tiny_info(name: str, directory: str | None = None) -> dict:
    """The JSON sidecar of a shipped tiny model (training record, reference continuation)."""
    with open(asset_path(name, directory).replace(".safetensors", ".json")) as f:
        return json.load(f)


def load_tiny(name: str, directory: str | None = None, *, path: str | None = None):
    """Loads a tiny model: returns `(model, params)` with float32 params.

    Args:
      name: preset ("gqa", "mla", "mha").
      directory: where the assets live (default the package's `kvjax/assets`).
      path: an explicit safetensors file instead.

    Raises:
      FileNotFoundError: the weights are missing. ValueError: a tensor has the wrong shape.
    """
    from kvjax.models.loading import SafetensorsFile

    path = path or asset_path(name, directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tiny model weights {path} not found; train them with "
                                f"`python -m kvjax.train --model {name}`.")
    config = tiny_config(name)
    like = _params_template(config)
    f = SafetensorsFile(path)
    leaves = []
    for key, leaf in _named_leaves(like):
        x = f.get(key)
        if tuple(x.shape) != tuple(leaf.shape):
            raise ValueError(f"{path}: tensor {key} has shape {x.shape}, expected {leaf.shape}.")
        leaves.append(jax.numpy.asarray(x.astype(np.float32)))
    params = jax.tree.unflatten(jax.tree.structure(like), leaves)
    return tiny_model(config), params
