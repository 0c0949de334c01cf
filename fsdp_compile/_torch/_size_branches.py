"""Python branches on a data-dependent size (an unbacked symbol: split sizes read back after a collective).

transformers' ``AllToAllEP.__call__`` (its expert parallelism in training) dispatches tokens by an all-to-all of
sizes read with ``.tolist()``, then branches ``if tokens.shape[0] == 0``: eagerly, a rank that received no
tokens runs its experts on one summed row sliced to none, only so that autograd still reaches the reverse
all-to-all and FSDP's reduction. Dynamo cannot decide ``Eq(u0 + u1, 0)`` and, under ``fullgraph=True``, fails
("Could not guard on data-dependent expression"); without it, it would break the graph there, a break whose
two sides issue collectives on every rank. A compiled backward is one fixed graph: every collective in it runs
whatever the sizes, and the general path on zero rows computes what the size-zero path computes (no rows, zero
expert gradients). So at the branches listed in ``_GENERAL_PATH`` the capture takes the general path (what
``guard_or_false`` does: false unless provably true), on every rank alike. Any other data-dependent branch is
refused with ``SizeBranchRefused`` naming its file and line: we cannot tell that its two sides compute the same.

Checked on 2.13.0. Delete when Dynamo takes a size-oblivious path on such a branch, or transformers writes it
with ``guard_or_false``.
"""

from __future__ import annotations

import contextlib
import sys

from fsdp_compile._torch import patched, wrapped

# (module, qualified name) of the functions whose data-dependent ``size == 0`` branches take the general path
_GENERAL_PATH = {("transformers.distributed.expert_parallel", "AllToAllEP.__call__")}


class SizeBranchRefused(NotImplementedError):
    """A Python branch on a data-dependent size that the capture cannot take for every rank."""


def _codes() -> set:
    """The code objects of ``_GENERAL_PATH`` among the modules already imported (none is imported for it)."""
    codes = set()
    for module, qualname in _GENERAL_PATH:
        obj = sys.modules.get(module)
        for part in qualname.split(".") if obj is not None else ():
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "__code__"):
            codes.add(obj.__code__)
    return codes


def _general_side(expr) -> bool | None:
    """For ``Eq(sizes, 0)`` (the test for an empty tensor) False, for ``Ne(sizes, 0)`` True; else None."""
    import sympy

    if isinstance(expr, (sympy.Eq, sympy.Ne)) and expr.rhs == 0 and not expr.lhs.is_number:
        return isinstance(expr, sympy.Ne)
    return None


@contextlib.contextmanager
def general_path_on_empty():
    """While our step is traced: a listed ``size == 0`` branch on unbacked sizes takes the general path; any
    other branch on a data-dependent value is refused with its file and line."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables.tensor import SymNodeVariable
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    original = SymNodeVariable.evaluate_expr
    codes = _codes()

    def evaluate_expr(self, output_graph=None):
        try:
            return original(self, output_graph)
        except Exception as e:  # Dynamo's UserError raised while handling the guard error, or that error itself
            if not any(isinstance(x, GuardOnDataDependentSymNode) for x in (e, e.__context__)):
                raise
            tx = InstructionTranslator.current_tx().output.current_tx  # the innermost (inlined) frame
            expr = self.sym_num.node.expr
            side = _general_side(expr)
            if tx.f_code in codes and side is not None:
                return side  # undecidable (the guard failed): the general path, as guard_or_false / guard_or_true
            where = tx.frame_summary()
            raise SizeBranchRefused(
                f"fsdp_compile: a Python branch on the data-dependent value {expr} at {where.filename}:"
                f"{where.lineno} ({where.line}) cannot be captured in one graph for every rank: write it with "
                "torch.fx.experimental.symbolic_shapes.guard_or_false / guard_or_true where the general path is "
                "correct for every size, or torch._check(...) the value, or train this model with eager FSDP2"
            ) from e

    try:
        with patched((SymNodeVariable, "evaluate_expr", evaluate_expr)):
            yield
    except TorchDynamoException as e:
        cause = wrapped(e, SizeBranchRefused)
        if cause is None:
            raise
        raise SizeBranchRefused(str(cause)) from e
