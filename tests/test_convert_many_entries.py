"""`convert --to dcp` of a checkpoint of many small entries (#30): what the conversion holds
beside the source it reads.

A user converts a `dcp.save` of thousands of tiny tensors. The source's entries are needed
while the data is copied; once it is, the records of what was written are all the report
needs, so the writer's `.metadata` and the check that reads the output back run without the
source's entries (nor the plan) alive beside them. Measured with tracemalloc (allocations,
deterministic), against what the opened source itself holds.
"""

from __future__ import annotations

import tracemalloc
import warnings
from pathlib import Path

import pytest

from ckpt_cli.formats import resolve_source
from ckpt_cli.ops.convert.run import convert
from ckpt_cli.sources.opening import open_source

from .dist_helpers import many_entries_dcp


def _traced(run: object) -> tuple[int, int]:
    """(bytes still held after `run()`, peak bytes while it ran), traced."""
    tracemalloc.start()
    try:
        result = run()  # type: ignore[operator]
        live, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return live, peak


@pytest.mark.slow  # tracemalloc over 3,000 entries: about a minute
def test_the_output_is_written_and_checked_without_the_source_entries(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    src = many_entries_dcp(tmp_path / "src", 3000)
    # a first conversion imports what a conversion uses: the traces below are the entries'
    convert(str(many_entries_dcp(tmp_path / "warm", 10)), str(tmp_path / "warm-out"), "dcp")

    def opened() -> object:
        with open_source(resolve_source(str(src))).checkpoint as checkpoint:
            return checkpoint.manifest

    source, _ = _traced(opened)
    _, peak = _traced(lambda: convert(str(src), str(tmp_path / "out"), "dcp"))
    # the copy holds the source, the plan and the writer's layout (a little over twice the
    # source); writing `.metadata` and reading it back with the source's entries still alive
    # took about three times
    assert peak < 2.5 * source, (peak, source)

    state = {f"layer.{i}.w": torch.zeros(4) for i in range(3000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(state["layer.2999.w"], torch.full((4,), 2999.0))
