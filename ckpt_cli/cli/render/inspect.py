"""Human rendering of `ckpt inspect`."""

from __future__ import annotations

import sys

from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from ...errors import with_fix
from ...models import Entry
from ...ops.inspect import InspectReport
from ...ops.shared.tree import TreeNode
from ...sizes import counted
from . import human_bytes, human_count, one_line, safe_text, shape_str, stderr, stdout

#: the tree stops unfolding below this many lines; --list shows everything
MAX_TREE_CHILDREN = 40


def _label(node: TreeNode) -> str:
    if node.children:
        counts = [
            counted(n, word)
            for n, word in ((node.tensors, "tensor"), (node.objects, "object"))
            if n
        ]
        return f"[bold]{one_line(node.name)}[/]  [dim]{', '.join(counts)}, {human_bytes(node.nbytes)}[/]"
    copies = node.tensors + node.objects
    if node.objects and not node.tensors:
        # a non-tensor leaf (step counter, hyper-parameter, RNG state): its Python type
        count = f" ×{copies}" if copies > 1 else ""
        kind = f"object:{node.dtype}" if node.dtype else "objects"
        return (
            f"{one_line(node.name)}  [magenta]{kind}[/]{count}  [dim]{human_bytes(node.nbytes)}[/]"
        )
    kind = node.dtype or "mixed"
    shape = shape_str(node.shape) if node.shape is not None else "various shapes"
    count = f" ×{copies}" if copies > 1 else ""
    return (
        f"{one_line(node.name)}  [cyan]{kind}[/] {shape}{count}  [dim]{human_bytes(node.nbytes)}[/]"
    )


def _add(tree: Tree, nodes: list[TreeNode]) -> None:
    for node in nodes[:MAX_TREE_CHILDREN]:
        branch = tree.add(_label(node))
        _add(branch, node.children)
    if len(nodes) > MAX_TREE_CHILDREN:
        tree.add(f"[dim]… {len(nodes) - MAX_TREE_CHILDREN} more (see --list)[/]")


def render_training(report: InspectReport) -> None:
    """The training-state block."""
    state = report.training
    if state is None:
        return
    verdict = (
        "[green]yes[/]" if state.resumable else f"[red]no[/] (missing: {', '.join(state.missing)})"
    )
    stdout.print(f"\n[bold]Training state[/] ({state.layout})")
    rows: list[tuple[str, str]] = []
    if state.step is not None or state.epoch is not None:
        rows.append(
            (
                "step / epoch",
                # an epoch is a float (the Trainer's 2.5); a whole one reads as the int it was
                f"{state.step if state.step is not None else '?'} / "
                f"{f'{state.epoch:g}' if state.epoch is not None else '?'}",
            )
        )
    if state.weights:
        rows.append(
            (
                "weights",
                f"{state.weights.get('tensors', 0)} tensors, {human_count(state.weights.get('parameters', 0))} params, {human_bytes(state.weights.get('bytes', 0))}",
            )
        )
    if state.optimizer is not None:
        opt = state.optimizer
        cover = f"{opt.params_with_state}/{opt.params}" if opt.params is not None else "?"
        rows.append(
            (
                "optimizer",
                f"{opt.kind or 'unknown'}: {', '.join(opt.states) or 'no state'} (params with state: {cover})",
            )
        )
    else:
        rows.append(("optimizer", "[dim]none[/]"))
    if state.schedulers:
        # several schedulers (accelerate's `scheduler_1.bin`...): one row each, named
        for name, summary in state.schedulers.items():
            rows.append((name, ", ".join(f"{k}={v}" for k, v in summary.items())))
    else:
        rows.append(
            (
                "scheduler",
                ", ".join(f"{k}={v}" for k, v in state.scheduler.items())
                if state.scheduler
                else "[dim]none[/]",
            )
        )
    rng = ", ".join(state.rng) if state.rng else "[dim]none[/]"
    if state.rng and state.rng_ranks:
        ranks = ", ".join(str(r) for r in state.rng_ranks)
        rng += f" ({len(state.rng_ranks)} rank{'s' if len(state.rng_ranks) != 1 else ''}: {ranks})"
    rows.append(("rng", rng))
    rows.append(
        (
            "data loader",
            ", ".join(f"{k}={v}" for k, v in state.dataloader.items())
            if state.dataloader
            else "[dim]none[/]",
        )
    )
    if state.components:
        rows.append(("components", ", ".join(f"{k}={v}" for k, v in state.components.items())))
    for rel, why in state.unreadable.items():
        rows.append(("unreadable", f"[yellow]{rel}[/]: {why}"))
    rows.append(("resumable", verdict))
    if state.resumable:
        rows.append(
            (
                "exact",
                "[green]yes[/]"
                if state.exact
                else f"[yellow]no[/] (missing: {', '.join(state.missing_exact)})",
            )
        )
    for key, value in rows:
        stdout.print(f"  {key:<12} {value}")


def render_quantization(report: InspectReport) -> None:
    """The quantization block: one line per scheme, then what is left unquantized."""
    quant = report.quantization
    if quant is None:
        return
    stdout.print(f"\n[bold]Quantization[/]  {escape(quant.label)}")
    config = quant.config
    if config.file:
        said = config.method or "?"
        if config.algo:
            said += f" {config.algo}"
        if config.block:
            said += f", weight_block_size {config.block}"
        stdout.print(f"  config       {escape(config.file)}: {escape(said)}")
    for group in quant.schemes:
        example = group.example
        stdout.print(
            f"  [cyan]{escape(group.label)}[/]  {group.modules} weights, "
            f"{human_count(group.parameters)} parameters, {human_bytes(group.stored_bytes)} stored"
        )
        stdout.print(
            f"    stored {group.stored_dtype} {shape_str(example.get('stored_shape', []))} + "
            + ", ".join(f"{r} {shape_str(s)}" for r, s in example.get("scales", {}).items())
            + f" -> logical {group.logical_dtype} {shape_str(example.get('logical_shape', []))}"
        )
        stdout.print(f"    [dim]{_first(group.patterns)}[/]")
    if quant.unquantized:
        stdout.print("  unquantized  " + _first(quant.unquantized))
    if quant.packed:
        stdout.print(
            "  packed       "
            + _first(quant.packed)
            + " [dim](packed values and their scales: kept as stored)[/]"
        )
    if quant.orphans:
        stdout.print(f"  [red]orphan scales[/] {_first(quant.orphans)}")


def _first(names: list[str], shown: int = 8) -> str:
    """The first `shown` names, escaped, then how many more there are (`--json` lists all)."""
    more = len(names) - shown
    return escape(", ".join(names[:shown])) + (f" … {more} more" if more > 0 else "")


def render_layout(report: InspectReport) -> None:
    """The library layout line, and one line per component of a multi-folder model."""
    layout = report.layout
    if layout is None:
        return
    stdout.print(f"  [bold]{layout.layout}[/]: {layout.description}", highlight=False)
    for comp in layout.components:
        what = (
            f"{counted(comp.tensors, 'tensor')}, {human_count(comp.parameters)} parameters, "
            f"{human_bytes(comp.bytes)}"
            if comp.tensors
            else "no weights"
        )
        kind = (comp.kind or "?").rsplit(".", 1)[-1]
        stdout.print(f"    {comp.name:<16} {kind}: {what}", highlight=False)


_LIST_COLUMNS = ("name", "kind/dtype", "shape", "bytes", "file")


def _entry_row(e: Entry) -> tuple[str, str, str, str, str]:
    """One `--list` record: name, dtype (or object type), shape (or short value), bytes, file."""
    return (
        one_line(e.name),
        (e.dtype or "") if e.kind == "tensor" else f"object:{e.py_type or '?'}",
        shape_str(e.shape)
        if e.kind == "tensor"
        else f"= {e.value!r}"
        if e.value is not None and len(repr(e.value)) <= 40
        else "",
        human_bytes(e.nbytes),
        one_line(e.file or ""),
    )


def _print_columns(rows: list[tuple[str, str, str, str, str]]) -> None:
    """The `--list` table off a terminal: the layout rich's borderless table has there (every
    column padded to its widest cell, two spaces apart, one record per line, no spaces after
    the last cell), written as plain lines. Rich measures and renders each cell (about 0.7 ms
    a row: minutes for 100,000 tensors); this is a few microseconds a row. Names are escaped
    as on the console and never read as markup."""
    from rich.cells import cell_len

    header = _LIST_COLUMNS
    escaped = [tuple(safe_text(cell) for cell in row) for row in rows]
    widths = [cell_len(h) for h in header]
    lengths = [[cell_len(cell) for cell in row] for row in escaped]
    for row_lengths in lengths:
        for i, n in enumerate(row_lengths):
            if n > widths[i]:
                widths[i] = n

    def line(cells: tuple[str, ...], sizes: list[int]) -> str:
        # (no padding after the last cell: a row ends at its last character)
        padded = "  ".join(c + " " * (w - n) for c, w, n in zip(cells, widths, sizes, strict=True))
        return padded.rstrip(" ")

    out = [line(header, [cell_len(h) for h in header])]
    out += [line(row, row_lengths) for row, row_lengths in zip(escaped, lengths, strict=True)]
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def render_inspect(report: InspectReport, show_tensors: bool) -> None:
    """Summary, training state, folded tree; every entry with `show_tensors`."""
    if report.run is not None:
        from .prune import render_run

        render_run(report.run)
        return
    files = len(report.files)
    kind = report.format
    if kind == "composite":
        # a training folder: its layout and the formats of its components
        formats = sorted(set(report.details.get("components", {}).values()) - {"json", "opaque"})
        kind = f"{report.details.get('layout', 'composite')}: {' + '.join(formats) or 'composite'}"
    stdout.print(f"[bold]{report.location}[/]  ({kind}, {files} file{'s' if files != 1 else ''})")
    dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in report.bytes_by_dtype.items()) or "-"
    stdout.print(
        f"  {counted(report.tensors, 'tensor')}, {human_count(report.parameters)} parameters, "
        f"{human_bytes(report.tensor_bytes)} ({dtypes})"
        + (f"; {report.objects} non-tensor entries" if report.objects else "")
    )
    if report.state_elements:
        # optimizer moments and other state are not parameters: their own figures
        parts = [f"{name} {human_count(n)}" for name, n in report.state_elements.items()]
        stdout.print(f"  state elements (not parameters): {', '.join(parts)}")
    if report.metadata:
        stdout.print(
            "  metadata: " + ", ".join(f"{k}={_shown_value(v)}" for k, v in report.metadata.items())
        )
    unsupported = report.details.get("unsupported_tensors") or {}
    if unsupported:
        listed = ", ".join(
            f"{escape(n)} ({escape(str(c))})" for n, c in list(unsupported.items())[:5]
        )
        more = f" … {len(unsupported) - 5} more" if len(unsupported) > 5 else ""
        stdout.print(
            f"  [yellow]{len(unsupported)} tensors of a dtype ckpt does not know, left out[/]: "
            f"{listed}{more}"
        )
    render_layout(report)
    if report.architecture is not None:
        arch = report.architecture
        where = f" (its {arch.component} component)" if arch.component else ""
        stdout.print(
            f"  architecture: {arch.title} ({arch.architecture}) in {arch.naming} names{where}",
            highlight=False,
        )
    if report.part_of is not None:
        stdout.print(f"  part of a larger checkpoint: {escape(report.part_of)}", highlight=False)
    if report.alias_of is not None:
        stdout.print(
            f"  alias of {escape(report.alias_of)}: a link to that folder, read as it",
            highlight=False,
        )
    for problem in report.problems:
        # on stderr, so the data on stdout stays what the file holds
        stderr.print(
            f"[yellow]ckpt inspect: warning:[/] malformed ({problem.code}): "
            f"{escape(with_fix(problem.message, problem.fix))}",
            highlight=False,
            soft_wrap=True,
        )
    compression = report.details.get("compression")
    if isinstance(compression, dict) and compression:
        stdout.print(
            "  compression: "
            + ", ".join(f"{k} ({counted(int(v), 'item')})" for k, v in compression.items())
        )
    megatron = report.details.get("megatron")
    if isinstance(megatron, dict):
        backend = ", ".join(f"{k}={v}" for k, v in megatron.get("metadata", {}).items())
        common = megatron.get("common", [])
        stdout.print(
            f"  Megatron-Core torch_dist: metadata.json {backend or 'missing'}; "
            f"common.pt {counted(len(common), 'key')}"
            + (f" ({', '.join(common[:8])}{', …' if len(common) > 8 else ''})" if common else "")
        )
    render_training(report)
    render_quantization(report)
    if show_tensors:
        rows = [_entry_row(e) for e in report.entries]
        stdout.print()
        if not stdout.on_terminal:
            _print_columns(rows)
            return
        table = Table(box=None, pad_edge=False, show_edge=False)
        for column in _LIST_COLUMNS:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*row)
        stdout.print(table)
        return
    if report.tree:
        tree = Tree("[bold]tree[/]", guide_style="dim")
        _add(tree, report.tree)
        stdout.print()
        stdout.print(tree)


#: the characters of a `__metadata__` value the text report shows (`--json` holds it whole): a
#: writer's note can be megabytes, a screen's worth of one line is enough to tell what it is
SHOWN_VALUE_CHARS = 200


def _shown_value(value: str) -> str:
    """`value`, cut at `SHOWN_VALUE_CHARS` with how long it is and where it is whole."""
    if len(value) <= SHOWN_VALUE_CHARS:
        return value
    return f"{value[:SHOWN_VALUE_CHARS]}… ({len(value):,} chars; --json shows it whole)"
