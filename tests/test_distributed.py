"""`ckpt` under torchrun: the work is split across ranks and the output is the single run's.

A user with a big checkpoint launches `torchrun --nproc-per-node K -m ckpt_cli convert|reshard|
verify …` on CPU. Every rank writes (or hashes) its share of the files; rank 0 writes the
index / `.metadata` / manifest last and publishes. These stories check that the published output
is byte for byte what one process writes, that only rank 0 prints, and that one failing rank
fails the whole launch cleanly. Launches are few and combined: each costs seconds on 2 cores.
"""

from __future__ import annotations

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
from safetensors.torch import save_file

from ckpt_cli.dist.command import (
    SINGLE,
    CombinedProgress,
    RankFailedError,
    Workers,
    active,
    launched,
)

from .conftest import RecordingProgress, run_ckpt
from .dist_helpers import (
    dcp_load_flat,
    dcp_save,
    free_port,
    require_torchrun_marker,
    run_launch,
    torchrun_ckpt,
    torchrun_command,
    torchrun_env,
    training_state,
)

SCRIPT = Path(__file__).resolve().parent / "dist_ckpt_script.py"


def model_state() -> dict[str, torch.Tensor]:
    """Tensors of uneven sizes and several dtypes, so shards and ranks get uneven shares."""
    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {
        f"layers.{i}.weight": torch.randn(48, 16 + 8 * i) for i in range(8)
    }
    state["embed"] = torch.randn(100, 16).to(torch.bfloat16)
    state["positions"] = torch.arange(77, dtype=torch.int64)
    state["scale"] = torch.tensor(0.5)
    return state


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative name -> bytes)."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def assert_same_tree(single: Path, split: Path) -> None:
    """The same file names and the same bytes; DCP `.metadata` equal up to its random save id."""
    a, b = tree(single), tree(split)
    assert sorted(a) == sorted(b)
    for name in a:
        if name == ".metadata":
            # dcp.save stamps a fresh uuid in storage_meta on every save, ours does too
            ma, mb = pickle.loads(a[name]), pickle.loads(b[name])  # our own test output
            assert ma.state_dict_metadata == mb.state_dict_metadata
            assert ma.storage_data == mb.storage_data
            assert ma.planner_data == mb.planner_data
        else:
            assert a[name] == b[name], name


def no_leftovers(parent: Path) -> list[str]:
    """Staging folders left beside the outputs (there must be none)."""
    return [p.name for p in parent.iterdir() if ".ckpt-tmp-" in p.name]


def run_split(tmp_path: Path, nproc: int, commands: list[list[str]]) -> list[list[dict[str, Any]]]:
    """Run `commands` in one torchrun launch of `nproc` ranks; per rank, per command results."""
    require_torchrun_marker()
    spec = tmp_path / "commands.json"
    spec.write_text(json.dumps(commands))
    out = tmp_path / "ranks"
    out.mkdir()
    proc = run_launch(torchrun_command(nproc, SCRIPT, spec, out), 300, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A safetensors model file and a DCP training checkpoint (real writers)."""
    root = tmp_path_factory.mktemp("sources")
    model = root / "model.safetensors"
    save_file(model_state(), str(model))
    dcp = root / "dcp"
    dcp_save(training_state(), dcp)
    return {"model": model, "dcp": dcp}


@pytest.mark.torchrun
def test_convert_reshard_and_verify_split_over_two_ranks_write_what_one_process_writes(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    model, dcp = sources["model"], sources["dcp"]
    single, split = tmp_path / "single", tmp_path / "split"
    single.mkdir()
    split.mkdir()
    # a sharded copy to reshard and to checksum, made once by one process
    sharded = tmp_path / "sharded"
    assert run_ckpt("convert", model, sharded, "--to", "safetensors", "--max-shard-size", "8KB")
    for name in ("single", "split", "corrupt"):
        shutil.copytree(sharded, tmp_path / f"hashed-{name}")
    assert run_ckpt("verify", tmp_path / "hashed-corrupt", "--write-manifest").exit_code == 0
    victim = sorted((tmp_path / "hashed-corrupt").glob("model-0000*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))

    def commands(out: Path, hashed: Path) -> list[list[str]]:
        return [
            [
                "convert",
                str(model),
                str(out / "st"),
                "--to",
                "safetensors",
                "--max-shard-size",
                "8KB",
                "--json",
            ],
            [
                "convert",
                str(model),
                str(out / "dcp"),
                "--to",
                "dcp",
                "--world-size",
                "3",
                "--dcp-serialization",
                "safetensors",
                "--json",
            ],
            [
                "convert",
                str(dcp),
                str(out / "from-dcp"),
                "--to",
                "safetensors",
                "--max-shard-size",
                "1KB",
                "--json",
            ],
            ["reshard", str(dcp), str(out / "ws3"), "--world-size", "3", "--json"],
            ["reshard", str(sharded), str(out / "bigger"), "--max-shard-size", "20KB", "--json"],
            ["verify", str(hashed), "--write-manifest", "--json"],
        ]

    wanted = [run_ckpt(*argv) for argv in commands(single, tmp_path / "hashed-single")]
    assert [r.exit_code for r in wanted] == [0] * 6, [r.stderr for r in wanted]
    checks = ["verify", str(tmp_path / "hashed-single"), "--checksums", "--json"]
    corrupt = ["verify", str(tmp_path / "hashed-corrupt"), "--checksums", "--json"]
    # --deep reads every tensor: each rank reads a share, the findings come back in order
    unhealthy = model_state()
    unhealthy["layers.2.weight"][3, :5] = float("nan")
    unhealthy["layers.6.weight"][0, 0] = float("inf")
    save_file(unhealthy, str(tmp_path / "unhealthy.safetensors"))
    deep = [
        ["verify", str(tmp_path / "unhealthy.safetensors"), "--deep", "--json"],
        ["verify", str(dcp), "--deep", "--json"],
    ]
    deep_wanted = [run_ckpt(*argv) for argv in deep]
    assert [r.exit_code for r in deep_wanted] == [1, 0]
    ranks = run_split(
        tmp_path, 2, [*commands(split, tmp_path / "hashed-split"), checks, corrupt, *deep]
    )

    # every rank exits as one process would; only rank 0 prints
    assert [c["code"] for c in ranks[0]] == [0] * 7 + [1, 1, 0]
    assert [c["code"] for c in ranks[1]] == [0] * 7 + [1, 1, 0]
    assert all(c["stdout"] == "" for c in ranks[1])
    docs = [json.loads(c["stdout"]) for c in ranks[0]]
    for name in ("st", "dcp", "from-dcp", "ws3", "bigger"):
        assert_same_tree(single / name, split / name)
    assert no_leftovers(split) == []

    for doc, ref in zip(docs[:5], wanted[:5], strict=True):
        got, want = doc["result"], ref.json["result"]
        # the split run names what each rank wrote; both ranks had a share
        assert [r["rank"] for r in got.pop("ranks")] == [0, 1]
        assert want.pop("ranks") == []
        for key in ("dest", "destination"):
            got.pop(key, None), want.pop(key, None)
        assert got == want

    # DCP outputs load with dcp.load, bit-exact
    state = training_state()
    template = {f"model.{k}": torch.empty_like(v) for k, v in state["model"].items()}
    loaded = dcp_load_flat(split / "ws3", template)
    for k, v in state["model"].items():
        assert torch.equal(loaded[f"model.{k}"], v)

    # the manifest: same digests and sizes as the single-process one, and each rank hashed
    # a disjoint share of the files
    m_single = json.loads((tmp_path / "hashed-single" / "ckpt-manifest.json").read_text())
    m_split = json.loads((tmp_path / "hashed-split" / "ckpt-manifest.json").read_text())
    assert m_split["files"] == m_single["files"]
    hashed = docs[5]["result"]["ranks"]
    assert [r["rank"] for r in hashed] == [0, 1]
    assert sorted(f for r in hashed for f in r["files"]) == sorted(m_single["files"])
    assert not set(hashed[0]["files"]) & set(hashed[1]["files"])
    assert docs[6]["ok"] is True
    # the corrupt shard is found whichever rank hashed it
    assert docs[7]["exit_code"] == 1
    assert [p["file"] for p in docs[7]["result"]["problems"]] == [str(victim)]
    for doc, ref in zip(docs[8:], deep_wanted, strict=True):
        assert doc["result"] == ref.json["result"]
    assert [h["name"] for h in docs[8]["result"]["nonfinite"]] == [
        "layers.2.weight",
        "layers.6.weight",
    ]


@pytest.mark.torchrun
def test_three_ranks_of_torchrun_m_ckpt_cli_convert_like_one_process(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    model = sources["model"]
    one = run_ckpt(
        "convert",
        model,
        tmp_path / "one",
        "--to",
        "safetensors",
        "--max-shard-size",
        "8KB",
        "--json",
    )
    assert one.exit_code == 0, one.stderr
    proc = torchrun_ckpt(
        3,
        "convert",
        model,
        tmp_path / "three",
        "--to",
        "safetensors",
        "--max-shard-size",
        "8KB",
        "--json",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_tree(tmp_path / "one", tmp_path / "three")
    # exactly one JSON document on stdout: rank 0's
    doc = json.loads(proc.stdout)
    shares = doc["result"]["ranks"]
    assert [r["rank"] for r in shares] == [0, 1, 2]
    assert all(r["files"] for r in shares)
    written = sorted(f for r in shares for f in r["files"])
    assert written == sorted(f.name for f in (tmp_path / "three").glob("model-*.safetensors"))


@pytest.mark.torchrun
def test_one_failing_rank_fails_every_rank_with_its_error_and_publishes_nothing(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    # the ranks are started the way torchrun starts them (its environment variables), so each
    # rank's own exit code can be read; rank 1 raises in the middle of its share
    dest = tmp_path / "resharded"
    env = torchrun_env(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": "2",
            "CKPT_TEST_FAIL_RANK": "1",
        }
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckpt_cli",
                "reshard",
                str(sources["dcp"]),
                str(dest),
                "--world-size",
                "3",
            ],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    # FormatError's documented code (4) on every rank, not just the one that failed
    assert [p.returncode for p in procs] == [4, 4], outputs
    assert "rank 1 of 2 failed: injected failure on rank 1" in outputs[0][1]
    assert "Nothing was published" in outputs[0][1]
    assert outputs[1][1] == ""  # rank 0 reports for the run
    assert not dest.exists()
    assert no_leftovers(tmp_path) == []

    # under torchrun itself, which stops the other ranks as soon as one exits: rank 0 still
    # removes its staging folder (the other ranks wait for it) and the launch fails
    dest = tmp_path / "converted"
    proc = torchrun_ckpt(
        2, "convert", sources["model"], dest, "--to", "safetensors", "--max-shard-size", "8KB",
        env={"CKPT_TEST_FAIL_RANK": "1"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "rank 1 of 2 failed: injected failure on rank 1" in proc.stderr
    assert not dest.exists()
    assert no_leftovers(tmp_path) == []


def test_a_plain_run_is_rank_0_of_1_and_never_imports_torch_distributed(
    monkeypatch: pytest.MonkeyPatch, sources: dict[str, Path]
) -> None:
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with launched():
        workers = active()
        assert workers is SINGLE
        assert (workers.rank, workers.size, workers.distributed) == (0, 1, False)
        assert workers.all_gather({"a": 1}) == [{"a": 1}]
        assert workers.mine([5, 1, 3]) == [0, 1, 2]
    # a launch of one rank is a plain run too
    launch = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    with launched():
        assert active() is SINGLE
    # a command that splits nothing never joins a launch (here: a launch variable set that
    # points nowhere, as a `ckpt` started from inside a launched program inherits them)
    env = {**launch, "WORLD_SIZE": "2", "RANK": "1"}
    code = (
        "import sys\n"
        "from ckpt_cli.cli.app import main\n"
        "try:\n"
        f"    main(['inspect', {str(sources['model'])!r}, '--json'])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=torchrun_env(env), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True  # it printed, though its RANK says 1


def test_work_is_balanced_by_bytes_and_the_same_on_every_rank() -> None:
    weights = [100, 90, 10, 10, 10, 80, 5, 5]
    owners = [Workers(rank, 3).assign(weights) for rank in range(3)]
    assert owners[0] == owners[1] == owners[2]
    load = [sum(w for w, r in zip(weights, owners[0], strict=True) if r == k) for k in range(3)]
    # greedy LPT: heaviest first onto the least-loaded rank
    assert owners[0][:2] == [0, 1] and owners[0][5] == 2
    assert max(load) - min(load) <= max(weights[2:])
    mine = [Workers(rank, 3).mine(weights) for rank in range(3)]
    assert sorted(i for m in mine for i in m) == list(range(len(weights)))


def test_the_collective_error_carries_the_first_failing_ranks_code() -> None:
    error = RankFailedError(
        [
            (1, {"code": "not_found", "exit_code": 3, "message": "x: gone"}),
            (2, {"code": "internal", "exit_code": 70, "message": "boom"}),
        ],
        3,
    )
    assert error.exit_code == 3
    assert "ranks 1, 2 of 3 failed: x: gone" in error.message
    assert os.environ.get("CKPT_TEST_FAIL_RANK") is None


def test_a_rank_reads_only_the_rows_of_its_chunks_from_safetensors(
    sources: dict[str, Path],
) -> None:
    from ckpt_cli.formats import open_checkpoint

    want = model_state()
    with open_checkpoint(str(sources["model"])) as checkpoint:
        rows = checkpoint.read_slice("layers.3.weight", [16, 0], [16, 40])
        assert torch.equal(rows, want["layers.3.weight"][16:32])
        box = checkpoint.read_slice("layers.3.weight", [0, 8], [48, 8])  # not whole rows
        assert torch.equal(box, want["layers.3.weight"][:, 8:16])
        assert torch.equal(checkpoint.read_slice("embed", [99, 0], [1, 16]), want["embed"][99:])


class DictStore:
    """The `add` of a torch.distributed store, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def test_rank_0_draws_one_bar_for_the_bytes_of_every_rank() -> None:
    store = DictStore()
    bars = [RecordingProgress(), RecordingProgress()]
    ranks = [
        CombinedProgress(bars[r], Workers(r, 2), store=store, interval=0.0, total=300)
        for r in range(2)
    ]
    for progress in ranks:
        progress.start(120, "hashing")
    ranks[1].advance(100)  # rank 1 publishes its share...
    ranks[0].advance(20)  # ...and rank 0 picks it up when it draws
    assert (bars[0].total, bars[0].done) == (300, 120)
    assert bars[0].description == "hashing (2 ranks)"
    ranks[1].advance(80)
    ranks[1].finish()
    ranks[0].finish()
    assert bars[0].done == 200
    assert bars[1].done == 0  # the other ranks draw nothing
    # a later phase counts afresh
    for progress in ranks:
        progress.start(10, "next")
    ranks[1].advance(5)
    ranks[0].advance(0)
    assert bars[0].done == 5


@pytest.mark.torchrun
def test_each_ranks_share_of_a_world_size_reshard_counts_the_bytes_of_its_files(
    tmp_path: Path,
) -> None:
    """The per-rank summary used to count tensor data only: the ranks' bytes did not add up
    to the files they wrote (the objects and the containers around each chunk were missing)."""
    src = tmp_path / "src"
    dcp_save({"w": torch.ones(64, 8), "b": torch.ones(8), "step": 3, "name": "x" * 4000}, src)
    out = tmp_path / "out"
    proc = torchrun_ckpt(2, "reshard", src, out, "--world-size", "3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["result"]
    shares = report["ranks"]
    assert len(shares) == 2
    for share in shares:
        assert share["bytes"] == sum((out / rel).stat().st_size for rel in share["files"])
    data_files = [p for p in out.iterdir() if p.name.endswith(".distcp")]
    assert sum(s["bytes"] for s in shares) == sum(p.stat().st_size for p in data_files)


@pytest.mark.torchrun
def test_a_rank_that_never_joins_fails_the_launch_within_the_join_timeout(tmp_path: Path) -> None:
    """Rank 1 of 2 leaves without ever joining (exit 0, so torchrun keeps waiting for rank 0):
    rank 0 used to wait torch's default 30 minutes in `init_process_group`. It now gives up
    after `CKPT_DIST_TIMEOUT`, naming the missing rank and the fix, and writes nothing."""
    require_torchrun_marker()
    src = tmp_path / "model.safetensors"
    save_file(model_state(), src)
    dest = tmp_path / "out"
    script = Path(__file__).resolve().parent / "dist_early_exit_script.py"
    args = ["convert", src, dest, "--to", "safetensors", "--json"]
    env = torchrun_env({"CKPT_DIST_TIMEOUT": "5s"})
    proc = run_launch(torchrun_command(2, script, "1", *args), 150, env=env)
    assert proc.returncode != 0
    envelope = json.loads(proc.stdout)
    assert envelope["exit_code"] == 5 and envelope["error"]["code"] == "rendezvous"
    message = envelope["error"]["message"]
    assert "rank 1 of 2" in message and "5 s" in message, message
    assert "CKPT_DIST_TIMEOUT" in envelope["error"]["fix"]
    assert "exitcode  : 5" in proc.stderr  # torchrun's summary of rank 0
    assert not dest.exists() and not list(tmp_path.glob(".out.ckpt-*"))


def test_a_join_timeout_that_is_not_a_duration_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckpt_cli.dist.command import join_timeout
    from ckpt_cli.errors import UsageError

    monkeypatch.delenv("CKPT_DIST_TIMEOUT", raising=False)
    assert join_timeout() == 300.0
    monkeypatch.setenv("CKPT_DIST_TIMEOUT", "90s")
    assert join_timeout() == 90.0
    monkeypatch.setenv("CKPT_DIST_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="CKPT_DIST_TIMEOUT") as refused:
        join_timeout()
    assert refused.value.exit_code == 2


def _no_files_over_4_kib() -> None:
    """In the rank's process before it starts: a file size limit (`ulimit -f 4`), so its
    writes fail with EFBIG (the signal the kernel sends with it ignored, as shells do)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))


@pytest.mark.torchrun
def test_a_rank_whose_writes_fail_exits_74_naming_dest_and_the_errno_on_every_rank(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    """Rank 1 cannot write its shards (its file size limit): every rank exited 70 with
    `rank 1 of 2 failed: internal error OSError: [Errno 27] File too large`, the code of a bug
    in ckpt and no file or fix, where one process exits 74 naming DEST, EFBIG and the fix."""
    dest = tmp_path / "converted"
    env = torchrun_env(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    )
    command = [sys.executable, "-m", "ckpt_cli", "convert", str(sources["model"]), str(dest)]
    command += ["--to", "safetensors", "--max-shard-size", "8KB"]
    procs = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            restore_signals=False,
            preexec_fn=_no_files_over_4_kib if rank == 1 else None,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [74, 74], outputs
    error = outputs[0][1]
    assert f"rank 1 of 2 failed: {dest}: writing converted failed: File too large (EFBIG)" in error
    assert "ulimit -f" in error and "internal error" not in error, error
    assert not dest.exists()
    assert no_leftovers(tmp_path) == []


@pytest.mark.torchrun
def test_an_object_store_dest_is_refused_under_torchrun_before_the_store_is_asked(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    """`reshard --world-size` to `s3://…` under torchrun asked the store whether DEST existed
    before refusing the URL (documented: refused in a split run): with the store unreachable
    or no credentials yet, rank 0 exited 5 (`cannot read from the remote store`), and the
    refusal came only once the store answered."""
    unreachable = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_MAX_ATTEMPTS": "1",
    }
    proc = torchrun_ckpt(
        2, "reshard", sources["dcp"], "s3://bucket/resharded", "--world-size", "3",
        env=unreachable,
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        "s3://bucket/resharded: a run split across torchrun ranks writes to a filesystem every "
        "rank sees" in proc.stderr
    ), proc.stderr
    assert "exitcode  : 2 " in proc.stderr and "remote store" not in proc.stderr, proc.stderr
