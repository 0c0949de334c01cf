"""Model code that logs, inside the captured step: Dynamo cannot trace a ``logging.Logger`` method.

Model code logs (transformers' ``logger.warning_once`` in its loss, say), and Dynamo cannot trace a
logging.Logger method: under fullgraph=True that is an error. Dynamo's ``reorderable_logging_functions``
do not help: torch 2.13 replays only the calls made in the top frame and drops those inside inlined
functions, i.e. every call a model makes. While our step runs, each such module's ``logger`` global is
a stand-in whose logging methods append ``(logger, method, args, kwargs)`` to ``_PENDING``: a list
mutation, which Dynamo traces and replays after the graph like any side effect. ``flush_logs`` (after
every compiled call) hands them to the real logger, so the message is emitted, once where it says once.

Versions, and when it can go (no upstream issue or PR is cited): checked on 2.13.0
(``tests/test_hf_multirank.py::test_gpt2_ties_and_keeps_its_warning``: transformers' ``warning_once`` in
GPT-2's loss; multi-rank, which CI runs on 2.13.0 only). Goes when Dynamo replays the calls to
``torch._dynamo.config.reorderable_logging_functions`` made in inlined frames too (register the logger
methods there instead), or traces a ``Logger`` method under ``fullgraph=True``.
"""

from __future__ import annotations

import logging
import sys

import torch.nn as nn


_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log", "warning_once",
                "info_once", "warning_advice")
_REAL: dict[str, logging.Logger] = {}  # logger name -> the module's real logger
_PENDING: list[tuple] = []  # (logger name, method, args, kwargs) logged by the last compiled call


class _DeferredLogger:
    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._name = logger.name
        _REAL[logger.name] = logger

    def __getattr__(self, name: str):  # everything but the logging methods: the real logger's
        return getattr(self._logger, name)


def _deferred(method: str):
    def log(self, *args, **kwargs):
        _PENDING.append((self._name, method, args, kwargs))

    log.__name__ = method
    return log


for _method in _LOG_METHODS:
    setattr(_DeferredLogger, _method, _deferred(_method))


def flush_logs() -> None:
    """Emit what the model logged during the compiled call, through the real loggers, in order."""
    pending = list(_PENDING)
    _PENDING.clear()
    for name, method, args, kwargs in pending:
        getattr(_REAL[name], method)(*args, **kwargs)


def install_logging(model: nn.Module) -> list[tuple[object, object]]:
    """``(module, stand-in)`` for the ``logger`` globals of the modules that define the model's classes,
    and of transformers (its base classes and losses log too): ``active`` swaps them in for one call."""
    names = {type(m).__module__ for m in model.modules()}
    names |= {n for n in sys.modules if n == "transformers" or n.startswith("transformers.")}
    out = []
    for name in sorted(names):
        module = sys.modules.get(name)
        logger = getattr(module, "logger", None) if module is not None else None
        if isinstance(logger, logging.Logger):
            out.append((module, _DeferredLogger(logger)))
    return out
