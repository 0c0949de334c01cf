"""One compiled step of a ``CompiledFSDPModule``: the function Dynamo captures, compiled once per all-gather
extension key, and the one retry its deferred parameters may need.

A region block's all-gather extension parameters (torchao's float8 weights) are deferred into its region
(``capture.forward.Deferred``): the step leaves None in their places and the block's region takes them
straight from the all-gather, which saves tracing their build at top level (float8 x TP Llama: 1.06 -> 0.78 s
of cold first step per layer). A model that reads such a weight outside its block during the step (a forward
pre-hook of the root, a tied use the plan cannot see) meets that None: eager FSDP2 reads its sharded DTensor
there, and Dynamo's trace fails ("Observed exception"). ``Step.run`` then traces the step once more with every
parameter built at top level, as a step without regions builds them, and warns once. The retry is taken only
where it cannot repeat a side effect: on the first call of a key whose trace failed before reaching the
backend (so no graph ran, and no collective was issued), and only while the step defers something.
"""

from __future__ import annotations

import warnings

import torch.nn as nn

from fsdp_compile import capture
from fsdp_compile._quote import quoted
from fsdp_compile.passes import Schedule
from fsdp_compile.plan import ShardingPlan

DEFERRED_READ = (
    "fsdp_compile: the step's first trace failed while a region block's all-gather extension parameters (float8 "
    "weights) went from the all-gather straight into their region, None in their places outside it (a model or "
    "hook that reads one there fails so). Compiling the step again with them built at top level, as without "
    "regions: each one's build is then traced once per block. The trace said: {error}"
)


class Step:
    """One compiled step: its sharding plan, its schedule, the compiled functions (one per all-gather
    extension key, ``_extensions.prepare``: a single one without extensions), and the parameters it reads.
    ``build(key, deferred)``: the compiled function for ``key``, deferring ``deferred`` (``fqn -> key``)."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, schedule: Schedule, build, deferred: dict[str, int]):
        self.plan, self.schedule, self._build, self._compiled = plan, schedule, build, {}
        self._deferred = deferred  # install_regions' deferred parameters; {} once a trace failed with them
        self._ran: set = set()  # keys whose compiled function returned once
        self.param_plans = [capture.unit_params(plan, u) for u in schedule.units]
        self.params = self.lookup(model)
        owners: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), (module, name))
        self._slots = [[owners[id(p)] for p in unit] for unit in self.params]  # where each parameter lives

    def compiled(self, key: tuple):
        """The compiled function for all-gather extensions laid out as ``key`` (this rank alone: no collective)."""
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._build(key, self._deferred)
        return fn

    def run(self, key: tuple, captured, *args, **kwargs):
        """The compiled function for ``key`` called on ``args``; ``captured``: the backend's ``CapturedGraphs``
        (a trace that reached the backend appended its graph there). See the module's docstring for the retry."""
        traced = len(captured.dynamo)
        try:
            out = self.compiled(key)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised unless the retry below applies
            if key in self._ran or not self._deferred or len(captured.dynamo) != traced:
                raise
            warnings.warn(DEFERRED_READ.format(error=_first_words(e)), stacklevel=5)  # the caller's line
            self._deferred = {}
            self._compiled.pop(key)
            out = self.compiled(key)(*args, **kwargs)
        self._ran.add(key)
        return out

    def lookup(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """The model's current parameter objects, per unit."""
        by_name = dict(model.named_parameters(remove_duplicate=False))  # ParamPlan.places' names too
        return [[by_name[pp.fqn] for pp in unit] for unit in self.param_plans]

    def current(self) -> bool:
        """Whether the model still holds the parameter objects this step reads (attribute reads only)."""
        return all(
            module._parameters.get(name) is p
            for unit, slots in zip(self.params, self._slots)
            for p, (module, name) in zip(unit, slots)
        )


def _first_words(e: Exception) -> str:
    """What a failed trace says first, with Dynamo's own account of the exception where it gives one."""
    said = "Developer debug context: "
    context = next((line.strip()[len(said):] for line in str(e).splitlines() if line.strip().startswith(said)), "")
    return f"{quoted(e)}; {context}" if context else quoted(e)


def traced_step(model, plan, schedule, kernels, key: tuple, deferred: dict[str, int]):
    """The function Dynamo captures for extension key ``key`` (``capture.traced_forward`` on what it reads of
    each unit, found once)."""
    # what the trace reads of each unit (its op arguments encoded: a constant string in the graph), found once
    units = capture.unit_traces(plan, schedule, kernels, key)
    constant = capture.trace_constants(units)
    places = capture.parameter_places(model, [fqn for u in units for fqn in u.fqns],
                                      {p.fqn: p.places for u in units for p in u.params if p.places})
    # a deferred parameter is built only in its block's forward: not one held elsewhere too (tied)
    deferred = {fqn: k for fqn, k in deferred.items() if len(places.get(fqn, ())) == 1}
    deferred, places = capture.constants({fqn: deferred.get(fqn) for fqn in places}), capture.place_table(places)

    def step(shards, sinks, accumulated, partials, extensions, *args, **kwargs):
        return capture.traced_forward(model, constant, places, deferred, shards, sinks, accumulated, partials,
                                      extensions, args, kwargs)

    return step
