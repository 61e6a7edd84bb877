"""A Megatron-LM run folder (`ckpts/iter_0000100/`, `ckpts/iter_0000200/`... beside
`latest_checkpointed_iteration.txt`) as `latest`, `prune`, `inspect` and `sync` see it.

Megatron-LM's `save_checkpoint` writes each save with megatron-core's `dist_checkpointing.save`
(a `torch_dist` DCP, `common.pt`, and `metadata.json` last) and rewrites the tracker file with
the iteration only once the save has finished; `load_checkpoint` resumes from the iteration the
tracker names, never from the highest `iter_*` folder. The saves here are megatron-core's own
(tests/megatron_writer.py), one written and copied under each iteration's name.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from .conftest import run_ckpt
from .run_fixtures import age
from .s3_fixtures import S3Server, make_bucket
from .test_megatron import megatron

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def one_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `torch_dist` save written by megatron-core's `dist_checkpointing.save`."""
    folder = tmp_path_factory.mktemp("megatron-save") / "save"
    megatron("save", folder)
    return folder


def megatron_run(root: Path, save: Path, iterations: list[int], tracker: str | None) -> Path:
    """A run folder with a finished save at each iteration and the tracker saying `tracker`
    (none when None), all written an hour ago."""
    run = root / "ckpts"
    run.mkdir()
    for iteration in iterations:
        shutil.copytree(save, run / f"iter_{iteration:07d}")
    if tracker is not None:
        (run / TRACKER).write_text(tracker)
    age(run)
    return run


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")}


def test_latest_and_prune_follow_the_iteration_the_tracker_names(
    one_save: Path, tmp_path: Path
) -> None:
    # killed after iter_0000300 was written whole but before the tracker was rewritten, and
    # killed mid-save of iter_0000400 (megatron-core writes metadata.json last)
    run = megatron_run(tmp_path, one_save, [100, 200, 300, 400], "200")
    (run / "iter_0000400" / "metadata.json").unlink()
    age(run)
    original = files_of(run / "iter_0000200")

    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip() == str(run / "iter_0000200")
    assert "warning" not in latest.stderr

    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    assert table["layouts"] == ["megatron"]
    assert table["megatron_latest"] == "iter_0000200"
    status = {c["name"]: (c["status"], c["reason"] or "") for c in table["checkpoints"]}
    assert status["iter_0000200"] == ("complete", "")
    assert status["iter_0000300"][0] == "incomplete"
    assert f"newer than iter_0000200, the save {TRACKER} names" in status["iter_0000300"][1]
    assert status["iter_0000400"][0] == "incomplete"
    assert "no metadata.json" in status["iter_0000400"][1]

    plan = run_ckpt("prune", run, "--keep-last", "1", "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stdout
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions["iter_0000200"] == "keep"
    assert actions["iter_0000100"] == "delete"
    pruned = run_ckpt("prune", run, "--keep-last", "1", "--incomplete", "--yes")
    assert pruned.exit_code == 0, pruned.stdout + pruned.stderr
    # the unrecorded saves newer than the resume point are kept (as every run's are)
    assert sorted(p.name for p in run.iterdir()) == [
        "iter_0000200",
        "iter_0000300",
        "iter_0000400",
        TRACKER,
    ]
    assert files_of(run / "iter_0000200") == original
    assert (run / TRACKER).read_text() == "200"


def test_prune_never_deletes_the_save_the_tracker_names(one_save: Path, tmp_path: Path) -> None:
    # the save the tracker names lost its metadata.json since: Megatron-LM still reads it first
    run = megatron_run(tmp_path, one_save, [100, 200], "200")
    (run / "iter_0000200" / "metadata.json").unlink()
    age(run)
    pruned = run_ckpt("prune", run, "--incomplete", "--yes", "--json")
    assert pruned.exit_code == 0, pruned.stdout
    assert (run / "iter_0000200").is_dir()
    latest = run_ckpt("latest", run)
    assert latest.stdout.strip() == str(run / "iter_0000100")
    assert f"{TRACKER} names iter_0000200, which is incomplete" in latest.stderr


def test_a_tracker_saying_release_resumes_from_the_release_folder(
    one_save: Path, tmp_path: Path
) -> None:
    run = megatron_run(tmp_path, one_save, [100], "release")
    shutil.copytree(one_save, run / "release")
    age(run)
    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip() == str(run / "release")
    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    assert table["megatron_latest"] == "release"
    assert {c["name"]: c["status"] for c in table["checkpoints"]} == {
        "release": "complete",
        "iter_0000100": "incomplete",
    }
    plan = run_ckpt("prune", run, "--keep-last", "1", "--dry-run", "--json").json["result"]
    assert {d["name"]: d["action"] for d in plan["decisions"]}["release"] == "keep"


@pytest.mark.parametrize(
    ("tracker", "said"),
    [
        (None, f"no {TRACKER}: Megatron-LM's load_checkpoint finds no save to resume from"),
        ("garbage\n", f"{TRACKER} holds neither an iteration nor `release`"),
        ("300", f"{TRACKER} names iter_0000300, which this run folder does not hold"),
    ],
    ids=["missing", "garbage", "deleted"],
)
def test_latest_says_why_megatron_would_not_resume_from_its_answer(
    one_save: Path, tmp_path: Path, tracker: str | None, said: str
) -> None:
    run = megatron_run(tmp_path, one_save, [100, 200], tracker)
    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip() == str(run / "iter_0000200")
    assert said in latest.stderr
    assert f"write its iteration into {TRACKER} to resume from iter_0000200" in latest.stderr
    result = run_ckpt("latest", run, "--json").json["result"]
    assert said in result["tracker_problem"]


def test_sync_carries_the_tracker_there_and_back(
    one_save: Path, s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, "ckpts")
    run = megatron_run(tmp_path, one_save, [100, 200, 300], "200")
    pushed = run_ckpt("sync", run, "s3://ckpts/run")
    assert pushed.exit_code == 0, pushed.stdout + pushed.stderr
    remote = run_ckpt("latest", "s3://ckpts/run")
    assert remote.stdout.strip() == "s3://ckpts/run/iter_0000200", remote.stdout + remote.stderr
    assert "warning" not in remote.stderr
    fresh = tmp_path / "fresh-machine" / "ckpts"
    pulled = run_ckpt("sync", "s3://ckpts/run/", fresh, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    assert sorted(p.name for p in fresh.iterdir() if not p.name.startswith(".")) == [
        "iter_0000200",
        TRACKER,
    ]
    assert (fresh / TRACKER).read_text() == "200"
    assert files_of(fresh / "iter_0000200").items() >= files_of(run / "iter_0000200").items()
    assert run_ckpt("latest", fresh).stdout.strip() == str(fresh / "iter_0000200")
    # megatron-core's own load reads the pulled save
    megatron("load", fresh / "iter_0000200", tmp_path / "back.pt")
    assert pulled.json["result"]["latest"] == str(fresh / "iter_0000200")
