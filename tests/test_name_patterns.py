"""The families' tensor-name patterns (`layers.{layer}.attention.wo.weight`) match exactly the
names their regexes match, and recognising a model of no known family compiles almost none of
them (#30: compiling every family's patterns was most of a metadata command's recognition)."""

from __future__ import annotations

import re

from ckpt_cli.architectures import architectures, recognise
from ckpt_cli.architectures.base import NAME_PATTERNS, NamePattern

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _reference(pattern: NamePattern) -> re.Pattern[str]:
    """The regex the pattern stands for, written out independently of `NamePattern`."""
    if pattern.prefix:
        return re.compile(re.escape(pattern.pattern) + r".*", re.DOTALL)
    pieces = _PLACEHOLDER.split(pattern.pattern)
    out = [re.escape(pieces[0])]
    for name, literal in zip(pieces[1::2], pieces[2::2], strict=True):
        out += [rf"(?P<{name}>\d+)", re.escape(literal)]
    return re.compile("".join(out))


def _every_pattern() -> list[NamePattern]:
    """Every rule and ignore pattern of every family's namings (`covers` makes them all)."""
    for arch in architectures():
        for naming in arch.namings():
            arch.covers(["x"], naming)
    return list(NAME_PATTERNS.values())


def _names_near(pattern: NamePattern) -> list[str]:
    """Names the pattern should take and names one character off it."""
    filled = [_PLACEHOLDER.sub(number, pattern.pattern) for number in ("0", "7", "31", "120")]
    off = []
    for name in filled[:2]:
        off += [name + "x", "x" + name, name[:-1], name.replace(".", "_", 1), name + ".0"]
    off += [_PLACEHOLDER.sub("a", pattern.pattern), _PLACEHOLDER.sub("", pattern.pattern)]
    return filled + off


def test_every_family_pattern_matches_what_its_regex_matches() -> None:
    patterns = _every_pattern()
    assert len(patterns) > 300
    every_name = [n for p in patterns for n in _names_near(p)]
    checked = 0
    for pattern in patterns:
        reference = _reference(pattern)
        for name in (*_names_near(pattern), *every_name[::37]):
            got, want = pattern.match(name), reference.fullmatch(name)
            assert (got is None) == (want is None), (pattern.pattern, name)
            if got is not None and want is not None:
                assert got.groupdict() == want.groupdict()
            checked += 1
    assert checked > 10_000


def test_recognising_a_model_of_no_family_compiles_few_patterns() -> None:
    names = [f"encoder.blocks.{b}.conv{i}.kernel" for b in range(50) for i in range(20)]
    NAME_PATTERNS.clear()
    assert recognise(names) is None
    made = list(NAME_PATTERNS.values())
    compiled = [p for p in made if p.compiled]
    assert len(made) > 300 and len(compiled) < len(made) // 10, (len(made), len(compiled))
