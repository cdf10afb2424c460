"""Token sampling: greedy, temperature, top-k and top-p, with one explicit PRNG key per row.

Each row draws from its own key (`fold_in(row_key, step)` in the decode loop),
so a sequence's samples do not depend on which other sequences share its batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["SamplingConfig", "RowSampling", "greedy", "sample", "sample_rows", "as_keys"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to pick the next token (hashable: a static argument).

    Attributes:
      temperature: 0 means greedy (argmax); otherwise logits are divided by it.
      top_k: keep only the k most likely tokens (None: all).
      top_p: keep the smallest set of most likely tokens whose probability
        reaches top_p (nucleus sampling; None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}.")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"SamplingConfig.top_k must be an int >= 1 or None, got "
                             f"{self.top_k!r}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must lie in (0, 1] or be None, got "
                             f"{self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def as_keys(key, batch: int) -> jax.Array:
    """Typed PRNG keys [batch]: from one key (split per row) or from per-row keys.

    Accepts typed keys (`jax.random.key`) or raw uint32 keys (`jax.random.PRNGKey`).
    """
    if key is None:
        raise ValueError("key must be a PRNG key, e.g. jax.random.key(0), got None.")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.ndim == 0:  # wrap_key_data checks the key width
            raise ValueError(f"key must be a PRNG key (jax.random.key) or raw uint32 key data "
                             f"(jax.random.PRNGKey), got {key.dtype}{list(key.shape)}.")
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(f"keys must be one key or one per row ({batch},), got shape {key.shape}.")
    return key


def _filter(logits: Float[Array, "batch vocab"], config: SamplingConfig):
    neg = jnp.float32(-jnp.inf)
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, config.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if config.top_p is not None and config.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep_sorted = before < jnp.float32(config.top_p)  # the top token is always kept
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits


def greedy(logits: Float[Array, "batch vocab"]) -> Int[Array, " batch"]:
    """Each row's first index of its largest logit, int32[batch]: `jnp.argmax` (a NaN
    counts as the largest, as there). On one CPU device, float32 logits take the kernel
    `kvjax.backends.cpu.argmax_rows` (one vectorized pass per row: 0.18 ms against
    0.8-2.5 ms for 32 x 32000 on a 2-core EPYC, Zen 4). Otherwise two single-operand
    reductions (the row's maximum, then the least index holding it) rather than argmax's
    (value, index) reduce, which XLA:CPU runs unvectorized (8.8 ms there)."""
    if (jax.default_backend() == "cpu" and logits.dtype == jnp.float32
            and logits.shape[-1] > 0):
        from kvjax.backends import cpu

        if cpu.choose("argmax_rows").use_kernel:
            return cpu.argmax_rows(logits)
    nan = jnp.isnan(logits)
    # XLA:CPU's max may skip NaNs, so a row holding one is decided by its NaNs alone.
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample(
    logits: Float[Array, "batch vocab"], keys: jax.Array, config: SamplingConfig
) -> Int[Array, " batch"]:
    """Next tokens int32[batch] from float32 logits, one typed key per row (unused if greedy)."""
    if config.greedy:
        return greedy(logits)
    logits = _filter(logits.astype(jnp.float32) / jnp.float32(config.temperature), config)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One `SamplingConfig` per row, as arrays (a pytree: rows of a batch sample differently
    without a recompile; the serving engine's requests each bring their own settings).

    Attributes:
      temperature: float32[batch]; 0 is greedy.
      top_k: int32[batch]; 0 keeps every token.
      top_p: float32[batch]; 1 keeps every token.
    """

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]

    @classmethod
    def of(cls, configs) -> "RowSampling":
        """The rows' settings from one `SamplingConfig` per row (NumPy arrays)."""
        return cls(
            temperature=np.array([c.temperature for c in configs], np.float32),
            top_k=np.array([c.top_k or 0 for c in configs], np.int32),
            top_p=np.array([1.0 if c.top_p is None else c.top_p for c in configs], np.float32))


def sample_rows(logits: Float[Array, "batch vocab"], keys: jax.Array,
                rows: RowSampling) -> Int[Array, " batch"]:
    """`sample` with each row's own settings: row i draws what `sample` would draw for it
    alone with `SamplingConfig(temperature[i], top_k[i] or None, top_p[i])`."""
    logits = logits.astype(jnp.float32)
    pick = rows.temperature <= 0
    best = greedy(logits)
    # All-greedy batches (the common serving case) skip the sort and the draws.
    return jax.lax.cond(jnp.all(pick), lambda: best,
                        lambda: jnp.where(pick, best, _draw_rows(logits, keys, rows)))


def _draw_rows(logits, keys, rows: RowSampling):
    greedy = rows.temperature <= 0
    t = jnp.where(greedy, 1.0, rows.temperature)[:, None]
    scaled = logits / t
    neg = jnp.float32(-jnp.inf)
    vocab = logits.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    k = jnp.clip(rows.top_k, 1, vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    use_k = ((rows.top_k > 0) & (rows.top_k < vocab))[:, None]
    scaled = jnp.where(use_k & (scaled < kth), neg, scaled)
    # top-p over the top-k survivors, as `sample` filters: masked tokens sort last.
    sorted_logits = jnp.where(use_k & (sorted_logits < kth), neg, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < rows.top_p[:, None]
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    scaled = jnp.where((rows.top_p < 1)[:, None] & ~keep, neg, scaled)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
