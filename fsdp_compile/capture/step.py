"""The compiled call's scope: whether our compiled step is running, and with regions.

``STEP`` is what FSDP2's hook dispatchers (``hooks.py``) and the regional forwards (``regions.py``) read;
``active`` sets it for one compiled call, with torch's ``invoke_subgraph`` patched for that call
(``_torch/_invoke_subgraph.py``) and the model's loggers swapped for stand-ins (``_torch/_dynamo_logging.py``).
"""

from __future__ import annotations

import contextlib

from fsdp_compile._torch import _grad_fn, _grad_hooks, _invoke_subgraph, _nested_subclasses, _size_branches


class _StepState:
    """What FSDP2's hook dispatchers and the regional forwards read: whether our compiled step is running
    (and being traced: Dynamo guards on these attributes), and whether repeated blocks run as regions.
    Set only for the duration of one compiled call, by ``active``; one object, so the guards stay put."""

    def __init__(self):
        self.active = False
        self.regions = False
        self.pieces = None  # while ``traced_forward`` runs the model: its deferred parameters by key (``forward.Deferred``)


STEP = _StepState()


class _Active:
    def __init__(self, regions: bool, loggers: list[tuple[object, object]]):
        self.regions, self.loggers = regions, loggers

    def __enter__(self):
        self._prev = (STEP.active, STEP.regions)
        STEP.active, STEP.regions = True, self.regions
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_invoke_subgraph.schemas_cached())
        self._patches.enter_context(_invoke_subgraph.reuse_checked())
        self._patches.enter_context(_grad_hooks.traced_as_grad_hooks())  # a TP plan's hooks registered in forward
        self._patches.enter_context(_size_branches.general_path_on_empty())  # transformers' EP: no tokens received
        self._patches.enter_context(_grad_fn.grad_fn_not_none())  # spmd_types' collectives (torchtitan's TP)
        self._patches.enter_context(_nested_subclasses.nested_subclass_regions())  # torchao's float8 x TP regions
        self._saved = [(module, module.logger) for module, _ in self.loggers]
        for module, proxy in self.loggers:
            module.logger = proxy

    def __exit__(self, *exc):
        STEP.active, STEP.regions = self._prev
        self._patches.__exit__(*exc)
        for module, logger in reversed(self._saved):
            module.logger = logger


def active(regions: bool = False, loggers: list[tuple[object, object]] = ()) -> _Active:
    """The compiled call's scope: FSDP2's hooks dispatch to ours, blocks to their regions (``regions``), and
    the model's loggers (``install_logging``) defer their messages to ``flush_logs``."""
    return _Active(regions, list(loggers))
