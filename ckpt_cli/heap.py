"""Pausing Python's cyclic garbage collector while a metadata path builds many small objects.

The metadata paths (a DCP `.metadata` of a million chunks, a manifest of 100,000 entries, a
reshard plan of a million chunks) build hundreds of thousands of small objects and no cycles.
With the cyclic GC on, each burst of allocations triggers collections over the whole growing
heap: on a 117,000-chunk DCP they cost a third of a reshard plan's CPU time. Reference counting
still frees everything as usual while the GC is paused; only cycles wait for it to resume.
Data paths (tensors read and written) never run paused.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC for the block (a no-op when it is already off), then restore it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: whether `pause_start_up` paused the collector (and `end_start_up` has yet to resume it)
_start_up_paused = False


def pause_start_up() -> None:
    """Pause the cyclic GC while a `ckpt` process starts (the CLI's entry point, first thing).

    Importing typer, pydantic, rich and ckpt's own modules and parsing the arguments make a
    few hundred thousand objects that live as long as the process; with the GC on, each burst
    of them triggers a young-generation collection (some 70 of them before a metadata
    command's work begins), every one finding nothing to free.
    """
    global _start_up_paused
    if gc.isenabled():
        gc.disable()
        _start_up_paused = True


def end_start_up() -> None:
    """Resume the GC `pause_start_up` paused, with every object made so far frozen
    (`gc.freeze`): collections from then on, and the one at exit, skip the modules, classes
    and schemas of the start-up. A no-op when nothing was paused (a library caller)."""
    global _start_up_paused
    if _start_up_paused:
        _start_up_paused = False
        gc.freeze()
        gc.enable()
