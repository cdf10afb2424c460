"""`params_from_hf`: HuggingFace Gemma 2 / Gemma 3 tensors to `GemmaParams`.

The text model's tensors live under `model.` in `Gemma2ForCausalLM` and
`Gemma3ForCausalLM` checkpoints. In `Gemma3ForConditionalGeneration` ones they live
under `language_model.model.` (the released checkpoints, and what transformers 5 writes
with `save_pretrained`) or `model.language_model.` (transformers 5's module names); the
vision tower and projector are not read.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.gemma.config import GemmaConfig
from kvjax.models.gemma.params import GemmaLayerParams, GemmaParams, param_shapes

__all__ = ["params_from_hf", "text_prefixes"]

_MULTIMODAL_PREFIXES = ("language_model.model.", "model.language_model.")


def text_prefixes(config: GemmaConfig) -> tuple[str, ...]:
    """Where the text model's tensors may live in a checkpoint of `config.architecture`."""
    if config.architecture == "Gemma3ForConditionalGeneration":
        return _MULTIMODAL_PREFIXES
    return ("model.",)


def _find_prefix(config: GemmaConfig, get_tensor) -> str:
    """The prefix under which `get_tensor` holds the embedding (KeyError naming each tried)."""
    tried = []
    for prefix in text_prefixes(config):
        name = prefix + "embed_tokens.weight"
        try:
            get_tensor(name)
        except KeyError:
            tried.append(name)
            continue
        return prefix
    raise KeyError(f"checkpoint is missing the {config.architecture} embedding: tried "
                   f"{', '.join(repr(t) for t in tried)}.")


def params_from_hf(config: GemmaConfig, get_tensor: Callable[[str], np.ndarray]) -> GemmaParams:
    """Maps HF tensors to `GemmaParams`, one tensor at a time.

    Each stacked parameter is assembled in one host buffer, layer by layer, then moved
    to the device: peak host memory is one stacked parameter.

    Args:
      config: the model config (its `architecture` says where the text model lives).
      get_tensor: returns the HF tensor with the given name as a NumPy array (any float
        dtype); raises KeyError naming a missing tensor.

    Raises:
      KeyError: naming a missing tensor. ValueError: naming a tensor of the wrong shape.
    """
    shapes = param_shapes(config)
    dtype = jnp.dtype(config.dtype)
    prefix = _find_prefix(config, get_tensor)
    # An untied head sits beside the text model: `language_model.lm_head` in the released
    # multimodal checkpoints, `lm_head` otherwise.
    head = ("language_model.lm_head.weight" if prefix == "language_model.model."
            else "lm_head.weight")

    def fetch(name, shape, transpose):
        x = np.asarray(get_tensor(name))
        x = x.T if transpose else x
        if x.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {x.shape}{' after transposing' if transpose else ''}"
                f", expected {shape} for this config.")
        return x

    layer = {}
    for pname, (shape, pattern, transpose) in shapes["layers"].items():
        buf = np.empty(shape, dtype)
        for i in range(config.num_layers):
            buf[i] = fetch(prefix + pattern.format(i), shape[1:], transpose)
        layer[pname] = jax.device_put(buf)  # no conversion program per shape
        del buf
    top = {}
    for pname, entry in shapes.items():
        if pname != "layers":
            shape, hf_name, transpose = entry
            name = head if pname == "lm_head" else prefix + hf_name
            top[pname] = jax.device_put(fetch(name, shape, transpose).astype(dtype))
    return GemmaParams(layers=GemmaLayerParams(**layer), **top)
