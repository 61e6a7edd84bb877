"""Shared test helpers: run the real CLI, build real checkpoints with the real writers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt_cli.cli.app import get_app

from . import framework_marks

REPO = Path(__file__).resolve().parents[1]


def _stop_signals_as_from_a_terminal() -> None:
    """A suite started as a shell's background job (`make test &` in a script) or under
    `nohup` inherits SIGINT or SIGHUP ignored, in every worker and every `ckpt` it starts; ckpt
    keeps an ignored signal ignored, as `nohup` asks, so the tests that send one would see
    nothing happen. They test ckpt as a terminal starts it: with its stop signals live.
    (`test_faults.py` starts a `ckpt` with them ignored on purpose.)"""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGHUP: signal.SIG_DFL}
    defaults[signal.SIGTERM] = signal.SIG_DFL
    for signum, handler in defaults.items():
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, handler)


_stop_signals_as_from_a_terminal()

# fixture modules shared across test files
pytest_plugins = [
    "tests.s3_fixtures",
    "tests.hub_fixtures",
    "tests.model_fixtures",
    "tests.framework_fixtures",
]


@dataclass
class CkptResult:
    """What one `ckpt` run produced."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict[str, Any]:
        """The --json envelope printed on stdout."""
        doc: dict[str, Any] = json.loads(self.stdout)
        return doc


def run_ckpt(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> CkptResult:
    """Run `ckpt ARGS…` in-process (fast) through typer's test runner."""
    runner = CliRunner()
    result = runner.invoke(get_app(), [str(a) for a in args], env=env, catch_exceptions=False)
    return CkptResult(result.exit_code, result.stdout, result.stderr)


def run_ckpt_process(
    *args: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> CkptResult:
    """Run `python -m ckpt_cli ARGS…` as a real process (for import checks, signals, torchrun)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_cli", *[str(a) for a in args]],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
    return CkptResult(proc.returncode, proc.stdout, proc.stderr)


def _frameworks_of(item: pytest.Function) -> frozenset[str]:
    """The frameworks a test needs: through its own code, its fixtures' and what they call."""
    functions = [item.function]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        functions.extend(fixturedef.func for fixturedef in defs)
    # helpers imported from other test modules (a fixture builder called directly)
    for function in list(functions):
        namespace = getattr(function, "__globals__", {})
        for name in getattr(getattr(function, "__code__", None), "co_names", ()):
            helper = namespace.get(name)
            code = getattr(helper, "__code__", None)
            if code is not None and code.co_filename.startswith(str(REPO / "tests")):
                functions.append(helper)
    needed: set[str] = set()
    for function in functions:
        code = getattr(function, "__code__", None)
        if code is not None:
            needed |= framework_marks.frameworks_needed(code.co_filename, function.__name__)
    return frozenset(needed)


def _deselects_every_test_of(markexpr: str, marks: frozenset[str]) -> bool:
    """Whether `-m markexpr` deselects a test carrying `marks`, whatever other marks of
    ours it carries too."""
    from itertools import combinations

    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    others = sorted({"frameworks", "torchrun", "slow"} - marks)

    def selects(carried: frozenset[str]) -> bool:
        return expression.evaluate(lambda name, /, **kwargs: name in carried)

    return not any(
        selects(marks | set(extra))
        for size in range(len(others) + 1)
        for extra in combinations(others, size)
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave a test module unimported when `-m` deselects every test of it (read from its
    source: a framework imported at its top, its `pytestmark`). The fast loop deselects the
    framework and torchrun modules, and importing them (transformers, torch.distributed) cost
    each worker about 17 s before its first test."""
    markexpr = config.getoption("markexpr", "")
    if not markexpr or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    marks = framework_marks.module_marks(str(collection_path))
    if marks and _deselects_every_test_of(markexpr, marks):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs a framework `frameworks` (see tests/framework_marks.py)."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        needed = _frameworks_of(item)
        if needed:
            item.add_marker(pytest.mark.frameworks(needs=sorted(needed)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a framework test, saying which, where the frameworks extra is not installed; and
    remember the running test, so launch helpers can check it carries the torchrun marker."""
    from . import dist_helpers

    dist_helpers.CURRENT_TEST = item
    marks = list(item.iter_markers("frameworks"))
    if marks:
        needed = {name for mark in marks for name in mark.kwargs.get("needs", ())}
        # an explicit mark may stand for a framework only a launched script imports
        wanted = needed or set(framework_marks.FRAMEWORKS)
        missing = sorted(name for name in wanted if not framework_marks.installed(name))
        if missing:
            pytest.skip(
                f"needs the frameworks extra ({', '.join(missing)} not installed): "
                "`make test` installs it"
            )


@pytest.fixture
def ckpt() -> Any:
    """The in-process CLI runner."""
    return run_ckpt


class RecordingProgress:
    """A progress sink (`ckpt_cli.progress.Progress`) that remembers every phase it was told.

    `phases` holds (description, total, done) per `start`; `description`, `total` and `done`
    speak of the latest phase (empty and 0 before any).
    """

    def __init__(self) -> None:
        self.phases: list[tuple[str, int, int]] = []

    def start(self, total: int, description: str) -> None:
        self.phases.append((description, total, 0))

    def advance(self, amount: int) -> None:
        name, total, done = self.phases[-1] if self.phases else ("", 0, 0)
        self.phases[-1:] = [(name, total, done + amount)]

    def finish(self) -> None:
        pass

    @property
    def description(self) -> str:
        return self.phases[-1][0] if self.phases else ""

    @property
    def total(self) -> int:
        return self.phases[-1][1] if self.phases else 0

    @property
    def done(self) -> int:
        return self.phases[-1][2] if self.phases else 0


@pytest.fixture(autouse=True)
def _torch_globals_restored(request: pytest.FixtureRequest) -> Any:
    """Give every test torch's default deterministic-algorithms mode back, and say which test
    changed it: with it left on, a later test's `torch.empty` of a dtype torch cannot fill
    (float4_e2m1fn_x2) fails, far from the cause."""
    torch = sys.modules.get("torch")
    before = torch.are_deterministic_algorithms_enabled() if torch is not None else False
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled() != before:
        torch.use_deterministic_algorithms(before)
        import warnings

        warnings.warn(
            f"{request.node.nodeid} left torch's deterministic algorithms "
            f"{'on' if not before else 'off'}; restored",
            stacklevel=1,
        )


@pytest.fixture
def train() -> Any:
    """examples/restart_test/train.py as a module, with torch's global settings (threads,
    deterministic algorithms, RNG) restored after: its `main` changes all three."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "restart_train", REPO / "examples" / "restart_test" / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    yield module
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_rng_state(rng)


#: root reads every file whatever its mode: without these two capabilities it is refused as any
#: other user is (a real EACCES from the kernel, not a patched `open`)
_ROOT_READS_ANYWAY = "-dac_override,-dac_read_search"
_PROBE = (
    "import os, sys; p = sys.argv[1]\n"
    "os.listdir(p) if os.path.isdir(p) else os.close(os.open(p, os.O_RDONLY))"
)


def denying_prefix(denied: Path) -> list[str]:
    """The command prefix under which ckpt may not read `denied` (made mode 000 by the caller):
    none for a user; for root, `setpriv` dropping the capabilities that let root read anyway.
    Skips where neither denies."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root reads a mode-000 file, and setpriv is not here to drop that")
        prefix = [
            setpriv,
            f"--bounding-set={_ROOT_READS_ANYWAY}",
            f"--inh-caps={_ROOT_READS_ANYWAY}",
        ]
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", _PROBE, str(denied)], capture_output=True
    )
    if probe.returncode == 0:
        pytest.skip("mode 000 does not deny reading here")
    return prefix


def run_ckpt_json_as(
    prefix: list[str], *args: str | os.PathLike[str]
) -> tuple[int, dict[str, Any]]:
    """Run `python -m ckpt_cli ARGS… --json` under `prefix` (`denying_prefix`'s): (exit code,
    the JSON envelope)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "ckpt_cli", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)
