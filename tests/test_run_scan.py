"""One run-folder scanner for local folders and object stores (issue #14 §2): the same run,
scanned on disk and in an S3 bucket (moto's server), gets the same verdicts and markers; the
run's own small files are read through its storage, confined to the run."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_cli.sources.runs import scan_run

from .conftest import run_ckpt
from .run_fixtures import age, interrupted_trainer_save, trainer_checkpoint, trainer_run
from .s3_fixtures import S3Server, upload_folder


def _verdicts(report_json: dict[str, object]) -> dict[str, tuple[object, ...]]:
    checkpoints = report_json["checkpoints"]
    assert isinstance(checkpoints, list)
    return {
        c["name"]: (c["layout"], c["step"], c["status"], c["complete"], tuple(c["markers"]))
        for c in checkpoints
    }


def test_a_run_on_disk_and_in_a_bucket_gets_the_same_verdicts(
    s3_server: S3Server, tmp_path: Path
) -> None:
    out = trainer_run(tmp_path)  # checkpoint-100 ... -500; the Trainer's best is 200
    interrupted_trainer_save(out, 600)  # preempted: model cut short, no trainer_state.json
    (out / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "eval_loss": 1.0 / s}) for s in (100, 200, 300, 400, 500))
    )
    upload_folder(s3_server.endpoint, "ckpts", "run", out)
    # the bucket's objects are seconds old: a settle window of 0 judges both by content alone
    here = scan_run(out, metric="eval_loss", settle=0).model_dump()
    there = scan_run("s3://ckpts/run", metric="eval_loss", settle=0).model_dump()
    assert _verdicts(here) == _verdicts(there)
    assert _verdicts(here)["checkpoint-600"][2] == "incomplete"
    assert "trainer-best" in _verdicts(here)["checkpoint-200"][4]
    assert "best" in _verdicts(here)["checkpoint-500"][4]  # 1/step: the newest is best
    for key in ("latest", "trainer_best", "trainer_best_metric", "best"):
        mine, theirs = here[key], there[key]
        if key == "latest":
            mine, theirs = Path(mine).name, theirs.rsplit("/", 1)[-1]
        if key == "best":
            mine = {**mine, "source": Path(mine["source"]).name}
            theirs = {**theirs, "source": theirs["source"].rsplit("/", 1)[-1]}
        assert mine == theirs, key


def test_a_latest_file_linked_from_outside_the_run_names_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (5, 10):
        trainer_checkpoint(run / f"global_step{step}", step)
    outside = tmp_path / "elsewhere-latest"
    outside.write_text("global_step5")
    (run / "latest").symlink_to(outside)
    age(run)
    report = scan_run(run)
    assert report.deepspeed_latest is None  # read through the run's storage: links stay inside
    (run / "latest").unlink()
    (run / "latest").write_text("global_step5")
    age(run)
    report = scan_run(run)
    assert report.deepspeed_latest == "global_step5"
    newer = {c.name: c.status for c in report.checkpoints}
    assert newer["global_step10"] == "incomplete"  # newer than the tag `latest` names


def test_a_pointer_to_a_link_loop_says_it_is_a_loop(tmp_path: Path) -> None:
    """DeepSpeed's `latest` file, or Megatron-LM's tracker, naming a save that is a link
    looping back on itself (`global_step20 -> global_step30 -> global_step20`): `latest` said
    nothing of it (or "which is missing"); it names the loop and the fix."""
    import os

    import torch

    from .run_fixtures import weights
    from .test_megatron_legacy import TRACKER, legacy_save, megatron_args

    ds = tmp_path / "ds"
    for step in (5, 10):
        (ds / f"global_step{step}").mkdir(parents=True)
        torch.save(
            {"module": weights(step)}, ds / f"global_step{step}" / "mp_rank_00_model_states.pt"
        )
    os.symlink("global_step30", ds / "global_step20")
    os.symlink("global_step20", ds / "global_step30")
    (ds / "latest").write_text("global_step20")
    mg = tmp_path / "mg"
    legacy_save(mg / "iter_0000010", 10, 1, 1, megatron_args(1, 1))
    os.symlink("iter_0000030", mg / "iter_0000020")
    os.symlink("iter_0000020", mg / "iter_0000030")
    (mg / TRACKER).write_text("20")
    for run in (ds, mg):
        age(run)

    for run, tag, chain, newest in (
        (ds, "global_step20", "global_step20 -> global_step30 -> global_step20", "global_step10"),
        (mg, "iter_0000020", "iter_0000020 -> iter_0000030 -> iter_0000020", "iter_0000010"),
    ):
        result = run_ckpt("latest", run)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.strip() == str(run / newest)
        said = " ".join(result.stderr.split())
        assert f"names {tag}, a symbolic link that loops back on itself ({chain})" in said, said
        assert "remove the link" in said and "missing" not in said

    # a DeepSpeed save folder opened as one checkpoint: its `latest` names the loop
    single = tmp_path / "single"
    (single / "global_step10").mkdir(parents=True)
    torch.save({"module": weights(10)}, single / "global_step10" / "mp_rank_00_model_states.pt")
    os.symlink("global_step20", single / "global_step20")
    (single / "latest").write_text("global_step20")
    error = run_ckpt("inspect", single, "--json").json["error"]
    assert error["code"] == "not_found"
    assert "loops back on itself (global_step20 -> global_step20)" in error["problem"]
    assert "missing" not in error["problem"] and "Remove the link" in error["fix"]
