"""DCP: inspect and read real `dcp.save` output (1 and 2 ranks, both serializations), write
checkpoints `dcp.load` restores bit-exact, and refuse hostile or broken folders (exit 4)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from ckpt_cli.dist.placement import shard_dim0_boxes
from ckpt_cli.formats import open_checkpoint, resolve_source
from ckpt_cli.formats.base import WriteOptions
from ckpt_cli.formats.dcp import DcpCheckpoint, DcpFormat
from ckpt_cli.models import Chunk, Entry

from .conftest import REPO, run_ckpt
from .dcp_dist_script import expected_state
from .dist_helpers import DIST_SCRIPT, dcp_load_flat, dcp_save, run_torchrun, training_state
from .s3_fixtures import S3Server, upload_folder

SERIALIZATIONS = ["torch_save", "safetensors"]


def torch_metadata(path: Path) -> Any:
    """The metadata as torch's own reader sees it (our own fixtures only: it is a plain pickle)."""
    return FileSystemReader(str(path)).read_metadata()


def write_metadata(path: Path, metadata: Any) -> None:
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)


def open_dcp(path: Path) -> DcpCheckpoint:
    checkpoint = open_checkpoint(str(path))
    assert isinstance(checkpoint, DcpCheckpoint)
    return checkpoint


def problems(path: Path) -> list[str]:
    return [p.code for p in DcpFormat.check(resolve_source(str(path)))]


@pytest.fixture(scope="module", params=SERIALIZATIONS)
def single(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training state saved by `dcp.save` in one process, with each serialization."""
    path = tmp_path_factory.mktemp("dcp") / request.param
    dcp_save(training_state(), path, request.param)
    return path


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One torchrun launch (2 ranks, gloo): `dcp.save` of Shard(0) DTensors, and `dcp.load`
    into Shard(0) DTensors of a 2-rank checkpoint written by our writer."""
    root = tmp_path_factory.mktemp("dist")
    ours = root / "ours"
    ours.mkdir()
    state = expected_state()
    plan = [
        Entry(
            name=k, dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape), nbytes=v.nbytes
        )
        for k, v in state.items()
    ]
    plan.append(Entry(name="train.step", kind="object"))
    writer = DcpFormat.writer(ours, plan, WriteOptions(world_size=2))
    for name, tensor in state.items():
        writer.write_tensor(name, tensor)
    writer.write_object("train.step", 11)
    writer.finish()
    run_torchrun(
        DIST_SCRIPT,
        2,
        *("--save", root / "saved", "--save-nocoll", root / "nocoll", "--save-hf", root / "hf"),
        *("--load", ours, root / "report", "train.step"),
    )
    names = ("saved", "nocoll", "hf", "report")
    return {"ours": ours, **{name: root / name for name in names}}


# --- inspect and read what dcp.save wrote ------------------------------------------------------


def test_inspect_lists_every_entry_as_torch_records_it(single: Path) -> None:
    result = run_ckpt("inspect", single, "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    md = torch_metadata(single)
    assert report["format"] == "dcp"
    assert report["details"]["serialization"] == single.name
    assert report["details"]["world_size"] == 1
    by_name = {e["name"]: e for e in report["entries"]}
    assert set(by_name) == set(md.state_dict_metadata)
    lengths = {index.fqn: info.length for index, info in md.storage_data.items()}
    tensors = 0
    for fqn, item in md.state_dict_metadata.items():
        entry = by_name[fqn]
        if hasattr(item, "size"):
            tensors += 1
            assert entry["kind"] == "tensor"
            assert entry["dtype"] == str(item.properties.dtype).removeprefix("torch.")
            assert entry["shape"] == list(item.size)
            assert entry["nbytes"] == item.size.numel() * item.properties.dtype.itemsize
        else:
            assert entry["kind"] == "object"
            assert entry["nbytes"] == lengths[fqn] > 0
    assert report["tensors"] == tensors and report["objects"] == len(by_name) - tensors
    state = training_state()
    assert by_name["model.0.weight"]["shape"] == [6, 8]
    assert by_name["embed"]["dtype"] == "bfloat16"
    assert by_name["rng.torch"]["nbytes"] == state["rng"]["torch"].numel()
    assert (by_name["step"]["py_type"], by_name["step"]["value"]) == ("int", 7)
    assert by_name["rng_bytes"]["py_type"] == "bytes"
    assert by_name["dataloader.position"]["value"] == 42
    human = run_ckpt("inspect", single, "--list")
    assert (
        human.exit_code == 0
        and "object:int" in human.stdout
        and "dataloader.position" in human.stdout
    )


def test_tensors_and_objects_read_back_bit_exact(single: Path) -> None:
    state = training_state()
    with open_dcp(single) as checkpoint:
        for name, tensor in state["model"].items():
            got = checkpoint.read_tensor(f"model.{name}")
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        for pid, per_param in state["optimizer"]["state"].items():
            for key, value in per_param.items():
                assert torch.equal(checkpoint.read_tensor(f"optimizer.state.{pid}.{key}"), value)
        assert torch.equal(checkpoint.read_tensor("embed"), state["embed"])
        assert torch.equal(checkpoint.read_tensor("rng.torch"), state["rng"]["torch"])
        assert checkpoint.read_object("step") == 7
        assert checkpoint.read_object("rng_bytes") == state["rng_bytes"]
        assert checkpoint.read_object("rng.python") == state["rng"]["python"]
        assert checkpoint.read_object("optimizer.param_groups.0.lr") == 1e-3
        box = checkpoint.read_slice("model.0.weight", [2, 3], [3, 4])
        assert torch.equal(box, state["model"]["0.weight"][2:5, 3:7])


def test_safetensors_serialization_exposes_raw_chunks(tmp_path: Path) -> None:
    state = training_state()
    dcp_save(state, tmp_path, "safetensors")
    with open_dcp(tmp_path) as checkpoint:
        entry = checkpoint.manifest.by_name["model.2.weight"]
        assert entry.chunks and all(c.raw for c in entry.chunks) and entry.is_raw
        raw = b"".join(checkpoint.iter_raw("model.2.weight"))
        expected = state["model"]["2.weight"].contiguous().view(torch.uint8).numpy().tobytes()
        assert raw == expected


def test_metadata_inspect_does_not_import_torch(single: Path) -> None:
    probe = (
        "import sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
        "from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", probe, "inspect", str(single), "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert json.loads(proc.stdout)["result"]["format"] == "dcp"
    assert "NO_TORCH" in proc.stderr, proc.stderr


def test_unloadable_object_is_reported_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(2), "evil": Evil()}, ckpt)
    report = run_ckpt("inspect", ckpt, "--json").json["result"]
    evil = next(e for e in report["entries"] if e["name"] == "evil")
    assert evil["kind"] == "object" and evil["py_type"] == "posix.system"
    with open_dcp(ckpt) as checkpoint, pytest.raises(Exception) as caught:
        checkpoint.read_object("evil")
    assert "weights_only" in str(caught.value) and "posix.system" in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("value", "loads"),
    [
        ({3, 1}, True),
        (bytearray(b"ab"), True),
        (complex(1, 2), True),
        (frozenset({1}), False),
        (range(3), False),
    ],
    ids=["set", "bytearray", "complex", "frozenset", "range"],
)
def test_verify_judges_a_saved_builtin_as_the_readers_do(
    tmp_path: Path, value: object, loads: bool
) -> None:
    """`dcp.save` pickles objects with `torch.save`'s protocol 2, which names Python 3's
    builtins after Python 2's (`__builtin__.set`, `__builtin__.xrange`). `verify` read those
    names as classes its reader refuses, and failed a save holding a set that `torch.load(
    weights_only=True)`, `dcp.load` and `ckpt convert` all read; it now says what they say."""
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(2), "v": value}, ckpt)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        torch_loads = True
    except pickle.UnpicklingError:
        torch_loads = False
    assert torch_loads == loads
    converted = run_ckpt("convert", ckpt, tmp_path / "out", "--to", "torch")
    assert converted.exit_code == (0 if loads else 4), converted.stderr
    verified = run_ckpt("verify", ckpt, "--json")
    assert verified.exit_code == (0 if loads else 1), verified.stdout
    codes = [p["code"] for p in verified.json["result"]["problems"]]
    assert codes == ([] if loads else ["unloadable_object"])


@pytest.mark.parametrize("serialization", SERIALIZATIONS)
@pytest.mark.slow
def test_dcp_in_an_object_store_reads_ranges_only(
    tmp_path: Path, s3_server: S3Server, serialization: str
) -> None:
    state = training_state()
    dcp_save(state, tmp_path / "ckpt", serialization)
    upload_folder(s3_server.endpoint, "ckpts", "run/step-7", tmp_path / "ckpt")
    s3_server.requests.clear()
    result = run_ckpt("inspect", "s3://ckpts/run/step-7", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["format"] == "dcp" and report["details"]["serialization"] == serialization
    assert next(e for e in report["entries"] if e["name"] == "step")["value"] == 7
    data_gets = s3_server.object_gets(".distcp")
    assert data_gets and all(r.range is not None for r in data_gets)
    with open_dcp_url("s3://ckpts/run/step-7") as checkpoint:
        got = checkpoint.read_tensor("model.0.weight")
        assert torch.equal(got, state["model"]["0.weight"])


def open_dcp_url(url: str) -> DcpCheckpoint:
    checkpoint = open_checkpoint(url)
    assert isinstance(checkpoint, DcpCheckpoint)
    return checkpoint


# --- 2 ranks under torchrun ------------------------------------------------------------------


@pytest.mark.torchrun
def test_two_rank_save_inspects_and_reassembles(two_rank: dict[str, Path]) -> None:
    saved = two_rank["saved"]
    report = run_ckpt("inspect", saved, "--json").json["result"]
    assert report["details"]["world_size"] == 2
    assert {f["path"] for f in report["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    by_name = {e["name"]: e for e in report["entries"]}
    full = expected_state()
    assert report["tensors"] == len(full) and report["objects"] == 1
    assert by_name["train.step"]["value"] == 11
    w = by_name["model.w"]
    assert w["shape"] == [5, 3] and w["nbytes"] == 60
    assert [(c["offsets"], c["sizes"], c["file"]) for c in w["chunks"]] == [
        ([0, 0], [3, 3], "__0_0.distcp"),
        ([3, 0], [2, 3], "__1_0.distcp"),
    ]
    with open_dcp(saved) as checkpoint:
        for name, tensor in full.items():
            assert torch.equal(checkpoint.read_tensor(name), tensor), name
        # a box across the rank boundary reads both chunks
        assert torch.equal(
            checkpoint.read_slice("model.w", [2, 1], [2, 2]), full["model.w"][2:4, 1:3]
        )
    assert problems(saved) == []


@pytest.mark.torchrun
def test_save_without_collectives_reads_from_per_rank_metadata(
    two_rank: dict[str, Path], tmp_path: Path
) -> None:
    nocoll = two_rank["nocoll"]
    assert not (nocoll / ".metadata").exists() and (nocoll / "__1.metadata").exists()
    report = run_ckpt("inspect", nocoll, "--json").json["result"]
    assert report["details"]["world_size"] == 2
    full = expected_state()
    with open_dcp(nocoll) as checkpoint:
        for name, tensor in full.items():
            assert torch.equal(checkpoint.read_tensor(name), tensor), name
    assert problems(nocoll) == []
    # one rank's metadata missing: that rank's save was interrupted
    copy = tmp_path / "copy"
    shutil.copytree(nocoll, copy)
    (copy / "__1.metadata").unlink()
    assert {"dcp_interrupted", "dcp_hole"} <= set(problems(copy))


@pytest.mark.torchrun
def test_hugging_face_writer_per_rank_shards_read_as_dcp(two_rank: dict[str, Path]) -> None:
    hf = two_rank["hf"]
    assert not (hf / ".metadata").exists()
    report = run_ckpt("inspect", hf, "--json").json["result"]
    assert report["format"] == "dcp"
    assert report["details"]["serialization"] == "hf_safetensors"
    assert report["details"]["world_size"] == 2
    full = expected_state()
    by_name = {e["name"]: e for e in report["entries"]}
    assert set(by_name) == set(full)
    with open_dcp(hf) as checkpoint:
        for name, tensor in full.items():
            assert by_name[name]["shape"] == list(tensor.shape), name
            assert torch.equal(checkpoint.read_tensor(name), tensor), name
    assert problems(hf) == []


@pytest.mark.torchrun
def test_writer_output_loads_into_shard0_dtensors_each_rank_its_own_file(
    two_rank: dict[str, Path],
) -> None:
    for rank in range(2):
        report = json.loads((two_rank["report"] / f"rank{rank}.json").read_text())
        assert report["ok"], report["mismatches"]
        assert report["objects"] == {"train.step": 11}
        for name, tensor in expected_state().items():
            if tensor.dim() and shard_dim0_boxes(list(tensor.shape), 2)[rank].sizes[0] > 0:
                assert report["files_read"][name] == [f"__{rank}_0.distcp"], name
    # and the same output has the layout dcp.save itself gives those DTensors
    ours = open_dcp(two_rank["ours"]).manifest
    theirs = open_dcp(two_rank["saved"]).manifest
    for entry in theirs.tensors:
        mine = ours.by_name[entry.name]
        assert {(tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks or []} == {
            (tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks or []
        }


# --- the writer ------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3])
def test_writer_round_trips_through_dcp_load(tmp_path: Path, world_size: int) -> None:
    src = tmp_path / "src"
    dcp_save(training_state(), src)
    out = tmp_path / "out"
    out.mkdir()
    with open_dcp(src) as source:
        plan = [e.model_copy(update={"chunks": None}) for e in source.manifest.entries]
        options = WriteOptions(world_size=world_size, dcp_planner_data=source.planner_data)
        writer = DcpFormat.writer(out, plan, options)
        for entry in plan:
            if entry.kind == "tensor":
                writer.write_tensor(entry.name, source.read_tensor(entry.name))
            else:
                writer.write_object_bytes(entry.name, source.read_object_bytes(entry.name))
        files = writer.finish()
        assert files[0].path == ".metadata"
        assert {f.path for f in files[1:]} == {f"__{r}_0.distcp" for r in range(world_size)}
        template: dict[str, Any] = {
            e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype or ""))
            if e.kind == "tensor"
            else None
            for e in plan
        }
        loaded = dcp_load_flat(out, template)
        for entry in plan:
            if entry.kind == "tensor":
                assert torch.equal(loaded[entry.name], source.read_tensor(entry.name)), entry.name
            else:
                assert loaded[entry.name] == source.read_object(entry.name), entry.name
    chunks = open_dcp(out).manifest.by_name["model.0.weight"].chunks or []
    assert [c.sizes for c in chunks] == [
        list(b.sizes) for b in shard_dim0_boxes([6, 8], world_size)
    ]
    assert problems(out) == []


def test_write_chunk_streams_a_planned_tensor_parallel_layout(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    wo = torch.randn(4, 6, generator=gen)
    # split along dim 1 (tensor-parallel style), one box per rank file
    chunks = [
        Chunk(offsets=[0, 0], sizes=[4, 3], file="__0_0.distcp", byte_offset=0, byte_length=0),
        Chunk(offsets=[0, 3], sizes=[4, 3], file="__1_0.distcp", byte_offset=0, byte_length=0),
    ]
    plan = [Entry(name="wo", dtype="float32", shape=[4, 6], nbytes=96, chunks=chunks)]
    out = tmp_path / "tp"
    out.mkdir()
    writer = DcpFormat.writer(out, plan, WriteOptions(world_size=2))
    for index, chunk in reversed(list(enumerate(chunks))):  # any order
        writer.write_chunk("wo", index, wo[:, chunk.offsets[1] : chunk.offsets[1] + 3])
    writer.finish()
    assert torch.equal(dcp_load_flat(out, {"wo": torch.empty(4, 6)})["wo"], wo)
    with open_dcp(out) as checkpoint:
        assert [c.file for c in checkpoint.manifest.by_name["wo"].chunks or []] == [
            c.file for c in chunks
        ]
        assert torch.equal(checkpoint.read_slice("wo", [1, 2], [2, 2]), wo[1:3, 2:4])


def test_writer_safetensors_serialization_matches_dcp_save_and_takes_raw_bytes(
    tmp_path: Path,
) -> None:
    state = training_state()
    theirs = tmp_path / "theirs"
    dcp_save(state, theirs, "safetensors")
    ours = tmp_path / "ours"
    ours.mkdir()
    with open_dcp(theirs) as source:
        plan = [e.model_copy(update={"chunks": None}) for e in source.manifest.entries]
        writer = DcpFormat.writer(
            ours, plan, WriteOptions(world_size=2, dcp_serialization="safetensors")
        )
        assert writer.accepts_raw
        for entry in plan:
            if entry.kind == "tensor":
                writer.write_raw(entry.name, source.iter_raw(entry.name, block=7))
            else:
                writer.write_object(entry.name, source.read_object(entry.name))
        writer.finish()
        with open_dcp(ours) as back:
            assert back.manifest.details["serialization"] == "safetensors"
            assert back.manifest.details["world_size"] == 2
            for entry in source.manifest.tensors:
                assert torch.equal(back.read_tensor(entry.name), source.read_tensor(entry.name))
                assert all(c.raw for c in back.manifest.by_name[entry.name].chunks or [])
            assert back.read_object("step") == 7
    # and from the 2-rank output the raw bytes stream back in order, across rank files
    with open_dcp(ours) as back:
        weight = state["model"]["0.weight"]
        assert len(back.manifest.by_name["model.0.weight"].chunks or []) == 2
        raw = b"".join(back.iter_raw("model.0.weight", block=5))
        assert raw == weight.contiguous().view(torch.uint8).numpy().tobytes()
    # the embedded safetensors blob carries DCP's sharding info, as dcp.save writes it
    from safetensors import safe_open

    blob = ours / "__1_0.distcp"
    with safe_open(str(blob), framework="pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert info["model.0.weight"]["saved_offsets"] == [3, 0]
        assert torch.equal(f.get_tensor("model.0.weight"), state["model"]["0.weight"][3:])


# --- hostile and broken folders ----------------------------------------------------------------


class _Hostile:
    def __init__(self, call: Any, arg: str):
        self.call, self.arg = call, arg

    def __reduce__(self) -> Any:
        return (self.call, (self.arg,))


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval-inside-metadata"])
def test_hostile_metadata_pickle_is_refused_and_not_run(tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    marker = tmp_path / "pwned"
    if kind == "os.system":
        payload: Any = _Hostile(os.system, f"touch {marker}")
    else:
        payload = torch_metadata(ckpt)
        payload.planner_data = _Hostile(eval, f"open({str(marker)!r}, 'w').close()")
    write_metadata(ckpt, payload)
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["code"] == "unsafe_input"
    assert error["path"].endswith(".metadata")
    assert ("posix.system" if kind == "os.system" else "builtins.eval") in error["message"]
    assert not marker.exists()
    assert problems(ckpt) == ["unsafe_input"]
    assert not marker.exists()


def test_metadata_memory_bomb_is_refused_before_it_is_built(tmp_path: Path) -> None:
    # a few MB of pickle that builds an empty list per byte: as torch's plain pickle.load would
    # build all of them, a larger one exhausts memory; the budget stops the load early
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    size = 8 << 20
    (ckpt / ".metadata").write_bytes(b"\x80\x02](" + b"]" * size + b"e.")
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["path"].endswith(".metadata")
    assert "objects from its first" in error["message"]
    read = int(error["message"].split("from its first ")[1].split(" bytes")[0].replace(",", ""))
    assert read < size // 2  # refused after a fraction of the file, not after building it all
    assert problems(ckpt) == ["bad_checkpoint"]


def test_metadata_over_the_size_budget_is_refused_unread(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    with open(ckpt / ".metadata", "r+b") as fh:
        fh.truncate((1 << 30) + 1)  # sparse: costs no disk, and is never read
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    assert result.json["error"]["path"].endswith(".metadata")
    assert "1,073,741,825 bytes, more than 1,073,741,824" in result.json["error"]["message"]


@pytest.mark.slow
def test_deeply_nested_planner_data_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    md = torch_metadata(ckpt)
    deep: list[Any] = ["w"]
    for _ in range(150):
        deep = [deep]
    md.planner_data["w"] = deep
    write_metadata(ckpt, md)
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    assert result.json["error"]["path"].endswith(".metadata")
    assert "planner data nested more than 100 deep" in result.json["error"]["message"]
    # a real save's metadata is far inside every budget
    dcp_save({f"layer{i}.w": torch.zeros(2) for i in range(2000)}, tmp_path / "many")
    assert run_ckpt("inspect", tmp_path / "many", "--json").exit_code == 0


class _EnumCall:
    """Pickles as `enum(value)`: how a member of a torch enum is stored, here with any value."""

    def __init__(self, enum: Any, value: Any):
        self.enum, self.value = enum, value

    def __reduce__(self) -> Any:
        return (self.enum, (self.value,))


def _with_save_plan(ckpt: Path, item_type: Any) -> None:
    """Give a real `.metadata` the save plan Megatron-Core keeps there (`all_local_plans`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    md = torch_metadata(ckpt)
    md.all_local_plans = [SavePlan(items=[WriteItem(index=MetadataIndex("w"), type=item_type)])]
    write_metadata(ckpt, md)


def test_every_member_of_every_enum_dcp_pickles_is_read() -> None:
    """Each member of torch's own enums, pickled as torch pickles it, reads as its stand-in."""
    import enum
    import inspect as pyinspect

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.distributed.checkpoint.planner as dcp_planner

    from ckpt_cli.formats.dcp.metadata import ENUMS, MetadataUnpickler

    memory_formats = {
        "TORCH_CONTIGUOUS_FORMAT": "contiguous_format",
        "TORCH_CHANNELS_LAST": "channels_last",
        "TORCH_PRESERVE_FORMAT": "preserve_format",
    }
    # enums torch defines there but never pickles into `.metadata`: LoadItemType lives in
    # LoadPlan / ReadItem only, SerializationFormat is a FileSystemWriter option
    never_pickled = {"LoadItemType", "SerializationFormat"}
    seen = set()
    for module in (dcp_md, dcp_planner, dcp_fs):
        for name, cls in pyinspect.getmembers(module, pyinspect.isclass):
            if not issubclass(cls, enum.Enum) or cls.__module__ != module.__name__:
                continue
            seen.add(name)
            if name in never_pickled:
                assert (module.__name__, name) not in ENUMS
                continue
            assert (module.__name__, name) in ENUMS, f"{module.__name__}.{name} is not mapped"
            for member in cls:
                got = MetadataUnpickler(pickle.dumps(member, protocol=4), "x").load()
                assert got == memory_formats.get(member.name, member.name), member
    assert seen >= {"WriteItemType", "_MEM_FORMAT_ENCODING"} | never_pickled


def test_byte_io_write_items_of_a_save_plan_are_read(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import WriteItemType

    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3), "step": 1}, ckpt)
    _with_save_plan(ckpt, WriteItemType.BYTE_IO)
    assert run_ckpt("inspect", ckpt).exit_code == 0
    from ckpt_cli.formats.dcp.metadata import load_metadata

    plans = load_metadata((ckpt / ".metadata").read_bytes(), "x").all_local_plans
    assert [item.type for item in plans[0].items] == ["BYTE_IO"]


@pytest.mark.parametrize(
    ("where", "value"),
    [("planner.WriteItemType", 4), ("metadata._MEM_FORMAT_ENCODING", 9)],
    ids=["write-item-type", "memory-format"],
)
def test_an_unknown_enum_value_is_named_not_called_truncated(
    tmp_path: Path, where: str, value: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A well-formed `.metadata` with a member torch 2.13 lacks (as a newer torch could write):
    exit 4 naming the enum and the value and a newer torch, never "truncated" or "interrupted"."""
    import importlib

    module, name = where.split(".")
    enum_cls = getattr(importlib.import_module(f"torch.distributed.checkpoint.{module}"), name)
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    if name == "WriteItemType":
        _with_save_plan(ckpt, _EnumCall(enum_cls, value))
    else:
        # TensorProperties pickles its memory format as `_MEM_FORMAT_ENCODING(n)`
        from torch.distributed.checkpoint.metadata import TensorProperties

        def with_unknown_format(self: Any) -> tuple[Any, ...]:
            return (self.dtype, self.layout, False, _EnumCall(enum_cls, value), False)

        monkeypatch.setattr(TensorProperties, "__getstate__", with_unknown_format)
        write_metadata(ckpt, torch_metadata(ckpt))
        monkeypatch.undo()
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert error["path"].endswith(".metadata")
    # verify lists the same finding as its problem (exit 1)
    verify = run_ckpt("verify", ckpt, "--json")
    assert verify.exit_code == 1, verify.stdout
    [problem] = verify.json["result"]["problems"]
    assert problem["file"].endswith(".metadata")
    for message in (error["message"] + " " + (error["fix"] or ""), problem["message"]):
        assert f"{where.split('.')[1]}({value})" in message and "newer torch" in message
        assert "truncated" not in message.lower() and "interrupted" not in message.lower()


def test_traversal_path_in_metadata_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3), "step": 1}, ckpt)
    md = torch_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    write_metadata(ckpt, md)
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    assert result.json["error"]["code"] == "unsafe_input"
    assert "outside the checkpoint" in result.json["error"]["message"]


def test_missing_metadata_reads_as_an_interrupted_save(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    (ckpt / ".metadata").unlink()
    result = run_ckpt("inspect", ckpt)
    assert result.exit_code == 4
    assert "interrupted" in result.stderr and "no .metadata" in result.stderr
    found = DcpFormat.check(resolve_source(str(ckpt)))
    assert [p.code for p in found] == ["dcp_interrupted"] and "interrupted" in found[0].message


def broken_copy(two_rank: dict[str, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(two_rank["saved"], copy)
    return copy


@pytest.mark.torchrun
def test_missing_rank_file_is_reported(two_rank: dict[str, Path], tmp_path: Path) -> None:
    ckpt = broken_copy(two_rank, tmp_path)
    (ckpt / "__1_0.distcp").unlink()
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    assert "__1_0.distcp is missing" in result.json["error"]["message"]
    assert problems(ckpt) == ["dcp_missing_file"]


@pytest.mark.torchrun
def test_truncated_rank_file_is_reported(two_rank: dict[str, Path], tmp_path: Path) -> None:
    ckpt = broken_copy(two_rank, tmp_path)
    data = ckpt / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 100)
    assert run_ckpt("inspect", ckpt).exit_code == 4
    found = DcpFormat.check(resolve_source(str(ckpt)))
    assert {p.code for p in found} == {"dcp_truncated"}
    assert all(p.file and p.file.endswith("__0_0.distcp") for p in found)


@pytest.mark.torchrun
def test_holes_and_overlaps_are_all_reported(two_rank: dict[str, Path], tmp_path: Path) -> None:
    ckpt = broken_copy(two_rank, tmp_path)
    md = torch_metadata(ckpt)
    # hole: forget the second chunk of model.w
    md.state_dict_metadata["model.w"].chunks.pop()
    # overlap: claim rank 1's chunk of model.emb starts one row earlier
    emb = md.state_dict_metadata["model.emb"]
    old = emb.chunks[1]
    new_offsets = torch.Size([old.offsets[0] - 1, 0])
    for index in list(md.storage_data):
        if index.fqn == "model.emb" and index.offset == old.offsets:
            info = md.storage_data.pop(index)
            md.storage_data[type(index)("model.emb", new_offsets, 1)] = info
    old.offsets = new_offsets
    write_metadata(ckpt, md)
    found = DcpFormat.check(resolve_source(str(ckpt)))
    assert {(p.code, p.tensor) for p in found} == {
        ("dcp_hole", "model.w"),
        ("dcp_overlap", "model.emb"),
    }
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4 and "1 more problem" in result.json["error"]["message"]


def test_writer_lays_out_tiny_and_empty_tensors_for_many_ranks(tmp_path: Path) -> None:
    state = {
        "one_row": torch.tensor([3.0]),
        "no_rows": torch.zeros(0, 3),
        "no_cols": torch.zeros(4, 0),
        "scalar": torch.tensor(1, dtype=torch.int64),
        "uneven": torch.randn(5, 2),
    }
    plan = [
        Entry(
            name=k, dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape), nbytes=v.nbytes
        )
        for k, v in state.items()
    ]
    writer = DcpFormat.writer(tmp_path, plan, WriteOptions(world_size=4))
    for name, tensor in state.items():
        writer.write_tensor(name, tensor)
    writer.finish()
    loaded = dcp_load_flat(tmp_path, {k: torch.full_like(v, 7) for k, v in state.items()})
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    manifest = open_dcp(tmp_path).manifest
    uneven = manifest.by_name["uneven"].chunks or []
    assert [(c.offsets[0], c.sizes[0], c.file) for c in uneven] == [
        (0, 2, "__0_0.distcp"),
        (2, 2, "__1_0.distcp"),
        (4, 1, "__2_0.distcp"),
        (5, 0, "__3_0.distcp"),
    ]
    assert [c.file for c in manifest.by_name["scalar"].chunks or []] == ["__0_0.distcp"]
    assert problems(tmp_path) == []


@pytest.mark.parametrize("serialization", SERIALIZATIONS)
def test_dtype_and_size_disagreements_with_the_data_are_reported(
    tmp_path: Path, serialization: str
) -> None:
    dcp_save(
        {"embed": torch.ones(4, 2, dtype=torch.bfloat16), "w": torch.ones(3)},
        tmp_path,
        serialization,
    )
    md = torch_metadata(tmp_path)
    md.state_dict_metadata["embed"].properties.dtype = torch.float16  # same item size
    write_metadata(tmp_path, md)
    found = DcpFormat.check(resolve_source(str(tmp_path)))
    assert [(p.code, p.tensor) for p in found] == [("dcp_mismatch", "embed")]
    assert "bfloat16" in found[0].message or "BF16" in found[0].message


def test_rank_file_linked_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(3)}, ckpt)
    outside = tmp_path / "elsewhere.distcp"
    (ckpt / "__0_0.distcp").rename(outside)
    (ckpt / "__0_0.distcp").symlink_to(outside)
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 4
    assert result.json["error"]["code"] == "unsafe_input"
    assert "outside the checkpoint" in result.json["error"]["message"]


@pytest.mark.parametrize("serialization", SERIALIZATIONS)
def test_a_rank_file_linked_to_a_small_file_outside_is_refused_not_called_truncated(
    tmp_path: Path, serialization: str
) -> None:
    # the listing followed the link: verify said "bytes 0..N lie past the end of
    # __0_0.distcp (6 bytes); the file is truncated", the outside file's size, never the link
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(300), "b": torch.ones(10)}, ckpt, serialization)
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(outside)
    verify = run_ckpt("verify", ckpt, "--json")
    output = verify.stdout + verify.stderr
    assert verify.exit_code == 1, output
    problems = verify.json["result"]["problems"]
    assert [p["code"] for p in problems] == ["unsafe_input"], problems
    message = problems[0]["message"]
    assert "'__0_0.distcp' is a link that points outside the checkpoint" in message
    assert str(outside) in message
    assert "Copy the file into the checkpoint folder" in problems[0]["fix"]
    assert "truncated" not in output and "6 bytes" not in output
    for command in ("inspect", "convert"):
        args = [tmp_path / "out.safetensors", "--to", "safetensors"] if command == "convert" else []
        result = run_ckpt(command, ckpt, *args, "--json")
        assert result.exit_code == 4, result.stdout + result.stderr
        assert result.json["error"]["code"] == "unsafe_input"
        assert "'__0_0.distcp' is a link that points outside" in result.json["error"]["message"]


def test_a_rank_file_linked_within_the_checkpoint_is_read_as_the_file(tmp_path: Path) -> None:
    # a link that stays inside the checkpoint folder is no escape: read through, bit-exact
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(300.0), "b": torch.ones(10)}
    dcp_save(state, ckpt)
    (ckpt / "data").mkdir()
    (ckpt / "__0_0.distcp").rename(ckpt / "data" / "rank0.bin")
    (ckpt / "__0_0.distcp").symlink_to(Path("data") / "rank0.bin")
    verify = run_ckpt("verify", ckpt, "--json")
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    out = tmp_path / "out.safetensors"
    converted = run_ckpt("convert", ckpt, out, "--to", "safetensors")
    assert converted.exit_code == 0, converted.stdout + converted.stderr
    from safetensors.torch import load_file

    loaded = load_file(out)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("serialization", SERIALIZATIONS)
def test_read_slice_loads_only_the_chunks_and_rows_it_needs(
    tmp_path: Path, serialization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.arange(60.0).reshape(12, 5)
    plan = [Entry(name="w", dtype="float32", shape=[12, 5], nbytes=240)]
    writer = DcpFormat.writer(
        tmp_path, plan, WriteOptions(world_size=4, dcp_serialization=serialization)
    )
    writer.write_tensor("w", tensor)
    writer.finish()
    with open_dcp(tmp_path) as checkpoint:
        loads: list[tuple[list[int], Any]] = []
        real = checkpoint._load_chunk

        def spy(entry: Entry, chunk: Chunk, rows: Any = None) -> torch.Tensor:
            loads.append((chunk.offsets, rows))
            return real(entry, chunk, rows)

        monkeypatch.setattr(checkpoint, "_load_chunk", spy)
        # rows 4..6 lie in rank 1's chunk (rows 3..5) and rank 2's (rows 6..8)
        box = checkpoint.read_slice("w", [4, 1], [3, 2])
        assert torch.equal(box, tensor[4:7, 1:3])
    assert [offsets for offsets, _ in loads] == [[3, 0], [6, 0]]
    if serialization == "safetensors":  # raw chunks: only the rows needed are read
        assert [rows for _, rows in loads] == [(1, 3), (0, 1)]


def test_every_dcp_problem_code_says_its_fix() -> None:
    """Each DCP and Megatron-Core problem of the code table has the fix `verify` prints after
    it; the lines named the flaw only ("...; the file is truncated")."""
    from ckpt_cli.formats.dcp.layout import PROBLEM_FIXES
    from ckpt_cli.problems import CODES

    codes = {code for code in CODES if code.startswith(("dcp_", "megatron_"))}
    assert codes <= set(PROBLEM_FIXES), codes - set(PROBLEM_FIXES)
    assert all(fix.endswith(".") for fix in PROBLEM_FIXES.values())


def test_inspect_names_a_saved_set_by_its_python_3_type(tmp_path: Path) -> None:
    """A set `dcp.save` pickled (protocol 2: `__builtin__.set`) showed as
    `object:__builtin__.set`, a name no Python 3 reader uses; it is a `set`."""
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(2), "seen": {1, 2}}, ckpt)
    result = run_ckpt("inspect", ckpt, "--json")
    assert result.exit_code == 0, result.stderr
    (entry,) = [e for e in result.json["result"]["entries"] if e["name"] == "seen"]
    assert entry["py_type"] == "set", entry


def test_planner_data_that_does_not_place_an_entry_is_found_as_torch_loaders_refuse_it(
    tmp_path: Path,
) -> None:
    # `.metadata` records where each entry sits in the nested state dict (`planner_data`);
    # torch's loaders without a template (`dcp_to_torch_save`, `_load_state_dict_from_keys`,
    # FSDP's optimizer loading) rebuild the state dict from it. One bit flipped in a memo
    # index of the pickle made it name a path that spells another entry (or a dict): a
    # well-formed pickle whose checkpoint those loaders refuse, and verify called OK.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "step-10"
    dcp_save({"model": {"w": torch.ones(2, 3)}, "step": 3}, path)
    metadata = torch_metadata(path)
    assert metadata.planner_data["model.w"] == ("model", "w")
    metadata.planner_data["model.w"] = ("model", "x")
    write_metadata(path, metadata)
    with pytest.raises(BaseException, match=r"model\.x"):  # torch's CheckpointException
        dcp_to_torch_save(str(path), str(tmp_path / "out.pt"))

    found = run_ckpt("verify", path, "--json")
    assert found.exit_code == 1, found.stderr
    errors = [p for p in json.loads(found.stdout)["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["tensor"]) for p in errors] == [("dcp_bad_planner_data", "model.w")]
    assert "('model', 'x')" in errors[0]["message"] and errors[0]["file"].endswith(".metadata")
    refused = run_ckpt("inspect", path)
    assert refused.exit_code == 4 and "'model.w'" in refused.stderr, refused.stderr
