"""Seeing what the compiler did to communication: readable graphs and dumps (``dump``), the predicted
timeline (``timeline``), the ``fsdp-compile`` command line (``cli``), and ``explain_graphs`` for tools
that need the graphs themselves."""

from __future__ import annotations


def explain_graphs(model, *example_args, config=None, **example_kwargs):
    """``fsdp_compile.explain``, also returning the captured graphs: ``(Report, CapturedGraphs)``.

    ``CapturedGraphs`` (``fsdp_compile.backend``) holds every Dynamo graph and every forward and backward
    graph after our passes, with the passes' records; ``dump.write_dump(dir, report, captured)`` writes
    them out. Used by the CLI and ``bench/scale_sim.py``.
    """
    from fsdp_compile._explain import explain_with_graphs

    return explain_with_graphs(model, example_args, example_kwargs, config)
