"""HuggingFace checkpoint directories -> kvjax params, and orbax save/restore of params.

A HF directory holds `config.json` and either `model.safetensors` or shards
listed by `model.safetensors.index.json`. Tensors are read one at a time from
memory-mapped files (our own reader of the safetensors layout, which also
handles bfloat16 through ml_dtypes), so loading never holds a second full copy
of the weights.
"""

import dataclasses
import json
import mmap
import os
import struct
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np

from kvjax.models.base import Model, family_for_architecture

__all__ = [
    "SafetensorsFile",
    "CheckpointReader",
    "read_hf_config",
    "load",
    "save_params",
    "restore_params",
]

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """A memory-mapped `.safetensors` file; `get(name)` returns a read-only zero-copy view."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        self._header = header
        self._offset = 8 + header_len

    def keys(self) -> list[str]:
        return list(self._header)

    def get(self, name: str) -> np.ndarray:
        if name not in self._header:
            raise KeyError(f"tensor {name!r} is not in {self.path}.")
        info = self._header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"tensor {name!r} in {self.path} has dtype {info['dtype']}, which kvjax cannot "
                f"read; supported: {sorted(_DTYPES)}."
            )
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        x = np.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize,
                          offset=self._offset + start)
        return x.reshape(info["shape"])


class CheckpointReader:
    """All tensors of a HF directory, single-file or sharded; callable as `get_tensor(name)`."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            with open(index) as f:
                self._where = dict(json.load(f)["weight_map"])
        elif os.path.exists(single):
            self._where = dict.fromkeys(self._open("model.safetensors").keys(),
                                        "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{path} holds neither model.safetensors nor model.safetensors.index.json."
            )

    def _open(self, filename: str) -> SafetensorsFile:
        if filename not in self._files:
            self._files[filename] = SafetensorsFile(os.path.join(self.path, filename))
        return self._files[filename]

    def keys(self) -> list[str]:
        return list(self._where)

    def __call__(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint {self.path} is missing tensor {name!r}.")
        return self._open(self._where[name]).get(name)


def read_hf_config(path: str) -> dict:
    """The parsed `config.json` of a HF model directory."""
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        raise FileNotFoundError(f"{path} has no config.json; is it a HuggingFace model directory?")
    with open(cfg) as f:
        return json.load(f)


def load(path: str, *, dtype: str | None = None,
         get_tensor: Callable[[str], np.ndarray] | None = None) -> tuple[Model, object]:
    """Loads a HuggingFace model directory: returns `(model, params)`.

    Args:
      path: directory with config.json and safetensors weights (sharded or not).
      dtype: params dtype ("float32", "bfloat16", ...); default the checkpoint's.
      get_tensor: override the tensor source (tests); default reads the directory.

    Raises:
      ValueError: the `architectures` entry is not supported (named, with the supported list).
      KeyError: a tensor the model needs is missing (named).
    """
    hf = read_hf_config(path)
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}/config.json has no 'architectures' entry; cannot pick a family.")
    family = family_for_architecture(archs[0])
    config = family.config_cls.from_hf(hf)
    if dtype is not None:
        if not any(f.name == "dtype" for f in dataclasses.fields(config)):
            raise ValueError(f"{family.config_cls.__name__} has no dtype field; cannot load "
                             f"as {dtype}.")
        config = dataclasses.replace(config, dtype=dtype)
    reader = get_tensor if get_tensor is not None else CheckpointReader(path)
    params = family.params_from_hf(config, reader)
    return family.model(config), params


def save_params(path: str, params) -> None:
    """Saves a params pytree with orbax-checkpoint to the (new) directory `path`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), params)


def restore_params(path: str, like):
    """Restores params saved by `save_params`; `like` is a params pytree or its `eval_shape`."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like
    )
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(path), abstract)
