"""A request per operation (#26): each command builds one frozen request model of its options,
and every per-component path is the same request `model_copy(update=...)`-ed, so no option is
re-listed by hand and none is dropped on the way to a component.

Two checks per operation: the request's fields are exactly the library function's keyword
options and the command's CLI options (so a new option cannot be left out of the request), and,
on a multi-part source, every option reaches every component (`--dry-run` writes nothing,
anywhere; what it plans is what the real run writes)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from safetensors import safe_open
from typer.main import get_command

from ckpt_cli.cli.app import get_app

from .conftest import run_ckpt

#: the CLI parameters that are not options of the operation (locations, output mode)
_NOT_OPTIONS = {"src", "dest", "json_output"}


def _cli_params(command: str) -> set[str]:
    """The Python names of `ckpt COMMAND`'s parameters (its typer function's arguments)."""
    group = get_command(get_app())
    found = group.commands[command]  # type: ignore[attr-defined]
    # `ckpt_*` are the global options every command takes (token, revision, verbosity)
    return {p.name for p in found.params if p.name and not p.name.startswith("ckpt_")}


def _keyword_options(function: Callable[..., Any]) -> set[str]:
    """The keyword-only parameters of a library entry point, less the progress sink."""
    return {
        name
        for name, p in inspect.signature(function).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    } - {"progress"}


def _fields(request: type[BaseModel]) -> set[str]:
    return set(request.model_fields)


def _files_under(root: Path) -> set[str]:
    return {str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()}


# -- reshard -------------------------------------------------------------------------------


def test_reshard_request_is_every_reshard_option() -> None:
    from ckpt_cli.ops.reshard.run import ReshardRequest, run_reshard

    assert ReshardRequest.model_config.get("frozen") is True
    assert _fields(ReshardRequest) == _keyword_options(run_reshard)
    # the CLI says `--no-extras`; the request holds what it means
    cli = _cli_params("reshard") - _NOT_OPTIONS
    assert _fields(ReshardRequest) == (cli - {"no_extras"}) | {"extras"}


def test_every_reshard_option_reaches_every_component(
    diffusers_pipeline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops.reshard import run as reshard_op

    # a dry run of the whole pipeline writes nothing, anywhere, and says it was one
    out = tmp_path / "out"
    args = ("reshard", diffusers_pipeline, out, "--max-shard-size", "20KB")
    dry = run_ckpt(*args, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    report = dry.json["result"]
    assert report["dry_run"] is True and report["verified"] is False
    assert list(tmp_path.iterdir()) == []  # no DEST, no staging left behind
    planned = {f["path"] for f in report["files"]}
    # what the dry run lists is what the real run writes
    real = run_ckpt(*args, "--json")
    assert real.exit_code == 0, real.stderr
    assert planned == _files_under(out)
    assert real.json["result"]["tensors"] == report["tensors"]
    # --max-shard-size reached each component: every shard is cut to it
    shards = [f for f in out.rglob("*.safetensors")]
    assert {s.parent.name for s in shards} == {"unet", "vqvae"}
    assert len([s for s in shards if s.parent.name == "unet"]) > 1
    for shard in shards:
        with safe_open(shard, "pt") as opened:
            names = opened.keys()
            data = sum(opened.get_tensor(k).nbytes for k in names)
        assert 0 < data <= 20_000

    # and the other options are the ones each component is resharded with
    seen: list[reshard_op.ReshardRequest] = []
    original = reshard_op.regroup

    def spy(source: Any, out: Any, request: Any, progress: Any) -> Any:
        seen.append(request)
        return original(source, out, request, progress)

    monkeypatch.setattr(reshard_op, "regroup", spy)
    given = run_ckpt(*args, "--no-extras", "--dry-run", "--force")
    assert given.exit_code == 0, given.stderr
    assert len(seen) == 2  # unet and vqvae
    for request in seen:
        assert (request.max_shard_size, request.dry_run, request.extras) == (20_000, True, False)


# -- verify --------------------------------------------------------------------------------


def test_verify_request_is_every_verify_option() -> None:
    from ckpt_cli.ops.verify.run import VerifyRequest, verify

    assert VerifyRequest.model_config.get("frozen") is True
    assert _fields(VerifyRequest) == _keyword_options(verify)
    assert _fields(VerifyRequest) == _cli_params("verify") - _NOT_OPTIONS


def test_every_verify_option_reaches_every_component(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file

    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")
    weights = [pipeline / c / "diffusion_pytorch_model.safetensors" for c in ("unet", "vqvae")]
    # --deep reads every tensor of every component
    deep = run_ckpt("verify", pipeline, "--deep", "--json")
    assert deep.exit_code == 0, deep.stderr
    assert "deep" in deep.json["result"]["checks"]
    assert deep.json["result"]["tensors"] == sum(len(load_file(w)) for w in weights)
    # --exact implies --resumable, on the multi-part source as on one file
    exact = run_ckpt("verify", pipeline, "--exact", "--json")
    assert "resumable" in exact.json["result"]["checks"]
    # --write-manifest / --algo record every component's files; --checksums then finds a
    # damaged one in any of them
    written = run_ckpt("verify", pipeline, "--write-manifest", "--algo", "sha256", "--json").json[
        "result"
    ]
    assert written["manifest_written"] is True and written["algorithm"] == "sha256"
    recorded = (pipeline / "ckpt-manifest.json").read_text()
    assert all(str(w.relative_to(pipeline)) in recorded for w in weights)
    data = bytearray(weights[1].read_bytes())
    data[-1] ^= 0xFF
    weights[1].write_bytes(bytes(data))
    checked = run_ckpt("verify", pipeline, "--checksums", "--json")
    assert checked.exit_code == 1
    assert any("vqvae" in (p["file"] or "") for p in checked.json["result"]["problems"])


# -- diff ----------------------------------------------------------------------------------


def test_diff_request_is_every_diff_option() -> None:
    from ckpt_cli.ops.diff.run import DiffRequest, diff

    assert DiffRequest.model_config.get("frozen") is True
    assert _fields(DiffRequest) == _keyword_options(diff)
    # the CLI's repeatable `--rename` / `--filter` / `--filter-out` are the request's lists
    cli = _cli_params("diff") - {"a", "b", "json_output"}
    plural = {"renames", "filters", "excludes"}
    assert _fields(DiffRequest) == (cli - {"rename", "filter", "exclude"}) | plural


def test_every_diff_option_reaches_every_component(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    other = shutil.copytree(diffusers_pipeline, tmp_path / "other")
    weights = other / "vqvae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.numel() > 1)
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    changed = f"vqvae.{name}"

    def run(*options: str) -> dict[str, Any]:
        result = run_ckpt("diff", diffusers_pipeline, other, *options, "--json")
        assert result.exit_code in (0, 1), result.stderr
        report: dict[str, Any] = result.json["result"]
        assert result.exit_code == (0 if report["identical"] else 1)
        return report

    whole = run()
    assert [d["name"] for d in whole["differences"]] == [changed]
    # the tolerance reaches the component's tensors
    close = run("--atol", "1e-2")
    assert close["identical"] and [d["name"] for d in close["within_tolerance"]] == [changed]
    # --select and --filter see the names of the whole folder
    assert run("--select", "unet")["identical"]
    assert run("--filter", "unet.*")["identical"]
    assert not run("--filter", "vqvae.*")["identical"]
    assert run("--filter-out", "vqvae.*")["identical"]
    assert not run("--filter-out", "unet.*")["identical"]
    # --ignore-dtype: a dtype-only change of a component is no difference
    cast = shutil.copytree(diffusers_pipeline, tmp_path / "cast")
    unet = cast / "unet" / "diffusion_pytorch_model.safetensors"
    widened = {n: t.to(torch.float64) for n, t in load_file(unet).items()}
    save_file(widened, unet, metadata={"format": "pt"})
    assert not run_ckpt("diff", diffusers_pipeline, cast, "--json").json["result"]["identical"]
    ignored = run_ckpt("diff", diffusers_pipeline, cast, "--ignore-dtype", "--json")
    assert ignored.exit_code == 0, ignored.stdout


# -- inspect -------------------------------------------------------------------------------


def test_inspect_request_is_every_inspect_option() -> None:
    from ckpt_cli.ops.inspect import InspectRequest
    from ckpt_cli.ops.inspect import inspect as run_inspect

    assert InspectRequest.model_config.get("frozen") is True
    assert _fields(InspectRequest) == set(inspect.signature(run_inspect).parameters) - {"src"}
    # `--list` only chooses what the text output shows; `--filter` / `--filter-out` are the
    # request's lists
    cli = _cli_params("inspect") - _NOT_OPTIONS - {"tensors"}
    assert _fields(InspectRequest) == (cli - {"filter", "exclude"}) | {"filters", "excludes"}


def test_every_inspect_option_reaches_every_component(diffusers_pipeline: Path) -> None:
    from safetensors.torch import load_file

    vqvae = load_file(diffusers_pipeline / "vqvae" / "diffusion_pytorch_model.safetensors")
    result = run_ckpt("inspect", diffusers_pipeline, "--filter", "vqvae.*", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["filters"] == ["vqvae.*"]
    assert {e["name"] for e in report["entries"]} == {f"vqvae.{n}" for n in vqvae}
    assert report["tensors"] == len(vqvae)
    # --filter-out sees the same names: leaving the other components out keeps the vqvae
    others = run_ckpt("inspect", diffusers_pipeline, "--filter-out", "unet.*", "--json")
    kept = {e["name"] for e in others.json["result"]["entries"]}
    assert {f"vqvae.{n}" for n in vqvae} <= kept and not any(n.startswith("unet.") for n in kept)
    # --list lists the entries of every component the filter keeps
    listed = run_ckpt("inspect", diffusers_pipeline, "--list", "--filter", "*.conv_in.*")
    assert listed.exit_code == 0, listed.stderr
    assert "unet" in listed.stdout and "vqvae" in listed.stdout


# -- prune ---------------------------------------------------------------------------------


def test_prune_policy_is_every_prune_option() -> None:
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.prune.run import run as run_prune

    assert PrunePolicy.model_config.get("frozen") is True
    # the policy (`now` is the clock tests set), and how it is run: --yes (unless --dry-run),
    # --watch N rounds
    how = _keyword_options(run_prune) - {"on_round"}
    assert how == {"yes", "watch_seconds", "max_iterations"}
    cli = _cli_params("prune") - {"run_dir", "json_output", "dry_run"}
    # --higher-is-better / --lower-is-better (and the deprecated --mode) set `mode`
    cli = (cli - {"higher_is_better"}) | {"mode"}
    assert (_fields(PrunePolicy) - {"now"}) | how == (cli - {"watch"}) | {"watch_seconds"}


def test_prune_without_yes_writes_nothing_anywhere(tmp_path: Path) -> None:
    from .run_fixtures import interrupted_trainer_save, trainer_run

    run = trainer_run(tmp_path / "run")
    interrupted_trainer_save(run, 50)

    def snapshot() -> dict[str, int]:
        return {str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in tmp_path.rglob("*")}

    before = snapshot()
    for options in (
        ("--keep-last", "1"),
        ("--slim-older-than", "1"),
        ("--incomplete",),
        # --dry-run means here what it means in every command, and wins over --yes
        ("--keep-last", "1", "--incomplete", "--dry-run"),
        ("--keep-last", "1", "--incomplete", "--yes", "--dry-run"),
    ):
        result = run_ckpt("prune", run, *options, "--json")
        assert result.exit_code == 0, result.stderr
        decided = result.json["result"]["decisions"]
        assert any(d["action"] != "keep" for d in decided), options
        assert snapshot() == before, options


def test_reshard_of_a_trainer_folder_dry_run_writes_nothing(tmp_path: Path) -> None:
    from .run_fixtures import trainer_checkpoint

    source = tmp_path / "src" / "checkpoint-100"
    trainer_checkpoint(source, 100, shards=True)
    before = {str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in tmp_path.rglob("*")}
    out = tmp_path / "out"
    args = ("reshard", source, out, "--max-shard-size", "150B")
    dry = run_ckpt(*args, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    assert dry.json["result"]["dry_run"] is True
    after = {str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in tmp_path.rglob("*")}
    assert after == before  # nothing written, anywhere
    planned = {f["path"] for f in dry.json["result"]["files"]}
    real = run_ckpt(*args, "--json")
    assert real.exit_code == 0, real.stderr
    written = _files_under(out)
    # what the dry run lists is what the real run writes: the weights' shards, and the
    # training state carried beside them
    assert planned == written
    assert len([p for p in written if p.endswith(".safetensors")]) > 1
    assert {"optimizer.pt", "trainer_state.json"} <= written


# -- protect / repair ----------------------------------------------------------------------


def test_protect_request_is_every_protect_option() -> None:
    from ckpt_cli.ops.parity import ProtectRequest, protect

    assert ProtectRequest.model_config.get("frozen") is True
    assert _fields(ProtectRequest) == _keyword_options(protect) - {"on_plan"}
    assert _fields(ProtectRequest) == _cli_params("protect") - _NOT_OPTIONS


def test_protect_and_repair_dry_runs_write_nothing_on_a_pipeline(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    import shutil

    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")

    def snapshot() -> dict[str, bytes]:
        return {
            str(f.relative_to(tmp_path)): f.read_bytes() for f in tmp_path.rglob("*") if f.is_file()
        }

    before = snapshot()
    options = ("--parity", "2", "--block-size", "4KiB", "--whole-files")
    plan = run_ckpt("protect", pipeline, *options, "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stderr
    planned = plan.json["result"]
    assert planned["dry_run"] is True and snapshot() == before
    # the options reached the plan, which covers every file of every component
    assert (planned["parity"], planned["block_size"], planned["whole_files"]) == (2, 4096, True)
    assert planned["files"] == len([f for f in pipeline.rglob("*") if f.is_file()])
    real = run_ckpt("protect", pipeline, *options, "--json")
    assert real.exit_code == 0, real.stderr
    protected = snapshot()
    damaged = pipeline / "vqvae" / "diffusion_pytorch_model.safetensors"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    broken = snapshot()
    dry = run_ckpt("repair", pipeline, "--dry-run", "--json")
    assert dry.exit_code in (0, 1), dry.stderr
    assert snapshot() == broken  # a dry run rebuilds nothing
    assert run_ckpt("repair", pipeline, "--json").exit_code == 0
    assert snapshot() == protected


def test_repair_request_is_every_repair_option() -> None:
    from ckpt_cli.ops.parity import RepairRequest, repair

    assert RepairRequest.model_config.get("frozen") is True
    assert _fields(RepairRequest) == _keyword_options(repair)
    assert _fields(RepairRequest) == _cli_params("repair") - _NOT_OPTIONS


# -- latest --------------------------------------------------------------------------------


def test_latest_request_is_every_latest_option() -> None:
    from ckpt_cli.ops.latest import LatestRequest, latest

    assert LatestRequest.model_config.get("frozen") is True
    assert _fields(LatestRequest) == _keyword_options(latest)
    # the command judges the whole table only when it prints it (`full` comes from --json)
    cli = _cli_params("latest") - _NOT_OPTIONS - {"run_dir"}
    assert _fields(LatestRequest) == cli | {"full"}


def test_every_latest_option_reaches_the_judge(tmp_path: Path) -> None:
    from ckpt_cli.ops.latest import LatestRequest, latest_with

    from .run_fixtures import trainer_checkpoint, trainer_run

    out = trainer_run(tmp_path, steps=(100, 200))
    broken = out / "checkpoint-300"
    trainer_checkpoint(broken, 300)
    (broken / "trainer_state.json").unlink()  # a save still going: written seconds ago
    # --settle: seconds ago is "still being written" under the default window, not under 0
    rows = run_ckpt("latest", out, "--json").json["result"]["checkpoints"]
    assert {c["name"]: c["status"] for c in rows}["checkpoint-300"] == "writing"
    rows = run_ckpt("latest", out, "--settle", "0", "--json").json["result"]["checkpoints"]
    assert {c["name"]: c["status"] for c in rows}["checkpoint-300"] == "incomplete"
    # full: without it judging stops at the newest complete save (what the plain command needs)
    whole = latest_with(out, LatestRequest(settle=0))
    short = latest_with(out, LatestRequest(settle=0, full=False))
    assert [c.name for c in whole.checkpoints] == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    ]
    assert [c.name for c in short.checkpoints] == ["checkpoint-200", "checkpoint-300"]
    assert whole.latest == short.latest == str(out / "checkpoint-200")
    plain = run_ckpt("latest", out)
    assert plain.stdout.strip() == whole.latest


# -- merge / doctor ------------------------------------------------------------------------


def test_merge_and_doctor_requests_are_their_options() -> None:
    from ckpt_cli.ops.doctor import DoctorRequest, doctor
    from ckpt_cli.ops.merge import MergeRequest, merge

    for request, function, command, locations in (
        (MergeRequest, merge, "merge", {"base", "adapter", "dest"}),
        (DoctorRequest, doctor, "doctor", {"run_dir"}),
    ):
        assert request.model_config.get("frozen") is True, command
        assert _fields(request) == _keyword_options(function), command
        assert _fields(request) == _cli_params(command) - _NOT_OPTIONS - locations, command


# -- download ------------------------------------------------------------------------------


def test_download_request_is_every_download_option() -> None:
    from ckpt_cli.ops.download import DownloadRequest, download

    assert DownloadRequest.model_config.get("frozen") is True
    assert _fields(DownloadRequest) == _keyword_options(download)
    # `--local-dir` is DEST spelled as huggingface-cli spells it; `--no-extras` is `extras`
    cli = _cli_params("download") - _NOT_OPTIONS - {"local_dir"}
    assert _fields(DownloadRequest) == (cli - {"no_extras"}) | {"extras"}


# -- sync ----------------------------------------------------------------------------------


def test_sync_request_is_every_sync_option() -> None:
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.sync import SyncRequest, sync

    assert SyncRequest.model_config.get("frozen") is True
    assert _fields(SyncRequest) == _keyword_options(sync) - {"on_round", "sleep", "on_file"}
    # `--prune-remote` and the `--keep-*` rules are the request's `prune_policy`
    # (`--settle` is the sync's own: which local saves are still being written)
    cli = _cli_params("sync") - _NOT_OPTIONS
    # --higher-is-better / --lower-is-better (and the deprecated --mode) set the policy's `mode`
    cli = (cli - {"higher_is_better"}) | {"mode"}
    rules = set(PrunePolicy.model_fields) - {"settle"}
    # (`--yes` is the command line's consent to --prune-remote's deletions: a library caller
    # that passes a policy has given it)
    policy = {o for o in cli if o in ("prune_remote", "yes") or o in rules}
    renamed = {"latest": "latest_only", "watch": "watch_seconds"}
    plain = {renamed.get(o, o) for o in cli - policy}
    assert _fields(SyncRequest) == plain | {"prune_policy"}


# -- every request -------------------------------------------------------------------------


def _every_request() -> list[type[BaseModel]]:
    """Each operation's request class, imported from where its operation lives."""
    from ckpt_cli.ops.convert.run import ConvertRequest
    from ckpt_cli.ops.diff.run import DiffRequest
    from ckpt_cli.ops.doctor import DoctorRequest
    from ckpt_cli.ops.download.plan import DownloadRequest
    from ckpt_cli.ops.inspect import InspectRequest
    from ckpt_cli.ops.latest import LatestRequest
    from ckpt_cli.ops.merge import MergeRequest
    from ckpt_cli.ops.parity.protect import ProtectRequest
    from ckpt_cli.ops.parity.repair import RepairRequest
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.reshard.request import ReshardRequest
    from ckpt_cli.ops.sync import SyncRequest
    from ckpt_cli.ops.verify.run import VerifyRequest

    return [
        ConvertRequest,
        DiffRequest,
        DoctorRequest,
        DownloadRequest,
        InspectRequest,
        LatestRequest,
        MergeRequest,
        ProtectRequest,
        RepairRequest,
        PrunePolicy,
        ReshardRequest,
        SyncRequest,
        VerifyRequest,
    ]


@pytest.mark.parametrize("request_class", _every_request(), ids=lambda c: c.__name__)
def test_a_misspelt_option_in_a_request_is_refused_not_ignored(
    request_class: type[BaseModel],
) -> None:
    """A library user who builds a request by hand with a typo (`ConvertRequest(dytpe=...)`)
    gets an error naming the field, as the operation's function would with a TypeError, rather
    than a request that silently runs with the default."""
    from pydantic import ValidationError

    from ckpt_cli.ops.doctor import DoctorRequest

    required: dict[str, Any] = {}
    if request_class is DoctorRequest:
        required = {"before": "run/step-100", "after": "run/step-200"}
    request_class.model_validate(required)  # the fields it declares are taken
    with pytest.raises(ValidationError, match="no_such_option"):
        request_class.model_validate({**required, "no_such_option": 1})
    assert request_class.model_config.get("frozen") is True
