"""Every problem `verify` lists says what to do about it: a `fix` beside the message in the JSON
output, and after the message on the problem's line in the human output, as an error's message
ends with its fix.

Before, `Problem` had no fix: a truncated shard, a ZeRO save without a rank's partition or a
quantized weight without its scale were reported with the flaw alone, and a few checks baked a
fix sentence into the message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

from ckpt_cli.errors import with_fix

from .conftest import CkptResult, run_ckpt, run_ckpt_process
from .run_fixtures import trainer_checkpoint
from .test_quant import fp8_source, hf_shards, write_fp8_block


def _sharded_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(32, 16, generator=gen) for i in range(6)}


def _sharded(folder: Path) -> dict[str, torch.Tensor]:
    """A Hub-style sharded safetensors checkpoint (index + shards), as `save_pretrained`
    writes one."""
    state = _sharded_state()
    folder.mkdir(parents=True)
    save_torch_state_dict(state, folder, max_shard_size=5000)
    return state


def _problems(result: CkptResult) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = result.json["result"]["problems"]
    assert problems, result.stdout
    return problems


def _line(problem: dict[str, Any]) -> str:
    """The problem's line in the human output: `file: message. fix`."""
    text = problem["message"]
    if problem["file"] and problem["file"] not in text:
        text = f"{problem['file']}: {text}"
    return f"{problem['code']} {with_fix(text, problem['fix'])}"


def _every_problem_says_its_fix(src: Path, *args: str) -> list[dict[str, Any]]:
    """`verify SRC ARGS --json`: every problem has a fix, not repeated in its message; the
    human output prints each one after its message, on the problem's one line."""
    result = run_ckpt("verify", src, *args, "--json")
    assert result.exit_code == 1, result.stdout
    problems = _problems(result)
    for problem in problems:
        assert isinstance(problem["fix"], str) and problem["fix"].strip(), problem
        assert problem["fix"] not in problem["message"], problem
    human = run_ckpt("verify", src, *args)
    assert human.exit_code == 1
    lines = human.stdout.splitlines()
    for problem in problems:
        assert any(line.endswith(_line(problem)) for line in lines), (_line(problem), lines)
    return problems


def test_a_truncated_shard_says_to_fetch_it_again(tmp_path: Path) -> None:
    src = tmp_path / "model"
    _sharded(src)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 100)
    problems = _every_problem_says_its_fix(src)
    assert {p["code"] for p in problems} == {"truncated"}
    assert all("fetch it again" in p["fix"] for p in problems)
    # the message is the flaw alone: the fix is no longer baked into it
    assert all(p["message"].endswith("bytes)") for p in problems)


def test_a_pipe_gets_each_problem_and_its_fix_on_one_unwrapped_line(tmp_path: Path) -> None:
    """CI reads verify through a pipe: a problem's line, fix included, is never wrapped, so
    `grep missing_partition` shows the fix too."""
    src = tmp_path / ("a-folder-with-a-long-name-" * 6) / "model"
    _sharded(src)
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.unlink()
    found = run_ckpt("verify", src, "--json").json["result"]["problems"]
    piped = run_ckpt_process("verify", src)
    assert piped.exit_code == 1
    lines = piped.stdout.splitlines()
    for problem in found:
        assert problem["fix"]
        (line,) = [line for line in lines if problem["message"] in line]
        assert line.endswith(problem["fix"]) and len(line) > 200


def test_a_protected_checkpoint_names_the_repair_that_restores_it(tmp_path: Path) -> None:
    """With parity, the fix of a damaged shard is `ckpt repair SRC`; running it restores the
    checkpoint bit-exact."""
    src = tmp_path / "model"
    _sharded(src)
    assert run_ckpt("protect", src).exit_code == 0
    shard = sorted(src.glob("model-*.safetensors"))[1]
    original = shard.read_bytes()
    os.truncate(shard, shard.stat().st_size - 100)
    problems = _every_problem_says_its_fix(src)
    about_shard = [p for p in problems if p["file"] and Path(p["file"]).name == shard.name]
    assert about_shard and all(p["repairable"] for p in about_shard)
    repair = f"`ckpt repair {src}`"
    assert all(repair in p["fix"] for p in about_shard), about_shard
    assert run_ckpt("repair", src).exit_code == 0
    assert run_ckpt("verify", src).exit_code == 0
    assert shard.read_bytes() == original
    assert len(load_file(shard)) == len(load_file(shard))


def test_a_quantized_model_missing_its_scale_says_to_fetch_it(tmp_path: Path) -> None:
    src = tmp_path / "fp8"
    write_fp8_block(src, fp8_source())
    # re-exported without one scale: the shard and its index both lack it
    shards = [
        {k: v.clone() for k, v in load_file(src / f"model-0000{i}-of-00002.safetensors").items()}
        for i in (1, 2)
    ]
    del shards[1]["model.layers.1.mlp.down_proj.weight_scale_inv"]
    hf_shards(src, shards, None)
    problems = _every_problem_says_its_fix(src)
    missing = [p for p in problems if p["code"] == "missing_scale"]
    assert [p["tensor"] for p in missing] == ["model.layers.1.mlp.down_proj.weight"]
    assert missing[0]["fix"].startswith("Fetch or re-export the shard holding the scale")


def test_a_trainer_save_that_lost_its_optimizer_points_at_another_checkpoint(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    trainer_checkpoint(run / "checkpoint-4", 4)
    (run / "checkpoint-4" / "optimizer.pt").unlink()
    problems = _every_problem_says_its_fix(run / "checkpoint-4", "--resumable")
    lost = [p for p in problems if p["code"] == "missing_component"]
    assert lost and all("`ckpt latest`" in p["fix"] for p in lost)


def test_weights_only_under_resumable_says_where_a_resumable_one_comes_from(
    tmp_path: Path,
) -> None:
    save_file({"w": torch.ones(4, 4)}, tmp_path / "model.safetensors")
    (problem,) = _every_problem_says_its_fix(tmp_path / "model.safetensors", "--resumable")
    assert problem["code"] == "not_resumable"
    assert "`ckpt latest RUN_DIR`" in problem["fix"]


def test_a_problem_built_from_an_error_carries_the_errors_fix(tmp_path: Path) -> None:
    """An unreadable component is reported with what reading it said: the same fix `ckpt
    inspect` of the file alone gives, in the problem's `fix`, not in its message."""
    folder = tmp_path / "checkpoint-4"
    trainer_checkpoint(folder, 4)
    (folder / "scheduler.pt").write_bytes(b"PK\x03\x04 not a zip archive at all")
    alone = run_ckpt("inspect", folder / "scheduler.pt", "--json")
    assert alone.exit_code == 4
    error = alone.json["error"]
    problems = _every_problem_says_its_fix(folder, "--resumable")
    (unreadable,) = [p for p in problems if p["code"] == "unreadable_component"]
    assert unreadable["fix"] == error["fix"]
    assert unreadable["message"] == f"{error['path']}: {error['problem']}"


def test_inspect_warns_of_a_malformed_file_with_its_fix(tmp_path: Path) -> None:
    """`inspect` reads a file with bytes after its last tensor and warns of it on stderr: the
    warning says the fix too (it was in the message; it is in `fix` now)."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, path)
    with open(path, "ab") as fh:
        fh.write(b"junk")
    (problem,) = run_ckpt("inspect", path, "--json").json["result"]["problems"]
    assert problem["code"] == "trailing_bytes" and problem["fix"].endswith("write it again.")
    warned = run_ckpt("inspect", path)
    assert warned.exit_code == 4
    assert f"{problem['message']}. {problem['fix']}" in warned.stderr


def test_a_copy_that_differs_from_the_hub_names_the_download_that_replaces_it(
    hub: Any, tmp_path: Path
) -> None:
    """A downloaded copy checked against the Hub's digests: a corrupt shard's line says which
    download gives a good copy, and that download passes the same check."""
    from huggingface_hub import snapshot_download

    from .hub_fixtures import publish_model

    state = {f"model.layers.{i}.weight": torch.full((16, 8), float(i)) for i in range(4)}
    publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=1000)
    copy = tmp_path / "copy"
    snapshot_download("org/model", local_dir=copy, endpoint=hub.url)
    shard = sorted(copy.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x04
    shard.write_bytes(bytes(data))
    args = ("--checksums", "--manifest", "hf://org/model")
    problems = _every_problem_says_its_fix(copy, *args)
    (mismatch,) = [p for p in problems if p["code"] == "checksum_mismatch"]
    assert Path(mismatch["file"]).name == shard.name
    assert "`ckpt download hf://org/model NEW_DIR`" in mismatch["fix"]
    fresh = tmp_path / "NEW_DIR"
    assert run_ckpt("download", "hf://org/model", fresh).exit_code == 0
    assert run_ckpt("verify", fresh, *args).exit_code == 0


def test_a_lost_file_of_a_hub_checkpoint_is_never_sent_to_repair(hub: Any, tmp_path: Path) -> None:
    """The fix of a file whose bytes are lost or wrong offers `ckpt repair SRC` where the
    checkpoint may be protected (a folder, an object store). On the Hub nothing is protected
    and `repair` is refused (exit 2): the fix says what works there instead."""
    from ckpt_cli.findings import restore_fix

    from .hub_fixtures import publish_model

    publish_model(hub, "org/model", tmp_path / "src", _sharded_state(), max_shard_size=1000)
    refused = run_ckpt("repair", "hf://org/model")
    assert refused.exit_code == 2, refused.stdout + refused.stderr
    assert "protect the copy" not in refused.stderr  # a protected copy repairs nothing here
    assert "upload a damaged file again from a good copy" in refused.stderr
    fix = restore_fix("hf://org/model")
    assert "ckpt repair hf://" not in fix
    assert "Upload the file again" in fix and "@REVISION" in fix
    for where in ("s3://ckpts/run/step-100", str(tmp_path / "src")):
        assert f"`ckpt repair {where}`" in restore_fix(where)
