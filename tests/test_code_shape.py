"""The shape of the package's code (issue #26): no module reaches into another's private names.

A name with a leading underscore is private to the module that defines it. A name another module
needs is part of the defining module's interface and is public: `from .plan import extras`, not
`from .plan import _extras`. These checks parse every module of `ckpt_cli/` with `ast` (nothing is
imported) and list each place that breaks the rule, so a failure names the file and line to fix.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from .parsed import parse

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_cli"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    """`_name` is private; dunder names (`__version__`, `__all__`) are not."""
    return name.startswith("_") and not name.startswith("__")


def _imported_from(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module an `ImportFrom` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()  # a module's relative imports start at its package
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def cross_module_private_uses(source: str, path: Path) -> list[str]:
    """Each place in `source` (the module at `path`) that uses another `ckpt_cli` module's private
    name: `from X import _name` (the package's `__init__` included) and `X._name` on an imported
    module `X`."""
    tree = parse(source, str(path))
    place = path.relative_to(PACKAGE.parent)
    found: list[str] = []
    modules: set[str] = set()  # local names bound to ckpt_cli modules (or names from them)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _imported_from(node, path)
            if source.split(".")[0] != "ckpt_cli":
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{place}:{node.lineno}: from {source} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ckpt_cli":
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{place}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_the_scan_sees_private_imports_and_module_attributes() -> None:
    # the checker itself, on a module written the way the rule forbids
    source = (
        "from __future__ import annotations\n"
        "from ckpt_cli import dtypes\n"
        "from ..runs import _UNMARKED, __doc__ as runs_doc\n"
        "from .plan import _helper as helper\n"
        "import ckpt_cli.sizes as sizes\n"
        "import os\n"
        "def f() -> object:\n"
        "    return dtypes._TABLE, sizes._units, os._exit, runs_doc, dtypes.public, helper\n"
    )
    found = cross_module_private_uses(source, PACKAGE / "ops" / "probe.py")
    assert found == [
        "ckpt_cli/ops/probe.py:3: from ckpt_cli.runs import _UNMARKED",
        "ckpt_cli/ops/probe.py:4: from ckpt_cli.ops.plan import _helper",
        "ckpt_cli/ops/probe.py:8: dtypes._TABLE",
        "ckpt_cli/ops/probe.py:8: sizes._units",
    ]


@pytest.mark.slow
def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        for use in cross_module_private_uses(path.read_text(), path)
    ]
    assert not found, "make these names public at their definition:\n" + "\n".join(found)


def attribute_probes(source: str, path: Path, names: set[str]) -> list[str]:
    """Places in `source` that probe an object for one of `names` by string:
    `getattr(x, "name", ...)` or `hasattr(x, "name")`."""
    place = path.relative_to(PACKAGE.parent)
    return [
        f"{place}:{node.lineno}: {node.func.id}(…, {node.args[1].value!r})"
        for node in ast.walk(parse(source, str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in names
    ]


def entry_subclass_fields() -> set[str]:
    """The fields the package's `Entry` subclasses add (`TorchEntry.key_path`), read from the
    class bodies: annotated names of every class deriving from `Entry`, at any depth."""
    bodies: dict[str, tuple[list[str], list[ast.stmt]]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                bodies[node.name] = (bases, node.body)

    def derives(name: str) -> bool:
        bases = bodies.get(name, ([], []))[0]
        return "Entry" in bases or any(derives(b) for b in bases if b in bodies)

    return {
        statement.target.id
        for name, (_, body) in bodies.items()
        if name != "Entry" and derives(name)
        for statement in body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
    }


@pytest.mark.slow
def test_what_only_some_entries_hold_is_read_through_entry_not_probed() -> None:
    # `getattr(entry, "key_path", None)` on a plain Entry goes through pydantic's __getattr__ and
    # an AttributeError each time (~10 µs; a training checkpoint's layouts asked it 5 times per
    # entry): Entry declares what a subclass may know (`saved_keys`, `top_key`) instead
    fields = entry_subclass_fields()
    assert "key_path" in fields
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        for use in attribute_probes(path.read_text(), path, fields)
    ]
    assert not found, "declare it on models.Entry and override it instead:\n" + "\n".join(found)
    probe = 'def f(e):\n    return getattr(e, "key_path", None) or hasattr(e, "key_path")\n'
    assert attribute_probes(probe, PACKAGE / "probe.py", {"key_path"}) == [
        "ckpt_cli/probe.py:2: getattr(…, 'key_path')",
        "ckpt_cli/probe.py:2: hasattr(…, 'key_path')",
    ]


def hub_url_parsing(source: str, path: Path) -> list[str]:
    """Places in `source` that take an `hf://` URL apart (or build one) by hand: a literal
    `"hf://"` or `"hf:"` in code. Text for people is not parsed: docstrings, f-strings, and a
    search of a message's text (`"hf://" in error.fix`) are left alone."""
    tree = parse(source, str(path))
    text: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            text.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            text.update(id(part) for part in ast.walk(node))
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and re.search(r"\b(fix|message)\b", ast.unparse(node.comparators[0]))
        ):
            text.add(id(node.left))
    place = path.relative_to(PACKAGE.parent)
    return [
        f"{place}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in ("hf://", "hf:")
        and id(node) not in text
    ]


@pytest.mark.slow
def test_hub_urls_are_parsed_in_one_place() -> None:
    # `uri.parse_location` / `is_hub_url` / `hub_url` / `with_hub_options` are the one parser
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "uri.py"
        for use in hub_url_parsing(path.read_text(), path)
    ]
    assert not found, (
        "use ckpt_cli.storage.uri (is_hub_url, parse_location, hub_url):\n" + "\n".join(found)
    )
    probe = (
        'def f(x, e):\n    """hf:// in a docstring"""\n'
        '    return x.startswith("hf://"), "hf://" not in e.fix, x[len("hf:") :]\n'
    )
    assert hub_url_parsing(probe, PACKAGE / "probe.py") == [
        "ckpt_cli/probe.py:3: 'hf://'",
        "ckpt_cli/probe.py:3: 'hf:'",
    ]


STORAGE = PACKAGE / "storage"


def storage_types() -> set[str]:
    """What `ckpt_cli/storage/` gives operations to read and write through: `Storage` and its
    subclasses, and the output destinations (`Destination = Path | RemoteDest`: the alias and the
    classes storage defines in it). Records (`RemoteFile`, `FileRange`...) are not included."""
    classes: dict[str, set[str]] = {}  # class -> its bases' names
    unions: dict[str, set[str]] = {}  # module-level `A = B | C` alias -> its names
    for path in sorted(STORAGE.rglob("*.py")):
        tree = parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in node.bases
                    if isinstance(n, ast.Name | ast.Attribute)
                }
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.BinOp)
                and isinstance(node.value.op, ast.BitOr)
            ):
                parts = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        unions[target.id] = parts
    names = {"Storage"}
    while grown := {c for c, bases in classes.items() if bases & names and c not in names}:
        names |= grown
    return names | {"Destination"} | (unions["Destination"] & set(classes))


def storage_type_checks(source: str, path: Path, types: set[str]) -> list[str]:
    """Each `isinstance` / `issubclass` in `source` whose class argument names one of `types`
    (bare, dotted, in a tuple or a `|` union): a choice made from a storage's class instead of
    what the storage declares."""
    place = path.relative_to(PACKAGE.parent)
    found = []
    for node in ast.walk(parse(source, str(path))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            continue
        named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
        found += [
            f"{place}:{node.lineno}: {node.func.id}(…, {name})" for name in sorted(named & types)
        ]
    return found


@pytest.mark.slow
def test_storage_classes_are_told_apart_only_inside_storage() -> None:
    # operations choose from what a storage declares (writable, local_root, ranged_reads,
    # destination()...), so a new storage needs no edit outside `ckpt_cli/storage/`
    types = storage_types()
    assert {"Storage", "LocalStorage", "FsspecStorage", "HubStorage", "RemoteDest"} <= types
    assert "Destination" in types
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORAGE not in path.parents
        for use in storage_type_checks(path.read_text(), path, types)
    ]
    assert not found, (
        "declare a capability on storage.base.Storage (or use storage.output's destination "
        "helpers) instead of testing the class:\n" + "\n".join(found)
    )
    probe = (
        "def f(s, d, o):\n"
        "    a = isinstance(s, LocalStorage | FsspecStorage)\n"
        "    b = isinstance(d, (output.RemoteDest, Path))\n"
        "    c = isinstance(o, torch.UntypedStorage) or isinstance(o, _Storage)\n"
        "    return issubclass(type(s), HubStorage)\n"
    )
    assert storage_type_checks(probe, PACKAGE / "probe.py", types) == [
        "ckpt_cli/probe.py:2: isinstance(…, FsspecStorage)",
        "ckpt_cli/probe.py:2: isinstance(…, LocalStorage)",
        "ckpt_cli/probe.py:3: isinstance(…, RemoteDest)",
        "ckpt_cli/probe.py:5: issubclass(…, HubStorage)",
    ]


#: at most this many functions over `COMPLEX` per thousand lines of code (issue #26)
COMPLEXITY_BUDGET_PER_KLOC = 1.2
COMPLEX = 15


def cyclomatic_complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """McCabe's number of a function, counted the way ruff's `C901` (mccabe) counts it: 1, plus
    one per `if`/`elif`, loop, `except` clause and `case`; a function defined inside (a method
    of a class defined inside too) adds one plus its own branch points. Expressions
    (`and`/`or`, `x if c else y`, comprehensions, lambdas) add nothing."""
    count = 1
    stack: list[ast.AST] = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(
            node,
            ast.If
            | ast.For
            | ast.AsyncFor
            | ast.While
            | ast.ExceptHandler
            | ast.match_case
            | ast.FunctionDef
            | ast.AsyncFunctionDef,
        ):
            count += 1
        stack.extend(ast.iter_child_nodes(node))
    return count


def complex_functions(source: str, path: Path) -> list[tuple[int, str]]:
    """(complexity, `file:line name`) of each function in `source` over `COMPLEX`."""
    place = path.relative_to(PACKAGE.parent)
    return [
        (n, f"{place}:{node.lineno} {node.name}")
        for node in ast.walk(parse(source, str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := cyclomatic_complexity(node)) > COMPLEX
    ]


def _code_lines(source: str) -> int:
    """Lines that are neither blank nor only a comment."""
    return sum(
        1 for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )


def test_the_complexity_counter_counts_branch_points() -> None:
    source = (
        "def f(xs, a, b):\n"
        "    if a and b or not a:\n"  # +1 (the operators add nothing)
        "        return [x for x in xs if x]\n"  # an expression: nothing
        "    for x in xs:\n"  # +1
        "        try:\n"
        "            pass\n"
        "        except ValueError:\n"  # +1
        "            continue\n"
        "        elif_ = 1 if x else 2\n"  # nothing
        "    class Inner:\n"
        "        def method(self, y):\n"  # +1, and its if +1
        "            if y:\n"
        "                return y\n"
        "    return Inner\n"
    )
    function = parse(source).body[0]
    assert isinstance(function, ast.FunctionDef)
    assert cyclomatic_complexity(function) == 1 + 1 + 1 + 1 + 2
    assert complex_functions(source, PACKAGE / "x.py") == []


@pytest.mark.slow
def test_complex_functions_stay_within_the_budget() -> None:
    found: list[tuple[int, str]] = []
    lines = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines += _code_lines(source)
        found += complex_functions(source, path)
    budget = COMPLEXITY_BUDGET_PER_KLOC * lines / 1000
    worst = "\n".join(f"{n:3d}  {where}" for n, where in sorted(found, reverse=True))
    assert len(found) <= budget, (
        f"{len(found)} functions over complexity {COMPLEX} in {lines} lines of code "
        f"(budget {budget:.0f}); extract well-named steps from the worst:\n{worst}"
    )


# -- every expected failure says the fix ------------------------------------------------------
#
# docs/json-output.md and the developer guide promise that a failure names the file, the problem
# and the fix: `CkptError(problem, path=..., fix=...)`. A `raise` of a CkptError subclass without
# `fix=` put `"fix": null` in the JSON envelope (93 such sites before this check).

#: raise sites (and error constructions) allowed to pass no `fix=`, as (module, enclosing
#: function) -> why: only where no fix can be said there and the caller catches the error and
#: raises it again with one. Empty: every site says its fix.
RAISES_WITHOUT_A_FIX: dict[tuple[str, str], str] = {}


def _called(node: ast.expr) -> str:
    """The name a call or a base class is spelled with: `FormatError`, `errors.FormatError`."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _passes_fix(call: ast.Call) -> bool:
    """Whether `call` passes a fix: `fix=` other than a literal None or "" (or `**kwargs`,
    which may carry one)."""
    for kw in call.keywords:
        if kw.arg is None:
            return True
        if kw.arg == "fix":
            return not (isinstance(kw.value, ast.Constant) and kw.value.value in (None, ""))
    return False


def _sets_its_own_fix(node: ast.ClassDef) -> bool:
    """Whether the class's `__init__` takes no `fix` and passes one to `super().__init__`
    (`RankFailedError(failures, size)`): a raise of it needs no `fix=`."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            args = item.args
            names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            calls = [c for c in ast.walk(item) if isinstance(c, ast.Call)]
            supers = [
                c
                for c in calls
                if isinstance(c.func, ast.Attribute)
                and c.func.attr == "__init__"
                and isinstance(c.func.value, ast.Call)
                and _called(c.func.value.func) == "super"
            ]
            return "fix" not in names and bool(supers) and all(map(_passes_fix, supers))
    return False


def ckpt_error_classes(trees: list[ast.Module]) -> set[str]:
    """The names of `CkptError` and of every class of the package derived from it (by name,
    through any number of steps), less those whose constructor sets the fix itself."""
    classes = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    known = {"CkptError"}
    grown = True
    while grown:
        grown = False
        for node in classes:
            if node.name not in known and {_called(b) for b in node.bases} & known:
                known.add(node.name)
                grown = True
    return known - {node.name for node in classes if _sets_its_own_fix(node)}


def errors_without_a_fix(tree: ast.Module, path: Path, errors: set[str]) -> list[str]:
    """`module:line function: raise Class(...)` for each raise of one of `errors` in `tree`
    that passes no fix, and `... Class(...)` for each one built elsewhere (an error a helper
    returns for its caller to raise); the enclosing function is the allow-list's key."""
    place = str(path.relative_to(PACKAGE.parent))
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            call = child.exc if isinstance(child, ast.Raise) else child
            if isinstance(call, ast.Call) and _called(call.func) in errors:
                allowed = (place, function) in RAISES_WITHOUT_A_FIX
                if not _passes_fix(call) and not allowed:
                    verb = "raise " if isinstance(child, ast.Raise) else ""
                    found.append(
                        f"{place}:{call.lineno} {function}: {verb}{_called(call.func)}(...)"
                    )
                if isinstance(child, ast.Raise):
                    visit(call, function)  # its arguments (an error built inside one)
                    continue
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_the_fix_scan_sees_errors_without_a_fix() -> None:
    source = (
        "class CkptError(Exception): ...\n"
        "class FormatError(CkptError): ...\n"
        "class SelfFixing(FormatError):\n"
        "    def __init__(self, n):\n"
        "        super().__init__(f'{n} failed', fix='Run it again.')\n"
        "def read(kw):\n"
        "    if kw:\n"
        "        raise FormatError('bad', path='x', fix='Fetch it again.')\n"
        "    if kw is None:\n"
        "        raise errors.FormatError('forwarded', **kw)\n"
        "    if kw == 1:\n"
        "        raise SelfFixing(3)\n"
        "    if kw == 2:\n"
        "        raise ValueError('not ours')\n"
        "    if kw == 3:\n"
        "        raise FormatError('bad', fix=None)\n"
        "    raise FormatError('bad', path='x')\n"
        "def too_big(where):\n"
        "    return FormatError('too big', path=where)\n"
    )
    tree = parse(source)
    errors = ckpt_error_classes([tree])
    assert errors == {"CkptError", "FormatError"}
    assert errors_without_a_fix(tree, PACKAGE / "x.py", errors) == [
        "ckpt_cli/x.py:16 read: raise FormatError(...)",
        "ckpt_cli/x.py:17 read: raise FormatError(...)",
        "ckpt_cli/x.py:19 too_big: FormatError(...)",
    ]


@pytest.mark.slow
def test_every_ckpt_error_says_its_fix() -> None:
    """Every `raise` of a CkptError subclass (and every one a helper builds for its caller)
    passes `fix=`: what the user can do (fetch the shard again, pass --format, run `ckpt
    repair`, report a bug...), never `"fix": null` in the JSON envelope."""
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = [parse(path.read_text(), str(path)) for path in paths]
    errors = ckpt_error_classes(trees)
    assert {"FormatError", "NotFoundError", "UnsafeInputError", "HubError"} <= errors
    found = [
        site
        for path, tree in zip(paths, trees, strict=True)
        for site in errors_without_a_fix(tree, path, errors)
    ]
    assert not found, "CkptErrors without fix=:\n" + "\n".join(found)


# -- every problem says its fix -------------------------------------------------------------
#
# What `verify`, `diff`, `doctor` and the training-state report list is a `models.Problem`, one
# per flaw: like an error, it names the file, the problem and the fix (its `fix` field, printed
# after the message). About 55 constructions once gave none.

#: the classes whose construction is a problem a user reads
PROBLEM_CLASSES = {"Problem", "ProblemSummary"}


def problems_without_a_fix(tree: ast.Module, path: Path) -> list[str]:
    """`module:line function: Problem(...)` for each construction of a problem in `tree` that
    passes no fix (`fix=` absent, a literal None or "")."""
    place = str(path.relative_to(PACKAGE.parent))
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if (
                isinstance(child, ast.Call)
                and _called(child.func) in PROBLEM_CLASSES
                and not _passes_fix(child)
            ):
                found.append(f"{place}:{child.lineno} {function}: {_called(child.func)}(...)")
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_the_problem_fix_scan_sees_problems_without_a_fix() -> None:
    source = (
        "def check(where, error):\n"
        "    found = [Problem(code='truncated', message='cut', file=where, fix='Fetch it.')]\n"
        "    found.append(models.Problem(code='gap', message='gap', file=where))\n"
        "    found.append(Problem(code='gap', message='gap', fix=None))\n"
        "    found.append(Problem(code=error.code, message=error.stated, fix=error.fix))\n"
        "    found.append(ProblemSummary(code='gap', message=''))\n"
        "    return found + [helper(Problem(code='x', message='y', **extra))]\n"
    )
    assert problems_without_a_fix(parse(source), PACKAGE / "x.py") == [
        "ckpt_cli/x.py:3 check: Problem(...)",
        "ckpt_cli/x.py:4 check: Problem(...)",
        "ckpt_cli/x.py:6 check: ProblemSummary(...)",
    ]


def test_every_problem_says_its_fix() -> None:
    """Every `Problem(...)` (and `ProblemSummary(...)`) built in ckpt_cli passes `fix=`: what
    the user can run or do (fetch the shard again, `ckpt repair SRC`, resume from the
    checkpoint `ckpt latest` names...); a problem built from a `CkptError` carries its fix."""
    found = [
        site
        for path in sorted(PACKAGE.rglob("*.py"))
        for site in problems_without_a_fix(parse(path.read_text(), str(path)), path)
    ]
    assert not found, "Problems without fix=:\n" + "\n".join(found)


#: what each layer of the house (shared/DESIGN.md's layout) may not import: the face above the
#: library, the operations above what they operate on, the sources above the formats they read,
#: the formats above the storage they read through. `formats.names`, the file names every layer
#: speaks of (it imports nothing), is the one module of a higher layer the storage layer reads.
SHARED_VOCABULARY = ("ckpt_cli.formats.names",)
LAYERS_ABOVE = {
    "ckpt_cli.storage": ("ckpt_cli.formats", "ckpt_cli.sources", "ckpt_cli.ops", "ckpt_cli.cli"),
    "ckpt_cli.formats": ("ckpt_cli.sources", "ckpt_cli.ops", "ckpt_cli.cli"),
    "ckpt_cli.quant": ("ckpt_cli.sources", "ckpt_cli.ops", "ckpt_cli.cli"),
    "ckpt_cli.sources": ("ckpt_cli.ops", "ckpt_cli.cli"),
    "ckpt_cli.ops": ("ckpt_cli.cli",),
}


def upward_imports(source: str, path: Path) -> list[str]:
    """Each import in `source` (the module at `path`) of a layer above the module's own, lazy
    imports inside functions included."""
    module = _module_name(path)
    above = next(
        (
            banned
            for layer, banned in LAYERS_ABOVE.items()
            if (module + ".").startswith(layer + ".")
        ),
        (),
    )
    place = path.relative_to(PACKAGE.parent)
    found: list[str] = []
    for node in ast.walk(parse(source, str(path))):
        if isinstance(node, ast.ImportFrom):
            names = [_imported_from(node, path)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [
            f"{place}:{node.lineno}: imports {name}"
            for name in names
            if any((name + ".").startswith(layer + ".") for layer in above)
            and name not in SHARED_VOCABULARY
        ]
    return found


def test_the_upward_import_scan_sees_lazy_imports() -> None:
    inner = PACKAGE / "formats" / "__init__.py"
    code = "def detect():\n    from ..sources.runs.naming import refuse_parent_folder\n"
    assert upward_imports(code, inner) == [
        "ckpt_cli/formats/__init__.py:2: imports ckpt_cli.sources.runs.naming"
    ]
    assert (
        upward_imports("from ..formats import get_format\n", PACKAGE / "ops" / "inspect.py") == []
    )


@pytest.mark.slow
def test_no_layer_imports_a_layer_above_it() -> None:
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        for use in upward_imports(path.read_text(), path)
    ]
    assert not found, "a lower layer reaches up (shared/DESIGN.md's layout):\n" + "\n".join(found)


def _reexports(sources: dict[str, tuple[str, Path]]) -> dict[str, dict[str, str]]:
    """Package -> {name its `__init__` hands on: the module it imports that name from}, for
    the packages whose `__init__` is only a face (under 40 lines, defining nothing): an import
    from any other package's `__init__` is an import of that file."""
    found: dict[str, dict[str, str]] = {}
    for module, (source, path) in sources.items():
        if path.name != "__init__.py":
            continue
        body = parse(source, str(path)).body
        defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if len(source.splitlines()) >= 40 or any(isinstance(n, defines) for n in body):
            continue
        names = found.setdefault(module, {})
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = _imported_from(node, path)
                for alias in node.names:
                    names[alias.asname or alias.name] = base
    return found


def import_graph(sources: dict[str, tuple[str, Path]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (`sources`: module -> its code and path), lazy
    and type-only imports included. A name taken from a package is an arrow to the submodule of
    that name, or to the module a package's face hands it on from (a face is no room of its own,
    as farm-studio draws the house), else to the package's `__init__`."""
    reexports = _reexports(sources)

    def target(package: str, name: str) -> str:
        seen = set()
        while f"{package}.{name}" not in sources and name in reexports.get(package, {}):
            if package in seen:
                break
            seen.add(package)
            package = reexports[package][name]
        return f"{package}.{name}" if f"{package}.{name}" in sources else package

    graph: dict[str, set[str]] = {module: set() for module in sources}
    for module, (source, path) in sources.items():
        for node in ast.walk(parse(source, str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _imported_from(node, path)
                names = [target(base, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            graph[module] |= {name for name in names if name in sources and name != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected parts of `graph` of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.add(top)
                if top == node:
                    break
            if len(part) > 1:
                circles.append(frozenset(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_circle_scan_sees_lazy_and_type_only_imports() -> None:
    storage = PACKAGE / "storage"
    code = {
        "ckpt_cli.storage.base": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .output import Dest\n",
            storage / "base.py",
        ),
        "ckpt_cli.storage.output": ("def f():\n    from . import base\n", storage / "output.py"),
        "ckpt_cli.storage.uri": ("from .base import Storage\n", storage / "uri.py"),
    }
    assert import_circles(import_graph(code)) == [
        frozenset({"ckpt_cli.storage.base", "ckpt_cli.storage.output"})
    ]


def test_no_import_circle() -> None:
    sources = {
        _module_name(path): (path.read_text(), path) for path in sorted(PACKAGE.rglob("*.py"))
    }
    graph = import_graph(sources)
    # the package's root is the library's face: it names every operation for the type checker
    # only (they load on first use), and every module may read its `__version__`
    del graph["ckpt_cli"]
    for imported in graph.values():
        imported.discard("ckpt_cli")
    found = [sorted(circle) for circle in import_circles(graph)]
    assert not found, f"import circles (break them; see shared/DESIGN.md's layers): {found}"


def test_every_import_of_a_ckpt_cli_name_resolves_lazy_ones_included() -> None:
    """A `from ckpt_cli.X import name` inside a function runs only when that path does, and a
    package with a module `__getattr__` (the layouts' face loads its layouts on first use)
    hides a wrong name from the type checker: a name moved elsewhere was an ImportError,
    exit 70, for the one command that took that path. Each such name must be there."""
    import importlib

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _imported_from(node, path)
            if not module.startswith("ckpt_cli"):
                continue
            loaded = importlib.import_module(module)
            for alias in node.names:
                if hasattr(loaded, alias.name):
                    continue
                try:
                    importlib.import_module(f"{module}.{alias.name}")
                except ImportError:
                    place = path.relative_to(PACKAGE.parent)
                    missing.append(f"{place}:{node.lineno}: {module} has no {alias.name}")
    assert not missing, "imports of names that are not there:\n" + "\n".join(missing)
