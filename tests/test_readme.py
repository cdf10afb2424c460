"""Every command and code block in README.md runs.

Fenced ```bash blocks: each line is a command (`\\` continues it, `#` starts a
comment, `&&` chains commands). `pip install` commands are not run: their
extras must exist in pyproject.toml. Every other command runs in a shell from
the repository root and must exit 0. Fenced ```python blocks each run in a
fresh interpreter.

A block that needs CI-sized inputs says so in an HTML comment right above it,
one directive per line:

    <!-- ci: what this changes, in words
    replace: OLD => NEW      textual replacement in the block (OLD must occur)
    setup: CODE              a line run before the block (python blocks)
    after: CODE              a line run after the block, e.g. an assert (python blocks)
    covered-by: CMD => PATH  CMD is run by PATH (a test or CI script), not here
    needs: MODULE            docs/flax.md: the block runs (tests/nnx/test_tunix.py) where
                             MODULE is installed
    -->

The test provides a tiny random HuggingFace checkpoint with a tokenizer.json:
`$CI_HF_CHECKPOINT` in commands, `CI_HF_CHECKPOINT` in python blocks.
"""

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"(?:<!-- ci:(?P<ci>.*?)-->\s*\n)?```(?P<lang>[a-z]*)\n(?P<body>.*?)```",
                   re.S)


def blocks(text: str):
    """(lang, body, directives, line) of every fenced block, directives parsed."""
    out = []
    for m in FENCE.finditer(text):
        directives = dict(replace=[], setup=[], after=[], covered_by={}, needs=[])
        for line in (m.group("ci") or "").splitlines()[1:]:
            key, _, value = line.strip().partition(":")
            value = value.strip()
            if key == "replace":
                old, new = (s.strip() for s in value.split("=>"))
                directives["replace"].append((old, new))
            elif key in ("setup", "after", "needs"):
                directives[key].append(value)
            elif key == "covered-by":
                cmd, path = (s.strip() for s in value.split("=>"))
                directives["covered_by"][cmd] = path
            elif key:
                raise ValueError(f"README line {text[:m.start()].count(chr(10)) + 1}: "
                                 f"unknown ci directive {key!r}")
        out.append((m.group("lang"), m.group("body"), directives,
                    text[:m.start()].count("\n") + 1))
    return out


def apply_replacements(body: str, directives, where: str) -> str:
    for old, new in directives["replace"]:
        assert old in body, f"{where}: ci replace {old!r} matches nothing: update the directive"
        body = body.replace(old, new)
    return body


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuations joined, comments dropped, `&&` split."""
    lines = re.sub(r"\s*\\\n\s*", " ", body).splitlines()
    cmds = []
    for line in lines:
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        cmds += [c.strip() for c in line.split("&&") if c.strip()]
    return cmds


def _cases():
    """(kind, original, CI form, directives, line): a command or a python block each."""
    cases = []
    for lang, body, directives, line in blocks(README.read_text()):
        ci_body = apply_replacements(body, directives, f"README.md:{line}")
        if lang in ("bash", "sh", "shell"):
            for cmd, ci_cmd in zip(commands(body), commands(ci_body), strict=True):
                cases.append(pytest.param("command", cmd, ci_cmd, directives, line,
                                          id=f"L{line}:{cmd[:40]}"))
        elif lang == "python":
            cases.append(pytest.param("python", body, ci_body, directives, line,
                                      id=f"L{line}:python"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Llama in HuggingFace's layout, and a word-level tokenizer.json.

    The files `LlamaForCausalLM.save_pretrained` writes for this config (config.json with
    its fields, model.safetensors with its tensor names, shapes and float32 weights drawn
    like its initializer: normal(0, 0.02), norms at one, the padding row zero), written
    with NumPy and safetensors: importing torch and transformers to save it cost 5 s a run.
    Head dim 32, so that the README's KIVI group size (32) divides it; 2 KV heads.
    """
    from safetensors.numpy import save_file
    tokenizers = pytest.importorskip("tokenizers")

    d = tmp_path_factory.mktemp("hf_tiny")
    vocab, hidden, inter, layers, heads, kv_heads = 64, 128, 128, 2, 4, 2
    head_dim = hidden // heads
    config = dict(
        architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
        bos_token_id=1, dtype="float32", eos_token_id=2, head_dim=head_dim, hidden_act="silu",
        hidden_size=hidden, initializer_range=0.02, intermediate_size=inter,
        max_position_embeddings=256, mlp_bias=False, model_type="llama",
        num_attention_heads=heads, num_hidden_layers=layers, num_key_value_heads=kv_heads,
        pad_token_id=0, pretraining_tp=1, rms_norm_eps=1e-06,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
        tie_word_embeddings=False, use_cache=True, vocab_size=vocab)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)
    shapes = {"lm_head.weight": (vocab, hidden), "model.embed_tokens.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter),
                   p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim)}
    weights = {name: (np.ones(shape, np.float32) if name.endswith("norm.weight")
                      else (0.02 * rng.standard_normal(shape)).astype(np.float32))
               for name, shape in shapes.items()}
    weights["model.embed_tokens.weight"][0] = 0  # the padding token's row, as HF's init
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    vocab_words = {f"w{i}": i for i in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab_words, unk_token="w3"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    return d


def _env(hf_checkpoint, child_env):
    # child_env: the README's commands see one CPU device, as a user's would
    return dict(child_env, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                CI_HF_CHECKPOINT=str(hf_checkpoint))


def _check_pip(cmd: str):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    args = shlex.split(cmd)[2:]
    targets = [a for a in args if not a.startswith("-")]
    assert targets, f"{cmd}: nothing to install"
    for t in targets:
        m = re.fullmatch(r"\.(?:\[([a-z0-9_,-]+)\])?", t)
        assert m, f"{cmd}: the README installs from the repository (`.` or `.[extra]`), got {t}"
        for extra in (m.group(1) or "").split(","):
            assert not extra or extra in extras, f"{cmd}: pyproject.toml has no extra {extra!r}"


def test_readme_has_runnable_blocks():
    kinds = {c.values[0] for c in CASES}
    assert kinds == {"command", "python"}, kinds
    assert "pip install -e . && python -m kvjax demo" in README.read_text()
    assert 'pip install -e ".[test]" && python -m pytest' in README.read_text()
    # CI runs the README's test command as it stands (plus a jax upgrade within the range).
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert 'pip install -e ".[test]"' in ci and "python -m pytest" in ci, ci


@pytest.mark.parametrize("kind,body,ci_body,directives,line", CASES)
def test_readme_block_runs(kind, body, ci_body, directives, line, hf_checkpoint, tmp_path,
                           child_env):
    where = f"README.md:{line}"
    env = _env(hf_checkpoint, child_env)
    if kind == "command":
        if body.startswith("pip install"):
            _check_pip(body)
            return
        if body in directives["covered_by"]:
            path = ROOT / directives["covered_by"][body]
            text = path.read_text()
            words = shlex.split(body)[1:]  # drop the interpreter
            assert all(w in text for w in words), f"{where}: {path} does not run {body!r}"
            return
        if body == "python -m pytest":  # the suite itself: CI runs it
            assert body in (ROOT / ".ci" / "run").read_text().splitlines(), (
                f"{where}: .ci/run must run {body!r}")
            return
        cmd = ci_body
        proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{where}: {cmd}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), f"{where}: {cmd} printed nothing"
    else:
        code = ci_body
        prelude = ["import os", "CI_HF_CHECKPOINT = os.environ['CI_HF_CHECKPOINT']",
                   *directives["setup"]]
        script = tmp_path / "block.py"
        script.write_text("\n".join(prelude) + "\n" + code + "\n" + "\n".join(directives["after"])
                          + "\n")
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{where}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def test_directives_are_checked():
    text = ('<!-- ci: x\nreplace: AAA => B\nsetup: y = 1\nafter: assert y\n'
            'covered-by: python -m z => f.py\n'
            '-->\n```bash\nfoo AAA \\\n  --bar  # comment\npip install -e . && baz\n```\n')
    [(lang, body, d, _)] = blocks(text)
    assert lang == "bash" and d["setup"] == ["y = 1"] and d["after"] == ["assert y"]
    assert d["covered_by"] == {"python -m z": "f.py"}
    assert commands(apply_replacements(body, d, "t")) == ["foo B --bar", "pip install -e .",
                                                          "baz"]
    with pytest.raises(AssertionError, match="matches nothing"):
        apply_replacements("nothing here", d, "t")
    with pytest.raises(ValueError, match="unknown ci directive"):
        blocks("<!-- ci: x\nreplce: a => b\n-->\n```bash\nfoo\n```\n")
    _check_pip('pip install -e ".[test]"')
    with pytest.raises(AssertionError, match="no extra"):
        _check_pip('pip install -e ".[nonexistent]"')
