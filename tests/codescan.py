"""Every problem-code literal in ckpt_cli's source, with the severities it is used at.

A code is a string literal that reaches `Problem(code=...)`: directly, through a helper whose
`code` parameter is passed on to `Problem` (found by a fixed point over the package's
functions), as a `CkptError` subclass's `code = "..."`, or compared with some `.code`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from .parsed import parse


def _strings(node: ast.AST) -> list[str] | None:
    """The string values `node` can take: a literal, or the branches of `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _strings(node.body), _strings(node.orelse)
        return None if body is None or orelse is None else body + orelse
    if isinstance(node, ast.BoolOp):  # `code or "default"`
        return [s for v in node.values for s in (_strings(v) or [])] or None
    return None


def _severities(call: ast.Call) -> set[str]:
    """The severities a call can report at (`severity=`, quant's `warn=`, else the default)."""
    for kw in call.keywords:
        if kw.arg == "severity":
            return set(_strings(kw.value) or ["error", "warning"])
        if kw.arg == "warn":
            if isinstance(kw.value, ast.Constant):
                return {"warning" if kw.value.value else "error"}
            return {"error", "warning"}
    return {"error"}


def _name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


class _Def:
    def __init__(self, node: ast.FunctionDef):
        args = node.args
        self.node = node
        self.positional = [a.arg for a in args.posonlyargs + args.args]
        self.method = bool(self.positional) and self.positional[0] in ("self", "cls")
        if self.method:
            self.positional = self.positional[1:]
        self.required = len(self.positional) - len(args.defaults)
        self.kwonly = {a.arg for a in args.kwonlyargs}
        self.kwonly_required = {
            a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None
        }
        self.star = args.vararg is not None or args.kwarg is not None

    def binds(self, call: ast.Call) -> bool:
        """Whether `call` could be a call of this function (argument counts and names)."""
        if self.star:
            return True
        given = {kw.arg for kw in call.keywords}
        if len(call.args) > len(self.positional):
            return False
        bound = set(self.positional[: len(call.args)]) | given
        if not given <= set(self.positional) | self.kwonly:
            return False
        return set(self.positional[: self.required]) | self.kwonly_required <= bound

    def code_at(self, call: ast.Call) -> ast.AST | None:
        """The argument of `call` bound to the `code` parameter."""
        for kw in call.keywords:
            if kw.arg == "code":
                return kw.value
        index = self.positional.index("code")
        return call.args[index] if index < len(call.args) else None


def scan(root: Path) -> tuple[dict[str, dict[str, set[str]]], dict[str, list[str]]]:
    """(code -> {place -> severities}, f-string code pattern -> places) over `root`."""
    trees = {path: parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}
    defs: dict[str, list[_Def]] = defaultdict(list)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                defs[node.name].append(_Def(node))

    def forwards(d: _Def, helpers: set[int]) -> bool:
        # the `code` parameter is passed on to Problem or to a known helper
        for call in ast.walk(d.node):
            if not isinstance(call, ast.Call):
                continue
            name = _name(call)
            targets = [t for t in defs.get(name or "", []) if id(t) in helpers and t.binds(call)]
            if name == "Problem" or targets:
                values = [kw.value for kw in call.keywords] + list(call.args)
                if any(isinstance(v, ast.Name) and v.id == "code" for v in values):
                    return True
        return False

    helpers: set[int] = set()
    candidates = [d for ds in defs.values() for d in ds if "code" in d.positional]
    while True:
        more = {id(d) for d in candidates if id(d) not in helpers and forwards(d, helpers)}
        if not more:
            break
        helpers |= more
    codes: dict[str, dict[str, set[str]]] = defaultdict(dict)
    patterns: dict[str, list[str]] = defaultdict(list)

    def note(value: ast.AST | None, place: str, severities: set[str]) -> None:
        if value is None:
            return
        if isinstance(value, ast.JoinedStr):
            patterns[ast.unparse(value)].append(place)
        for code in _strings(value) or []:
            codes[code].setdefault(place, set()).update(severities)

    for path, tree in trees.items():
        for node in ast.walk(tree):
            place = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                name = _name(node)
                if name == "Problem":
                    note(
                        next((k.value for k in node.keywords if k.arg == "code"), None),
                        place,
                        _severities(node),
                    )
                    continue
                bindable = [d for d in defs.get(name or "", []) if d.binds(node)]
                if bindable and all(id(d) in helpers for d in bindable):
                    note(bindable[0].code_at(node), place, _severities(node))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                # `code, severity = "lost_file", "error"` / `code = "x"` before a Problem(code=code)
                target, value = node.targets[0], node.value
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    names = [t.id if isinstance(t, ast.Name) else "" for t in target.elts]
                    if "code" in names and len(names) == len(value.elts):
                        got = (
                            _strings(value.elts[names.index("severity")])
                            if ("severity" in names)
                            else None
                        )
                        note(value.elts[names.index("code")], place, set(got or ["error"]))
                elif isinstance(target, ast.Name) and target.id == "code":
                    note(value, place, set())
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:  # CkptError subclasses: `code = "..."`
                    target = (
                        stmt.target
                        if isinstance(stmt, ast.AnnAssign)
                        else stmt.targets[0]
                        if isinstance(stmt, ast.Assign)
                        else None
                    )
                    if isinstance(target, ast.Name) and target.id == "code" and stmt.value:
                        note(stmt.value, f"{path}:{stmt.lineno}", {"error"})
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "code" for s in sides):
                    for side in sides:
                        for sub in ast.walk(side):
                            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                                codes[sub.value].setdefault(place, set())
    return codes, patterns
