"""What torch.load is never handed: a pickle whose calls would allocate what its bytes do not hold.

torch's weights_only loader admits a few calls that allocate by a size argument, and ckpt's
numpy allow-list (RNG states) adds one more:

* `bytearray(n)`: n zero-filled bytes, from a 300-byte file;
* the legacy tensor and storage constructors (`torch.FloatTensor(n)`, `torch.Tensor(n)`,
  `UntypedStorage(n)`): a tensor of n uninitialised elements no byte of the file backs, which
  `convert` would write out (process memory) and `inspect` would list as real;
* a numpy array state that declares more elements than it carries: numpy 2.x crashes with
  SIGSEGV on an object array whose item list is short, whatever the size.

`check_torch_pickle` reads the same pickle first with ckpt's own restricted C unpickler
(`budgets.BudgetedUnpickler`: memo, hash flooding and lengths checked before it runs) in which
every global is an inert stand-in and these calls check their arguments; one that asks for
memory its bytes do not hold is refused (`FormatError` naming the file, exit 4), and a pickle
this reader cannot read whole is refused too (torch's reader reads no pickle this one cannot).
Nothing from the file is imported or run. `torch_pickles` finds the pickles torch.load would
read: every `data.pkl` of a zip, or the four leading pickles of a legacy (non-zip) file.
"""

from __future__ import annotations

import functools
import io
import pickle
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import OrderedDict
from typing import IO, Any

from ...budgets import ZIP_READ_ERRORS, BudgetedUnpickler, read_member
from ...dtypes import MAX_NDIM
from ...errors import FormatError

#: a pickle longer than this is not read (torch.save's pickle of 100,000 tensors is ~10 MB)
MAX_PICKLE_BYTES = 256 << 20
#: the pickles at the head of a legacy torch.save file: magic number, protocol version, system
#: info, the object itself (the storage keys and the raw storages follow)
_LEGACY_PICKLES = 4
#: bytes of a legacy file's head read at first; doubled up to `MAX_PICKLE_BYTES` while its
#: pickles run past them
_FIRST_WINDOW = 1 << 20

_FIX = (
    "torch.save never writes this; the file is corrupt or crafted. Do not trust where it came "
    "from; re-save the checkpoint from its source."
)


class _Refused(Exception):
    """A call of the pickle asks for what its bytes do not hold (args: why)."""


class Opaque:
    """Any global not checked here, and what it builds: accepts every call the unpickler makes."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque()

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _sized(value: Any) -> int | None:
    """The size an argument asks a constructor for: an int, or a sequence of ints (a shape)."""
    if type(value) is int:
        return value
    if isinstance(value, (tuple, list)) and value and all(type(v) is int for v in value):
        count = 1
        for v in value:
            count *= max(v, 0)
        return count
    return None


class _Constructor(Opaque):
    """A tensor or storage class (`torch.FloatTensor`, `torch.storage.UntypedStorage`...): fine
    as a value (a storage's type, `_rebuild_from_type_v2`'s new type), refused when called with
    a size, which allocates that many uninitialised elements."""

    original = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Constructor:
        for arg in args:
            size = _sized(arg)
            if size is not None:
                raise _Refused(
                    f"calls {cls.original}({size:,}), which allocates {size:,} uninitialised "
                    "elements that no byte of the file holds"
                )
        return object.__new__(cls)


@functools.cache
def _constructor(name: str) -> type[_Constructor]:
    return type(name.rsplit(".", 1)[1], (_Constructor,), {"original": name})


def _bytearray(*args: Any) -> Any:
    """`bytearray(str, "latin-1")` is how protocol 2 pickles one; `bytearray(n)` zero-fills n
    bytes."""
    for arg in args:
        if type(arg) is int:
            raise _Refused(f"calls bytearray({arg:,}), which fills {arg:,} bytes of memory")
    return Opaque()


def _encode(text: Any, encoding: Any = "utf-8", *rest: Any) -> Any:
    """`_codecs.encode(text, "latin1")`: how protocol 2 spells bytes (a numpy array's data)."""
    if isinstance(text, str) and encoding in ("latin1", "latin-1"):
        return text.encode("latin1")
    return Opaque()


class _ArrayState(Opaque):
    """numpy's `_reconstruct(ndarray, (0,), b'b')` (how `ndarray.__reduce__` starts an array):
    its state is checked against what it carries; nothing of numpy runs on it."""

    def __setstate__(self, state: Any) -> None:
        why = array_state_refused(state)
        if why is not None:
            raise _Refused(why)


def array_state_refused(state: Any) -> str | None:
    """Why a numpy array's pickled state (`ndarray.__setstate__`'s argument) is refused, or None.

    The state must carry what it declares: `(version, shape, dtype, fortran, data)` with data
    of exactly `prod(shape) * itemsize` bytes, or for an array of Python objects a list of
    exactly `prod(shape)` items (numpy 2.x reads past a shorter one: SIGSEGV). Shared by
    ckpt's reader of torch.save zips, which builds such arrays itself.
    """
    import numpy as np

    if not isinstance(state, tuple) or len(state) not in (4, 5):
        return "sets a numpy array's state to something other than the tuple numpy writes"
    shape, dtype, _, data = state[-4:]
    if not isinstance(dtype, np.dtype):
        return "sets a numpy array's state without a dtype"
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_NDIM
        or not all(type(v) is int and v >= 0 for v in shape)
    ):
        return f"declares a numpy array of shape {str(shape)[:80]}"
    count = 1
    for dim in shape:
        count *= dim
    if dtype.hasobject:
        if not isinstance(data, list) or len(data) != count:
            have = len(data) if isinstance(data, list) else 0
            return (
                f"declares a numpy array of {count:,} Python objects but carries {have:,} "
                "(numpy would read past them and crash)"
            )
        return None
    if not isinstance(data, (bytes, bytearray)) or len(data) != count * dtype.itemsize:
        have = len(data) if isinstance(data, (bytes, bytearray)) else 0
        return f"declares a numpy array of {count * dtype.itemsize:,} bytes but carries {have:,}"
    return None


def _reconstruct(subtype: Any = None, shape: Any = None, dtype: Any = None) -> Any:
    if shape != (0,):
        size = _sized(shape)
        raise _Refused(
            f"builds a numpy array of shape {str(shape)[:80]}"
            + (f" ({size:,} elements)" if size is not None else "")
            + " before its data, not as numpy pickles one"
        )
    return _ArrayState()


def numpy_allowlist() -> list[Any]:
    """numpy globals that only build arrays and scalars from bytes (RNG states hold them).

    transformers and accelerate allow-list the same ones for `rng_state.pth` and
    `random_states_*.pkl`; none of them can call arbitrary code.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return []
    core = getattr(np, "_core", None) or np.core
    allow: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    # files written under numpy 1.x name the same functions under `numpy.core`
    allow += [
        (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (core.multiarray.scalar, "numpy.core.multiarray.scalar"),
    ]
    for code in "?bBhHiIlLqQefdgFDGSUV":
        allow.append(type(np.dtype(code)))
    return allow


@functools.cache
def _numpy_globals() -> dict[str, Any]:
    """The numpy globals ckpt admits (`numpy_allowlist`), `_reconstruct` checked; the
    dtype classes are numpy's own (they only parse a dtype)."""

    named: dict[str, Any] = {}
    for item in numpy_allowlist():
        obj, name = item if isinstance(item, tuple) else (item, None)
        key = name or f"{obj.__module__}.{obj.__qualname__}"
        if key.endswith("._reconstruct"):
            named[key] = _reconstruct
        elif key.endswith(".scalar"):
            named[key] = Opaque
        else:
            named[key] = obj
    return named


_PLAIN = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("_codecs", "encode"): _encode,
}


class _PreflightUnpickler(BudgetedUnpickler):
    """Every global an inert stand-in; the allocating calls check their arguments."""

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 names Python 3's modules by their Python 2 names (`__builtin__`), which
        # torch's reader maps back as Python's own does
        module, name = NAME_MAPPING.get((module, name), (module, name))
        module = IMPORT_MAPPING.get(module, module)
        plain = _PLAIN.get((module, name))
        if plain is not None:
            return plain
        if module.startswith("numpy"):
            return _numpy_globals().get(f"{module}.{name}", Opaque)
        if module.startswith("torch") and (name.endswith(("Tensor", "Storage"))):
            return _constructor(f"{module}.{name}")
        return Opaque

    def persistent_load(self, pid: Any) -> Any:
        return Opaque()


def _refused(why: str, where: str) -> FormatError:
    return FormatError(
        f"holds a pickle that {why}; ckpt refuses it before torch.load reads it, nothing was "
        "executed",
        path=where,
        fix=_FIX,
    )


def _unreadable(why: str, where: str) -> FormatError:
    return FormatError(
        f"is not a readable torch.save file (its pickle does not read: {why[:200]})",
        path=where,
        fix="The file is truncated or corrupt; write or fetch it again.",
    )


def check_torch_pickle(data: bytes, where: str) -> None:
    """Refuse (FormatError naming `where`) a pickle torch.load must not be handed: one over a
    budget of `budgets`, one whose calls allocate what its bytes do not hold, or one this
    reader cannot read whole."""
    try:
        _PreflightUnpickler(data, where).load()
    except _Refused as exc:
        raise _refused(str(exc.args[0]), where) from None
    except FormatError:
        raise
    except RecursionError:
        raise _refused("nests containers deeper than Python can read", where) from None
    except Exception as exc:  # any bytes: what this reader cannot read, torch.load must not
        raise _unreadable(f"{type(exc).__name__}: {exc}", where) from None


def check_legacy_head(read: Any, size: int, where: str) -> None:
    """Check the leading pickles of a legacy (non-zip) torch.save file read by `read(offset, n)`
    (`check_torch_pickle` on each): its head is read in growing windows, at most
    `MAX_PICKLE_BYTES`, so a file of gigabytes of storages costs a few megabytes here."""
    window = _FIRST_WINDOW
    while True:
        head = read(0, min(size, window))
        cut = len(head) < size
        try:
            pos = 0
            for _ in range(_LEGACY_PICKLES):
                stream = io.BytesIO(head)
                stream.seek(pos)
                try:
                    _PreflightUnpickler(head[pos:], where, stream, complete=False).load()
                except _Refused as exc:
                    raise _refused(str(exc.args[0]), where) from None
                except (EOFError, pickle.UnpicklingError) as exc:
                    if cut and window < MAX_PICKLE_BYTES:
                        raise _NeedMore from exc
                    raise
                pos = stream.tell()
            return
        except _NeedMore:
            window *= 16
        except FormatError:
            raise
        except RecursionError:
            raise _refused("nests containers deeper than Python can read", where) from None
        except Exception as exc:
            if cut and window >= MAX_PICKLE_BYTES:
                raise FormatError(
                    f"holds a pickle longer than the {MAX_PICKLE_BYTES:,} bytes ckpt reads",
                    path=where,
                    fix="Re-save the checkpoint with torch.save (a zip file).",
                ) from None
            raise _unreadable(f"{type(exc).__name__}: {exc}", where) from None


class _NeedMore(Exception):
    """The head read so far cuts a pickle short: read a larger window."""


def check_zip_pickles(file: IO[bytes], where: str) -> None:
    """Check every `data.pkl` of the torch.save zip `file` (`check_torch_pickle`); each is read
    within `MAX_PICKLE_BYTES` (`budgets.read_member`). A zip this reader cannot open is refused
    too: what is not checked is not loaded."""
    try:
        archive = zipfile.ZipFile(file)
    except ZIP_READ_ERRORS as exc:
        raise _unreadable(f"{type(exc).__name__}: {exc}", where) from None
    with archive:
        for name in archive.namelist():
            if name.endswith("data.pkl"):
                try:
                    data = read_member(archive, name, MAX_PICKLE_BYTES, where)
                except ZIP_READ_ERRORS as exc:
                    raise _unreadable(f"{type(exc).__name__}: {exc}", where) from None
                check_torch_pickle(data, where)


def check_torch_blob(file: IO[bytes], size: int, where: str) -> None:
    """Check the pickles of the torch.save bytes `file` holds (a seekable file of `size` bytes: a
    DCP item), zip or legacy, as `check_zip_pickles` / `check_legacy_head` do; `file` is left
    at its start for torch.load."""
    file.seek(0)
    if file.read(4) == b"PK\x03\x04":
        file.seek(0)
        check_zip_pickles(file, where)
    else:

        def read(at: int, n: int) -> bytes:
            file.seek(at)
            return file.read(n)

        check_legacy_head(read, size, where)
    file.seek(0)
