"""Loading HF checkpoint directories: a malformed safetensors file, index or config.json gives
a ValueError that names the file and the problem (never MemoryError, struct.error, a raw
JSONDecodeError or a KeyError), and a well-formed copy of the same directory still loads."""

import json
import re
import shutil
import struct

import numpy as np
import pytest

import kvjax.models as models
from kvjax.models import deepseek as ds
from kvjax.models.loading import SafetensorsFile

torch = pytest.importorskip("torch")
from tests.models import hf_tiny  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-load")
    hf_tiny.build("qwen2").save_pretrained(d)
    return d


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _parts(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data, n, json.loads(data[8:8 + n])


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _malformed(case: str, data: bytes, n: int, header: dict) -> tuple[bytes, str]:
    """(file bytes, the problem the error must name) for each kind of damage."""
    body = data[8 + n:]
    if case == "empty":
        return b"", "0 bytes, fewer than the 8-byte header length"
    if case == "shorter_than_length_field":
        return data[:5], "5 bytes, fewer than the 8-byte header length"
    if case == "huge_header_length":
        return struct.pack("<Q", 2**40) + data[8:], "header length field says 1099511627776"
    if case == "garbage":
        return bytes(range(200, 256)) * 4, "header length field says"
    if case == "truncated_in_header":
        return data[:8 + n // 2], f"header length field says {n} bytes, but only {n // 2}"
    if case == "header_not_json":
        return struct.pack("<Q", n) + b"{" + b"\xff" * (n - 1) + body, "is not valid JSON"
    if case == "header_not_object":
        return _with_header([1, 2], body), "a JSON list, not an object"
    if case == "truncated_data":
        return data[:-64], "outside the .* data bytes of the file \\(truncated file\\?\\)"
    if case == "shape_disagrees_with_bytes":
        name = next(k for k in header if k != "__metadata__")
        bad = {**header, name: {**header[name], "shape": [3, 5]}}
        return _with_header(bad, body), f"{re.escape(repr(name))} spans .* but shape \\[3, 5\\]"
    raise AssertionError(case)


CASES = ["empty", "shorter_than_length_field", "huge_header_length", "garbage",
         "truncated_in_header", "header_not_json", "header_not_object", "truncated_data",
         "shape_disagrees_with_bytes"]


@pytest.mark.parametrize("case", CASES)
def test_malformed_safetensors_names_file_and_problem(case, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path)
    f = d / "model.safetensors"
    data, n, header = _parts(f)
    bad, problem = _malformed(case, data, n, header)
    f.write_bytes(bad)
    with pytest.raises(ValueError, match=re.escape(str(f)) + ".*" + problem):
        models.load(str(d))
    with pytest.raises(ValueError, match=re.escape(str(f))):
        SafetensorsFile(str(f))


def test_sound_copy_loads_and_reads_every_tensor(model_dir, tmp_path):
    """The checks accept what save_pretrained writes: every tensor reads back as torch wrote it."""
    d = _copy(model_dir, tmp_path)
    f = SafetensorsFile(str(d / "model.safetensors"))
    from safetensors.numpy import load_file

    want = load_file(str(d / "model.safetensors"))
    assert sorted(f.keys()) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(f.get(k), v)
    model, _ = models.load(str(d))
    assert model.family == "llama"


def test_malformed_shard_index(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path)
    (d / "model.safetensors").rename(d / "shard-1.safetensors")
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match=re.escape(str(index)) + " is not valid JSON"):
        models.load(str(d))
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=re.escape(str(index)) + " has no 'weight_map'"):
        models.load(str(d))


def _load_with_config(model_dir, tmp_path, edit):
    d = _copy(model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d, lambda: models.load(str(d))


def test_config_missing_required_field(model_dir, tmp_path):
    d, load = _load_with_config(model_dir, tmp_path, lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json"))
                       + " lacks the field 'hidden_size', which a Qwen2ForCausalLM config needs"):
        load()


@pytest.mark.parametrize("rope", [{"rope_type": "linear"},
                                  {"rope_type": "llama3", "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0}])
def test_config_rope_scaling_without_factor(rope, model_dir, tmp_path):
    def edit(c):
        c.pop("rope_parameters", None)
        c["rope_theta"], c["rope_scaling"] = 10000.0, rope

    d, load = _load_with_config(model_dir, tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json")) + ".*"
                       + f"'{rope['rope_type']}' needs 'factor'.*it is missing"):
        load()


def test_config_architectures_as_a_string(model_dir, tmp_path):
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    d, load = _load_with_config(model_dir, tmp_path,
                                lambda c: c.__setitem__("architectures", arch))
    with pytest.raises(ValueError, match="'architectures' must be a list of architecture names "
                       + re.escape(f'like ["LlamaForCausalLM"], got {arch!r}')):
        load()


def test_config_not_json(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path)
    (d / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"],')
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json")) + " is not valid JSON"):
        models.load(str(d))


def test_deepseek_config_errors():
    base = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=8)
    assert ds.DeepseekConfig.from_hf(base).hidden_size == 32
    with pytest.raises(ValueError, match=r"config.json lacks \['hidden_size', 'v_head_dim'\]"):
        ds.DeepseekConfig.from_hf({k: v for k, v in base.items()
                                   if k not in ("hidden_size", "v_head_dim")})
    with pytest.raises(ValueError, match="'architectures' must be a list"):
        ds.DeepseekConfig.from_hf({**base, "architectures": "DeepseekV2ForCausalLM"})
    with pytest.raises(ValueError, match="'yarn' needs 'original_max_position_embeddings'"):
        ds.DeepseekConfig.from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4}})
