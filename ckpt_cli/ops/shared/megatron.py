"""A Megatron-Core `torch_dist` source kept one in a DCP output (convert and reshard): its common
state stays in the source's own `common.pt` and `metadata.json` (`sources.layouts.megatron`)."""

from __future__ import annotations

from ...formats.base import Checkpoint
from ...models import Entry
from ...sources.layouts.megatron import MEGATRON_FILES, common_entries_to_keep
from .transfer import TransferPlan


def keep_megatron_layout(
    checkpoint: Checkpoint, plan: TransferPlan | list[Entry], to: str
) -> list[str]:
    """Keep a Megatron-Core torch_dist source one in a DCP output.

    `plan` is a `TransferPlan` (convert) or a list of entries (reshard). When the source is a
    Megatron save, the output is DCP and every common entry is kept under its own name, the
    common entries are removed from `plan` (in place) and the source files to copy into the
    output (`common.pt`, `metadata.json`) are returned; otherwise `plan` is untouched and the
    result is empty.
    """
    common = common_entries_to_keep(checkpoint, to)
    if not common:
        return []
    if isinstance(plan, list):
        kept = {e.name: e.name for e in plan}
    else:
        kept = {i.source.name: i.target.name for i in plan.items}
    if any(kept.get(name) != name for name in common):
        return []  # a filter dropped or renamed common state: no faithful common.pt
    if isinstance(plan, list):
        plan[:] = [e for e in plan if e.name not in common]
    else:
        plan.items = [i for i in plan.items if i.source.name not in common]
    return list(MEGATRON_FILES)
