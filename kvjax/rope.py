"""Rotary position embedding (RoPE): one implementation for the models and the cache policies.

A `RopeConfig` names the base, the rotated width, the pair layout and the
frequency scaling, one of:

* "default": inv_freq[i] = theta ** (-2i / dim);
* "linear": positions divided by `factor` (inv_freq / factor);
* "llama3": Llama-3.1's frequency-dependent scaling (`factor`,
  `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`);
* "yarn": YaRN (arXiv 2309.00071): a per-dimension blend of the original
  (extrapolated) and the divided-by-`factor` (interpolated) frequencies with a
  linear ramp between the `beta_fast` and `beta_slow` correction dimensions,
  and cos / sin multiplied by `attention_factor` (see `attention_factor`).
  DeepSeek also multiplies its softmax scale by `softmax_scale_multiplier`.

Two pair layouts: "rotate half" (HF Llama; channel i pairs with i + dim/2) and
interleaved (DeepSeek; channels 2i and 2i + 1). Channels past `2 * len(inv_freq)`
are not rotated (partial rotary).

Numerics follow transformers, the reference the model tests compare against:
inverse frequencies are computed once on the host in float32; angles are the
float32 product position * inv_freq. Re-rotating keys that are already cached
(StreamingLLM moving a key to a new slot) needs more: `angles(..., exact=True)`
reduces the angle in turns with error-free partial products, accurate to ~1e-6
rad at any position below 2**24.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "RopeConfig",
    "ROPE_TYPES",
    "rope_inv_freq",
    "attention_factor",
    "softmax_scale_multiplier",
    "yarn_mscale",
    "angles",
    "rope_cos_sin",
    "apply_rope",
    "rotate",
    "rerotate",
]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _positive(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding settings (hashable; usable inside a static model config).

    Attributes:
      theta: base wavelength (`rope_theta`).
      dim: rotated width per head (even).
      rope_type: "default", "linear", "llama3" or "yarn" (module docstring).
      factor: the context-extension factor of "linear", "llama3" and "yarn".
      low_freq_factor, high_freq_factor: "llama3"'s wavelength bounds.
      original_max_position_embeddings: the pre-extension context ("llama3", "yarn").
      beta_fast, beta_slow: "yarn"'s rotation counts bounding its interpolation ramp.
      mscale, mscale_all_dim: "yarn"'s magnitude-scaling coefficients (0 = unset).
      attention_factor: "yarn"'s explicit cos / sin multiplier; None derives it.
      truncate: "yarn" rounds its correction range outwards to whole dimensions.
      interleaved: pairs are adjacent channels (DeepSeek) instead of the two halves.
    """

    theta: float
    dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RopeConfig: rope_type {self.rope_type!r} is not supported; supported: "
                f"{ROPE_TYPES}."
            )
        if not _positive(self.theta):
            raise ValueError(f"RopeConfig.theta must be positive, got {self.theta!r}.")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0 or (
                self.dim % 2):
            raise ValueError(f"RopeConfig.dim must be a positive even int, got {self.dim!r}.")
        if not _positive(self.factor):
            raise ValueError(f"RopeConfig.factor must be a positive number, got {self.factor!r}.")
        opm = self.original_max_position_embeddings
        if isinstance(opm, bool) or not isinstance(opm, int) or opm <= 0:
            raise ValueError(f"RopeConfig.original_max_position_embeddings must be a positive "
                             f"int, got {opm!r}.")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeConfig: llama3 scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}."
            )
        if not _positive(self.beta_fast) or not _positive(self.beta_slow):
            raise ValueError(f"RopeConfig.beta_fast and beta_slow must be positive, got "
                             f"{self.beta_fast!r} and {self.beta_slow!r}.")
        if self.attention_factor is not None and not _positive(self.attention_factor):
            raise ValueError(f"RopeConfig.attention_factor must be positive or None, got "
                             f"{self.attention_factor!r}.")

    @classmethod
    def from_hf(cls, hf_config: dict, dim: int, *, interleaved: bool = False,
                layer_type: str | None = None) -> "RopeConfig":
        """Reads `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older).

        Args:
          hf_config: a parsed `config.json`.
          dim: the rotated width per head.
          interleaved: the model's pair layout (not stored in config.json).
          layer_type: for models whose layer types rotate differently (Gemma 3's
            "sliding_attention" and "full_attention"), transformers keys
            `rope_parameters` by layer type: read this type's entry. Such a config's
            top-level `rope_theta` and `rope_scaling` are not consulted (they are
            model-specific legacy fields; the family maps them).

        Raises:
          ValueError: naming an unsupported rope type or partial rotary factor, or a
            field the rope type needs that is missing or not a number; with
            `layer_type`, a `rope_parameters` without an object for that type.
        """
        params, legacy = (hf_config.get(k) or {} for k in ("rope_parameters", "rope_scaling"))
        for key, v in (("rope_parameters", params), ("rope_scaling", legacy)):
            if not isinstance(v, dict):
                raise ValueError(f"config.json: {key} must be an object (a dict), got {v!r}.")
        if layer_type is not None:
            params = params.get(layer_type)
            if not isinstance(params, dict):
                raise ValueError(
                    f"config.json: rope_parameters must hold an object for layer type "
                    f"{layer_type!r}, got {params!r}.")
            hf_config = {k: v for k, v in hf_config.items()
                         if k not in ("rope_theta", "rope_scaling")}
            legacy = {}
        params = dict(params)
        for k, v in legacy.items():
            params.setdefault(k, v)
        theta = params.get("rope_theta") or hf_config.get("rope_theta") or 10000.0
        rope_type = params.get("rope_type") or params.get("type") or "default"
        partial = params.get("partial_rotary_factor",
                             hf_config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0).")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported; "
                             f"supported: {ROPE_TYPES}.")

        def number(key, cast=float, default=None):
            v = params.get(key)
            if v is None:
                if default is not None:
                    return default
                raise ValueError(
                    f"config.json: rope scaling of type {rope_type!r} needs {key!r} in "
                    f"rope_parameters (or rope_scaling); it is missing. Given: {params}.")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"config.json: rope {key!r} must be a number, got {v!r}.")
            return cast(v)

        kw = dict(theta=float(theta), dim=int(dim), rope_type=rope_type, interleaved=interleaved)
        max_pos = hf_config.get("max_position_embeddings")
        if rope_type in ("linear", "llama3"):
            kw["factor"] = number("factor")
        if rope_type == "llama3":
            kw["low_freq_factor"] = number("low_freq_factor")
            kw["high_freq_factor"] = number("high_freq_factor")
            kw["original_max_position_embeddings"] = number(
                "original_max_position_embeddings", int, max_pos or 8192)
        if rope_type == "yarn":
            orig = number("original_max_position_embeddings", int, max_pos)
            # transformers: without a factor, the ratio of the extended to the original context.
            factor = params.get("factor")
            if factor is None and max_pos is not None:
                factor = max_pos / orig
            kw["factor"] = number("factor", float, factor)
            kw["original_max_position_embeddings"] = orig
            kw["beta_fast"] = float(params.get("beta_fast") or 32)
            kw["beta_slow"] = float(params.get("beta_slow") or 1)
            kw["mscale"] = float(params.get("mscale") or 0)
            kw["mscale_all_dim"] = float(params.get("mscale_all_dim") or 0)
            kw["attention_factor"] = params.get("attention_factor")
            kw["truncate"] = bool(params.get("truncate", True))
        return cls(**kw)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """The multiplier of cos and sin: YaRN's attention factor, 1.0 for the other types."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_mscale(rope.factor, rope.mscale)
                     / yarn_mscale(rope.factor, rope.mscale_all_dim))
    return float(yarn_mscale(rope.factor))


def softmax_scale_multiplier(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax-scale factor mscale(factor, mscale_all_dim)**2 (1.0 if unset)."""
    if rope.rope_type != "yarn" or not rope.mscale_all_dim:
        return 1.0
    m = yarn_mscale(rope.factor, rope.mscale_all_dim)
    return m * m


def rope_inv_freq(rope: RopeConfig) -> np.ndarray:
    """float32[dim // 2] inverse frequencies, scaled as `rope.rope_type` says.

    Computed on the host in float32, the way transformers computes them, so that
    long positions agree with it to the last bits.
    """
    dim = rope.dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponent
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(rope.factor), inv_freq)
        smooth = (np.float32(old) / wavelen - np.float32(rope.low_freq_factor)) / np.float32(
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        interpolated = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(rope.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        keep = np.float32(1) - ramp  # 1 = keep the original (extrapolated) frequency
        inv_freq = interpolated * (np.float32(1) - keep) + inv_freq * keep
    return inv_freq.astype(np.float32)


def angles(
    positions: Int[Array, "*batch"], inv_freq: Float[Array, " half"], *, exact: bool = False
) -> Float[Array, "*batch half"]:
    """Rotation angles position * inv_freq, float32.

    With `exact`, the angle is reduced to [0, 2 pi) accurately (~1e-6 rad at any
    position < 2**24): a plain float32 product rounds by |angle| * 2**-24, i.e. 3e-5
    rad at angle 500, so a key rotated to s then re-rotated by j - s would differ
    from one rotated to j by more than 1e-5. The angle is computed in turns,
    p * g with g = inv_freq / (2 pi), split into 12-bit halves (p = ph + pl,
    g = gh + gl) whose partial products are exact in float32; their fractional
    parts are exact too, and only their sum of at most four numbers in [0, 1) rounds.
    Without it, the plain product (what transformers computes, so models match it).
    """
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    p = jnp.asarray(positions).astype(jnp.float32)[..., None]  # exact for |p| < 2**24
    if not exact:
        return p * inv_freq
    ph = jnp.floor(p * jnp.float32(1 / 4096)) * jnp.float32(4096)
    pl = p - ph
    g = inv_freq / jnp.float32(2 * np.pi)
    # Keep the top 12 significant bits of g by masking the low 12 mantissa bits.
    gh = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(g, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32
    )
    gl = g - gh

    def frac(x):
        return x - jnp.floor(x)

    turns = frac(ph * gh) + frac(ph * gl) + frac(pl * gh) + frac(pl * gl)
    return frac(turns) * jnp.float32(2 * np.pi)


def rope_cos_sin(
    positions: Int[Array, "*batch"], rope: RopeConfig, dtype=jnp.float32
) -> tuple[Float[Array, "*batch half"], Float[Array, "*batch half"]]:
    """cos and sin of the angles of `positions` (times YaRN's attention factor), in `dtype`.

    Computed in float32 and cast to `dtype`, the precision `apply_rope` then rotates
    in: transformers' Llama rotates in the activation dtype, DeepSeek in float32.
    """
    a = angles(positions, rope_inv_freq(rope))
    cos, sin = jnp.cos(a), jnp.sin(a)
    af = attention_factor(rope)
    if af != 1.0:
        cos, sin = cos * jnp.float32(af), sin * jnp.float32(af)
    return cos.astype(dtype), sin.astype(dtype)


def _rotate(x, cos, sin, interleaved: bool):
    """The rotation: cos / sin broadcast against x[..., :2 * half]; math in cos's dtype."""
    half = cos.shape[-1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"apply_rope: rotary width {rot} exceeds the head width {x.shape[-1]}.")
    xc = x.astype(cos.dtype)
    xr, rest = xc[..., :rot], xc[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        out = out.reshape(*out.shape[:-2], rot)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)


def apply_rope(
    x: Float[Array, "*batch heads dim"],
    cos: Float[Array, "*batch half"],
    sin: Float[Array, "*batch half"],
    *,
    interleaved: bool = False,
) -> Float[Array, "*batch heads dim"]:
    """Rotates every head of x by its position's angles (tables from `rope_cos_sin`).

    Args:
      x: [..., heads, dim]; the first 2 * half channels are rotated.
      cos, sin: [..., half] per position, broadcast over the heads axis; the
        rotation is computed in their dtype and returned in x's.
      interleaved: adjacent channel pairs (DeepSeek) instead of the two halves.
    """
    return _rotate(x, cos[..., None, :], sin[..., None, :], interleaved)


def rotate(
    x: Float[Array, "*batch dim"],
    positions: Int[Array, "*batch"],
    inv_freq: Float[Array, " half"],
    *,
    interleaved: bool = False,
) -> Float[Array, "*batch dim"]:
    """Rotates x (any leading axes) to `positions`, with exact angles and float32 math.

    Args:
      x: [..., dim]; the first `2 * len(inv_freq)` channels are rotated.
      positions: integer positions, shape `x.shape[:-1]` or broadcastable to it
        (negative values rotate backwards, as re-rotation needs).
      inv_freq: float32[half], e.g. `rope_inv_freq(rope)`.
      interleaved: adjacent channel pairs instead of the two halves.

    Returns:
      x rotated, in x's dtype.
    """
    a = angles(positions, inv_freq, exact=True)
    return _rotate(x, jnp.cos(a), jnp.sin(a), interleaved)


def rerotate(
    k: Float[Array, "*batch dim"],
    delta: Int[Array, "*batch"],
    inv_freq: Float[Array, " half"],
    *,
    interleaved: bool = False,
) -> Float[Array, "*batch dim"]:
    """A key rotated at position s, re-rotated to s + delta: R(delta) applied to it.

    Rotations compose, R(j) = R(j - s) R(s), so a cached key moves to a new
    position without its pre-RoPE value.
    """
    return rotate(k, delta, inv_freq, interleaved=interleaved)
