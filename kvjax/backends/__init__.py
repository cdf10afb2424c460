"""Native (non-Pallas) backends: the C++ CPU kernels, their build and their options.

The layers above ask this package backend-neutral questions (`prefers_unstacked`,
`kvjax.backends.linear.linear`); which backend answers is decided here.
"""

__all__ = ["prefers_unstacked"]


def prefers_unstacked(layer_weights, rows: int) -> bool:
    """Whether a decode of `rows` rows per step should run per-layer weight arrays.

    Stacked layer weights inside a `lax.scan` are sliced every step; on the CPU backend
    XLA copies each slice (a read and a write of every layer weight per token) unless
    the CPU matmul reads the stack in place. Other backends read slices in place.
    """
    import jax

    if jax.default_backend() != "cpu":
        return False
    from kvjax.backends.cpu import policy

    return policy.unstack_layers_for(layer_weights, rows)
