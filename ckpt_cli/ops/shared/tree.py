"""Fold dotted tensor names into a compact module tree (`layers.{0..31}.attn.wq.weight`).

Numeric path components are merged into one node per position, so a 32-layer model shows one
`layers.{0..31}` block instead of 32 copies; a 1,000-tensor model fits one screen.
"""

from __future__ import annotations

from pydantic import Field

from ...models import Entry, Record


class TreeNode(Record):
    """One node of the folded tree.

    Attributes:
        name: the path component, or `{0..31}` for folded numeric components.
        tensors: tensors under this node (counting every folded copy).
        objects: non-tensor entries under this node.
        nbytes: bytes under this node.
        dtype / shape: of the leaf tensor, when every folded copy agrees.
        children: child nodes in first-seen order.
    """

    name: str
    tensors: int = 0
    objects: int = 0
    nbytes: int = 0
    dtype: str | None = None
    shape: list[int] | None = None
    children: list[TreeNode] = Field(default_factory=list)


def _ranges(indices: list[int]) -> str:
    """[0,1,2,5,7,8] -> '{0..2,5,7..8}'."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    start = prev = ordered[0]
    for i in ordered[1:]:
        if i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        start = prev = i
    parts.append(str(start) if start == prev else f"{start}..{prev}")
    return "{" + ",".join(parts) + "}"


#: the child key of the folded numeric components: None, which no component is (a name's own
#: `#`, `{0..3}`, `.`... stay what they are)
FOLDED = None

#: the deepest a name is folded: the components past it stay one node (`a.b.….z`), so a name of
#: thousands of dots (no model has more than a dozen) cannot make the tree, or what draws and
#: serialises it, recurse that deep
MAX_DEPTH = 64

#: how many components `_walk` steps back from a prefix, looking for one already walked, before
#: it walks the rest from the root: each step copies the name, so a name of one long component
#: costs a few copies, not one per dot
LOOK_BACK = 4


class _Builder:
    """A node while the tree is built: what its own entries hold; `build` adds its subtree's."""

    __slots__ = ("children", "dtypes", "indices", "nbytes", "objects", "shapes", "tensors")

    def __init__(self) -> None:
        self.children: dict[str | None, _Builder] = {}
        self.indices: list[int] = []
        self.tensors = 0
        self.objects = 0
        self.nbytes = 0
        self.dtypes: set[str | None] = set()
        self.shapes: set[tuple[int, ...]] = set()

    def child(self, part: str) -> _Builder:
        """The child for the component `part`: one folded child for every numeric one."""
        # ASCII digits only: `int` refuses some characters `isdigit` takes (`²`)
        numeric = part.isdigit() and part.isascii()
        key = FOLDED if numeric else part
        found = self.children.get(key)
        if found is None:
            found = self.children[key] = _Builder()
        if numeric:
            found.indices.append(int(part))
        return found

    def build(self, name: str | None) -> TreeNode:
        if name is FOLDED:
            name = _ranges(self.indices)
        leaf = not self.children
        children = [child.build(key) for key, child in self.children.items()]
        # every value was computed here from checked entries: no validation pass needed
        return TreeNode.model_construct(
            name=name,
            tensors=self.tensors + sum(c.tensors for c in children),
            objects=self.objects + sum(c.objects for c in children),
            nbytes=self.nbytes + sum(c.nbytes for c in children),
            dtype=next(iter(self.dtypes)) if leaf and len(self.dtypes) == 1 else None,
            shape=list(next(iter(self.shapes))) if leaf and len(self.shapes) == 1 else None,
            children=children,
        )


def build_tree(entries: list[Entry]) -> list[TreeNode]:
    """The folded tree of `entries` (top-level nodes), in one pass over the names.

    Each entry is counted at its own node only; a node's totals (its subtree's) are summed
    once, when the tree is built, not added along the path of every entry. An entry's parent
    is found by its whole dotted prefix, so the components of a prefix are walked once, not
    once for every entry under it (a large model's names share almost all of theirs: #30).
    """
    root = _Builder()
    parents: dict[str, _Builder] = {}
    for entry in entries:
        name = entry.name
        if name.count(".") < MAX_DEPTH:
            prefix, dot, leaf = name.rpartition(".")
            parent = root
            if dot:
                found = parents.get(prefix)
                parent = found if found is not None else _walk(root, prefix, parents)
            # `parent.child(leaf)`, inlined: this line runs once per entry
            named = None if leaf.isdigit() and leaf.isascii() else parent.children.get(leaf)
            if named is not None:
                node = named
            else:
                node = parent.child(leaf)
        else:
            node = root
            for part in name.split(".", MAX_DEPTH - 1):
                node = node.child(part)
        if entry.kind == "tensor":
            node.tensors += 1
            node.dtypes.add(entry.dtype)
        else:
            node.objects += 1
            node.dtypes.add(entry.py_type)
        node.nbytes += entry.nbytes
        node.shapes.add(tuple(entry.shape))
    return [child.build(key) for key, child in root.children.items()]


def _walk(root: _Builder, prefix: str, parents: dict[str, _Builder]) -> _Builder:
    """The node of the dotted `prefix`, made from a prefix of it already walked (at most
    `LOOK_BACK` components back, else from the root), with the prefixes stepped through
    remembered in `parents`."""
    missing: list[str] = []
    head, node = prefix, root
    path: str | None = None  # the dotted path of `node`; None for the root
    for _ in range(LOOK_BACK):
        head, dot, part = head.rpartition(".")
        missing.append(part)
        if not dot:
            break
        found = parents.get(head)
        if found is not None:
            node, path = found, head
            break
    else:  # none of the last few prefixes walked yet: walk the rest of the name from the root
        for part in head.split("."):
            node = node.child(part)
        path = head
    for part in reversed(missing):
        node = node.child(part)
        path = part if path is None else f"{path}.{part}"
        parents[path] = node
    return node


def collapse_chains(node: TreeNode) -> TreeNode:
    """Join single-child chains (`model` -> `model.embed_tokens.weight`) to save lines."""
    children = [collapse_chains(c) for c in node.children]
    # a node that holds an entry of its own (`0` beside `1.a`) counts more than its only child,
    # and is never folded away
    if len(children) == 1 and (node.tensors, node.objects) == (
        children[0].tensors,
        children[0].objects,
    ):
        only = children[0]
        return only.model_copy(update={"name": f"{node.name}.{only.name}"})
    return node.model_copy(update={"children": children})
