"""ckpt_cli's modules parsed once per test process.

A dozen code-shape scans each walk every module of the package; parsing it takes about 2 s, so
each scan parsing it anew cost the fast loop half a minute. The trees are only read, never
changed, so one parse of a source serves every scan.
"""

from __future__ import annotations

import ast
from functools import cache


@cache
def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source, filename)`, shared by every scan of the same text."""
    return ast.parse(source, filename)
