"""Our passes' records, carried through torch's compile caches.

A compile that Inductor's FX graph cache or AOTAutograd's cache serves skips our passes, so nothing would
record what the graphs hold: a warm process reported 0 collectives. Each compiled Dynamo graph's
``PassRecord``s (forward and backward, without the readable stages) are stored beside Inductor's cache,
under a key over what the cached artifacts depend on (the Dynamo graph, its inputs' metadata, our passes'
key and source, torch's version), and read back when a cache serves the compile. They also travel in
``torch.compiler.save_cache_artifacts`` as an artifact of their own type (``fsdp_compile``), so a process
that starts from loaded artifacts reports the same; import ``fsdp_compile`` before
``load_cache_artifacts`` so that the type is known.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch
from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

_TYPE = "fsdp_compile"


def _directory() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fsdp_compile")


def graph_key(gm: torch.fx.GraphModule, example_inputs, passes_key: str) -> str:
    """What a cached compile of ``gm`` depends on, as far as our records go."""
    inputs = [
        (tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type, t.requires_grad)
        if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]
    # the graph's code without comments: they hold stack traces and per-process counters (region call ids)
    code = [line for line in gm.print_readable(print_output=False).splitlines() if not line.lstrip().startswith("#")]
    text = repr((code, inputs, passes_key, torch.__version__))
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str) -> dict | None:
    """``{"forward": PassRecord fields, "backward": ...}`` as stored (either may be missing), or None."""
    try:
        with open(os.path.join(_directory(), key + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def store(key: str, record) -> None:
    """Add one ``PassRecord`` (its kind's slot) to the entry of ``key``, on disk and in the mega-cache."""
    entry = load(key) or {}
    entry[record.kind] = {**dataclasses.asdict(record), "stages": [], "cached": True}
    content = json.dumps(entry).encode()
    _write(key, content)
    CacheArtifactManager.record_artifact(_TYPE, key, content)


def _write(key: str, content: bytes) -> None:
    directory = _directory()
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{key}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(content)
    os.replace(tmp, os.path.join(directory, key + ".json"))  # atomic: ranks may share one cache directory


@CacheArtifactFactory.register
class RecordArtifact(CacheArtifact):
    """Our records in ``save_cache_artifacts``' bundle: ``load_cache_artifacts`` writes them back."""

    def populate_cache(self) -> None:
        _write(self.key, self.content)

    @staticmethod
    def type() -> str:
        return _TYPE
