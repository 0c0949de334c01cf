"""AOTAutograd's cache key for two kinds of graphs it cannot key (torch 2.13), while our compiles run.

* **An autograd Function in the graph.** Dynamo calls an ``allow_in_graph`` autograd Function (ours:
  ``_extensions.Attach``, TP's ``_DataParallelDTensor``, the region boundary's DTensor crossings; torchao's
  float8 matmul) through a trampoline it makes per class, a local function, which the key's import block
  cannot name: "Bypassing autograd cache due to: <function ...trampoline_autograd_apply...> was not found as
  torch._dynamo.variables.misc.produce_trampoline_autograd_apply.<locals>.trampoline_autograd_apply". Every
  warm start of a TP or float8 model then traced and partitioned the step again (the FX graph cache still
  served Inductor). Keyed here by the class's module, qualified name and source text, and its package's
  version (what the class calls: torchao's float8 code; our own source is in the key already, through our
  passes' ``uuid``), and by its ``fsdp_compile_key`` where it has one (the constants of a class made per use); a
  class whose source cannot be read still bypasses. AOTAutograd traces through the
  Function, so its cached graphs do not call it.
* **A DeviceMesh among the graph's inputs** (TP/EP layouts, an opaque object in 2.13): the key pickles the
  mesh itself, with the pickler's memo switched on midway, and the bytes differ from process to process,
  so a warm start missed. Keyed here by what a compiled graph depends on: device type, shape, ranks, dimension
  names and each dimension's process group name (the names the graph's collectives name).

* **A value class constructed in the graph** (a NamedTuple or a frozen dataclass: torchao's float8 Linear builds
  its ``ScaledMMConfig``, ``LinearMMConfig`` and ``CastConfig`` there wherever it runs outside a region): "Bypassing
  autograd cache due to: Unsupported call_function target <class '...ScaledMMConfig'>", so every warm start of a
  float8 model with a block compiled inline traced and partitioned the step again. Such a class only holds its
  (constant, so keyed) arguments, and AOTAutograd traces through it: ``value_classes`` names each for the node
  check, keyed by its source and its package's version, as a Function is.

``keys()`` patches the first two only while our backend compiles; ``MARKED`` is the name AOTAutograd's node check
reads for the trampoline (``torch._inductor.config.unsafe_marked_cacheable_functions``, set by the backend).
Checked on 2.13.0 (``tests/test_compile_cache.py``). Goes when Dynamo names its trampolines importably (or
keys the Function itself), DeviceMesh pickles the same in every process and the node check admits value classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import pickle
import sys

import torch

from fsdp_compile._torch import patched


MARKED = "torch._dynamo.variables.misc.trampoline_autograd_apply"


def _function_class(obj) -> type | None:
    """The autograd Function class of a Dynamo trampoline, or None."""
    if getattr(obj, "__name__", None) != "trampoline_autograd_apply" or not getattr(obj, "__closure__", None):
        return None
    for cell in obj.__closure__:
        value = cell.cell_contents
        if isinstance(value, type) and issubclass(value, torch.autograd.Function):
            return value
    return None


def _function_key(name: str, cls: type) -> str:
    return f"# cache_key_autograd_function {name}: {_class_key(cls)}"


@functools.lru_cache(maxsize=1024)
def _class_key(cls: type) -> str:
    """Once per class: the key pickles every node that calls one (a float8 block's weights, 7 a layer), and
    ``inspect.getsource`` of a class parses its module (3 ms a call for ``Attach``, 11 for a crossing's ``Direct``)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError) as e:  # AOTAutograd turns a pickling error into a bypass, as before
        raise pickle.PicklingError(f"{cls.__qualname__}: no source to key it by ({e})") from e
    # a class made per use holds its constants in a closure, which its source does not show: it names them
    # (``capture.boundary``'s crossings: the subclass's flatten context)
    source += getattr(cls, "fsdp_compile_key", "")
    digest = hashlib.sha256(source.encode()).hexdigest()
    package = sys.modules.get(cls.__module__.partition(".")[0])  # torchao: its version keys what the class calls
    version = getattr(package, "__version__", "")
    return f"{cls.__module__}.{cls.__qualname__} {digest} {version}"


def value_classes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The NamedTuples and frozen dataclasses that ``gm`` (or a subgraph of it) constructs, each as AOTAutograd's
    node check names it (``torch._inductor.config.unsafe_marked_cacheable_functions``) with its key; a class
    whose source cannot be read is left out (it bypasses, as before)."""
    # each class once: a float8 block builds its configs at every Linear, and a class without source is not
    # remembered by _class_key's cache (it raises), so each node would read its module's source again; in name
    # order, as the names enter the cache key (a set's order differs from process to process: a warm start missed)
    classes = {node.target for module in gm.modules() if isinstance(getattr(module, "graph", None), torch.fx.Graph)
               for node in module.graph.nodes if node.op == "call_function" and isinstance(node.target, type)}
    out = {}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        named_tuple = issubclass(cls, tuple) and hasattr(cls, "_fields")
        frozen = dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        if named_tuple or frozen:
            with contextlib.suppress(pickle.PicklingError):
                out[f"{cls.__module__}.{cls.__name__}"] = _class_key(cls)
    return out


def _mesh_key(mesh) -> tuple:
    return ("DeviceMesh", mesh.device_type, tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist(), mesh.mesh_dim_names,
            tuple(mesh.get_group(i).group_name for i in range(mesh.ndim)))


@contextlib.contextmanager
def keys():
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
    from torch._inductor import codecache
    from torch.distributed.device_mesh import DeviceMesh

    format_global = AOTAutogradCachePickler.__dict__.get("_format_global_for_cache_key")
    reduce_script_object = getattr(codecache.FxGraphCachePickler, "_reduce_fake_script_object", None)
    if not isinstance(format_global, staticmethod) or reduce_script_object is None or not hasattr(codecache, "_ident"):
        yield  # another torch: its own keys, as they are
        return

    def _format_global_for_cache_key(name, obj):
        cls = _function_class(obj)
        return _function_key(name, cls) if cls is not None else format_global.__func__(name, obj)

    def _reduce_fake_script_object(self, t):
        if isinstance(t.real_obj, DeviceMesh):
            return codecache._ident, (_mesh_key(t.real_obj), t.script_class_name)
        return reduce_script_object(self, t)

    with patched((AOTAutogradCachePickler, "_format_global_for_cache_key", staticmethod(_format_global_for_cache_key)),
                 (codecache.FxGraphCachePickler, "_reduce_fake_script_object", _reduce_fake_script_object)):
        yield
