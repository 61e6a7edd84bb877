"""Megatron-Core `torch_dist` checkpoints as output: a DCP written from one stays one.

Megatron-Core's `dist_checkpointing.save` (the `torch_dist` backend) writes a regular DCP
(`.metadata` + `__R_I.distcp`, the sharded tensors and objects) beside two files of its own:
`common.pt`, a `torch.save` of the state every rank shares (iteration, args, RNG...), and
`metadata.json`, the backend description `dist_checkpointing.load` reads first. ckpt reads
`common.pt`'s top-level keys as entries of the checkpoint (`formats/dcp.py`). Written as a
plain DCP those keys would land inside the `.distcp` files and Megatron's own loader fails
("no common.pt"); so when the source is a Megatron save and the output is DCP, the common
entries are left out of the DCP and the source's `common.pt` and `metadata.json` are copied
unchanged, published atomically with the rest (`keep_megatron_layout` is the hook convert and
reshard call).

The copy is verbatim because the common state is not sharded: resharding or converting the
tensors never changes it, and its nested structure (`args` as one dict) is what Megatron's
loader merges back into the state dict; ckpt's flattened names (`args.lr`) could not rebuild
it faithfully. When the user's filters drop or rename a common entry there is no faithful
`common.pt` to write, and the output stays the plain DCP it was before (all entries inside).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...formats.dcp.megatron import MEGATRON_LAYOUT
from ...formats.details import DcpDetails

if TYPE_CHECKING:
    from ...formats.base import Checkpoint
    from ...models import Entry
    from ...ops.shared.transfer import TransferPlan

#: Megatron-Core's own files beside the DCP ones
MEGATRON_FILES = ("common.pt", "metadata.json")


def _common_entries(checkpoint: Checkpoint) -> set[str] | None:
    """Names of the entries read from `common.pt`, or None when this is no Megatron save
    with both of its own files."""
    manifest = checkpoint.manifest
    details = DcpDetails.of(manifest)
    if details is None or details.layout != MEGATRON_LAYOUT:
        return None
    files = checkpoint.source.files
    if any(name not in files for name in MEGATRON_FILES):
        return None
    return {e.name for e in manifest.entries if e.file == MEGATRON_FILES[0] and e.offset is None}


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
    from ...formats import find_format

    target = find_format(to)
    if target is None or MEGATRON_LAYOUT not in target.layout_files:  # only DCP reads it back
        return []
    common = _common_entries(checkpoint)
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
