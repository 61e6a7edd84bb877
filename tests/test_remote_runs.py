"""Run folders in an object store (moto's S3 server) and on the Hub (the test Hub server):
`ckpt latest`, `ckpt prune` and `ckpt inspect RUN_DIR` read listings and headers only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .hub_server import TestHub
from .run_fixtures import interrupted_trainer_save, trainer_run
from .s3_fixtures import S3Server, list_keys, upload_folder


def _data_files(keys: list[str]) -> list[str]:
    return [k for k in keys if k.endswith((".safetensors", ".pt", ".pth"))]


@pytest.mark.slow
def test_latest_and_prune_on_an_s3_run_folder(s3_server: S3Server, tmp_path: Path) -> None:
    out = trainer_run(tmp_path)  # checkpoint-100 ... -500; the Trainer's best is 200
    interrupted_trainer_save(out, 600)  # preempted: model cut short, no trainer_state.json
    upload_folder(s3_server.endpoint, "ckpts", "run", out)
    s3_server.requests.clear()
    latest = run_ckpt("latest", "s3://ckpts/run/")
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout.strip() == "s3://ckpts/run/checkpoint-500"
    # headers only: every read of a data file is a small ranged read
    reads = [r for r in s3_server.requests if r.method == "GET" and "list-type" not in r.path]
    data_reads = [r for r in reads if r.path.endswith((".safetensors", ".pt", ".pth"))]
    assert data_reads and all(r.range is not None for r in data_reads)
    table = run_ckpt("latest", "s3://ckpts/run", "--json").json["result"]
    status = {c["name"]: c["status"] for c in table["checkpoints"]}
    # the objects were written seconds ago (S3 LastModified): a broken save may still be going
    assert status["checkpoint-600"] == "writing" and status["checkpoint-300"] == "complete"
    table = run_ckpt("latest", "s3://ckpts/run", "--settle", "0", "--json").json["result"]
    status = {c["name"]: c["status"] for c in table["checkpoints"]}
    assert status["checkpoint-600"] == "incomplete"
    assert table["trainer_best"] == "checkpoint-200"
    inspected = run_ckpt("inspect", "s3://ckpts/run", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    assert inspected.json["result"]["format"] == "run"
    assert len(inspected.json["result"]["run"]["checkpoints"]) == 6

    plan = run_ckpt("prune", "s3://ckpts/run", "--keep-last", "2", "--settle", "0", "--json")
    assert plan.exit_code == 0, plan.stderr
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions == {
        "checkpoint-100": "delete",
        "checkpoint-200": "keep",  # the Trainer's best_model_checkpoint
        "checkpoint-300": "delete",
        "checkpoint-400": "keep",
        "checkpoint-500": "keep",
        "checkpoint-600": "keep",  # incomplete: only --incomplete removes it
    }
    before = list_keys(s3_server.endpoint, "ckpts")
    assert plan.json["result"]["bytes_to_free"] > 0
    assert list_keys(s3_server.endpoint, "ckpts") == before  # a plan deletes nothing
    done = run_ckpt(
        "prune", "s3://ckpts/run", "--keep-last", "2", "--settle", "0", "--yes", "--json"
    )
    assert done.exit_code == 0, done.stderr
    assert sorted(done.json["result"]["deleted"]) == ["checkpoint-100", "checkpoint-300"]
    left = {k.split("/")[1] for k in list_keys(s3_server.endpoint, "ckpts")}
    assert left == {"checkpoint-200", "checkpoint-400", "checkpoint-500", "checkpoint-600"}
    # what is left still reads back whole
    assert run_ckpt("verify", "s3://ckpts/run/checkpoint-400").exit_code == 0


def test_a_store_that_fails_to_answer_never_makes_a_complete_checkpoint_incomplete(
    s3_server: S3Server, tmp_path: Path
) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    upload_folder(s3_server.endpoint, "ckpts", "run", out)
    before = list_keys(s3_server.endpoint, "ckpts")
    for failing in (
        "checkpoint-300/optimizer.pt",
        "checkpoint-300/model-00002-of-00002.safetensors",
    ):
        # the store answers 403 to every read of one object of the newest, complete save
        s3_server.refuse = lambda r, f=failing: r.method == "GET" and r.path.endswith(f)
        latest = run_ckpt("latest", "s3://ckpts/run/", "--json")
        assert latest.exit_code == 5, latest.stdout
        assert failing in latest.json["error"]["message"]
        assert "remote store" in latest.json["error"]["message"]
        pulled = run_ckpt("sync", "s3://ckpts/run/", tmp_path / "pulled", "--latest")
        assert pulled.exit_code == 5, pulled.stderr
        assert not (tmp_path / "pulled" / "checkpoint-200").exists()
        pruned = run_ckpt(
            "prune",
            "s3://ckpts/run",
            "--incomplete",
            "--keep-last",
            "5",
            "--settle",
            "0",
            "--yes",
        )
        assert pruned.exit_code == 5, pruned.stderr
        assert list_keys(s3_server.endpoint, "ckpts") == before  # nothing deleted
    s3_server.refuse = None
    latest = run_ckpt("latest", "s3://ckpts/run/")
    assert latest.stdout.strip() == "s3://ckpts/run/checkpoint-300"


@pytest.mark.slow
def test_a_dcp_run_in_s3_skips_a_save_without_metadata(s3_server: S3Server, tmp_path: Path) -> None:
    from .run_fixtures import dcp_save

    run = tmp_path / "dump"
    for step in (10, 20, 30):
        dcp_save(run / f"step-{step}", step)
    (run / "step-30" / ".metadata").unlink()  # the writer was evicted before its commit marker
    upload_folder(s3_server.endpoint, "ckpts", "titan", run)
    latest = run_ckpt("latest", "s3://ckpts/titan")
    assert latest.stdout.strip() == "s3://ckpts/titan/step-20", latest.stderr
    table = run_ckpt("latest", "s3://ckpts/titan", "--json").json["result"]
    reasons = {c["name"]: c["reason"] for c in table["checkpoints"]}
    assert ".metadata" in (reasons["step-30"] or "")


def test_latest_and_prune_plan_on_a_hub_repo_of_checkpoints(hub: TestHub, tmp_path: Path) -> None:
    # the repo Trainer's push_to_hub(hub_strategy="all_checkpoints") leaves: checkpoint-N/ folders
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    interrupted_trainer_save(out, 400)
    hub.add_repo("org/run", out)
    latest = run_ckpt("latest", "hf://org/run")
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout.strip() == "hf://org/run/checkpoint-300"
    # no file was downloaded whole: only headers and the small JSON files
    for path in (out / "checkpoint-300").iterdir():
        if path.suffix in (".safetensors", ".pt", ".pth"):
            sent = hub.bytes_sent("org/run", f"checkpoint-300/{path.name}")
            assert sent < path.stat().st_size, path.name
    plan = run_ckpt("prune", "hf://org/run", "--keep-last", "1", "--json")
    assert plan.exit_code == 0, plan.stderr
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions == {
        "checkpoint-100": "delete",
        "checkpoint-200": "keep",
        "checkpoint-300": "keep",
        "checkpoint-400": "keep",
    }
    refused = run_ckpt("prune", "hf://org/run", "--keep-last", "1", "--yes")
    assert refused.exit_code == 2 and "commit" in refused.stderr
    inspected = run_ckpt("inspect", "hf://org/run", "--json").json["result"]
    assert inspected["format"] == "run" and inspected["run"]["latest"] == latest.stdout.strip()
    assert torch  # torch is the writer of the fixtures' optimizer files


@pytest.mark.slow
def test_one_run_folder_gets_the_same_verdicts_on_disk_and_in_s3(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """One judge (#26): the same saves, on disk and uploaded to S3, get the same status, the
    same reason (but for where the file is), the same formats, sizes and markers."""
    from .run_fixtures import age, trainer_checkpoint

    out = trainer_run(tmp_path, steps=(100, 200, 300))  # 300 is sharded, with an index
    interrupted_trainer_save(out, 400)  # model cut short, no trainer_state.json
    trainer_checkpoint(out / "checkpoint-500", 500)
    state = out / "checkpoint-500" / "trainer_state.json"
    state.write_text(state.read_text()[:20])  # cut short mid-write
    trainer_checkpoint(out / "checkpoint-600", 600, shards=True)
    shards = sorted((out / "checkpoint-600").glob("model-*.safetensors"))
    shards[-1].unlink()  # the index names a shard that never arrived
    staging = out / ".checkpoint-700.ckpt-tmp-1234"  # an upload that stopped
    trainer_checkpoint(staging, 700)
    age(out)
    upload_folder(s3_server.endpoint, "ckpts", "run", out)

    def judged(where: str) -> dict[str, dict]:  # type: ignore[type-arg]
        # --settle 0: S3's LastModified is now, the local files an hour old
        result = run_ckpt("latest", where, "--settle", "0", "--json")
        assert result.exit_code == 0, result.stderr
        rows = {}
        for c in result.json["result"]["checkpoints"]:
            reason = (c["reason"] or "").replace(where, "RUN")
            rows[c["name"]] = (c["status"], reason, c["formats"], c["size"], sorted(c["markers"]))
        return rows

    local, remote = judged(str(out)), judged("s3://ckpts/run")
    assert local == remote
    assert {name: row[0] for name, row in local.items()} == {
        "checkpoint-100": "complete",
        "checkpoint-200": "complete",
        "checkpoint-300": "complete",
        "checkpoint-400": "incomplete",
        "checkpoint-500": "incomplete",
        "checkpoint-600": "incomplete",
        ".checkpoint-700.ckpt-tmp-1234": "interrupted",
    }
    assert local["checkpoint-300"][4] == ["newest"]
    assert local["checkpoint-200"][4] == ["trainer-best"]
    assert "RUN/checkpoint-400/model.safetensors" in local["checkpoint-400"][1]
    assert "RUN/checkpoint-500/trainer_state.json: not valid JSON" in local["checkpoint-500"][1]
    assert shards[-1].name in local["checkpoint-600"][1]
    assert local[".checkpoint-700.ckpt-tmp-1234"][1] == (
        "staging folder left by an interrupted save"
    )


def test_time_rules_on_a_hub_run_folder_without_times_are_refused(
    hub: TestHub, tmp_path: Path
) -> None:
    """The Hub lists no modification times: a time rule would judge every save by 1970
    (`--keep-within 2d` planned to delete a save pushed a minute ago)."""
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    hub.add_repo("org/run", out)
    for rule in (("--keep-within", "2d"), ("--keep-every-duration", "1h")):
        plan = run_ckpt("prune", "hf://org/run", *rule, "--json")
        assert plan.exit_code == 2, plan.stdout
        message = plan.json["error"]["message"]
        assert rule[0] in message and "no modification times" in message
    assert run_ckpt("prune", "hf://org/run", "--keep-last", "1").exit_code == 0
    table = run_ckpt("latest", "hf://org/run", "--json").json["result"]
    assert [c["mtime"] for c in table["checkpoints"]] == [None, None, None]
    shown = run_ckpt("inspect", "hf://org/run")
    assert "ago" not in shown.stdout and "unknown" in shown.stdout


def test_latest_of_a_hub_repo_a_trainer_pushes_its_last_checkpoint_to(
    hub: TestHub, tmp_path: Path
) -> None:
    """`push_to_hub=True, hub_strategy="checkpoint"`: each save uploads the model to the repo's
    root and the whole save to `last-checkpoint/`, the folder `resume_from_checkpoint` is given.
    Its name holds no step, and `ckpt latest hf://org/run` said "no step checkpoints found"
    (exit 3): the save to resume from is found, at the step its trainer_state.json records."""
    from .run_fixtures import trainer_checkpoint

    save = tmp_path / "output" / "checkpoint-300"
    trainer_checkpoint(save, 300)
    pushed = {f"last-checkpoint/{p.name}": p.read_bytes() for p in save.iterdir()}
    pushed["model.safetensors"] = (save / "model.safetensors").read_bytes()
    hub.add_repo("org/run", pushed)
    latest = run_ckpt("latest", "hf://org/run", "--json")
    assert latest.exit_code == 0, latest.stdout
    report = latest.json["result"]
    assert report["latest"] == "hf://org/run/last-checkpoint"
    (found,) = report["checkpoints"]
    assert (found["layout"], found["step"], found["status"]) == ("hf-trainer", 300, "complete")
    # the model at the root is still the repo's model
    inspected = run_ckpt("inspect", "hf://org/run", "--json").json["result"]
    assert inspected["format"] == "safetensors"
    # and the save comes down to resume from, whole
    fresh = tmp_path / "fresh"
    pulled = run_ckpt("sync", "hf://org/run", fresh, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    (done,) = pulled.json["result"]["checkpoints"]
    assert (done["name"], done["action"]) == ("last-checkpoint", "downloaded")
    for path in save.iterdir():
        assert (fresh / "last-checkpoint" / path.name).read_bytes() == path.read_bytes()
    assert run_ckpt("latest", fresh).stdout.strip() == str(fresh / "last-checkpoint")

    # a push cut short before trainer_state.json (the Trainer writes it last) is no save to
    # resume from, and says why
    cut = {k: v for k, v in pushed.items() if not k.endswith("trainer_state.json")}
    hub.add_repo("org/cut", cut)
    refused = run_ckpt("latest", "hf://org/cut", "--json")
    assert refused.exit_code == 3, refused.stdout
    (judged,) = refused.json["result"]["checkpoints"]
    assert judged["name"] == "last-checkpoint" and "trainer_state.json" in judged["reason"]


def test_a_local_last_checkpoint_copy_beside_the_trainer_saves_is_not_a_save(
    tmp_path: Path,
) -> None:
    """transformers before 4.36 also copied the newest save to `output_dir/last-checkpoint/`
    when pushing: the Trainer resumes from `checkpoint-N/` only, so `latest` names that and
    `prune --keep-last 1` keeps it, never the copy in its place."""
    import shutil

    out = trainer_run(tmp_path, steps=(100, 200))
    shutil.copytree(out / "checkpoint-200", out / "last-checkpoint")
    latest = run_ckpt("latest", out)
    assert latest.stdout.strip() == str(out / "checkpoint-200"), latest.stderr
    plan = run_ckpt("prune", out, "--keep-last", "1", "--json")
    assert plan.exit_code == 0, plan.stdout
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions == {"checkpoint-100": "delete", "checkpoint-200": "keep"}


@pytest.mark.slow
def test_a_save_verified_in_s3_or_on_the_hub_is_held_to_the_save_before_it_as_on_disk(
    s3_server: S3Server, hub: TestHub, tmp_path: Path
) -> None:
    """A 2-process Trainer run keeps `rng_state_0.pth` and `rng_state_1.pth` in every save;
    one save lost rank 1's. Only the save before it can tell, and `ckpt verify` of the save
    alone compared it with that save on disk only: the same files in S3 or on the Hub were
    "OK". Each now gets the verdict the folder on disk gets (`Storage.beside`)."""
    from .run_fixtures import trainer_checkpoint

    run = tmp_path / "out"
    for step in (100, 200):
        save = run / f"checkpoint-{step}"
        trainer_checkpoint(save, step)
        (save / "rng_state.pth").rename(save / "rng_state_0.pth")  # what each rank writes
        torch.save({"cpu": torch.random.get_rng_state()}, save / "rng_state_1.pth")
    (run / "checkpoint-200" / "rng_state_1.pth").unlink()
    upload_folder(s3_server.endpoint, "ckpts", "run", run)
    hub.add_repo("org/run", run)
    for where in (run, "s3://ckpts/run", "hf://org/run"):
        checked = run_ckpt("verify", f"{where}/checkpoint-200", "--json")
        assert checked.exit_code == 1, (where, checked.stdout)
        (problem,) = checked.json["result"]["problems"]
        assert problem["code"] == "missing_rank_rng", where
        assert problem["file"].endswith("checkpoint-200/rng_state_1.pth"), where
        assert "the save before it (checkpoint-100)" in problem["message"], where
        # the save before it, whole, is held to nothing older: OK wherever it is
        assert run_ckpt("verify", f"{where}/checkpoint-100").exit_code == 0, where


def test_latest_and_prune_of_one_checkpoint_on_the_hub_name_no_folder_above_a_repository(
    hub: TestHub, tmp_path: Path
) -> None:
    """A model repo given as a run folder is one checkpoint: `latest` and `prune` say so, and
    name the run folder above a save in a repo (`hf://org/run`), never `hf://org`, which is
    no repository."""
    from .run_fixtures import trainer_checkpoint

    save = tmp_path / "checkpoint-100"
    trainer_checkpoint(save, 100)
    hub.add_repo("org/model", save)
    hub.add_repo("org/run", save.parent)
    for command in (("latest",), ("prune", "--keep-last", "1")):
        repo = run_ckpt(*command[:1], "hf://org/model", *command[1:], "--json")
        assert repo.exit_code in (2, 3), repo.stdout
        error = repo.json["error"]
        assert error["problem"].startswith("is one checkpoint, not a run folder of checkpoints")
        assert "hf://org " not in error["fix"] and "hf://org`" not in error["fix"], error["fix"]
        assert "Point at the run folder" in error["fix"]
        one = run_ckpt(*command[:1], "hf://org/run/checkpoint-100", *command[1:], "--json")
        assert f"`ckpt {command[0]} hf://org/run" in one.json["error"]["fix"], one.stdout


def test_prune_of_a_run_whose_prefix_holds_a_glob_character_deletes_only_that_run(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Two runs side by side in a bucket, `exp/run/` and `exp/r?n/` (a name a user chose, and
    a legal S3 key): pruning the second must not touch the first. fsspec's `rm` reads `?`, `*`
    and `[` as glob patterns, so `r?n/out/checkpoint-100/...` also named `run/out/...`."""
    out = trainer_run(tmp_path)  # checkpoint-100 ... -500; the Trainer's best is 200
    upload_folder(s3_server.endpoint, "ckpts", "exp/run", out)
    upload_folder(s3_server.endpoint, "ckpts", "exp/r?n", out)
    before = list_keys(s3_server.endpoint, "ckpts", "exp/run/")

    pruned = run_ckpt(
        "prune", "s3://ckpts/exp/r?n", "--keep-last", "1", "--settle", "0", "--yes", "--json"
    )
    assert pruned.exit_code == 0, pruned.stderr
    assert list_keys(s3_server.endpoint, "ckpts", "exp/run/") == before
    kept = {k.split("/")[2] for k in list_keys(s3_server.endpoint, "ckpts", "exp/r?n/")}
    assert kept == {"checkpoint-200", "checkpoint-500"}  # the best, the newest
    assert run_ckpt("latest", "s3://ckpts/exp/run").stdout.strip() == (
        "s3://ckpts/exp/run/checkpoint-500"
    )
