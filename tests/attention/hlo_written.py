"""What an optimised XLA program writes to memory: shared by the XLA-path HLO tests."""

import re

import jax
import numpy as np

__all__ = ["materialised", "written"]

_ALIASING = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "opt-barrier",
             "constant", "call", "conditional"}


def materialised(fn, *args):
    """(opcode, dtype, element count) of every array the optimised program writes.

    Instructions inside fused computations are computed element by element and
    never stored, so only top-level computations (entry, loop bodies) count; ops
    that only alias a buffer (parameters, bitcasts, tuples) are skipped.
    """
    return written(jax.jit(fn).lower(*args).compile().as_text())


def written(text: str):
    """`materialised` of an optimised program's HLO text. Custom calls that update an
    operand in place (`output_to_operand_aliasing`) write only what they touch: skipped."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", text))
    out, skip = [], False
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head:
            skip = head.group(1) in fused
            continue
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([0-9,]*)\]\{?[^ ]* ([\w\-]+)\(", line)
        if skip or not m or m.group(3) in _ALIASING or "output_to_operand_aliasing" in line:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        out.append((m.group(3), m.group(1), int(np.prod(dims)) if dims else 1))
    return out
