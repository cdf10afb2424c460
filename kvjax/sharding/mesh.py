"""Device meshes with kvjax's named axes, and the sharding plan built on them.

kvjax names three mesh axes:

  * `data`: sequences (block-table rows) and the pages they own;
  * `model`: tensor parallelism: attention heads, MLP hidden units, vocabulary;
  * `context`: the pages of one sequence, spread round-robin over devices.

A mesh may use any subset of them, in any order.

Axis types. `make_mesh` builds *Auto* axes on purpose. jax 0.10's `jax.make_mesh`
defaults to Explicit axes, under which every op must state its output sharding:
a gather from a pool sharded on pages raises `ShardingTypeError` unless it sits
inside `shard_map`. kvjax's model code is sharding-agnostic (plain jnp), so the
compiler propagates the param and cache shardings through it (Auto), and the two
operations the compiler would partition badly, attention over a page-sharded
pool and its log-sum-exp merge, run inside `jax.shard_map` where kvjax states
every collective itself (`kvjax.sharding.attention`).
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["AXES", "STRATEGIES", "make_mesh", "ShardingPlan"]

AXES = ("data", "model", "context")
STRATEGIES = ("heads", "sequences", "context")
# The mesh axis each strategy spreads the cache over.
_STRATEGY_AXIS = {"heads": "model", "sequences": "data", "context": "context"}
_FALLBACKS = ("replicate", "error")


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over `prod(shape)` devices with kvjax axis names and Auto axis types.

    Args:
      shape: size of each axis, e.g. `(2, 4)`.
      axis_names: a subset of `("data", "model", "context")` in any order, one per axis.
      devices: devices to use; default the first `prod(shape)` of `jax.devices()`
        (so a 4-device mesh can be built on an 8-device host).

    Raises:
      ValueError: unknown or repeated axis names, a shape/name count mismatch,
        a non-positive size, or more devices asked for than are available; the
        message names the axis and sizes.
    """
    shape = tuple(shape)
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"make_mesh: got {len(shape)} sizes {shape} for {len(axis_names)} axis names "
            f"{axis_names}; give one size per axis."
        )
    for name in axis_names:
        if name not in AXES:
            raise ValueError(f"make_mesh: unknown axis name {name!r}; allowed names are {AXES}.")
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"make_mesh: axis names must be distinct, got {axis_names}.")
    for name, size in zip(axis_names, shape, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: axis {name!r} must have a positive int size, got "
                             f"{size!r}.")
    available = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(available):
        sizes = ", ".join(f"{n}={s}" for n, s in zip(axis_names, shape, strict=True))
        raise ValueError(
            f"make_mesh: axes ({sizes}) need {need} devices but only {len(available)} are "
            f"available."
        )
    if devices is not None and need != len(available):
        raise ValueError(
            f"make_mesh: axes {dict(zip(axis_names, shape, strict=True))} need {need} devices; "
            f"{len(available)} were given."
        )
    return jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=available[:need])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """A mesh and the cache strategies that use it (hashable: usable as a static argument).

    Strategies (any combination):
      * `"heads"`: KV heads over `model`. When `model` does not divide kv_heads
        but kv_heads divides `model` (and always for MLA's single latent head),
        `kv_heads_fallback="replicate"` keeps every KV head on every `model`
        device (as vLLM does when tensor parallelism exceeds kv_heads): the
        query heads are still split over `model` and each device reads the KV
        head its query heads need; memory then does not shrink along `model`.
        `kv_heads_fallback="error"` raises instead.
      * `"sequences"`: block-table rows and their pages over `data`; each data
        shard allocates from its own range of page ids.
      * `"context"`: one sequence's pages round-robin over `context` (page j on
        context shard j % C); attention merges per-device partial results by
        log-sum-exp.

    Mesh axes that no strategy uses replicate the cache (a `model` axis still
    splits the query heads and the params).

    Args:
      mesh: from `make_mesh`.
      strategies: a tuple drawn from `("heads", "sequences", "context")`.
      kv_heads_fallback: `"replicate"` or `"error"`, see above.
    """

    mesh: Mesh
    strategies: tuple[str, ...]
    kv_heads_fallback: str = "replicate"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"ShardingPlan.mesh must be a jax.sharding.Mesh, got "
                            f"{type(self.mesh).__name__}.")
        strategies = (self.strategies,) if isinstance(self.strategies, str) else self.strategies
        strategies = tuple(strategies)
        object.__setattr__(self, "strategies", strategies)
        for s in strategies:
            if s not in STRATEGIES:
                raise ValueError(f"ShardingPlan: unknown strategy {s!r}; allowed strategies are "
                                 f"{STRATEGIES}.")
        if len(set(strategies)) != len(strategies):
            raise ValueError(f"ShardingPlan: strategies must be distinct, got {strategies}.")
        for s in strategies:
            axis = _STRATEGY_AXIS[s]
            if axis not in self.mesh.axis_names:
                raise ValueError(
                    f"ShardingPlan: strategy {s!r} needs a mesh axis named {axis!r}, but the "
                    f"mesh has axes {dict(self.mesh.shape)}."
                )
        if self.kv_heads_fallback not in _FALLBACKS:
            raise ValueError(f"ShardingPlan.kv_heads_fallback must be one of {_FALLBACKS}, got "
                             f"{self.kv_heads_fallback!r}.")

    def axis_size(self, name: str) -> int:
        """Size of mesh axis `name`, 1 if the mesh lacks it."""
        return int(self.mesh.shape[name]) if name in self.mesh.axis_names else 1

    @property
    def data_shards(self) -> int:
        """Sequence groups: the `data` size under `"sequences"`, else 1."""
        return self.axis_size("data") if "sequences" in self.strategies else 1

    @property
    def context_shards(self) -> int:
        """Pages of one sequence are spread over this many devices."""
        return self.axis_size("context") if "context" in self.strategies else 1

    @property
    def page_shards(self) -> int:
        """Ranges the pool's page axis is cut into: data_shards * context_shards."""
        return self.data_shards * self.context_shards

    @property
    def page_axes(self) -> tuple[str, ...]:
        """Mesh axes over the pool's page axis, data-major (shard k = d * C + c)."""
        axes = []
        if self.data_shards > 1:
            axes.append("data")
        if self.context_shards > 1:
            axes.append("context")
        return tuple(axes)

    @property
    def num_devices(self) -> int:
        return int(self.mesh.size)
