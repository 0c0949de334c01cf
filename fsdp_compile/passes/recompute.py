"""Recompute tagging, a joint-graph pass: ``reshard_after_forward=True`` re-gathers in backward.

Every node of such a group's unshard chain (copy-in, all-gather, wait, copy-out) becomes
``MUST_RECOMPUTE``, so the partitioner saves only the local shards and replays the chain in backward, as
FSDP2's pre-backward unshard does. Groups with ``reshard_after_forward=False`` keep the partitioner's
default for collectives (``force_save_collectives``: the gathered buffer is saved for backward).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._annotations import chains, fsdp_group


def tag_unshard_recompute(graph: fx.Graph, reshard: Mapping[str, bool]) -> int:
    """Tag, in place, the unshard chains of the FSDP groups ``reshard`` maps to True; returns the count."""
    tagged = 0
    for node in chains(graph)[0]:
        if reshard.get(fsdp_group(node), False):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged
