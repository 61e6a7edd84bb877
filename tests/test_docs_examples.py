"""Every console example of README.md and docs/ runs, and prints what the page says it prints.

The rules (markers, fixtures, the normalisation, `CKPT_UPDATE_DOCS=1`) are in
tests/docs_examples.py. One test per block, its id the file and line of its fence.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .docs_examples import (
    FIXTURES,
    REPO,
    SERVICES,
    Example,
    Step,
    ckpt_wrapper,
    command_env,
    copy_fixture,
    documents,
    find_examples,
    matches,
    parse_steps,
    problems,
    refreshed,
    rewrite,
    run_example,
)

EXAMPLES = [example for path in documents() for example in find_examples(path)]
UPDATE = os.environ.get("CKPT_UPDATE_DOCS") == "1"
#: pytest marks a block's flags (`<!-- fixture: NAME; slow -->`) map to
FLAG_MARKS = {
    "slow": pytest.mark.slow,
    "torchrun": pytest.mark.torchrun,
    "frameworks": pytest.mark.frameworks,
}


def example_params() -> list[object]:
    params = []
    for example in EXAMPLES:
        marks = [FLAG_MARKS[flag] for flag in sorted(example.flags) if flag in FLAG_MARKS]
        params.append(pytest.param(example, id=example.id, marks=marks))
    return params


@pytest.fixture(scope="session")
def built_fixtures() -> Iterator[dict[str, tuple[Path, dict[str, str]]]]:
    """Each fixture is built once per session, on first use (its folder and the variables it
    sets); blocks run in copies. Servers a fixture started stop with the session."""
    yield {}
    while SERVICES:
        SERVICES.pop()()


def fixture_copy(
    name: str,
    built: dict[str, tuple[Path, dict[str, str]]],
    factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, str]]:
    if name not in built:
        source = factory.mktemp(f"docs-fixture-{name}")
        built[name] = (source, FIXTURES[name](source) or {})
    source, env = built[name]
    scratch = factory.mktemp("docs-example") / "work"
    copy_fixture(source, scratch)
    return scratch, env


def test_the_docs_have_console_examples() -> None:
    # the collection below is not vacuous: the README's tour and the command pages have blocks
    ids = {example.id.split(":")[0] for example in EXAMPLES}
    assert "README.md" in ids and "docs/commands/inspect.md" in ids
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize("example", example_params())
@pytest.mark.slow
def test_console_example(
    example: Example,
    built_fixtures: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    assert example.fixture is not None, (
        f"{example.id}: a console block needs `<!-- fixture: NAME -->` on the line before it "
        f"(fixtures: {', '.join(FIXTURES)}); a block that is no transcript of commands and "
        "their output takes another fence (bash, python)"
    )
    assert example.fixture in FIXTURES, f"{example.id}: no fixture {example.fixture!r}"
    assert example.malformed is None, f"{example.id}: {example.malformed}"
    assert example.steps, f"{example.id}: a console block with no `$ ` command"
    scratch, fixture_env = fixture_copy(example.fixture, built_fixtures, tmp_path_factory)
    bin_dir = scratch.parent / "bin"
    ckpt_wrapper(bin_dir)
    results = run_example(example, scratch, {**command_env(scratch, bin_dir), **fixture_env})
    found = problems(example, results)
    wrong_exit = [message for message in found if "the example says" in message]
    if found and UPDATE and not wrong_exit:
        # only outputs are refreshed; a changed exit status is a change of behaviour to fix
        rewrite(example, results)
        found = []
    assert not found, f"{example.id} drifted (CKPT_UPDATE_DOCS=1 refreshes it):\n" + "\n".join(
        found
    )


# --- the machinery itself ---------------------------------------------------------------------


def test_a_changed_output_or_exit_status_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- fixture: empty -->\n```console\n$ echo one\ntwo\n$ false\n```\n"
        "<!-- fixture: empty -->\n```console\n$ echo one; false  # exit 1\none\n"
        "$ sh -c 'exit 3'\n$ echo $?\n3\n```\n"
    )
    drifted, good = find_examples(page)
    ckpt_wrapper(tmp_path / "bin")
    scratch = tmp_path / "work"
    scratch.mkdir()
    env = command_env(scratch, tmp_path / "bin")
    found = problems(drifted, run_example(drifted, scratch, env))
    assert len(found) == 2
    assert "--- the example\ntwo\n  --- the command now\none" in found[0]
    assert "exit 1, the example says 0" in found[1]
    assert problems(good, run_example(good, scratch, env)) == []


def test_ckpt_in_an_example_is_this_checkouts_cli(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- fixture: empty -->\n```console\n$ ckpt inspect nothere\nx\n```\n")
    (example,) = find_examples(page)
    ckpt_wrapper(tmp_path / "bin")
    scratch = tmp_path / "work"
    scratch.mkdir()
    (result,) = run_example(example, scratch, command_env(scratch, tmp_path / "bin"))
    assert result.exit_code == 3
    assert result.output[0].startswith("ckpt inspect: error: nothere: no such file or folder")


def test_an_ellipsis_line_stands_for_any_lines_and_survives_a_refresh() -> None:
    actual = ["a", "b", "c", "d"]
    assert matches(["a", "…", "d"], actual)
    assert matches(["a", "b", "c", "d", "…"], actual)
    assert not matches(["a", "…", "c"], actual)
    assert not matches(["a", "b"], actual)
    assert refreshed(["a", "…"], ["x", "y", "z"]) == ["x", "…"]
    assert refreshed(["a", "…", "q"], ["x", "y", "z"]) == ["x", "…", "z"]
    assert refreshed(["a", "b"], ["x", "y", "z"]) == ["x", "y", "z"]
    # an indented one too, kept as written
    assert matches(["a", "  …"], actual)
    assert refreshed(["a", "  …"], ["x", "y", "z"]) == ["x", "  …"]
    # lines shown between two ellipses stay where the output still has them
    assert refreshed(["…", "c", "…"], ["a", "b", "c", "d"]) == ["…", "c", "…"]
    assert refreshed(["…", "gone", "…"], ["a", "b", "c", "d"]) == ["…"]


def test_the_refresh_rewrites_only_the_outputs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n<!-- fixture: empty -->\n```console\n$ printf 'a\\nb\\n' \\\n  | cat\nold\n```\nend\n"
    )
    (example,) = find_examples(page)
    assert [step.command for step in example.steps] == ["printf 'a\\nb\\n' \\\n  | cat"]
    ckpt_wrapper(tmp_path / "bin")
    scratch = tmp_path / "work"
    scratch.mkdir()
    rewrite(example, run_example(example, scratch, command_env(scratch, tmp_path / "bin")))
    assert page.read_text() == (
        "text\n<!-- fixture: empty -->\n```console\n$ printf 'a\\nb\\n' \\\n  | cat\na\nb\n```\nend\n"
    )


def test_parse_steps_refuses_output_before_a_command() -> None:
    with pytest.raises(ValueError, match="before the first"):
        parse_steps(["orphan", "$ echo"])
    assert parse_steps(["$ a  # exit 2", "out"]) == [Step("a  # exit 2", ["out"])]
    assert parse_steps(["$ a  # exit 2"])[0].expected_exit == 2


def test_every_document_is_found() -> None:
    assert REPO / "README.md" in documents()
    assert REPO / "docs" / "index.md" in documents()
