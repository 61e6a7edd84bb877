"""Megatron-Core `dist_checkpointing` (torch_dist backend): `common.pt` and `metadata.json` beside a DCP."""

from __future__ import annotations

import json
from typing import Any

from ...models import Entry
from ...storage import Storage
from .layout import MEGATRON_COMMON, MEGATRON_METADATA, Layout
from .peek import peek_saved_mapping

#: the layout name the DCP details carry for a Megatron-Core torch_dist save
MEGATRON_LAYOUT = "megatron_torch_dist"
_MEGATRON_COMMON_MAX = 256 << 20
_MEGATRON_METADATA_MAX = 1 << 20


def read_megatron_common(storage: Storage, listing: dict[str, int], layout: Layout) -> None:
    """Megatron-Core torch_dist: `metadata.json` (backend names) and `common.pt` (the state
    every rank shares: iteration, args, ...), whose top-level keys Megatron merges into the
    sharded state on load. Each key becomes an object entry read from `common.pt`; the peek
    uses no torch and resolves no global (`peek_saved_mapping`)."""
    if MEGATRON_METADATA not in listing and MEGATRON_COMMON not in listing:
        return
    info: dict[str, Any] = {}
    if MEGATRON_METADATA in listing:
        try:
            if listing[MEGATRON_METADATA] > _MEGATRON_METADATA_MAX:
                raise ValueError("larger than 1 MiB")
            doc = json.loads(storage.read_all(MEGATRON_METADATA))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            layout.problem(
                "megatron_metadata",
                f"{MEGATRON_METADATA} is not Megatron-Core's backend description ({exc})",
                file=MEGATRON_METADATA,
            )
            doc = {}
        info["metadata"] = {k: v for k, v in doc.items() if isinstance(v, (str, int, float))}
        if doc.get("sharded_backend") not in (None, "torch_dist"):
            layout.problem(
                "megatron_backend",
                f"{MEGATRON_METADATA} names sharded backend {doc.get('sharded_backend')!r}; "
                "only torch_dist (a DCP) is read",
                file=MEGATRON_METADATA,
            )
    if MEGATRON_COMMON not in listing:
        layout.problem(
            "megatron_missing_common",
            f"{MEGATRON_COMMON} is missing: Megatron-Core keeps the state every rank shares "
            "(iteration, args...) in it, and its load needs it",
            file=MEGATRON_COMMON,
        )
        layout.megatron = info
        return
    keys = None
    if listing[MEGATRON_COMMON] <= _MEGATRON_COMMON_MAX:
        keys = peek_saved_mapping(
            storage.read_all(MEGATRON_COMMON), storage.describe(MEGATRON_COMMON)
        )
    if keys is None:
        layout.problem(
            "megatron_common",
            f"{MEGATRON_COMMON} is not a torch.save file of a dict with string keys (or is "
            "larger than 256 MiB)",
            file=MEGATRON_COMMON,
        )
        keys = {}
    taken = {e.name for e in layout.entries}
    for key, (py_type, value) in keys.items():
        if key in taken:
            layout.problem(
                "megatron_common_clash",
                f"{MEGATRON_COMMON} key {key!r} is also a sharded entry; the sharded one is read",
                file=MEGATRON_COMMON,
                tensor=key,
                severity="warning",
            )
            continue
        layout.entries.append(
            Entry.checked(
                name=key,
                kind="object",
                dtype=None,
                shape=[],
                nbytes=0,
                file=MEGATRON_COMMON,
                offset=None,
                chunks=None,
                py_type=py_type,
                value=value,
            )
        )
    info["common"] = sorted(keys)
    layout.megatron = info
