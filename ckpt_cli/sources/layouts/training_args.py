"""A Hugging Face Trainer's `training_args.bin`, read without unpickling it: the plain fields
(`save_only_model`, `gradient_accumulation_steps`...) from the pickle's opcodes alone."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from ...formats.base import Source

#: the opcodes that push a plain value: their own value, or the one they carry as argument
_CONSTANT_OPS: dict[str, Any] = {"NEWTRUE": True, "NEWFALSE": False, "NONE": None}
_VALUE_OPS = frozenset(
    ("BININT", "BININT1", "BININT2", "LONG1", "INT", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE")
)

#: one opcode as `pickletools.genops` yields it: (its info, its argument, its position)
_Op = tuple[Any, Any, Any]


def training_arg_values(source: Source, rel: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Plain fields (bool, int, float, str, None) of a Trainer's `training_args.bin`, read from
    the pickle's opcodes alone; a string enum (`lr_scheduler_type`: `SchedulerType('cosine')`,
    its class then its value) is read as its value; fields stored otherwise (lists) are left out.

    The file is a torch.save zip of transformers' `TrainingArguments`; nothing in it is ever
    unpickled (it would import and run transformers code). Its `data.pkl` stores the dataclass
    fields as key, value pairs, so the opcode after a field's name string is its value.
    """
    import io
    import pickletools
    import zipfile

    size = source.storage.size(rel)
    if size > 16 << 20:
        return {}
    data = source.storage.read_all(rel)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if member is None or archive.getinfo(member).file_size > 16 << 20:
                return {}
            data = archive.read(member)
    except zipfile.BadZipFile:
        pass  # an old-style (non-zip) torch.save: the pickle itself
    # streamed, never listed: a 16 MiB pickle of one-byte opcodes would list 16M tuples; the
    # memo bookkeeping between a key and its value carries no data
    memo = ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE")
    ops = (op for op in pickletools.genops(data) if op[0].name not in memo)
    wanted = set(names)
    found: dict[str, Any] = {}
    try:
        for (key_op, arg, _), (op, value, _), (then, enum_value, _) in _triples(ops):
            if key_op.name not in ("SHORT_BINUNICODE", "BINUNICODE") or arg not in wanted:
                continue
            if arg in found:
                continue  # the first occurrence is the field (later ones are values elsewhere)
            if op.name in _CONSTANT_OPS:
                found[arg] = _CONSTANT_OPS[op.name]
            elif op.name in _VALUE_OPS:
                found[arg] = value
            elif op.name == "GLOBAL" and then.name in ("SHORT_BINUNICODE", "BINUNICODE"):
                found[arg] = enum_value  # an enum's class (never imported), then its value
    except Exception:
        return {}
    return found


def _triples(ops: Iterator[_Op]) -> Iterator[tuple[_Op, _Op, _Op]]:
    """Each opcode with the two that follow it (a field's value is at most two opcodes on;
    the pickle's last two opcodes, its STOP among them, begin no field)."""
    pairs = itertools.pairwise(ops)
    for (first, second), (_, third) in itertools.pairwise(pairs):
        yield first, second, third
