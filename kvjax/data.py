"""Offline training and evaluation data for the tiny byte-level demo models.

Two sources, both available on any machine with Python installed:

* **Code**: the Python standard library's own `.py` files (found through
  `sysconfig.get_paths()["stdlib"]`), read as raw bytes (vocabulary 256, no
  tokenizer), in sorted relative-path order, joined by a blank line. A file is
  held out when the first byte of the SHA-256 of its relative path is below
  `HELDOUT_BYTE_BELOW` (about 5% of files), so the split depends only on file
  names. (The bytes themselves depend on the Python version: 3.11 here.)
* **Retrieval**: synthetic long-context sequences. Lines `key_ab12 = "83921"`
  are buried at random depths in code filler; the sequence ends with
  `assert key_ab12 == "` and the model must copy the 5-digit value from far
  back. These teach (and test) use of context hundreds of bytes back.
  `query="repeat"` ends with the queried line's own prefix, `key_ab12 = "`,
  instead: a plain induction (match a repeated prefix, copy what followed)
  where the default needs a multi-hop circuit. Neither was learned by the
  shipped models in this project's CPU budget (see docs/models.md).
"""

import dataclasses
import hashlib
import os
import sysconfig

import numpy as np

__all__ = [
    "HELDOUT_BYTE_BELOW",
    "RetrievalExample",
    "stdlib_files",
    "is_heldout",
    "load_corpus",
    "QUERY_STYLES",
    "max_pairs",
    "max_drill_pairs",
    "retrieval_example",
    "retrieval_drill",
    "code_crop",
    "training_batch",
]

HELDOUT_BYTE_BELOW = 13  # of 256: about 5% of files are held out
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
_KEY_CHARS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", np.uint8)
VALUE_DIGITS = 5


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the standard library's `.py` files, sorted (deterministic order)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    """Whether a file belongs to the held-out split (a hash of its relative path)."""
    return hashlib.sha256(relpath.encode()).digest()[0] < HELDOUT_BYTE_BELOW


def load_corpus(split: str, *, root: str | None = None, max_bytes: int | None = None
                ) -> np.ndarray:
    """The concatenated bytes of one split ("train" or "heldout") as uint8[n].

    Raises:
      ValueError: for another split name, or when the standard library holds no files.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}.")
    root = root or sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for rel in stdlib_files(root):
        if is_heldout(rel) != (split == "heldout"):
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks:
        raise ValueError(f"no standard-library .py files found under {root!r}.")
    corpus = np.frombuffer(b"".join(chunks), np.uint8)
    return corpus[:max_bytes] if max_bytes is not None else corpus


def code_crop(rng: np.random.Generator, corpus: np.ndarray, length: int) -> np.ndarray:
    """A random crop uint8[length] of the corpus."""
    start = int(rng.integers(0, len(corpus) - length))
    return corpus[start:start + length].copy()


@dataclasses.dataclass(frozen=True)
class RetrievalExample:
    """A retrieval sequence: `tokens[:answer_start]` is the prompt, the value follows.

    Attributes:
      tokens: uint8[length]; ends with the value digits and a closing quote.
      answer_start: index of the first value digit.
      value: the expected digits (bytes, VALUE_DIGITS long).
      depth: byte offset of the queried `key_... = "..."` line.
    """

    tokens: np.ndarray
    answer_start: int
    value: bytes
    depth: int


def _random_chars(rng, n):
    return bytes(_KEY_CHARS[rng.integers(0, len(_KEY_CHARS), n)])


QUERY_STYLES = ("assert", "repeat")


def _keys_values(rng, n):
    """n distinct 4-character keys and their VALUE_DIGITS-digit values (bytes)."""
    keys = []
    while len(keys) < n:
        k = _random_chars(rng, 4)
        if k not in keys:
            keys.append(k)
    values = [bytes(rng.integers(ord("0"), ord("9") + 1, VALUE_DIGITS).astype(np.uint8))
              for _ in keys]
    return keys, values


def retrieval_example(rng: np.random.Generator, corpus: np.ndarray, length: int, *,
                      num_pairs: int = 4, depth: float | None = None,
                      query: str = "assert") -> RetrievalExample:
    """Key→value lines buried in code filler, one of them asked for at the end.

    Args:
      rng: randomness (keys, values, filler, positions).
      corpus: filler source (uint8 code bytes).
      length: total bytes, including the query and the answer.
      num_pairs: key→value lines buried in the filler (one is queried).
      depth: where the queried line sits, as a fraction of the filler (0 = start);
        None = uniform at random.
      query: "assert" ends with `assert key_ab12 == "` (what the shipped models
        were trained on); "repeat" with the queried line's own prefix `key_ab12 = "`.
    """
    if query not in QUERY_STYLES:
        raise ValueError(f"query must be one of {QUERY_STYLES}, got {query!r}.")
    keys, values = _keys_values(rng, num_pairs)
    target = int(rng.integers(0, num_pairs))
    lines = [b'key_%s = "%s"\n' % (k, v) for k, v in zip(keys, values, strict=True)]
    ask = (b'\nkey_%s = "' if query == "repeat" else b'\nassert key_%s == "') % keys[target]
    tail = values[target] + b'"'
    filler_len = length - len(ask) - len(tail) - sum(len(x) for x in lines)
    if filler_len < 16:
        raise ValueError(f"length={length} is too short for {num_pairs} key/value pairs.")
    filler = code_crop(rng, corpus, filler_len).tobytes()
    # Insert points, at line starts where possible so the lines look like code.
    points = []
    for i in range(num_pairs):
        frac = depth if (i == target and depth is not None) else float(rng.random())
        p = int(frac * filler_len)
        nl = filler.rfind(b"\n", 0, p)
        points.append(nl + 1 if nl >= 0 and p - nl < 80 else p)
    order = np.argsort(points, kind="stable")
    out, prev, target_at = [], 0, 0
    for i in order:
        out.append(filler[prev:points[i]])
        if i == target:
            target_at = sum(len(x) for x in out)
        out.append(lines[i])
        prev = points[i]
    out.append(filler[prev:])
    prompt = b"".join(out) + ask
    tokens = np.frombuffer(prompt + tail, np.uint8).copy()
    assert len(tokens) == length
    return RetrievalExample(tokens=tokens, answer_start=len(prompt), value=values[target],
                            depth=target_at)


def retrieval_drill(rng: np.random.Generator, corpus: np.ndarray, length: int, *,
                    num_pairs: int, query: str = "repeat") -> tuple[np.ndarray, np.ndarray]:
    """A training sequence that asks for every buried value, in random order.

    `num_pairs` key/value lines are buried in code filler (as in `retrieval_example`)
    and the sequence ends with one query per key, each followed by its answer:
    `num_pairs` times the copy signal of a single-query example for the same bytes.

    Returns:
      tokens uint8[length]; answer uint8[length], 1 on the value digits and closing
      quotes that a model must copy from far back.
    """
    if query not in QUERY_STYLES:
        raise ValueError(f"query must be one of {QUERY_STYLES}, got {query!r}.")
    keys, values = _keys_values(rng, num_pairs)
    lines = [b'key_%s = "%s"\n' % (k, v) for k, v in zip(keys, values, strict=True)]
    fmt = b'\nkey_%s = "' if query == "repeat" else b'\nassert key_%s == "'
    asks = [(fmt % keys[i], values[i] + b'"') for i in rng.permutation(num_pairs)]
    filler_len = length - sum(len(a) + len(t) for a, t in asks) - sum(len(x) for x in lines)
    if filler_len < 16:
        raise ValueError(f"length={length} is too short for {num_pairs} drilled pairs.")
    filler = code_crop(rng, corpus, filler_len).tobytes()
    points = sorted(int(f * filler_len) for f in rng.random(num_pairs))
    out, prev = [], 0
    for p, line in zip(points, rng.permutation(lines), strict=True):
        out += [filler[prev:p], bytes(line)]
        prev = p
    out.append(filler[prev:])
    answer = np.zeros(length, np.uint8)
    at = sum(len(x) for x in out)
    for ask, tail in asks:
        at += len(ask)
        answer[at:at + len(tail)] = 1
        out += [ask, tail]
        at += len(tail)
    tokens = np.frombuffer(b"".join(out), np.uint8).copy()
    assert len(tokens) == length
    return tokens, answer


def max_drill_pairs(length: int) -> int:
    """Pairs (1-4) a `length`-byte `retrieval_drill` holds with 16 bytes of filler left."""
    # A buried line is 19 bytes; its query and answer 19 ("repeat") or 27 ("assert").
    return int(min(4, max(1, (length - 16) // 46)))


DRILL_MIN_LENGTH = 64


def _drill(rng, corpus, length, query):
    n = int(rng.integers(1, max_drill_pairs(length) + 1))
    return retrieval_drill(rng, corpus, length, num_pairs=n, query=query)


def max_pairs(length: int) -> int:
    """Key/value pairs (1-4) a `length`-byte retrieval example holds with 16 bytes of filler
    left, for either query style (4 from 119 bytes on)."""
    # A line `key_ab12 = "83921"\n` is 19 bytes; the longer query plus the answer 27.
    return int(min(4, max(1, (length - 16 - 27) // 19)))


def training_batch(rng: np.random.Generator, corpus: np.ndarray, batch: int, length: int, *,
                   retrieval_fraction: float, answer_weight: float, query: str = "assert",
                   drill: bool = False, drill_split: float = 0.0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A batch of byte sequences and per-target loss weights.

    With `drill`, retrieval sequences are `retrieval_drill`s (every buried value asked
    for) instead of single-query `retrieval_example`s; a `drill_split` fraction of them
    are two drills back to back, cut at a random point (each at least
    `DRILL_MIN_LENGTH` bytes), so that questions also come at shorter contexts than
    `length` (a model trained only on full-length drills can fail at half the length).

    Returns:
      tokens int32[batch, length]; weights float32[batch, length - 1] (weight of
      predicting tokens[:, 1:]): 1, or `answer_weight` on retrieval answers.
    """
    tokens = np.empty((batch, length), np.int32)
    weights = np.ones((batch, length - 1), np.float32)
    for b in range(batch):
        is_retrieval = rng.random() < retrieval_fraction
        if is_retrieval and drill:
            cut = length
            if length >= 2 * DRILL_MIN_LENGTH and rng.random() < drill_split:
                cut = int(rng.integers(DRILL_MIN_LENGTH, length - DRILL_MIN_LENGTH + 1))
            parts = [_drill(rng, corpus, n, query) for n in (cut, length - cut) if n]
            tokens[b] = np.concatenate([t for t, _ in parts])
            answer = np.concatenate([a for _, a in parts])
            weights[b] = np.where(answer[1:] == 1, answer_weight, 1.0)
        elif is_retrieval:
            most = max_pairs(length)
            ex = retrieval_example(rng, corpus, length, num_pairs=int(rng.integers(1, most + 1)),
                                   query=query)
            tokens[b] = ex.tokens
            weights[b, ex.answer_start - 1:] = answer_weight
        else:
            tokens[b] = code_crop(rng, corpus, length)
    return tokens, weights
