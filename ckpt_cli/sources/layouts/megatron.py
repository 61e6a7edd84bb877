"""Megatron-Core `torch_dist` checkpoints as output: a DCP written from one stays one.

Megatron-Core's `dist_checkpointing.save` (the `torch_dist` backend) writes a regular DCP
(`.metadata` + `__R_I.distcp`, the sharded tensors and objects) beside two files of its own:
`common.pt`, a `torch.save` of the state every rank shares (iteration, args, RNG...), and
`metadata.json`, the backend description `dist_checkpointing.load` reads first. ckpt reads
`common.pt`'s top-level keys as entries of the checkpoint (`formats/dcp.py`). Written as a
plain DCP those keys would land inside the `.distcp` files and Megatron's own loader fails
("no common.pt"); so when the source is a Megatron save and the output is DCP, the common
entries are left out of the DCP and the source's `common.pt` and `metadata.json` are copied
unchanged, published atomically with the rest (`ops.shared.megatron.keep_megatron_layout` is
the hook convert and reshard call).

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


def common_entries_to_keep(checkpoint: Checkpoint, to: str) -> set[str]:
    """The entries of a Megatron-Core save's `common.pt` that an output in format `to` keeps as
    the source's own files (`MEGATRON_FILES`, copied verbatim): every one when `to` reads the
    layout back (DCP) and the source is such a save with both of its files, else none."""
    from ...formats import find_format

    target = find_format(to)
    if target is None or MEGATRON_LAYOUT not in target.layout_files:  # only DCP reads it back
        return set()
    return _common_entries(checkpoint) or set()
