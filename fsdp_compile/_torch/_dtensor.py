"""DTensor's caches of sharding decisions, which fsdp_compile has to empty (torch 2.13).

* ``clear_sharding_cache``: DTensor's C++ sharding-propagation cache keeps what an eager step decided, and
  AOTAutograd, tracing the same op at the same shapes, can hit it and build a joint graph that returns a
  tangent as a forward output ("Node tangents_2 was invalid, but is output" in the partitioner; measured:
  a TP Llama compiled after an eager step at the same shapes). The backend empties it before tracing.
* ``forget_meshes``: those caches (and DTensor's Python ones) hold DeviceMesh objects, and meshes compare
  equal by layout alone, so a mesh of the same shape built later on new process groups meets the old one
  (and its destroyed groups) there. Real jobs build one mesh per process; the tests and the simulator,
  which build many on a fake process group each, call this when a group ends.

Versions, and when it can go (no upstream issue or PR is cited):

* ``clear_sharding_cache``: the bad joint graph seen on 2.13.0 (multi-rank TP tests, which CI runs on 2.13.0
  only); on 2.14.1 it runs wherever the fast tier compiles a TP model (``tests/test_tp.py``), the failure not
  re-measured. Goes when a TP model compiled after an eager step at the same shapes traces without it.
* ``forget_meshes``: 2.13.0 and 2.14.1 (every fake-process-group test ends with it, ``tests/dist_helpers.py``).
  Used by the tests and ``bench/scale_sim.py``, not by the library. Goes when meshes built on other process
  groups no longer compare equal (DeviceMesh equality that includes its groups); ``_extensions._GRAD_SPECS``
  then needs its own clearing.
"""

from __future__ import annotations

import torch


def clear_sharding_cache() -> None:
    torch._C._clear_DTensor_sharding_propagator_cache()


def forget_meshes() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from fsdp_compile._extensions import _GRAD_SPECS

    clear_sharding_cache()
    _GRAD_SPECS.clear()  # LocalShards' gradient specs, keyed by their parameters' specs (which hold meshes)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
