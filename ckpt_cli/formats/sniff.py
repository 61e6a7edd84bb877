"""What a file is, from its first bytes: for error messages that say more than "corrupt".

When a file is not the format its name (or `--format`) says, the message should say what it
is instead (text, empty, a ZIP archive, another checkpoint format) and what to do.
"""

from __future__ import annotations

import struct

#: how many leading bytes `what_is` looks at
SNIFF_BYTES = 64


def what_is(head: bytes, size: int | None = None) -> str:
    """A short description of a file from its first bytes: `a text file ("hello…")`."""
    if size == 0 or not head:
        return "an empty file"
    if head.startswith(b"PK\x03\x04"):
        return "a ZIP archive (the torch.save format)"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    if head.startswith(b"GGUF"):
        return "a GGUF file"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file (Keras .h5?)"
    if len(head) >= 9 and head[8:9] == b"{":
        (length,) = struct.unpack("<Q", head[:8])
        if size is None or length <= size:
            return "a safetensors file"
    if is_pickle(head):
        return "a plain pickle (legacy torch.save or pickle.dump)"
    text = _as_text(head)
    if text is not None:
        shown = text.strip().splitlines()[0][:32] if text.strip() else ""
        kind = "a JSON file" if text.lstrip().startswith(("{", "[")) else "a text file"
        return f"{kind} (it starts {shown!r})" if shown else kind
    return "binary data of an unknown kind (it starts " + head[:8].hex(" ") + ")"


def is_pickle(head: bytes) -> bool:
    """Whether the bytes start a pickle of protocol 2 to 5 (what the legacy torch.save format,
    before its zip, and `pickle.dump` write)."""
    return head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")


def _as_text(head: bytes) -> str | None:
    # the cut may fall inside a multi-byte character: drop an incomplete tail
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in text)
        return text if text and printable / len(text) > 0.95 else None
    return None
