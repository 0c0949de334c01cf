"""Python's cyclic garbage collector, collecting less often while one of our compiles runs.

A compile of the whole step as one graph allocates millions of small objects (FX nodes, fake tensors,
sympy expressions, Inductor's IR), most of which outlive the compile's passes. CPython's generational
collector runs a young collection every 700 net allocations and promotes what survives, so that the older
generations are scanned again and again while they grow: the collections' cost grows faster than the
graph. Measured on HF ``LlamaForCausalLM`` at 32 layers (one rank, fake process group, 2-core CPU, torch
2.13): 3.3 s of a 38.4 s cold first step under Inductor, 1.6 s of 6.4 s under ``aot_eager``.

While one of our compiles runs, the thresholds are raised (``THRESHOLDS``): a young collection every
50,000 net allocations, and no full one unless a very long compile asks for it. Collection is not
disabled and nothing is frozen, so garbage a compile makes is still collected, in fewer and larger
passes; the thresholds in force before are restored when the compile ends. Thresholds the user raised
further are kept, and a collector the user disabled (``gc.disable()`` or a threshold of 0) is left so.

"One of our compiles" is a compile Dynamo starts during a call of a ``CompiledFSDPModule`` (the step's
trace and its backend: AOTAutograd, our passes, Inductor's forward), and the lazy backward compile of the
graphs such a compile produced (AOTAutograd runs it under the forward's compile id at the first backward).
Both are found with Dynamo's compile callbacks (``torch._dynamo.callback_handler``), which run once per
outermost compile; any other ``torch.compile`` in the process is left alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading

from torch._dynamo.callback import CallbackTrigger, callback_handler

THRESHOLDS = (50_000, 50, 1_000)  # while compiling: gc.set_threshold's (young, middle, old); CPython's: (700, 10, 10)

_state = threading.local()  # .calls: depth of CompiledFSDPModule calls on this thread
_ours: set[str] = set()  # compile ids of the Dynamo compiles started inside our calls
_saved: list[tuple[int, int, int] | None] = []  # per compile entered: the thresholds to restore (None: left alone)


@contextlib.contextmanager
def ours():
    """Around a call of a compiled model: a compile Dynamo starts inside is one of ours."""
    _register()
    _state.calls = getattr(_state, "calls", 0) + 1
    try:
        yield
    finally:
        _state.calls -= 1


def _on_start(args) -> None:
    mine = False
    if args.callback_trigger == CallbackTrigger.DYNAMO and getattr(_state, "calls", 0):
        _ours.add(args.compile_id)
        mine = True
    elif args.callback_trigger == CallbackTrigger.LAZY_BACKWARD:
        mine = args.compile_id in _ours
    _saved.append(_raise() if mine else None)


def _on_end(args) -> None:
    if _saved:  # this module imported while a compile was under way: its start was not seen
        previous = _saved.pop()
        if previous is not None:
            gc.set_threshold(*previous)


def _raise() -> tuple[int, int, int] | None:
    """Raise the thresholds to at least ``THRESHOLDS``; the ones in force before, or None where nothing changed."""
    previous = gc.get_threshold()
    if not gc.isenabled() or previous[0] == 0:
        return None
    raised = tuple(max(p, t) for p, t in zip(previous, THRESHOLDS))
    if raised == previous:
        return None
    gc.set_threshold(*raised)
    return previous


def _register() -> None:
    """Our callbacks among Dynamo's, registered again at each call where ``torch._dynamo.reset()`` cleared them
    (it clears every compile callback; registered only on import, a reset in a test or a notebook left every
    later compile of ours at CPython's thresholds: a 16-layer HF Llama's ``aot_eager`` first step, one process
    on the fake process group, spent 1.2 and 2.1 s of about 9 s in the collector, against 0.3 and 1.0 s with
    ours). Outside our calls and their lazy backward compiles they leave the thresholds alone."""
    if _on_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_start)
    if _on_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_end)


_register()
