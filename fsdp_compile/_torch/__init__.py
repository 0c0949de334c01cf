"""What we add to torch or work around in it: one file per torch behaviour.

Each file's docstring names the behaviour, the torch versions it was checked on and when it can go. CI runs
the whole suite on torch 2.13.0 and, on 2.14.1, the fast tier, ``-m inductor tests/test_ops.py``, the demo
and the GPU-codegen tier (``.ci/run``): "2.14.1" below means one of those exercises the file there. No
upstream issue or PR is cited for any of them yet.

====================  ============================================  ==============  ====================================
file                  torch behaviour                               checked on      delete when
====================  ============================================  ==============  ====================================
_invoke_subgraph.py   invoke_subgraph has no Conjugate kernel; its  2.13.0, 2.14.1  torch has the kernel, caches the
                      gen_schema re-traces the region per call;                     schema, guards pending writes on
                      Dynamo's region reuse misses attribute                        reuse, and lowers regions without
                      writes made in the trace; Inductor's region                   those two faults (per part: its
                      lowering takes the enclosing graph's donated                  docstring)
                      inputs and hides outputs that alias inputs
_dtensor.py           DTensor's sharding cache hands AOTAutograd    2.13.0, 2.14.1  a TP model compiled after an eager
                      an eager decision (a bad joint graph);        (the failure:   step traces without it; meshes on
                      meshes compare equal by layout, so a new      2.13.0)         other process groups stop comparing
                      mesh meets a destroyed one in the caches                      equal
_gloo.py              ProcessGroupGloo's worker threads write the   2.13.0 (ASan),  every supported torch writes the
                      group's status without a lock: a double free  2.14.1 (demo)   status under its lock (public
                                                                                    single_thread_gloo: kept as a no-op
                                                                                    for a release)
_dynamo_logging.py    Dynamo cannot trace a logging.Logger method,  2.13.0          Dynamo replays reorderable logging
                      and reorderable_logging_functions drops the                   calls from inlined frames, or traces
                      calls made in inlined frames                                  a Logger method under fullgraph=True
_grad_hooks.py        Dynamo traces a post-accumulate-grad hook     2.13.0, 2.14.1  Dynamo defers a post-accumulate-grad
                      registered on an intermediate at once, with                   hook on an intermediate to its
                      .grad None (transformers' Qwen3 TP plan)                      gradient
_size_branches.py     Dynamo cannot guard on a data-dependent size  2.13.0          Dynamo takes a size-oblivious path
                      (transformers' AllToAllEP: if tokens.shape                    there, or transformers writes it
                      [0] == 0 after its all-to-all)                                with guard_or_false
_grad_fn.py           Dynamo cannot read the grad_fn of a tensor    2.14.1          Dynamo answers grad_fn is None there,
                      computed in the graph (spmd_types'                            or spmd_types stops reading it
                      collectives: x.grad_fn is None)
_nested_subclasses.py Dynamo's region checks unwrap a tensor        2.13.0, 2.14.1  _collect_fake_inputs recurses, and a
                      subclass one level; a region body's                           region body's functionalization
                      functionalization hands ops autograd would                    decomposes as autograd would
                      decompose to a subclass whole (torchao's
                      float8 x TP: a DTensor of a Float8Training-
                      Tensor)
_aot_cache.py         AOTAutograd's cache key cannot name Dynamo's  2.13.0          Dynamo names its trampolines
                      trampoline for an autograd Function in the                    importably, DeviceMesh pickles
                      graph, and pickles a DeviceMesh input                         the same in every process, and the
                      differently in every process; its node check                  node check admits value classes
                      refuses a NamedTuple or frozen dataclass
                      built in the graph (torchao's float8 configs)
====================  ============================================  ==============  ====================================

Not here, because each is a decision that lives with the code it steers: ``_fsdp2.py`` (the one reader of
FSDP2's private state, a version-checked adapter), ``backend.py``'s Inductor settings per torch
(``REGIONS_SOUND_UNDER_INDUCTOR``), ``passes/regions.py``'s and ``capture/regions.py``'s reasons to compile
a block inline instead of as a region.
"""

from __future__ import annotations

import contextlib

_ABSENT = object()


@contextlib.contextmanager
def patched(*changes: tuple[object, str, object]):
    """Within the block, each ``(owner, name, value)`` of ``changes`` set; after it, each owner's own attribute
    put back as it was, or deleted where the owner had only inherited it (a class's, a module's)."""
    saved = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def wrapped(error: BaseException, cls: type) -> BaseException | None:
    """The ``cls`` exception that ``error`` (a Dynamo error) wraps, or None: Dynamo, or its backend, wraps what is
    raised in a trace, and may chain it once more. Our patches raise their refusals in a trace and re-raise
    them unwrapped, so the user reads our message, not Dynamo's."""
    cause = error
    while cause is not None and not isinstance(cause, cls):
        cause = cause.__cause__ or cause.__context__
    return cause
