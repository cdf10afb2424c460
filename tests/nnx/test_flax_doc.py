"""docs/flax.md's code runs: its ```python blocks, in order, in one namespace (the page
says they form one session), with the `<!-- ci: ... -->` directives of
tests/test_readme.py (`setup:` / `after:` lines, `replace:`), here on this suite's 8
CPU devices. The `after:` lines check what each block claims (same tokens on the
sharded cache, a quantized cache held to its H2O budget, the engine's tokens equal
`kvjax.generate`'s)."""

import contextlib
import io
from pathlib import Path

from tests.test_readme import apply_replacements, blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "flax.md"


def test_flax_doc_python_blocks_run_in_order():
    # Blocks that need another package (`needs:`) run in tests/nnx/test_tunix.py.
    code = [(body, d, line) for lang, body, d, line in blocks(DOC.read_text())
            if lang == "python" and not d["needs"]]
    assert len(code) >= 5, f"docs/flax.md has {len(code)} python blocks"
    namespace: dict = {"__name__": "flax_doc"}
    for body, directives, line in code:
        where = f"docs/flax.md, the block at line {line}"
        source = "\n".join([*directives["setup"],
                            apply_replacements(body, directives, where),
                            *directives["after"]])
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, where, "exec"), namespace)  # noqa: S102
