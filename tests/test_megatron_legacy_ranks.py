"""A legacy Megatron-LM save's rank folders: one named alone, and the distributed optimizer's
`distrib_optim.pt` beside each rank's `model_optim_rng.pt`.

A user points ckpt at `iter_0000200/mp_rank_00/`: it is one rank of a tensor-parallel save,
holding half of each split weight, and `verify` said OK, `convert --to hf` wrote its halves as
the model. With `--use-distributed-optimizer`, Megatron-LM's `save_checkpoint` has each rank
folder's first data-parallel rank write the optimizer's moments and fp32 master weights with
megatron-core's `DistributedOptimizer.save_parameter_state` into `distrib_optim.pt`
(`get_distributed_optimizer_checkpoint_name`); `model_optim_rng.pt` keeps the param groups alone
(`DistributedOptimizer.state_dict` drops "state"). A save whose rank folder lost it was called
complete and resumable, and a rank folder holding it could not be opened at all.

megatron-core's DistributedOptimizer needs a data-parallel process group and its DDP grad
buffers (CUDA streams), so each `distrib_optim.pt` here is the dict its
`get_parameter_state_dp_zero` builds, written with `torch.save` as `save_parameter_state` does;
`model_optim_rng.pt` is the dict Megatron-LM's `generate_state_dict` builds, as in
tests/test_megatron_legacy.py.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch

from .conftest import run_ckpt
from .run_fixtures import age
from .s3_fixtures import S3Server, make_bucket
from .test_megatron_legacy import RANK_FILE, TRACKER, legacy_save, megatron_args

DISTRIB_OPTIM = "distrib_optim.pt"

#: a tiny Llama in Megatron-Core's names (local spec), split over two tensor-parallel ranks:
#: hidden 16, 4 heads in 2 query groups of head_dim 4, MLP 32, vocabulary 64
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 16, 4, 2, 4, 32, 64


def llama_rank(tp: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Rank `tp`'s slices of the model, as Megatron-Core's `GPTModel.state_dict()` on that rank
    names and shapes them: column-parallel weights split by rows, row-parallel by columns."""
    torch.manual_seed(tp)
    qkv_rows = GROUPS * (HEADS // GROUPS + 2) * HEAD_DIM
    layer = "decoder.layers.0."
    return {
        "embedding.word_embeddings.weight": torch.randn(VOCAB // tp_size, HIDDEN),
        f"{layer}input_layernorm.weight": torch.ones(HIDDEN),
        f"{layer}self_attention.linear_qkv.weight": torch.randn(qkv_rows // tp_size, HIDDEN),
        f"{layer}self_attention.linear_proj.weight": torch.randn(
            HIDDEN, HEADS * HEAD_DIM // tp_size
        ),
        f"{layer}pre_mlp_layernorm.weight": torch.ones(HIDDEN),
        f"{layer}mlp.linear_fc1.weight": torch.randn(2 * FFN // tp_size, HIDDEN),
        f"{layer}mlp.linear_fc2.weight": torch.randn(HIDDEN, FFN // tp_size),
        "decoder.final_layernorm.weight": torch.ones(HIDDEN),
        "output_layer.weight": torch.randn(VOCAB // tp_size, HIDDEN),
    }


def llama_args(tp_size: int, distributed_optimizer: bool) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        padded_vocab_size=VOCAB,
        untie_embeddings_and_output_weights=True,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        use_distributed_optimizer=distributed_optimizer,
        ckpt_format="torch",
        lr=0.1,
        seed=1234,
    )


def distrib_optim_state(params: list[torch.Tensor]) -> dict[object, object]:
    """What `DistributedOptimizer.get_parameter_state_dp_zero` returns on data-parallel rank 0
    for one fp32 grad buffer: the buffer's params' fp32 master weights and Adam moments,
    flattened and coalesced over its buckets."""
    flat = torch.cat([p.detach().flatten().float() for p in params])
    return {
        "buckets_coalesced": True,
        0: {
            torch.float32: {
                "param": flat.clone(),
                "exp_avg": torch.randn_like(flat) * 1e-3,
                "exp_avg_sq": torch.rand_like(flat) * 1e-6,
                "numel_unpadded": flat.numel(),
            }
        },
    }


def distributed_save(folder: Path, iteration: int, tp_size: int) -> None:
    """One legacy save of the Llama above, trained with `--use-distributed-optimizer`: each
    rank folder's `model_optim_rng.pt` (its optimizer's param groups alone, as
    `DistributedOptimizer.state_dict` keeps them) and `distrib_optim.pt`."""
    args = llama_args(tp_size, distributed_optimizer=True)
    for tp in range(tp_size):
        shard = llama_rank(tp, tp_size)
        rank = folder / f"mp_rank_{tp:02d}"
        rank.mkdir(parents=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": shard,
            "optimizer": {
                "optimizer": {
                    "param_groups": [
                        {
                            "lr": 0.1,
                            "betas": (0.9, 0.95),
                            "eps": 1e-8,
                            "weight_decay": 0.1,
                            "step": iteration,
                        }
                    ]
                }
            },
            "opt_param_scheduler": {"num_steps": iteration * 32, "max_lr": 0.1},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {},
                }
            ],
            "num_floating_point_operations_so_far": 0,
        }
        torch.save(state, rank / RANK_FILE)
        torch.save(distrib_optim_state(list(shard.values())), rank / DISTRIB_OPTIM)


def distributed_run(root: Path, tp_size: int = 2) -> Path:
    """A run folder of two such saves, the tracker naming the newest; written an hour ago."""
    run = root / "ckpts"
    for iteration in (100, 200):
        distributed_save(run / f"iter_{iteration:07d}", iteration, tp_size)
    (run / TRACKER).write_text("200")
    age(run)
    return run


def errors(result: dict[str, object]) -> list[dict[str, str]]:
    problems = result["problems"]
    assert isinstance(problems, list)
    return [p for p in problems if p["severity"] == "error"]


# --------------------------------------------------------------------------- one rank folder


def test_one_rank_folder_named_alone_says_it_is_one_of_the_save(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 1, megatron_args(2, 1))
    rank = save / "mp_rank_00"

    verify = run_ckpt("verify", rank, "--json")
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    told = [p for p in verify.json["result"]["problems"] if p["code"] == "one_rank_folder"]
    assert len(told) == 1
    assert told[0]["severity"] == "warning"
    assert "mp_rank_00/ is one of the 2 rank folders" in told[0]["message"]
    assert "1/2 of each tensor-parallel weight" in told[0]["message"]
    assert f"`ckpt verify {save}`" in told[0]["fix"]
    human = run_ckpt("verify", rank)
    assert "one of the 2 rank folders" in human.stdout

    # the command it names checks every rank folder of the save
    whole = run_ckpt("verify", save, "--json")
    assert whole.exit_code == 0, whole.stdout + whole.stderr
    assert whole.json["result"]["format"] == "megatron"
    assert whole.json["result"]["files"] == 2
    assert not any(p["code"] == "one_rank_folder" for p in whole.json["result"]["problems"])
    # ... and finds a rank folder's damage, naming the file
    damaged = save / "mp_rank_01" / RANK_FILE
    damaged.write_bytes(damaged.read_bytes()[:4000])
    broken = run_ckpt("verify", save, "--json")
    assert broken.exit_code == 1, broken.stdout
    assert [p["file"] for p in errors(broken.json["result"])] == [str(damaged)]

    inspect = run_ckpt("inspect", rank, "--json").json["result"]
    assert "one of the 2 rank folders" in inspect["part_of"]
    assert "part of a larger checkpoint" in run_ckpt("inspect", rank).stdout


def test_one_tensor_parallel_rank_is_never_exported_as_the_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    save = tmp_path / "iter_0000200"
    distributed_save(save, 200, 2)
    rank = save / "mp_rank_01"

    out = tmp_path / "hf"
    refused = run_ckpt("convert", rank, out, "--to", "hf", "--json")
    assert refused.exit_code == 4, refused.stdout
    error = refused.json["error"]
    assert "one of the 2 rank folders" in error["message"]
    assert "cannot be mapped to the hf naming" in error["message"]
    assert "--ckpt-convert-format torch_dist" in error["fix"]
    assert not out.exists()

    # copied as it is, the rank's own slices, said to be one rank's
    copy = tmp_path / "rank.safetensors"
    result = run_ckpt("convert", rank, copy, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("one of the 2 rank folders" in w for w in result.json["result"]["warnings"])
    # the optimizer's state is no tensor of safetensors': said, never dropped silently
    skipped = {s["name"]: s["kind"] for s in result.json["result"]["skipped"]}
    assert skipped[DISTRIB_OPTIM] == "file"
    assert skipped["distrib_optim.0"] == "object"
    want = llama_rank(1, 2)
    with safe_open(copy, "pt") as f:
        for name, tensor in want.items():
            assert torch.equal(f.get_tensor(f"model.{name}"), tensor), name


# --------------------------------------------------------------------------- distrib_optim.pt


def test_distrib_optim_is_read_as_the_optimizer_state_of_a_rank(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    distributed_save(save, 200, 2)
    rank = save / "mp_rank_00"

    inspect = run_ckpt("inspect", rank, "--json")
    assert inspect.exit_code == 0, inspect.stdout + inspect.stderr
    training = inspect.json["result"]["training"]
    assert training["layout"] == "megatron-legacy"
    assert training["optimizer"]["source"] == DISTRIB_OPTIM
    assert training["optimizer"]["states"] == ["param", "exp_avg", "exp_avg_sq"]
    assert training["components"]["distrib_optim"] == DISTRIB_OPTIM
    assert training["step"] == 200
    assert training["resumable"] is True
    assert {f["path"] for f in inspect.json["result"]["files"]} == {RANK_FILE, DISTRIB_OPTIM}

    resumable = run_ckpt("verify", save, "--resumable", "--json")
    assert resumable.exit_code == 0, resumable.stdout + resumable.stderr
    assert "resumable" in resumable.json["result"]["checks"]
    assert resumable.json["result"]["files"] == 4


def test_a_rank_that_lost_distrib_optim_is_not_resumable_and_latest_skips_it(
    tmp_path: Path,
) -> None:
    run = distributed_run(tmp_path)
    lost = run / "iter_0000200" / "mp_rank_01" / DISTRIB_OPTIM
    lost.unlink()
    age(run)

    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip() == str(run / "iter_0000100")
    assert f"lacks mp_rank_01/{DISTRIB_OPTIM}" in latest.stderr

    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    status = {c["name"]: (c["status"], c["reason"] or "") for c in table["checkpoints"]}
    assert status["iter_0000100"] == ("complete", "")
    assert status["iter_0000200"][0] == "incomplete"
    assert "use_distributed_optimizer=True" in status["iter_0000200"][1]

    plan = run_ckpt("prune", run, "--keep-last", "1", "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stdout
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions["iter_0000100"] == "keep"

    for target in (run / "iter_0000200", run / "iter_0000200" / "mp_rank_01"):
        verify = run_ckpt("verify", target, "--resumable", "--json")
        assert verify.exit_code == 1, verify.stdout + verify.stderr
        found = errors(verify.json["result"])
        assert [p["code"] for p in found] == ["missing_optimizer"]
        assert found[0]["file"] == str(lost)
        assert "use_distributed_optimizer=True" in found[0]["message"]
        assert "Restore distrib_optim.pt" in found[0]["fix"]


def test_a_truncated_distrib_optim_is_named_by_verify_and_the_judge(tmp_path: Path) -> None:
    run = distributed_run(tmp_path)
    cut = run / "iter_0000200" / "mp_rank_00" / DISTRIB_OPTIM
    cut.write_bytes(cut.read_bytes()[:3000])
    age(run)

    verify = run_ckpt("verify", run / "iter_0000200", "--json")
    assert verify.exit_code == 1, verify.stdout + verify.stderr
    assert [p["file"] for p in errors(verify.json["result"])] == [str(cut)]
    assert run_ckpt("latest", run).stdout.strip() == str(run / "iter_0000100")


def test_sync_carries_distrib_optim_there_and_back(s3_server: S3Server, tmp_path: Path) -> None:
    make_bucket(s3_server.endpoint, "ckpts")
    run = distributed_run(tmp_path)
    pushed = run_ckpt("sync", run, "s3://ckpts/run")
    assert pushed.exit_code == 0, pushed.stdout + pushed.stderr
    fresh = tmp_path / "fresh-machine" / "ckpts"
    pulled = run_ckpt("sync", "s3://ckpts/run/", fresh, "--latest")
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    for rank in ("mp_rank_00", "mp_rank_01"):
        copied = fresh / "iter_0000200" / rank / DISTRIB_OPTIM
        assert copied.read_bytes() == (run / "iter_0000200" / rank / DISTRIB_OPTIM).read_bytes()
        state = torch.load(copied, weights_only=True)  # as load_parameter_state reads it
        assert set(state[0][torch.float32]) == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
    verify = run_ckpt("verify", fresh / "iter_0000200", "--resumable")
    assert verify.exit_code == 0, verify.stdout + verify.stderr


def test_reshard_refuses_a_legacy_save_and_its_rank_folders(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    distributed_save(save, 200, 2)
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    for src, how in (
        (save, ["--world-size", "4"]),
        (save / "mp_rank_00", ["--max-shard-size", "1KB"]),
        (save / "mp_rank_00", ["--world-size", "2"]),
    ):
        out = tmp_path / "out"
        result = run_ckpt("reshard", src, out, *how, "--json")
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert "legacy Megatron-LM save" in error["message"]
        assert "tools/checkpoint/convert.py" in error["fix"]
        assert not out.exists()
    assert {p: p.read_bytes() for p in save.rglob("*") if p.is_file()} == before
