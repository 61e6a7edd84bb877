"""Human rendering of `ckpt diff`: the verdict first, then the largest differences."""

from __future__ import annotations

from ...ops.diff.run import DiffReport, EntryDiff
from . import shape_str, stdout

#: differences shown before the rest are counted (all of them are in --json)
MAX_SHOWN = 15


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def describe(d: EntryDiff) -> str:
    """One line for one differing pair."""
    if d.status == "kind":
        return f"{d.kind_a} in A, {d.kind_b} in B"
    if d.status == "shape":
        return f"shape {shape_str(d.shape_a or [])} → {shape_str(d.shape_b or [])}"
    if d.status == "value":
        return f"{d.value_a} → {d.value_b}"
    text = f"{d.dtype_a} {shape_str(d.shape_a or [])}"
    if d.status == "dtype":
        text = f"dtype {d.dtype_a} → {d.dtype_b} {shape_str(d.shape_a or [])}"
    if d.differing:
        text += (
            f"  {d.differing}/{d.numel} elements differ, max abs {_num(d.max_abs)},"
            f" max rel {_num(d.max_rel)}"
        )
        if d.outside_tolerance is not None:
            text += f", {d.outside_tolerance} outside tolerance"
    return text


def _names(label: str, names: list[str]) -> None:
    if not names:
        return
    shown = ", ".join(names[:MAX_SHOWN])
    more = f" … {len(names) - MAX_SHOWN} more" if len(names) > MAX_SHOWN else ""
    stdout.print(f"  only in {label} ({len(names)}): {shown}{more}", highlight=False)


def _aliases(report: DiffReport) -> None:
    """Tied names: which name is an alias of which tensor, on which side, recorded how."""
    if not report.aliases:
        return
    stdout.print(f"  aliases ({len(report.aliases)}): tied names, one tensor", highlight=False)
    for a in report.aliases[:MAX_SHOWN]:
        how = [
            f"{side}: {recorded}"
            + (", stored once: compared with it" if a.written_once == side.lower() else "")
            for side, recorded in (("A", a.recorded_a), ("B", a.recorded_b))
            if recorded
        ]
        stdout.print(
            f"    {a.name} = {a.target}  ({'; '.join(how)})", highlight=False, markup=False
        )
    if len(report.aliases) > MAX_SHOWN:
        stdout.print(f"    … {len(report.aliases) - MAX_SHOWN} more (see --json)")


def _naming(report: DiffReport) -> None:
    """How names were mapped between two namings, and what has no counterpart."""
    mapping = report.naming
    if mapping is None:
        return
    for side, naming, transforms in (
        ("A", mapping.naming_a, mapping.transforms_a),
        ("B", mapping.naming_b, mapping.transforms_b),
    ):
        if transforms:
            how = ", ".join(f"{n} {t}" for t, n in transforms.items())
            stdout.print(
                f"  names mapped: {side}'s {mapping.title} {naming} names read as "
                f"{mapping.compared_in} names ({how})",
                highlight=False,
                markup=False,
            )
    for side, left_out in (("A", mapping.left_out_a), ("B", mapping.left_out_b)):
        by_reason: dict[str, list[str]] = {}
        for item in left_out:
            by_reason.setdefault(item.reason, []).append(item.name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
            stdout.print(
                f"  not compared, no counterpart in the {mapping.compared_in} naming: "
                f"{side} {len(names)} × {reason} ({shown})",
                highlight=False,
                markup=False,
            )


def render_diff(report: DiffReport) -> None:
    """Verdict, the two sides, the largest differences, names on one side only."""
    colour = "green" if report.identical else "red"
    stdout.print(f"[bold {colour}]{report.verdict}[/]")
    stdout.print(f"  A  {report.a}  [dim]({report.format_a})[/]", highlight=False)
    stdout.print(f"  B  {report.b}  [dim]({report.format_b})[/]", highlight=False)
    _naming(report)
    if report.atol is not None or report.rtol is not None:
        stdout.print(f"  tolerance: atol={report.atol or 0:g}, rtol={report.rtol or 0:g}")
    if report.components:
        parts = [f"{name} ({n})" for name, n in report.components.items()]
        stdout.print("  differs in: " + ", ".join(parts), highlight=False)
    if report.differences:
        stdout.print("[bold]largest differences[/]")
        width = min(60, max(len(d.name) for d in report.differences[:MAX_SHOWN]))
        for d in report.differences[:MAX_SHOWN]:
            stdout.print(f"  {d.name:<{width}}  {describe(d)}", highlight=False, markup=False)
        if len(report.differences) > MAX_SHOWN:
            stdout.print(f"  … {len(report.differences) - MAX_SHOWN} more (see --json)")
    if report.quant_errors:
        sides = ", ".join(f"{n} in {side.upper()}" for side, n in report.dequantized.items())
        stdout.print(f"[bold]dequantized weights[/] ({sides}), worst relative RMS error first")
        width = min(60, max(len(e.name) for e in report.quant_errors[:MAX_SHOWN]))
        for e in report.quant_errors[:MAX_SHOWN]:
            stdout.print(
                f"  {e.name:<{width}}  {e.scheme:<10} rel RMS {e.rel_rms:.3e}  max abs {e.max_abs:.3e}",
                highlight=False,
                markup=False,
            )
        if len(report.quant_errors) > MAX_SHOWN:
            stdout.print(f"  … {len(report.quant_errors) - MAX_SHOWN} more (see --json)")
    if report.metadata:
        stdout.print(f"[bold]metadata[/] ({len(report.metadata)} keys differ)")
        for m in report.metadata[:MAX_SHOWN]:
            a = "absent" if m.value_a is None else m.value_a
            b = "absent" if m.value_b is None else m.value_b
            stdout.print(f"  {m.key}  {a} → {b}", highlight=False, markup=False)
        if len(report.metadata) > MAX_SHOWN:
            stdout.print(f"  … {len(report.metadata) - MAX_SHOWN} more (see --json)")
    _names("A", report.only_a)
    _names("B", report.only_b)
    _aliases(report)
    if report.differ_within:
        stdout.print(f"  {report.differ_within} entries differ within tolerance")
