"""Which tests need the `frameworks` extra, found from the code rather than by hand.

A test needs a framework (transformers, accelerate, peft, diffusers, DeepSpeed, megatron-core,
torchtitan, sentence-transformers...) when its function, one of its fixtures, or a function of
the same module either of them calls (followed to a fixed point) imports one, also inside a
script string it hands to a subprocess. `conftest.py` marks such tests `frameworks`, so the fast
loop (`make test-fast`, `-m "not frameworks and not torchrun and not slow"`) leaves them out,
and skips them with the reason when the extra is not installed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

#: the import names of the `frameworks` extra (and of DeepSpeed / torchtitan, which the
#: Makefile installs beside it)
FRAMEWORKS = (
    "transformers",
    "accelerate",
    "peft",
    "diffusers",
    "sentence_transformers",
    "deepspeed",
    "megatron",
    "torchtitan",
    "compressed_tensors",
)

_IMPORT = re.compile(r"\b(?:from|import)\s+(" + "|".join(FRAMEWORKS) + r")\b")
_IMPORTORSKIP = re.compile(r"importorskip\(\s*[\"'](" + "|".join(FRAMEWORKS) + r")\b")


class _Source:
    """A module's source split into lines once: `ast.get_source_segment` splits the whole
    source again for every node it is asked about (quadratic: ~20 s of collection)."""

    def __init__(self, source: str) -> None:
        self.lines: list[str] = []
        start = 0
        for end in re.finditer(r"\r\n|\r|\n", source):  # the line ends `ast` counts
            self.lines.append(source[start : end.end()])
            start = end.end()
        self.lines.append(source[start:])

    def segment(self, node: ast.stmt) -> str:
        """The source text of `node` (its offsets count UTF-8 bytes, as `ast`'s do)."""
        end_lineno, end_col = node.end_lineno or node.lineno, node.end_col_offset or 0
        first = self.lines[node.lineno - 1].encode()
        if end_lineno == node.lineno:
            return first[node.col_offset : end_col].decode()
        middle = "".join(self.lines[node.lineno : end_lineno - 1])
        last = self.lines[end_lineno - 1].encode()[:end_col].decode()
        return first[node.col_offset :].decode() + middle + last


@functools.cache
def _parsed(path: str) -> tuple[ast.Module, _Source]:
    source = Path(path).read_text(encoding="utf-8")
    return ast.parse(source), _Source(source)


@functools.cache
def _everywhere(path: str) -> frozenset[str]:
    """The frameworks a module imports at its top, or asks for with importorskip there: every
    test of the module needs them."""
    tree, text = _parsed(path)
    found: set[str] = set()
    for node in tree.body:
        segment = text.segment(node)
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= set(_IMPORT.findall(segment))
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found |= set(_IMPORTORSKIP.findall(segment))
    return frozenset(found)


def _pytestmark_names(tree: ast.Module) -> set[str]:
    """The marks a module's top-level `pytestmark = ...` names (`pytest.mark.NAME`)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets
        ):
            for sub in ast.walk(node.value):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "mark"
                ):
                    names.add(sub.attr)
    return names


def module_marks(path: str) -> frozenset[str]:
    """The marks every test of a test module carries, read without importing it: `frameworks`
    when the module imports one at its top, and what its `pytestmark` names. Empty when the
    file cannot be read."""
    try:
        tree, _ = _parsed(path)
        marks = _pytestmark_names(tree)
        if _everywhere(path):
            marks.add("frameworks")
    except (OSError, SyntaxError):
        return frozenset()
    return frozenset(marks)


@functools.cache
def _module_graph(path: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per top-level function (or named constant, such as a script string) of a module: the
    frameworks it imports itself, and the names it uses (only the module's own matter)."""
    tree, text = _parsed(path)
    imports: dict[str, set[str]] = {}
    uses: dict[str, set[str]] = {}
    # a framework the module imports at its top, or asks for with importorskip, is needed by all
    everywhere = set(_everywhere(path))
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        segment = text.segment(node)
        used = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}
        for name in names:
            imports[name] = set(_IMPORT.findall(segment)) | everywhere
            uses[name] = used - {name}
    return imports, uses


@functools.cache
def _tainted(path: str) -> dict[str, frozenset[str]]:
    """Per top-level function of a module, every framework it needs through its own calls."""
    imports, calls = _module_graph(path)
    needs = {name: set(found) for name, found in imports.items()}
    changed = True
    while changed:  # a fixed point over the module's call graph
        changed = False
        for name, called in calls.items():
            for callee in called & needs.keys():
                if not needs[callee] <= needs[name]:
                    needs[name] |= needs[callee]
                    changed = True
    return {name: frozenset(found) for name, found in needs.items()}


def frameworks_needed(path: str | None, function_name: str) -> frozenset[str]:
    """The frameworks a module-level function needs (empty when unknown)."""
    if path is None or not path.endswith(".py"):
        return frozenset()
    try:
        return _tainted(path).get(function_name, frozenset())
    except (OSError, SyntaxError):
        return frozenset()


@functools.cache
def installed(name: str) -> bool:
    """Whether a framework can be imported here (without importing it)."""
    return importlib.util.find_spec(name) is not None
