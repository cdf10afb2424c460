"""HuggingFace checkpoint directories -> kvjax params, and orbax save/restore of params.

A HF directory holds `config.json` and either `model.safetensors` or shards
listed by `model.safetensors.index.json`. Tensors are read one at a time from
memory-mapped files (our own reader of the safetensors layout, which also
handles bfloat16 through ml_dtypes), so loading never holds a second full copy
of the weights.
"""

import dataclasses
import json
import math
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
    """A memory-mapped `.safetensors` file; `get(name)` returns a read-only zero-copy view.

    The header is checked when the file is opened: its length against the file size
    (before anything is read), its JSON, and every tensor's entry (dtype, shape and
    byte range inside the file). A malformed file raises ValueError naming the file
    and the problem.
    """

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(
                    f"{path} is not a safetensors file: it has {size} bytes, fewer than the "
                    f"8-byte header length that starts every safetensors file.")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(
                    f"{path} is truncated or not a safetensors file: its header length field "
                    f"says {header_len} bytes, but only {size - 8} bytes follow it.")
            raw = f.read(header_len)
            try:
                header = json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{path} is corrupt: its {header_len}-byte safetensors header "
                                 f"is not valid JSON ({e}).") from e
            if not isinstance(header, dict):
                raise ValueError(f"{path} is corrupt: its safetensors header is a JSON "
                                 f"{type(header).__name__}, not an object of tensor entries.")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        for name, info in header.items():
            _check_entry(path, name, info, size - 8 - header_len)
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


def _check_entry(path: str, name: str, info, data_size: int) -> None:
    """ValueError naming `path` and tensor `name` unless its header entry is well formed."""
    def bad(problem: str):
        return ValueError(f"{path} is corrupt: the header entry of tensor {name!r} {problem}.")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad(f"must hold dtype, shape and data_offsets, got {info!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(info["dtype"], str):
        raise bad(f"has dtype {info['dtype']!r}, not a name like 'F32'")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise bad(f"has data_offsets {offsets!r}, outside the {data_size} data bytes of the file "
                  f"(truncated file?)")
    dtype = _DTYPES.get(info["dtype"])
    if dtype is not None and offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise bad(f"spans {offsets[1] - offsets[0]} bytes, but shape {shape} of "
                  f"{info['dtype']} needs {math.prod(shape) * dtype.itemsize}")


class CheckpointReader:
    """All tensors of a HF directory, single-file or sharded; callable as `get_tensor(name)`."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            self._where = _read_index(index)
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


def _read_json(file: str, what: str):
    with open(file, "rb") as f:
        try:
            return json.loads(f.read())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise ValueError(f"{file} is not valid JSON ({e}); {what}.") from e


def _read_index(file: str) -> dict[str, str]:
    """tensor name -> shard file name, from a `model.safetensors.index.json`."""
    index = _read_json(file, "it should map tensor names to shards under 'weight_map'")
    where = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(where, dict) or not all(isinstance(v, str) for v in where.values()):
        raise ValueError(f"{file} has no 'weight_map' object mapping tensor names to shard "
                         f"files; got {type(where).__name__}.")
    return dict(where)


def read_hf_config(path: str) -> dict:
    """The parsed `config.json` of a HF model directory.

    Raises:
      FileNotFoundError: there is no config.json. ValueError: it is not a JSON object.
    """
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        raise FileNotFoundError(f"{path} has no config.json; is it a HuggingFace model directory?")
    hf = _read_json(cfg, "a HuggingFace config.json is one JSON object")
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg} holds a JSON {type(hf).__name__}, not the object of a "
                         f"HuggingFace config.json.")
    return hf


def load(path: str, *, dtype: str | None = None,
         get_tensor: Callable[[str], np.ndarray] | None = None) -> tuple[Model, object]:
    """Loads a HuggingFace model directory: returns `(model, params)`.

    Args:
      path: directory with config.json and safetensors weights (sharded or not).
      dtype: params dtype ("float32", "bfloat16", ...); default the checkpoint's.
      get_tensor: override the tensor source (tests); default reads the directory.

    Raises:
      ValueError: naming config.json and the field for a missing, malformed or unsupported
        setting (`architectures` names the supported list); naming the weight file and
        the problem for a malformed safetensors file.
      KeyError: a tensor the model needs is missing (named).
    """
    hf = read_hf_config(path)
    cfg_file = os.path.join(path, "config.json")
    archs = hf.get("architectures")
    if not archs:
        raise ValueError(f"{cfg_file} has no 'architectures' entry; cannot pick a family. "
                         f"Expected a list like [\"LlamaForCausalLM\"].")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{cfg_file}: 'architectures' must be a list of architecture names "
                         f"like [\"LlamaForCausalLM\"], got {archs!r}.")
    family = family_for_architecture(archs[0])
    try:
        config = family.config_cls.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{cfg_file} lacks the field {e.args[0]!r}, which a {archs[0]} "
                         f"config needs.") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: {e}") from e
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
