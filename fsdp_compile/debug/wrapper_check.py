"""Static checks of Inductor's generated wrapper code for the collective discipline a GPU needs.

On NCCL a functional collective runs on its own stream: its output is valid only after its
``wait_tensor``, and its input must not be overwritten (or its memory reused) before then. A CPU run with
gloo cannot show a violation, because gloo's "async" collectives complete before the code goes on, so the
wrapper is read instead. ``check_wrapper(code)`` walks the ``call`` function and every region subgraph
function Inductor emitted (``def partitioned_*_subgraph_*(args)``), and reports

1. a collective output read before its wait (anything but a size, stride, alignment or metadata assert);
2. a collective input (or a view of it) written by a kernel, passed as ``out=``, or handed to another
   buffer by Inductor's memory reuse (``# reuse``) before the wait;
3. a collective output never waited on before the function returns;

and, per collective, how many kernels and matrix multiplies are launched between it and its wait: the
compute the schedule put behind it. A region subgraph call counts as the kernels and matmuls inside it.

Tested on torch 2.13's wrapper format (``fsdp-compile``'s GPU-codegen tier compiles our graphs for an
H100 and runs this on every wrapper); a line this does not recognize is treated as ordinary code.
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
_COLL = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.(" + "|".join(COLLECTIVES) + r")\.default\((\w+)")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)\)")
_FUNC = re.compile(r"^(\s*)def (\w+)\((?:self, )?args\):")
_KERNEL_DEF = re.compile(r"^def (triton_\w+)\(([^)]*)\)", re.M)
_RUN = re.compile(r"\b(triton_\w+)\.run\((.*)\)")
_MATMUL = re.compile(r"(?:extern_kernels|torch\.ops\.aten)\.(?:mm|addmm|bmm|baddbmm|_scaled_mm)(?:\.default)?\(")
_LAUNCH = re.compile(r"\.run\(|extern_kernels\.\w+\(|torch\.ops\.(?:aten|fsdp_compile)\.\w+\.\w+\(")
_ALIAS = re.compile(r"^\s*(\w+) = reinterpret_tensor\((\w+),")
_REUSE = re.compile(r"^\s*(\w+) = (?:reinterpret_tensor\()?(\w+)\b.*; del \2\b.*#\s*reuse")
_INERT = re.compile(r"assert_(?:size_stride|alignment|tensor_metadata)\(|^\s*del \w+\s*$")


@dataclasses.dataclass
class Collective:
    function: str  # "call" or the region subgraph's function name
    op: str
    output: str
    line: int
    waited_at: int | None = None
    kernels_between: int = 0
    matmuls_between: int = 0


@dataclasses.dataclass
class WrapperReport:
    collectives: list[Collective]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a call's argument text (parentheses nest)."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                break
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _functions(lines: list[str]) -> dict[str, tuple[int, list[tuple[int, str]]]]:
    """name -> (first line number, [(line number, line)]) for ``def X(args)`` / ``def call(self, args)``."""
    funcs, current, indent = {}, None, 0
    for i, line in enumerate(lines, 1):
        m = _FUNC.match(line)
        if m:
            current, indent = m[2], len(m[1])
            funcs[current] = (i, [])
            continue
        if current is None:
            continue
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            current = None
            continue
        funcs[current][1].append((i, line))
    return funcs


def check_wrapper(code: str) -> WrapperReport:
    lines = code.splitlines()
    written = {name: [p.split(":")[0].strip() for p in params.split(",")] for name, params in _KERNEL_DEF.findall(code)}
    written = {k: [i for i, p in enumerate(ps) if p.startswith(("out_ptr", "in_out_ptr"))] for k, ps in written.items()}
    funcs = _functions(lines)
    totals: dict[str, tuple[int, int]] = {}  # function -> (kernels, matmuls) launched in it, subgraphs included
    collectives: list[Collective] = []
    problems: list[str] = []

    def launched(code_part: str) -> tuple[int, int]:
        m = re.search(r"=\s*(\w+)\(", code_part)
        if m and m[1] in funcs:
            return walk(m[1])
        return (1 if _LAUNCH.search(code_part) else 0, 1 if _MATMUL.search(code_part) else 0)

    def writes(code_part: str) -> list[str]:
        """Argument texts this line writes: out= of extern kernels, out/in_out pointers of Triton kernels."""
        out = re.findall(r"\bout=([^,)]*\)?)", code_part)
        m = _RUN.search(code_part)
        if m and m[1] in written:
            args = _split_args(m[2])
            out += [args[i] for i in written[m[1]] if i < len(args)]
        return out

    def walk(name: str) -> tuple[int, int]:
        if name in totals:
            return totals[name]
        totals[name] = (0, 0)  # no recursion through a malformed self-call
        kernels = matmuls = 0
        pending: dict[str, Collective] = {}
        inputs: dict[str, dict[str, str]] = {}  # collective output -> {its input or a view of it: the input}
        for i, line in funcs[name][1]:
            code_part = line.split("#")[0] if "#" in line and "# reuse" not in line else line
            if not code_part.strip() or code_part.strip().startswith("#"):
                continue
            if (m := _WAIT.search(code_part)) and m[1] in pending:
                pending.pop(m[1]).waited_at = i
                inputs.pop(m[1], None)
                continue
            if m := _COLL.match(code_part):
                c = Collective(name, m[2], m[1], i)
                pending[m[1]], inputs[m[1]] = c, {m[3]: m[3]}
                collectives.append(c)
                continue
            if code_part.strip().startswith("return"):
                break
            k, mm = launched(code_part)
            kernels, matmuls = kernels + k, matmuls + mm
            for c in pending.values():
                c.kernels_between += k
                c.matmuls_between += mm
            if m := _ALIAS.match(code_part):
                for views in inputs.values():
                    if m[2] in views:
                        views[m[1]] = views[m[2]]
            reused = _REUSE.match(line)
            written_now = writes(code_part)
            for out, c in pending.items():
                if re.search(rf"\b{out}\b", code_part) and not _INERT.search(code_part):
                    problems.append(f"{name}:{i}: {c.op} output {out} (line {c.line}) used before its wait: {line.strip()[:120]}")
                for buf, base in inputs[out].items():
                    what = f"{c.op} input {base}" + (f" (through its view {buf})" if buf != base else "") + f" (line {c.line})"
                    if reused and reused[2] == buf:
                        problems.append(f"{name}:{i}: {what} reused before the wait: {line.strip()[:120]}")
                    if any(re.search(rf"\b{buf}\b", w) for w in written_now):
                        problems.append(f"{name}:{i}: {what} written before the wait: {line.strip()[:120]}")
        for out, c in pending.items():
            problems.append(f"{name}:{c.line}: {c.op} output {out} is never waited on before the function returns")
        totals[name] = (kernels, matmuls)
        return totals[name]

    for name in funcs:
        walk(name)
    collectives.sort(key=lambda c: c.line)
    return WrapperReport(collectives, problems)
