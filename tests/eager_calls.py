"""Count the collectives issued from Python through ``torch.distributed``.

Eager FSDP2's hooks issue their all-gathers and reduce-scatters this way; a step compiled by
``fsdp_compile`` issues none (its collectives are ``_c10d_functional`` ops inside the graphs), which is
how the tests and the benchmarks check that no eager hook ran. Test instrumentation, kept out of the
package: it patches ``torch.distributed`` for the duration of the block.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single", "barrier",
)


class Calls(list):
    """The names of the collectives called, in order; ``bytes[i]``: the bytes of call ``i``'s largest tensor
    argument (its full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self):
        super().__init__()
        self.bytes: list[int] = []


def _largest(args, kwargs) -> int:
    sizes = [t.numel() * t.element_size() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return max(sizes, default=0)


@contextlib.contextmanager
def count_eager_collectives():
    """Within the block, every call of a ``torch.distributed`` collective is appended (by name) to the
    yielded ``Calls``. Patches both ``torch.distributed`` and ``distributed_c10d``; restores them on exit."""
    calls = Calls()
    saved = {}
    for module in (dist, c10d):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            saved[(module, name)] = fn

            def counting(*args, _fn=fn, _name=name, **kwargs):
                calls.append(_name)
                calls.bytes.append(_largest(args, kwargs))
                return _fn(*args, **kwargs)

            setattr(module, name, counting)
    try:
        yield calls
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
