"""`python -m kvjax generate` end to end on a saved tiny checkpoint with a tokenizer.json."""

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvjax.__main__ import main
from tests.models import hf_tiny

torch, transformers = hf_tiny.torch, hf_tiny.T


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    m = hf_tiny.build("qwen2")
    d = tmp_path_factory.mktemp("qwen2-cli")
    m.save_pretrained(d)
    vocab = {f"w{i}": i for i in range(m.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    return m, d


def test_generate_text_matches_transformers(model_dir, capsys):
    m, d = model_dir
    prompt = [5, 9, 17, 33, 60, 71, 8, 12, 40, 3]
    text = " ".join(f"w{t}" for t in prompt)
    assert main(["generate", "--model", str(d), "--prompt", text, "--max-new-tokens", "12",
                 "--page-size", "8", "--eos-id", "none", "--kv-dtype", "f32"]) == 0
    out = capsys.readouterr()
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0].tolist()
    assert out.out.strip() == " ".join(f"w{t}" for t in ref)
    assert "tokens/s" in out.err
    # 10 + 12 - 1 tokens cached at the peak: 3 pages of 8.
    assert "KV cache: 3 of 3 pages used at peak" in out.err


def test_generate_ids_with_parallel_samples(model_dir, capsys):
    _, d = model_dir
    assert main(["generate", "--model", str(d), "--prompt-ids", "1,2,3,4,5,6,7,8,9",
                 "--max-new-tokens", "5", "--n", "3", "--temperature", "1.0", "--top-k", "20",
                 "--page-size", "8", "--eos-id", "none"]) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"[{i}] ") for i, line in enumerate(lines))
    for line in lines:
        assert line.split(" ", 1)[1].startswith("w1 w2 w3 w4 w5 w6 w7 w8 w9 ")
        assert len(line.split(" ")) == 1 + 9 + 5
    # The 9-token prompt's first page is shared: 1 + 3 x 1 pages (13 tokens each).
    assert "KV cache: 4 of" in out.err


def test_cli_errors_name_the_problem(model_dir, tmp_path, capsys):
    _, d = model_dir
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["BloomForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2"]) == 2
    assert "BloomForCausalLM" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(d), "--prompt-ids", "1,x"])
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2,
        max_position_embeddings=128, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=0)
    m = transformers.DeepseekV2ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("deepseek-cli")
    m.save_pretrained(d)
    return m, d


def test_generate_deepseek_checkpoint(deepseek_dir, capsys):
    """An MLA checkpoint runs through the CLI (its config has no `architecture` field)."""
    m, d = deepseek_dir
    prompt = [5, 9, 17, 33, 60, 7, 12]
    assert main(["generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "6", "--page-size", "4", "--eos-id", "none"]) == 0
    out = capsys.readouterr()
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0].tolist()
    assert out.out.strip() == ",".join(map(str, ref))
    assert "loaded DeepseekV2ForCausalLM (deepseek, MLA" in out.err


def test_cache_full_is_one_error_line(model_dir, capsys):
    _, d = model_dir
    # 10 prompt tokens need 2 pages of 8; the pool has 1.
    assert main(["generate", "--model", str(d), "--prompt-ids", "1,2,3,4,5,6,7,8,9,10",
                 "--max-new-tokens", "4", "--page-size", "8", "--num-pages", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: KV cache is full") and "--num-pages (now 1)" in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_malformed_weights_are_one_error_line(damage, model_dir, tmp_path, capsys):
    _, d = model_dir
    bad = tmp_path / "model"
    shutil.copytree(d, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    assert main(["generate", "--model", str(bad), "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {weights}")
