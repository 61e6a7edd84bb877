"""DCP stream transforms: the `stream.zstd/1` extension (`ZStandard`) items are stored through."""

from __future__ import annotations

from typing import IO, Any

from ...errors import FormatError

#: DCP's `ZStandard` stream extension (`torch.distributed.checkpoint._extension`)
ZSTD_DESCRIPTOR = "stream.zstd/1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: what a compressed torch_save item may grow to beyond its tensor bytes (zip + pickle)
SAVE_OVERHEAD = 1 << 20
#: the cap for a compressed object entry: no decompression bomb exhausts memory
OBJECT_INFLATE_MAX = 256 << 20


def transform_of(descriptors: Any, name: str, where: str) -> str:
    """The transform an item's `transform_descriptors` name; only `stream.zstd/1.*` is read."""
    if isinstance(descriptors, (list, tuple)) and len(descriptors) == 1:
        registry, _, version = str(descriptors[0]).partition("/")
        if registry == "stream.zstd" and version.partition(".")[0] == "1":
            return "zstd"
    raise FormatError(
        f"entry {name!r} is stored through stream transforms {list(descriptors)!r}; this tool "
        f"reads {ZSTD_DESCRIPTOR} (DCP's ZStandard extension) only",
        path=where,
        fix="Save with FileSystemWriter(..., _extensions=[ZStandard()]) or without _extensions.",
    )


def inflate(source: IO[bytes] | bytes, limit: int, where: str, what: str) -> bytes:
    """Decompress one zstd-compressed DCP item (at most `limit` bytes, else FormatError)."""
    import zstandard

    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
        while True:
            piece = reader.read(1 << 20)
            if not piece:
                break
            out += piece
            if len(out) > limit:
                raise FormatError(
                    f"{what}: the zstd stream inflates past {limit} bytes, more than the item "
                    "can hold",
                    path=where,
                    fix="The file is corrupt or hostile; it was not loaded.",
                )
    except zstandard.ZstdError as exc:
        raise FormatError(
            f"{what}: not a valid zstd stream ({exc})",
            path=where,
            fix="The file is corrupt or truncated; use a complete copy of the checkpoint.",
        ) from None
    return bytes(out)


def inflate_head(stored: bytes, size: int) -> bytes | None:
    """The first `size` bytes a (possibly cut) zstd stream inflates to; None if it is not zstd."""
    import zstandard

    if not stored.startswith(ZSTD_MAGIC):
        return None
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
        return bytes(reader.read(size))
    except zstandard.ZstdError:
        return None
