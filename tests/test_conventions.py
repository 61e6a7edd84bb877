"""The CLI's conventions (issue #13): pipes and terminals, one JSON envelope per outcome,
one option vocabulary, Hub habits, and names that cannot drive the terminal (#19 item 14).

Each command runs as a real process with stdout/stderr as pipes and as a pseudo-terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from ckpt_cli.cli.completions import describe_app, render_all

from .conftest import REPO, CkptResult, run_ckpt, run_ckpt_process
from .run_fixtures import trainer_run

#: a name long enough that an 80-column wrap would split it
LONG = "model.layers.0.self_attn.q_proj.a_name_long_enough_to_wrap_at_eighty_columns.weight"
#: a hostile name: clears the screen, turns text red, and reverses what follows
EVIL = "evil\x1b[2J\x1b[31mred\u202egpj.exe"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("COLUMNS", None)
    return env


def run_in_pty(*args: str | os.PathLike[str], columns: int = 80) -> CkptResult:
    """Run `python -m ckpt_cli ARGS` with stdout and stderr on one pseudo-terminal."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", *[str(a) for a in args]],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(),
    )
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    code = proc.wait(timeout=120)
    text = b"".join(chunks).decode("utf-8", "replace")
    return CkptResult(code, text, text)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A safetensors file with long and hostile names, its converted copy, a Trainer run."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("world")
    state = {f"model.layers.{i}.mlp.weight": torch.full((2, 3), float(i)) for i in range(3)}
    state[LONG] = torch.zeros(4)
    state[EVIL] = torch.ones(1)
    model = root / "model.safetensors"
    save_file(state, model)
    other = dict(state)
    other["model.layers.0.mlp.weight"] = torch.full((2, 3), 9.0)
    save_file(other, root / "other.safetensors")
    (root / "empty-run").mkdir()
    return {"model": model, "other": root / "other.safetensors", "root": root}


def invocations(world: dict[str, Path], tmp: Path) -> dict[str, list[str]]:
    """One real invocation per command (each writes into `tmp`)."""
    model = str(world["model"])
    run = trainer_run(tmp)
    # protect writes its parity beside the file: a copy of its own
    protected = tmp / "protected"
    protected.mkdir()
    (protected / "model.safetensors").write_bytes(world["model"].read_bytes())
    return {
        "inspect": ["inspect", model, "--list"],
        "verify": ["verify", model],
        "convert": ["convert", model, str(tmp / "out.safetensors"), "--to", "safetensors"],
        "reshard": ["reshard", model, str(tmp / "resharded"), "--max-shard-size", "64B"],
        "prune": ["prune", str(run), "--keep-last", "2"],
        "latest": ["latest", str(run)],
        "diff": ["diff", model, str(world["other"])],
        "protect": ["protect", str(protected), "--force"],  # (run twice by one test)
        "repair": ["repair", str(protected)],
    }


# -- pipes and terminals ----------------------------------------------------------------------


@pytest.mark.parametrize("colour", [{}, {"FORCE_COLOR": "1"}], ids=["plain", "FORCE_COLOR"])
@pytest.mark.slow
def test_piped_output_is_one_record_per_line_never_wrapped(
    world: dict[str, Path], colour: dict[str, str]
) -> None:
    # FORCE_COLOR (common in CI) makes rich call a pipe a terminal: colour is the user's
    # choice there, but records cut at COLUMNS were not
    env = {"COLUMNS": "40", **colour}
    result = run_ckpt_process("inspect", world["model"], "--list", env=env)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    # `ckpt inspect X -l | grep NAME` finds the whole record on one line
    [record] = [line for line in lines if LONG in line]
    assert "float32" in record and "[4]" in record and "model.safetensors" in record
    # no box drawing off a terminal
    assert not any(ch in result.stdout for ch in "│╭╰─┃")


def test_long_error_messages_off_a_terminal_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / ("a-folder-name-long-enough-to-wrap-" * 4)
    result = run_ckpt_process("verify", missing, env={"COLUMNS": "40"})
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and str(missing) in result.stderr


def test_parser_errors_off_a_terminal_are_one_line_without_a_box() -> None:
    result = run_ckpt_process("inspect", "--no-such-option", "x")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "No such option: --no-such-option" in result.stderr
    assert "ckpt inspect --help" in result.stderr
    assert not any(ch in result.stderr for ch in "│╭╰─")


@pytest.mark.slow  # every command twice, through pipes and a pseudo-terminal
def test_every_command_runs_with_pipes_and_with_a_terminal(
    world: dict[str, Path], tmp_path: Path
) -> None:
    runs = invocations(world, tmp_path)
    for name, args in runs.items():
        piped = run_ckpt_process(*args, env={"COLUMNS": "30"})
        assert piped.exit_code in (0, 1), (name, piped.stderr)
        if name in ("prune", "latest"):
            # a run table row is one line: name, step, status, size, age, notes
            rows = [line for line in piped.stdout.splitlines() if "checkpoint-100" in line]
            assert name == "latest" or ("complete" in rows[0] and "delete" in rows[0]), rows
        assert "Traceback" not in piped.stderr
        for line in piped.stdout.splitlines():
            assert "\x1b" not in line, (name, line)  # no colour codes into a pipe
        # the same command on a terminal (fresh outputs for the writers)
        if name in ("convert", "reshard"):
            args = [*args[:2], args[2] + "-tty", *args[3:]]
        tty = run_in_pty(*args)
        assert tty.exit_code == piped.exit_code, (name, tty.stdout)
        assert "Traceback" not in tty.stdout
        # names from the checkpoint never reach the terminal raw
        assert "\x1b[2J" not in tty.stdout and "\u202e" not in tty.stdout, name
    for command in describe_app():  # commands added later get at least their help checked
        assert run_ckpt_process(command.name, "--help").exit_code == 0
        assert run_in_pty(command.name, "--help").exit_code == 0


def test_a_closed_pipe_exits_quietly_with_141(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    # far more than a pipe buffer holds, so the writer meets the closed pipe mid-output
    state = {f"{LONG}.{i}": torch.zeros(1) for i in range(3000)}
    save_file(state, tmp_path / "big.safetensors")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "inspect", str(tmp_path / "big.safetensors"), "-l"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert first.startswith(str(tmp_path).encode())
    assert code == 141, stderr
    assert stderr == ""  # no traceback, no "Exception ignored", no error message


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "--help"],
        ["inspect", "--no-such-option", "--json"],  # the usage error's envelope
        ["no-such-command", "--json"],
        [],  # bare `ckpt`: its help
    ],
    ids=["help", "usage-error", "no-such-command", "bare"],
)
@pytest.mark.slow
def test_help_and_usage_errors_into_a_closed_pipe_exit_141_too(args: list[str]) -> None:
    # `ckpt --help | true`: the reader is gone before ckpt writes
    reader, writer = os.pipe()
    os.close(reader)
    done = subprocess.run(
        [sys.executable, "-m", "ckpt_cli", *args],
        stdout=writer,
        stderr=subprocess.PIPE,
        env=_env(),
        timeout=120,
    )
    os.close(writer)
    assert done.returncode == 141, done.stderr
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("stdout", ["full", "closed"])
@pytest.mark.parametrize("args", [["convert", "--help"], ["--help"]], ids=["command", "root"])
def test_a_help_that_stdout_refuses_is_an_io_error_not_a_crash(
    stdout: str, args: list[str]
) -> None:
    """`ckpt convert --help > /dev/full` (or `>&-`) was a Python traceback and exit 1 while
    `ckpt --help > /dev/full` was exit 74 naming the errno: a command's help is printed while
    its own arguments are parsed, outside what the root's parser guards."""
    if stdout == "full" and not Path("/dev/full").exists():
        pytest.skip("this system has no /dev/full")
    _assert_refused_stdout_is_an_io_error(args, stdout)


@pytest.mark.parametrize("json_output", [False, True], ids=["human", "json"])
@pytest.mark.parametrize("stdout", ["full", "closed"])
@pytest.mark.slow
def test_a_stdout_that_refuses_the_result_is_an_io_error_not_a_crash(
    world: dict[str, Path], tmp_path: Path, stdout: str, json_output: bool
) -> None:
    """`ckpt inspect X > /dev/full` (or with stdout closed, `>&-`) was a Python traceback and
    exit 1, which a script reads as "problems found": it is exit 74 naming the errno, as
    for any other file that cannot be written."""
    if stdout == "full" and not Path("/dev/full").exists():
        pytest.skip("this system has no /dev/full")
    run = trainer_run(tmp_path)
    for args in (["inspect", str(world["model"]), "--list"], ["latest", str(run)]):
        _assert_refused_stdout_is_an_io_error(args + (["--json"] if json_output else []), stdout)


def _assert_refused_stdout_is_an_io_error(args: list[str], stdout: str) -> None:
    """`ckpt ARGS` with stdout on /dev/full (`full`) or closed (`closed`, `>&-`): exit 74
    naming the errno, no traceback."""
    with contextlib.ExitStack() as stack:
        target: Any = stack.enter_context(open("/dev/full", "w")) if stdout == "full" else None
        done = subprocess.run(
            [sys.executable, "-m", "ckpt_cli", *args],
            stdout=target,
            stderr=subprocess.PIPE,
            env=_env(),
            timeout=120,
            # `>&-`: the child starts without a file descriptor 1
            preexec_fn=None if stdout == "full" else _close_stdout,
        )
    assert done.returncode == 74, done.stderr
    errno_name = "ENOSPC" if stdout == "full" else "EBADF"
    assert errno_name in done.stderr.decode() and b"Traceback" not in done.stderr


def _close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("stderr", ["full", "reader-gone"])
@pytest.mark.slow
def test_a_stderr_that_refuses_messages_never_changes_the_exit_status(
    world: dict[str, Path], tmp_path: Path, stderr: str
) -> None:
    """`ckpt ... 2>>job.log` with the log's disk full: a missing path exited 1 ("problems
    found") while its `--json` envelope said 3, a usage error 74, and a convert whose DEST was
    published whole exited 74 because its warning could not be printed. stderr carries only
    messages: the exit status (and stdout) must be what the command's outcome was; with the
    log's reader gone (`2> >(head -1)`) the same, not 141 with stdout silenced."""
    if stderr == "full" and not Path("/dev/full").exists():
        pytest.skip("this system has no /dev/full")
    dest = tmp_path / "out.safetensors"
    cases: list[tuple[list[str], int]] = [
        (["inspect", str(tmp_path / "missing"), "--json"], 3),
        (["inspect", str(tmp_path / "missing")], 3),
        (["inspect", "--no-such-option", "--json"], 2),
        # published whole, with a warning that `--rename` matched nothing
        (
            ["convert", str(world["model"]), str(dest), "--to", "safetensors", "--rename", "x.=y."],
            0,
        ),
        (["convert", str(world["model"]), str(dest), "--to", "safetensors", "--json"], 2),
    ]
    for args, expected in cases:
        with contextlib.ExitStack() as stack:
            if stderr == "full":
                target: Any = stack.enter_context(open("/dev/full", "w"))
            else:
                reader, target = os.pipe()
                os.close(reader)
                stack.callback(os.close, target)
            done = subprocess.run(
                [sys.executable, "-m", "ckpt_cli", *args],
                stdout=subprocess.PIPE,
                stderr=target,
                env=_env(),
                timeout=120,
            )
        assert done.returncode == expected, (args, done.returncode)
        if "--json" in args:
            assert json.loads(done.stdout)["exit_code"] == expected
        elif expected == 0:
            assert str(dest) in done.stdout.decode()  # the report still printed
    with safe_open(str(dest), "pt") as published:
        assert EVIL in published.keys()  # noqa: SIM118


# -- terminal escape injection (#19 item 14) ---------------------------------------------------


@pytest.mark.slow
def test_control_and_bidi_characters_in_names_are_escaped_in_human_output(
    world: dict[str, Path],
) -> None:
    human = run_ckpt("inspect", world["model"], "--list")
    assert human.exit_code == 0
    assert "\x1b" not in human.stdout and "\u202e" not in human.stdout
    assert "evil\\x1b[2J\\x1b[31mred\\u202egpj.exe" in human.stdout
    # JSON keeps the real name, escaped by the encoder
    names = [
        e["name"] for e in run_ckpt("inspect", world["model"], "--json").json["result"]["entries"]
    ]
    assert EVIL in names
    # error messages too: a path holding an escape sequence
    missing = run_ckpt("inspect", str(world["root"] / "no\x1b[2Jsuch"))
    assert missing.exit_code == 3
    assert "\x1b[2J" not in missing.stderr and "no\\x1b[2Jsuch" in missing.stderr
    # and on a real terminal, where rich adds its own colours
    tty = run_in_pty("diff", world["model"], world["other"])
    assert "\x1b[2J" not in tty.stdout and "\u202e" not in tty.stdout


def test_a_newline_in_a_file_or_tensor_name_never_splits_a_line_of_human_output(
    tmp_path: Path,
) -> None:
    """A checkpoint whose shard, extra file and tensor names hold a newline: `inspect --list`
    printed the shard's name over two lines (its second read as a record of its own), and
    `convert` said `carried: notes` with `FAKE LINE.txt` on a line by itself. Such names are
    now printed quoted (`'notes\\nFAKE LINE.txt'`), one record a line; JSON keeps them."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "m"
    model.mkdir()
    save_file({"a": torch.zeros(3)}, model / "model.safetensors")
    save_file({"b\nFAKE: tensor": torch.zeros(3)}, model / "extra\nFAKE LINE.safetensors")
    (model / "notes\nFAKE LINE.txt").write_text("x")
    listed = run_ckpt("inspect", model, "--list")
    assert listed.exit_code == 0, listed.stderr
    records = listed.stdout.splitlines()
    assert not any(line.startswith("FAKE") for line in records), listed.stdout
    assert "'extra\\nFAKE LINE.safetensors'" in listed.stdout
    assert "'b\\nFAKE: tensor'" in listed.stdout
    tree = run_ckpt("inspect", model)
    assert not any(line.startswith("FAKE") for line in tree.stdout.splitlines()), tree.stdout
    converted = run_ckpt("convert", model, tmp_path / "out", "--to", "safetensors")
    assert converted.exit_code == 0, converted.stderr
    assert "carried: 'notes\\nFAKE LINE.txt'" in converted.stdout, converted.stdout
    assert not any(line.startswith("FAKE") for line in converted.stdout.splitlines())
    assert (tmp_path / "out" / "notes\nFAKE LINE.txt").read_text() == "x"
    names = [e["name"] for e in run_ckpt("inspect", model, "--json").json["result"]["entries"]]
    assert "b\nFAKE: tensor" in names


def test_a_message_naming_a_file_with_a_newline_stays_one_line(tmp_path: Path) -> None:
    """verify prints one line per problem (fix included), and an error is one line: a shard
    named `extra\\nok: fake.safetensors`, truncated, split both in two, the second line
    reading as a record of its own (`ok: fake.safetensors: declares a 56-byte header...`).
    The line break is now written as `\\n`."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "m"
    model.mkdir()
    save_file({"a": torch.zeros(3)}, model / "model.safetensors")
    shard = model / "extra\nok: fake.safetensors"
    save_file({"b": torch.zeros(3)}, shard)
    os.truncate(shard, 50)
    checked = run_ckpt("verify", model)
    assert checked.exit_code == 1
    assert not any(line.startswith("ok: fake") for line in checked.stdout.splitlines())
    assert "extra\\nok: fake.safetensors: declares" in checked.stdout, checked.stdout
    failed = run_ckpt("inspect", model)
    assert failed.exit_code == 4
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert "extra\\nok: fake.safetensors" in failed.stderr
    assert (
        "extra\nok: fake.safetensors"
        in run_ckpt("inspect", model, "--json").json["error"]["message"]
    )


# -- one JSON envelope per outcome -------------------------------------------------------------
@pytest.mark.parametrize("signals", [1, 2], ids=["one-signal", "a-second-signal"])
@pytest.mark.slow
def test_a_signal_while_the_envelope_prints_leaves_exactly_one(
    tmp_path: Path, signals: int
) -> None:
    """`ckpt inspect BIG --json | slow-reader`, Ctrl-C while the envelope was being written:
    stdout held the first envelope cut short with a second one (exit 130) glued to it, which
    no JSON parser reads. The work is done once the envelope prints: the signal is held, the
    envelope is written whole (none of it dropped by Python's text layer, which loses what
    a signal-interrupted write left unwritten) and the command ends as it would have. A second
    signal stops the printing: what is on stdout stays the only envelope, the interruption is
    said on stderr, exit 130."""
    import signal
    import time

    import torch
    from safetensors.torch import save_file

    model = tmp_path / "many.safetensors"
    save_file({f"model.layers.{i}.mlp.weight": torch.zeros(1) for i in range(20_000)}, model)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "inspect", str(model), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    # the envelope (megabytes) has begun: the command is printing, and cannot finish until read
    first = proc.stdout.read(4096)
    time.sleep(1)  # let it block on the full pipe, where the lost-bytes case lives
    proc.send_signal(signal.SIGINT)
    if signals == 2:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    out = first + proc.stdout.read()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert out.count(b'"ckpt_json"') == 1, out[-300:]
    if signals == 1:
        assert proc.returncode == 0, err
        doc = json.loads(out)
        assert doc["exit_code"] == 0 and len(doc["result"]["entries"]) == 20_000
    else:
        assert proc.returncode == 130, err
        assert "interrupted while the report printed" in err


@pytest.fixture(scope="module")
def validator() -> Any:
    import jsonschema

    schema = json.loads((REPO / "schema" / "ckpt-json.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def envelope_of(result: CkptResult, validator: Any) -> dict[str, Any]:
    """The one envelope on stdout, valid against the published schema."""
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout  # exactly one document, compact off a terminal
    doc: dict[str, Any] = json.loads(lines[0])
    errors = [e.message for e in validator.iter_errors(doc)]
    assert not errors, errors
    assert doc["exit_code"] == result.exit_code
    if result.exit_code:
        assert doc["error"]["code"] and doc["error"]["message"] and doc["error"]["fix"]
    return doc


def test_the_published_schema_is_current() -> None:
    from ckpt_cli.cli.render.schema import render_schema

    committed = (REPO / "schema" / "ckpt-json.schema.json").read_text()
    assert committed == render_schema(), "schema is stale: run `make completions`"


@pytest.mark.slow
def test_every_command_prints_one_valid_envelope_for_every_outcome(
    world: dict[str, Path], tmp_path: Path, validator: Any
) -> None:
    for name, args in invocations(world, tmp_path).items():
        doc = envelope_of(run_ckpt_process(*args, "--json"), validator)
        assert doc["command"] == name
    # problems found (diff: exit 1) carry an error object
    differ = envelope_of(run_ckpt("diff", world["model"], world["other"], "--json"), validator)
    assert differ["exit_code"] == 1 and differ["error"]["code"] == "problems_found"
    # `ckpt latest EMPTY --json` is exit 3 with an error, not `error: null` (the code every
    # command gives a folder holding no checkpoint)
    empty = envelope_of(run_ckpt("latest", world["root"] / "empty-run", "--json"), validator)
    assert empty["exit_code"] == 3 and empty["error"]["code"] == "no_checkpoint"
    # parser errors, for every command (later ones included): unknown option, missing argument
    for command in describe_app():
        unknown = run_ckpt_process(command.name, "--no-such-option", "--json")
        doc = envelope_of(unknown, validator)
        assert (doc["command"], doc["exit_code"]) == (command.name, 2)
        assert "--no-such-option" in doc["error"]["message"]
        needs_argument = any(
            p.param_type_name == "argument" and p.required for p in _click_params(command.name)
        )
        if needs_argument:
            missing = envelope_of(run_ckpt(command.name, "--json"), validator)
            assert missing["exit_code"] == 2 and "Missing argument" in missing["error"]["message"]


def test_a_truncated_file_gives_a_bad_checkpoint_envelope(tmp_path: Path, validator: Any) -> None:
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    doc = envelope_of(run_ckpt("verify", tmp_path / "cut.safetensors", "--json"), validator)
    assert doc["exit_code"] in (1, 4)


def _click_params(name: str) -> list[Any]:
    import typer.main

    from ckpt_cli.cli.app import get_app

    group = typer.main.get_command(get_app())
    return list(group.commands[name].params)  # type: ignore[attr-defined]


# -- one vocabulary for options ----------------------------------------------------------------


def _options() -> Iterator[tuple[str, str, list[str]]]:
    for command in describe_app():
        for option in command.options:
            for short in option.shorts:
                yield command.name, short, option.longs


def test_no_short_flag_means_two_things() -> None:
    meaning: dict[str, set[str]] = {}
    users: dict[str, set[str]] = {}
    for command, short, longs in _options():
        meaning.setdefault(short, set()).add(longs[0])
        users.setdefault(short, set()).add(command)
    double = {s: (longs, users[s]) for s, longs in meaning.items() if len(longs) > 1}
    assert not double, f"short flags with two meanings: {double}"


def test_no_long_option_means_two_things() -> None:
    """`--mode` was how to fetch in `download` (shards|tensors) and which end of the metric is
    best in `prune` and `sync` (min|max). An option name is declared the same way in every
    command that takes it: a flag everywhere or a value everywhere, the same metavar, the same
    closed set of values (enum choices, or what the completions offer), the same short name and
    the same partner (`--higher-is-better/--lower-is-better`)."""
    shapes: dict[str, dict[tuple[object, ...], set[str]]] = {}
    for command in describe_app():
        for option in command.options:
            shape = (
                tuple(option.longs),
                tuple(option.shorts),
                option.takes_value,
                option.metavar if option.takes_value else None,
                tuple(sorted(option.values)),
            )
            for long in option.longs:
                shapes.setdefault(long, {}).setdefault(shape, set()).add(command.name)
    double = {name: found for name, found in shapes.items() if len(found) > 1}
    assert not double, f"option names declared with two meanings: {double}"


def test_hidden_options_are_exactly_the_deprecated_spellings_and_say_so() -> None:
    """A hidden option is an old spelling kept working (it is left out of help and completions,
    so the vocabulary test above does not see it): each must be registered with what replaces
    it, and every registered one must exist."""
    import typer.main

    from ckpt_cli.cli.app import get_app
    from ckpt_cli.cli.conventions import DEPRECATED_OPTIONS

    group = typer.main.get_command(get_app())
    hidden = {
        (name, long)
        for name, command in group.commands.items()  # type: ignore[attr-defined]
        for param in command.params
        if param.param_type_name == "option" and getattr(param, "hidden", False)
        for long in param.opts
        if long.startswith("--")
    }
    assert hidden == set(DEPRECATED_OPTIONS)
    visible = {(c.name, n) for c in describe_app() for o in c.options for n in o.longs}
    for (command, _old), alias in DEPRECATED_OPTIONS.items():
        # what it points at is a real, visible option of the same command
        assert {(command, new) for new, _value in alias.replacements.values()} <= visible


def test_every_command_that_can_plan_takes_n_for_its_dry_run() -> None:
    """`-n/--dry-run` means "the plan, nothing written" wherever a command has a dry run
    (protect and repair took only the long name)."""
    planners = {
        command.name: list(option.shorts)
        for command in describe_app()
        for option in command.options
        if "--dry-run" in option.longs
    }
    assert {"convert", "reshard", "download", "prune", "protect", "repair"} <= set(planners)
    assert all(shorts == ["-n"] for shorts in planners.values()), planners


def test_a_negative_settle_time_is_a_usage_error_in_every_command(tmp_path: Path) -> None:
    """`--settle -5` meant nothing (every save "settled") and was taken silently."""
    for command in ("latest", "prune", "sync", "doctor"):
        args = [command, tmp_path, *(["s3://bucket/run/"] if command == "sync" else [])]
        refused = run_ckpt(*args, "--settle", "-5")
        assert refused.exit_code == 2, (command, refused.stdout, refused.stderr)
        assert "--settle" in refused.stderr, command


def test_every_command_has_quiet_and_verbose_and_real_metavars() -> None:
    for command in describe_app():
        longs = {n for o in command.options for n in o.longs}
        assert {"--quiet", "--verbose", "--json"} <= longs, command.name
        text = run_ckpt(command.name, "--help").stdout
        assert "-q, --quiet" in text and "-v, --verbose" in text
        # no `{src}`, `<str>`, `<bool>`: real metavars, and flags take no value
        usage = text.splitlines()[0]
        assert "{" not in usage and "<" not in usage, usage
        for bad in ("<str>", "<bool>", "<int>", "<list", " TEXT", " BOOLEAN", " INTEGER"):
            assert bad not in text.split("Examples")[0], (command.name, bad)
        assert "  --json  " in text  # a flag: no value after it
    assert "--max-shard-size SIZE" in run_ckpt("convert", "--help").stdout
    # the metavar is the letter the help text and docs/commands/protect.md use (it said N)
    assert "--parity K " in run_ckpt("protect", "--help").stdout
    assert "-k, --filter GLOB" in run_ckpt("inspect", "--help").stdout
    assert "Usage: ckpt convert [OPTIONS] SRC DEST" in run_ckpt("convert", "--help").stdout


def test_the_unreleased_old_spellings_are_plain_usage_errors(world: dict[str, Path]) -> None:
    # 0.1.0 was never released: no hidden aliases of old option names are kept
    old = run_ckpt("inspect", world["model"], "--tensors")
    assert old.exit_code == 2
    assert "No such option" in old.stderr and "--tensors" in old.stderr
    assert "--tensors" not in render_all()["ckpt.bash"].split("download)")[1].split(";;")[0]


def test_quiet_silences_warnings_and_quiet_with_verbose_is_refused(
    world: dict[str, Path], tmp_path: Path
) -> None:
    # a --rename rule that matches nothing is a warning
    convert = ["convert", world["model"], "--to", "safetensors", "--rename", "zz=yy"]
    loud = run_ckpt(*convert[:2], tmp_path / "loud", *convert[2:])
    quiet = run_ckpt(*convert[:2], tmp_path / "quiet", *convert[2:], "-q")
    assert loud.exit_code == quiet.exit_code == 0
    assert "warning" in loud.stderr and quiet.stderr == ""
    both = run_ckpt("inspect", world["model"], "-q", "-v")
    assert both.exit_code == 2 and "contradict" in both.stderr
    verbose = run_ckpt("inspect", world["root"] / "nope", "-v")
    assert "(error code not_found, exit 3)" in verbose.stderr


def test_completions_offer_option_values_and_keep_descriptions_intact() -> None:
    scripts = render_all()
    assert (
        'convert\\ --to) COMPREPLY=( $(compgen -W "safetensors dcp torch hf torchtitan megatron"'
        in scripts["ckpt.bash"]
    )
    assert 'download\\ --mode) COMPREPLY=( $(compgen -W "shards tensors"' in scripts["ckpt.bash"]
    assert ":ALGO:(sha256 blake3 xxh3)" in scripts["ckpt.zsh"]
    assert ":PATH:_files" in scripts["ckpt.zsh"]  # verify --manifest completes paths
    assert "-f -a 'bf16 fp16 fp32'" in scripts["ckpt.fish"]
    # descriptions are not mangled: `hf://` stays `hf://` (0.1.0 wrote `hf -//`)
    assert "hf -//" not in scripts["ckpt.zsh"] and "hf://org/repo" in scripts["ckpt.zsh"]


def test_bash_completion_completes_values_in_a_real_bash(tmp_path: Path) -> None:
    script = tmp_path / "c.sh"
    script.write_text(
        render_all()["ckpt.bash"]
        + 'COMP_WORDS=(ckpt convert a b --to s); COMP_CWORD=5; _ckpt; echo "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["safetensors"]


# -- Hub habits ---------------------------------------------------------------------------------


def test_a_bare_org_repo_that_is_no_path_gets_the_hf_hint(tmp_path: Path) -> None:
    result = run_ckpt_process("inspect", "someorg/somemodel", cwd=tmp_path)
    assert result.exit_code == 3
    assert "did you mean hf://someorg/somemodel?" in result.stderr.lower()
    # a file missing from a local folder is no Hub repo: `verify --checksums` of a folder
    # without its manifest said "did you mean hf://model/ckpt-manifest.json?"
    import numpy as np
    from safetensors.numpy import save_file

    (tmp_path / "model").mkdir()
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "model" / "model.safetensors"))
    missing = run_ckpt_process("verify", "model", "--checksums", cwd=tmp_path)
    assert missing.exit_code == 3, missing.stderr
    assert "ckpt-manifest.json" in missing.stderr and "hf://" not in missing.stderr


def test_revision_on_a_local_path_is_refused(world: dict[str, Path]) -> None:
    result = run_ckpt("inspect", world["model"], "--revision", "v1", "--json")
    assert result.exit_code == 2
    assert "--revision" in result.json["error"]["message"]


def test_an_unknown_command_is_the_root_s_usage_error(validator: Any) -> None:
    result = run_ckpt("nosuch", "--json")
    doc = envelope_of(result, validator)
    assert doc["command"] == "ckpt" and doc["exit_code"] == 2
    assert "No such command 'nosuch'" in doc["error"]["message"]
    assert "Run 'ckpt --help'" in doc["error"]["fix"]
    assert result.stderr.startswith("ckpt: error: No such command")


def test_verbose_shows_the_traceback_of_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops import inspect as inspect_ops

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug in the library")

    monkeypatch.setattr(inspect_ops, "inspect_with", broken)  # the command's one call
    quiet = run_ckpt("inspect", tmp_path)
    assert quiet.exit_code == 70 and "Traceback" not in quiet.stderr
    loud = run_ckpt("inspect", tmp_path, "-v")
    assert loud.exit_code == 70
    assert "Traceback" in loud.stderr and "RuntimeError: a bug in the library" in loud.stderr


@pytest.mark.slow
def test_download_runs_with_pipes_and_with_a_terminal(hub: Any, tmp_path: Path) -> None:
    import torch

    from .hub_fixtures import publish_model

    state = {LONG: torch.zeros(4), EVIL: torch.ones(1), "model.norm.weight": torch.ones(3)}
    publish_model(hub, "org/model", tmp_path / "src", state)
    args = ["download", "hf://org/model", str(tmp_path / "d"), "--mode", "tensors", "--dry-run"]
    piped = run_ckpt_process(*args, env={"COLUMNS": "40"})
    assert piped.exit_code == 0, piped.stderr
    # the range table: one line per request, the long name whole on it
    assert any(LONG in line and "B" in line for line in piped.stdout.splitlines())
    assert "\x1b" not in piped.stdout
    tty = run_in_pty(*args)
    assert tty.exit_code == 0, tty.stdout
    assert "\x1b[2J" not in tty.stdout and "\u202e" not in tty.stdout
    fetched = run_in_pty("download", "hf://org/model", tmp_path / "real")
    assert fetched.exit_code == 0, fetched.stdout
    assert (tmp_path / "real" / "model.safetensors").is_file()


def test_every_command_that_reads_a_hub_location_takes_the_hub_options(tmp_path: Path) -> None:
    """`prune`, `doctor`, `merge` and `latest` read `hf://` run folders and models but had no
    `--revision`, `--repo-type` or `--token` (`prune hf://org/run --revision v1` was "No such
    option"): the location parameters of every command get them."""
    import typer

    from ckpt_cli.cli.app import get_app
    from ckpt_cli.cli.conventions import LOCATION_PARAMS

    group = typer.main.get_command(get_app())
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        arguments = {p.name for p in command.params if p.param_type_name == "argument"}
        options = {o for p in command.params for o in p.opts}
        if arguments & set(LOCATION_PARAMS):
            assert {"--revision", "--repo-type", "--token"} <= options, name
    assert {"run_dir", "base", "adapter"} <= set(LOCATION_PARAMS)
    refused = run_ckpt("prune", tmp_path, "--keep-last", "1", "--revision", "v1", "--json")
    assert (
        refused.exit_code == 2 and "applies to a Hub location" in refused.json["error"]["message"]
    )
    # --token too: a token for no Hub location would be silently unused
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, tmp_path / "l.safetensors")
    for args in (("inspect", tmp_path / "l.safetensors"), ("prune", tmp_path, "--keep-last", "1")):
        token = run_ckpt(*args, "--token", "hf_x", "--json")
        assert token.exit_code == 2, (args, token.stdout)
        assert "--token applies to a Hub location" in token.json["error"]["message"]


def test_settle_says_one_thing_in_every_command_that_takes_it() -> None:
    """`--settle` read as three options: "an incomplete save ... counts as still being
    written" (latest), "a checkpoint with a file modified within ... is never touched"
    (prune), "saves of layouts without a commit marker wait ..." (sync). It is one judgement
    (docs/safety.md, conventions): every help opens with it, then says what that command does
    with such a save."""
    shared = (
        "A save modified within this DURATION (seconds, or 2m, 1h) may still be being written: "
        "an incomplete one counts as writing, not interrupted"
    )
    helps = {
        command.name: option.help
        for command in describe_app()
        for option in command.options
        if "--settle" in option.longs
    }
    assert set(helps) == {"latest", "doctor", "prune", "sync"}
    for name, text in helps.items():
        assert text.startswith(shared), (name, text)
    assert "none is touched" in helps["prune"]
    assert "commit marker" in helps["sync"] and "not replaced" in helps["sync"]
    safety = (REPO / "docs" / "safety.md").read_text()
    assert "`--settle DURATION`" in safety and "latest, doctor, prune, sync" in safety


def test_piped_tables_carry_no_trailing_padding(world: dict[str, Path], tmp_path: Path) -> None:
    """Off a terminal a table's rows were padded with spaces to its widest cell, the last
    column too (406 characters a row for `prune`'s rules): `awk '{print length}'`, `diff` and
    editors saw them. Rows now end at their last character; columns stay aligned."""
    run = trainer_run(tmp_path)
    for args in (
        ["prune", str(run), "--keep-last", "1"],
        ["inspect", str(world["model"]), "--list"],
    ):
        result = run_ckpt_process(*args)
        assert result.exit_code in (0, 1), (args, result.stderr)
        lines = result.stdout.splitlines()
        assert len(lines) > 2, (args, result.stdout)
        assert [line for line in lines if line != line.rstrip()] == [], args
