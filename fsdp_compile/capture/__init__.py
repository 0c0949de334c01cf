"""Traceable FSDP2: bypass FSDP2's eager hooks while our compiled step runs, gather through our ops.

One module per concern, what callers use re-exported here (``capture.<name>``)::

    step.py     STEP, active: the compiled call's scope, read by the two below
    hooks.py    FSDP2's forward hooks swapped for dispatchers (eager outside our step, its casts inside);
                attach / Attachment: what compile and explain install on a model, and take off again
    forward.py  traced_forward, the function Dynamo captures: one fsdp_compile::unshard per schedule
                unit, then the model on the full parameters (call_with, parameter_places)
    regions.py  each kind of repeated block routed through one nested_compile_region (install_regions)

What the model logs inside the step is deferred by ``fsdp_compile/_torch/_dynamo_logging.py`` (Dynamo cannot
trace a logger), swapped in by ``active``.
"""

from fsdp_compile._torch._dynamo_logging import flush_logs, install_logging
from fsdp_compile.capture.forward import (
    UnitTrace,
    call_with,
    constants,
    parameter_places,
    place_table,
    trace_constants,
    traced_forward,
    unit_params,
    unit_traces,
    unshard_args,
)
from fsdp_compile.capture.hooks import Attachment, attach, install_hooks
from fsdp_compile.capture.regions import (
    INLINE_PARALLEL,
    INLINE_SUBCLASS,
    _unique_code,  # _api.py names its compiled step's code with it
    find_repeated_blocks,
    inline_reason,
    install_regions,
)
from fsdp_compile.capture.step import STEP, active

__all__ = [
    "INLINE_PARALLEL", "INLINE_SUBCLASS", "STEP", "Attachment", "UnitTrace", "active", "attach",
    "call_with", "constants", "find_repeated_blocks", "flush_logs", "inline_reason", "install_hooks",
    "install_logging", "install_regions", "parameter_places", "place_table", "trace_constants", "traced_forward",
    "unit_params", "unit_traces", "unshard_args",
]
