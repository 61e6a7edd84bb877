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
    once, when the tree is built, not added along the path of every entry.
    """
    root = _Builder()
    for entry in entries:
        node = root
        for part in entry.name.split(".", MAX_DEPTH - 1):
            # ASCII digits only: `int` refuses some characters `isdigit` takes (`²`)
            numeric = part.isdigit() and part.isascii()
            children = node.children
            key = FOLDED if numeric else part
            child = children.get(key)
            if child is None:
                child = children[key] = _Builder()
            if numeric:
                child.indices.append(int(part))
            node = child
        if entry.kind == "tensor":
            node.tensors += 1
            node.dtypes.add(entry.dtype)
        else:
            node.objects += 1
            node.dtypes.add(entry.py_type)
        node.nbytes += entry.nbytes
        node.shapes.add(tuple(entry.shape))
    return [child.build(key) for key, child in root.children.items()]


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
