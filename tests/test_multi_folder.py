"""Multi-folder models written by their libraries: a diffusers pipeline root (model_index.json +
unet/ + vqvae/ + scheduler/) and a sentence-transformers folder (root BERT, 1_Pooling/,
2_Dense/) are one checkpoint of components. inspect and verify cover every component; convert
and reshard write each with its own naming, and the owning library loads every output."""

from __future__ import annotations

import inspect
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt


@contextmanager
def _quiet() -> Iterator[None]:
    """The libraries' deprecation chatter off while they load an output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_pipeline_inspect_reports_every_component(diffusers_pipeline: Path) -> None:
    report = run_ckpt("inspect", diffusers_pipeline, "--json").json["result"]
    layout = report["layout"]
    assert layout["layout"] == "diffusers-pipeline"
    assert layout["details"]["pipeline"] == "LDMPipeline"
    by_name = {c["name"]: c for c in layout["components"]}
    assert set(by_name) == {"unet", "vqvae", "scheduler"}
    for name in ("unet", "vqvae"):
        tensors = load_file(diffusers_pipeline / name / "diffusion_pytorch_model.safetensors")
        assert by_name[name]["tensors"] == len(tensors)
        assert by_name[name]["parameters"] == sum(t.numel() for t in tensors.values())
    assert by_name["scheduler"]["tensors"] == 0
    assert report["tensors"] == by_name["unet"]["tensors"] + by_name["vqvae"]["tensors"]
    human = run_ckpt("inspect", diffusers_pipeline).stdout
    assert "UNet2DModel" in human and "VQModel" in human and "DDIMScheduler" in human


def test_pipeline_verify_checks_every_component(diffusers_pipeline: Path, tmp_path: Path) -> None:
    assert run_ckpt("verify", diffusers_pipeline).exit_code == 0
    damaged = shutil.copytree(diffusers_pipeline, tmp_path / "damaged")
    weights = damaged / "vqvae" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1
    problems = result.json["result"]["problems"]
    assert problems and all("vqvae" in (p["file"] or "") for p in problems)


def test_pipeline_converts_component_by_component(diffusers_pipeline: Path, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline, UNet2DModel

    out = tmp_path / "fp16"
    result = run_ckpt("convert", diffusers_pipeline, out, "--to", "safetensors", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert (out / "model_index.json").read_bytes() == (
        diffusers_pipeline / "model_index.json"
    ).read_bytes()
    assert (out / "scheduler" / "scheduler_config.json").exists()
    with _quiet():
        pipe = DiffusionPipeline.from_pretrained(out, torch_dtype=torch.float16)
        original = DiffusionPipeline.from_pretrained(diffusers_pipeline)
    for component in ("unet", "vqvae"):
        want = getattr(original, component).state_dict()
        got = getattr(pipe, component).state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k].half()) for k in want), component

    # one component alone, with its own naming and config
    unet_out = tmp_path / "unet"
    result = run_ckpt(
        "convert", diffusers_pipeline, unet_out, "--to", "safetensors", "--select", "unet"
    )
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in unet_out.iterdir()} == {
        "config.json",
        "diffusion_pytorch_model.safetensors",
    }
    with _quiet():
        unet = UNet2DModel.from_pretrained(unet_out)
    want = original.unet.state_dict()
    assert all(torch.equal(unet.state_dict()[k], want[k]) for k in want)
    assert run_ckpt("convert", diffusers_pipeline, tmp_path / "d", "--to", "dcp").exit_code == 2


def test_fp16_variant_names_survive_convert_and_reshard(
    fp16_variant_unet: Path, tmp_path: Path
) -> None:
    from diffusers import UNet2DModel

    with _quiet():
        want = UNet2DModel.from_pretrained(fp16_variant_unet, variant="fp16").state_dict()
    single = tmp_path / "single"
    assert run_ckpt("convert", fp16_variant_unet, single, "--to", "safetensors").exit_code == 0
    assert {p.name for p in single.iterdir()} == {
        "config.json",
        "diffusion_pytorch_model.fp16.safetensors",
    }
    sharded = tmp_path / "sharded"
    assert (
        run_ckpt("reshard", fp16_variant_unet, sharded, "--max-shard-size", "40KB").exit_code == 0
    )
    names = {p.name for p in sharded.iterdir()}
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in names
    assert any(n.startswith("diffusion_pytorch_model.fp16-00001-of-") for n in names)
    for out in (single, sharded):
        with _quiet():
            got = UNet2DModel.from_pretrained(out, variant="fp16").state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_sentence_transformers_folder_includes_dense(
    sentence_transformer: Path, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    report = run_ckpt("inspect", sentence_transformer, "--json").json["result"]
    layout = report["layout"]
    assert layout["layout"] == "sentence-transformers"
    by_name = {c["name"]: c for c in layout["components"]}
    assert set(by_name) == {"0_Transformer", "1_Pooling", "2_Dense"}
    dense = load_file(sentence_transformer / "2_Dense" / "model.safetensors")
    assert by_name["2_Dense"]["tensors"] == len(dense) == 2
    assert any(e["name"].startswith("2_Dense.") for e in report["entries"])

    with _quiet():
        model = SentenceTransformer(str(sentence_transformer), device="cpu")
        want = model.encode(["w1 w2 w3", "w4"], convert_to_tensor=True)
    outputs = {
        "torch": ("convert", sentence_transformer, tmp_path / "torch", "--to", "torch"),
        "resharded": (
            "reshard",
            sentence_transformer,
            tmp_path / "resharded",
            "--max-shard-size",
            "8KB",
        ),
    }
    for label, args in outputs.items():
        result = run_ckpt(*args)
        assert result.exit_code == 0, (label, result.stderr)
        with _quiet():
            got = SentenceTransformer(str(args[2]), device="cpu").encode(
                ["w1 w2 w3", "w4"], convert_to_tensor=True
            )
        assert torch.equal(got, want), label
    assert (tmp_path / "torch" / "2_Dense" / "pytorch_model.bin").exists()
    assert (tmp_path / "resharded" / "model.safetensors.index.json").exists()

    damaged = shutil.copytree(sentence_transformer, tmp_path / "damaged")
    (damaged / "2_Dense" / "model.safetensors").write_bytes(b"\x08" * 16)
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1
    assert any("2_Dense" in (p["file"] or "") for p in result.json["result"]["problems"])


def test_every_convert_option_reaches_every_component(
    diffusers_pipeline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops.convert import run as convert_op

    # the request carries exactly convert's options: a new option cannot be left out of it
    options = set(inspect.signature(convert_op.convert).parameters) - {"src", "dest", "to"}
    assert set(convert_op.ConvertRequest.model_fields) == options - {"progress"}

    # a dry run of the whole pipeline writes nothing, anywhere, and says it was one
    out = tmp_path / "out"
    dry = run_ckpt("convert", diffusers_pipeline, out, "--to", "safetensors", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    report = dry.json["result"]
    assert report["dry_run"] is True and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # no staging left behind
    planned = {f["path"] for f in report["files"]}
    assert "unet/diffusion_pytorch_model.safetensors" in planned  # the library's own names
    # what the dry run lists is what the real run writes
    real = run_ckpt("convert", diffusers_pipeline, out, "--to", "safetensors")
    assert real.exit_code == 0, real.stderr
    assert planned == {str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()}

    # and the other options are the ones each component is converted with
    seen: list[convert_op.ConvertRequest] = []
    real = convert_op.convert_component

    def spy(src: str, dest: str, to: str, request: Any, progress: Any) -> Any:
        seen.append(request)
        return real(src, dest, to, request, progress)

    with monkeypatch.context() as patch:
        patch.setattr(convert_op, "convert_component", spy)
        given = run_ckpt(
            "convert",
            diffusers_pipeline,
            tmp_path / "bf16",
            "--to",
            "safetensors",
            "--dtype",
            "bf16",
            "--max-shard-size",
            "10MB",
            "--filter-out",
            "*.num_batches*",
            "--no-extras",
            "--dry-run",
        )
    assert given.exit_code == 0, given.stderr
    assert len(seen) == 2  # unet and vqvae
    for request in seen:
        assert (request.dtype, request.dry_run, request.extras) == ("bf16", True, False)
        assert request.max_shard_size == 10 * 1000**2
        assert request.exclude == ["*.num_batches*"]


def test_a_module_whose_weights_were_deleted_fails_verify(
    sentence_transformer: Path, tmp_path: Path
) -> None:
    """modules.json names the root Transformer and 2_Dense, whose weights sentence-transformers
    saves: a folder without one of them cannot load, and verify says so (exit 1) naming the
    file, like a missing shard; Pooling saves none and is not asked for any."""
    import pytest
    from sentence_transformers import SentenceTransformer

    assert run_ckpt("verify", sentence_transformer).exit_code == 0
    for lost in ("model.safetensors", "2_Dense/model.safetensors"):
        damaged = shutil.copytree(sentence_transformer, tmp_path / lost.replace("/", "-"))
        (damaged / lost).unlink()
        # the library's own loader cannot build the model from what is left
        with _quiet(), pytest.raises((OSError, FileNotFoundError, RuntimeError, ValueError)):
            SentenceTransformer(str(damaged), device="cpu")
        result = run_ckpt("verify", damaged, "--json")
        assert result.exit_code == 1, result.stdout
        problems = result.json["result"]["problems"]
        assert [p["code"] for p in problems] == ["missing_component_weights"]
        assert problems[0]["file"] == str(damaged / lost)
        assert "modules.json" in problems[0]["message"]
        # and no model missing a module's weights is published
        out = tmp_path / f"out-{lost.replace('/', '-')}"
        converted = run_ckpt("convert", damaged, out, "--to", "safetensors")
        assert converted.exit_code == 4 and lost in converted.stderr, converted.stderr
        assert not out.exists()


def test_a_pipeline_model_without_weights_fails_verify(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    damaged = shutil.copytree(diffusers_pipeline, tmp_path / "damaged")
    (damaged / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [p["code"] for p in problems] == ["missing_component_weights"]
    assert problems[0]["file"] == str(damaged / "unet" / "diffusion_pytorch_model.safetensors")


def test_filter_rules_match_the_names_inspect_shows(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """`--filter` / `--filter-out` of a pipeline match `unet.conv_in.weight`, the name inspect and
    diff show (each component is converted on its own, under its inner names); a glob that
    matches no entry of any component is a warning, never a silent no-op."""
    listed = run_ckpt("inspect", diffusers_pipeline, "--json", "--list").json["result"]
    names = {e["name"] for e in listed["entries"]}
    assert {"unet.conv_in.weight", "vqvae.encoder.conv_in.weight"} <= names
    unet = load_file(diffusers_pipeline / "unet" / "diffusion_pytorch_model.safetensors")
    vqvae = load_file(diffusers_pipeline / "vqvae" / "diffusion_pytorch_model.safetensors")

    out = tmp_path / "no-conv-in"
    result = run_ckpt(
        "convert", diffusers_pipeline, out, "--to", "safetensors", "--filter-out", "unet.conv_in*"
    )
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr
    got = load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(unet) - {"conv_in.weight", "conv_in.bias"}
    assert all(torch.equal(got[k], unet[k]) for k in got)
    kept = load_file(out / "vqvae" / "diffusion_pytorch_model.safetensors")
    assert set(kept) == set(vqvae)  # vqvae's own encoder.conv_in is not unet.conv_in
    # diff lines both up by the same names, and --filter picks them the same way
    lost = run_ckpt("diff", diffusers_pipeline, out, "--json")
    assert lost.exit_code == 1
    assert sorted(lost.json["result"]["only_a"]) == ["unet.conv_in.bias", "unet.conv_in.weight"]
    picked = run_ckpt("diff", diffusers_pipeline, out, "--filter", "unet.conv_in*", "--json")
    assert sorted(picked.json["result"]["only_a"]) == ["unet.conv_in.bias", "unet.conv_in.weight"]
    assert picked.json["result"]["compared"] == 0
    same = run_ckpt("diff", diffusers_pipeline, out, "--filter", "vqvae.*", "--json")
    assert same.exit_code == 0 and same.json["result"]["identical"] is True
    # a glob that names nothing on either side says so (diff), on stderr and in --json
    stray = run_ckpt("diff", diffusers_pipeline, out, "--filter", "vqvae.*", "--filter", "conv_in*")
    assert stray.exit_code == 0
    assert "--filter 'conv_in*' matches no entry" in stray.stderr

    # the inner name alone (what the component calls it) matches nothing: a warning, no loss
    inner = tmp_path / "inner"
    result = run_ckpt(
        "convert", diffusers_pipeline, inner, "--to", "safetensors", "--filter-out", "conv_in*"
    )
    assert result.exit_code == 0, result.stderr
    assert "--filter-out 'conv_in*' matches no entry of any component" in result.stderr
    assert run_ckpt("diff", diffusers_pipeline, inner).exit_code == 0

    # --filter naming one component: the other is left out whole, and the report says so
    only = tmp_path / "only-unet"
    result = run_ckpt(
        "convert", diffusers_pipeline, only, "--to", "safetensors", "--filter", "unet.*", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    skipped = {s["name"]: s["kind"] for s in report["skipped"]}
    assert skipped == {"vqvae": "component", "vqvae/diffusion_pytorch_model.safetensors": "file"}
    assert any("vqvae component is left out whole" in w for w in report["warnings"])
    assert not (only / "vqvae" / "diffusion_pytorch_model.safetensors").exists()
    assert set(load_file(only / "unet" / "diffusion_pytorch_model.safetensors")) == set(unet)
    nothing = run_ckpt(
        "convert",
        diffusers_pipeline,
        tmp_path / "none",
        "--to",
        "safetensors",
        "--filter",
        "conv_in*",
    )
    assert nothing.exit_code == 3 and not (tmp_path / "none").exists()

    # --select of a component: the globs still see the whole folder's names
    alone = tmp_path / "unet-alone"
    result = run_ckpt(
        "convert",
        diffusers_pipeline,
        alone,
        "--to",
        "safetensors",
        "--select",
        "unet",
        "--filter-out",
        "unet.conv_in*",
    )
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr
    got = load_file(alone / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(unet) - {"conv_in.weight", "conv_in.bias"}
    inner_alone = run_ckpt(
        "convert",
        diffusers_pipeline,
        tmp_path / "unet-inner",
        "--to",
        "safetensors",
        "--select",
        "unet",
        "--filter-out",
        "conv_in*",
        "--json",
    )
    assert inner_alone.exit_code == 0, inner_alone.stderr
    assert any("'conv_in*' matches no entry" in w for w in inner_alone.json["result"]["warnings"])


def test_a_folder_holding_the_default_weights_and_a_variant_reads_as_the_default(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """`save_pretrained(d)` then `save_pretrained(d, variant="fp16")`, as Hub pipelines ship:
    `inspect`, `convert` and `reshard` of the UNet folder failed with "tensor appears in more
    than one shard", and `verify` called it a corrupt mix of two saves. The default weights are
    the checkpoint; the variant is listed as left out, with why."""
    from diffusers import UNet2DModel

    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")
    with _quiet():
        unet = UNet2DModel.from_pretrained(pipeline / "unet")
        want = unet.state_dict()
        unet.to(torch.float16).save_pretrained(pipeline / "unet", variant="fp16")
    assert (pipeline / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert run_ckpt("verify", pipeline / "unet").exit_code == 0
    inspected = run_ckpt("inspect", pipeline / "unet", "--json")
    assert inspected.exit_code == 0, inspected.stdout
    assert inspected.json["result"]["tensors"] == len(want)
    for command in (["convert", "--to", "safetensors"], ["reshard", "--max-shard-size", "40KB"]):
        out = tmp_path / command[0]
        result = run_ckpt(command[0], pipeline / "unet", out, *command[1:], "--json")
        assert result.exit_code == 0, result.stdout
        skipped = {
            s.get("name", s.get("path")): s["reason"] for s in result.json["result"]["skipped"]
        }
        assert "fp16 variant" in skipped["diffusion_pytorch_model.fp16.safetensors"]
        with _quiet():
            got = UNet2DModel.from_pretrained(out).state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    whole = run_ckpt("convert", pipeline, tmp_path / "whole", "--to", "safetensors")
    assert whole.exit_code == 0, whole.stderr


def _load_fp16(path: Path) -> Any:
    from diffusers import DiffusionPipeline

    with _quiet():
        return DiffusionPipeline.from_pretrained(path, variant="fp16", torch_dtype=torch.float16)


def test_a_pipeline_saved_as_the_fp16_variant_converts_whole(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """`save_pretrained(variant="fp16")` leaves `text_encoder/model.fp16.safetensors` (the
    transformers spelling) and variant-indexed shards: every command sees every component, and
    the outputs load in diffusers with `variant="fp16"`, bit-exact."""
    report = run_ckpt("inspect", fp16_variant_pipeline, "--json").json["result"]
    by_name = {c["name"]: c for c in report["layout"]["components"]}
    assert by_name["text_encoder"]["tensors"] > 0
    assert by_name["unet"]["tensors"] > 0 and by_name["vae"]["tensors"] > 0
    verified = run_ckpt("verify", fp16_variant_pipeline)
    assert verified.exit_code == 0, verified.stdout
    want = _load_fp16(fp16_variant_pipeline)
    outputs = {
        "safetensors": ("convert", "--to", "safetensors"),
        "torch": ("convert", "--to", "torch"),
        "resharded": ("reshard", "--max-shard-size", "1KB"),
    }
    for label, (command, *options) in outputs.items():
        out = tmp_path / label
        result = run_ckpt(command, fp16_variant_pipeline, out, *options)
        assert result.exit_code == 0, result.stderr
        names = {p.name for p in (out / "text_encoder").iterdir()}
        assert any(".fp16" in n for n in names), (label, names)
        got = _load_fp16(out)
        for component in ("unet", "vae", "text_encoder"):
            a = getattr(want, component).state_dict()
            b = getattr(got, component).state_dict()
            assert a.keys() == b.keys(), (label, component)
            assert all(torch.equal(a[k], b[k]) for k in a), (label, component)
        assert run_ckpt("verify", out).exit_code == 0, label
        assert run_ckpt("diff", fp16_variant_pipeline, out).exit_code == 0, label


def test_a_cast_of_an_fp16_variant_pipeline_is_named_by_its_new_dtype(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """`convert --dtype fp32` of a pipeline saved as the `fp16` variant wrote fp32 data under
    `model.fp16.safetensors` and `….index.fp16.json`: `from_pretrained(out)` found no weights
    and `variant="fp16"` loaded fp32 under a name that lies. The cast output is named by its
    dtype: the default weights for fp32, the `bf16` variant for bf16 (as the Hub names one),
    and each loads in diffusers bit-exact against the source cast the same way."""
    from diffusers import DiffusionPipeline

    want = _load_fp16(fp16_variant_pipeline)
    cases = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, "bf16")}
    for dtype, (torch_dtype, variant) in cases.items():
        out = tmp_path / dtype
        result = run_ckpt(
            "convert", fp16_variant_pipeline, out, "--to", "safetensors", "--dtype", dtype,
            "--max-shard-size", "20KB", "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.stdout
        names = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
        assert not [n for n in names if ".fp16" in n], (dtype, names)
        weights = [n for n in names if n.endswith((".safetensors", ".json")) and "model" in n]
        if variant is None:
            assert "text_encoder/model.safetensors" in names
            assert "unet/diffusion_pytorch_model.safetensors.index.json" in names
        else:
            assert "text_encoder/model.bf16.safetensors" in names
            assert "unet/diffusion_pytorch_model.safetensors.index.bf16.json" in names
            assert all(".bf16" in n for n in weights if n.startswith(("unet/", "vae/"))), names
        notes = [w for w in result.json["result"]["warnings"] if "fp16 variant" in w]
        assert len(notes) == 1, result.json["result"]["warnings"]
        assert (f'variant="{variant}"' if variant else "without variant=") in notes[0]
        with _quiet():
            got = DiffusionPipeline.from_pretrained(out, variant=variant, torch_dtype=torch_dtype)
        for component in ("unet", "vae", "text_encoder"):
            a = getattr(want, component).state_dict()
            b = getattr(got, component).state_dict()
            assert a.keys() == b.keys(), (dtype, component)
            for key, value in a.items():
                assert b[key].dtype == torch_dtype, (dtype, component, key)
                assert torch.equal(b[key], value.to(torch_dtype)), (dtype, component, key)
        assert run_ckpt("verify", out).exit_code == 0, dtype


def test_a_pipeline_refused_for_dcp_suggests_a_component_with_weights(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    result = run_ckpt("convert", diffusers_pipeline, tmp_path / "d", "--to", "dcp")
    assert result.exit_code == 2
    suggested = result.stderr.rsplit("--select ", 1)[1].split(".")[0]
    assert suggested in ("unet", "vqvae"), result.stderr
    # the suggestion works as given
    out = tmp_path / "one"
    assert (
        run_ckpt("convert", diffusers_pipeline, out, "--to", "dcp", "--select", suggested).exit_code
        == 0
    )


def test_a_pipeline_reshard_names_the_variants_it_leaves_out(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """A pipeline holding the default weights and an fp16 variant of its UNet (as Hub
    pipelines ship): `reshard` of the whole folder wrote the default weights and dropped the
    variant without a line; the component's own reshard said so. It is listed, with why, and
    the files copied beside the components are listed as carried."""
    from diffusers import DiffusionPipeline

    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")
    with _quiet():
        original = DiffusionPipeline.from_pretrained(pipeline)
        original.unet.to(torch.float16).save_pretrained(pipeline / "unet", variant="fp16")
        original = DiffusionPipeline.from_pretrained(pipeline)
    out = tmp_path / "out"
    result = run_ckpt("reshard", pipeline, out, "--max-shard-size", "40KB", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    assert "fp16 variant" in skipped["unet/diffusion_pytorch_model.fp16.safetensors"]
    assert {"model_index.json", "unet/config.json", "vqvae/config.json"} <= set(report["extras"])
    human = run_ckpt("reshard", pipeline, tmp_path / "again", "--max-shard-size", "40KB")
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in human.stdout + human.stderr
    with _quiet():
        got = DiffusionPipeline.from_pretrained(out)
    for component in ("unet", "vqvae"):
        want = getattr(original, component).state_dict()
        have = getattr(got, component).state_dict()
        assert want.keys() == have.keys()
        assert all(torch.equal(have[k], want[k]) for k in want), component


def test_a_pipeline_convert_lists_every_file_it_wrote(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """The text encoder's `config.json` (written beside its weights by the component's own
    convert) was missing from `files` and from the count ("9 files" for 10), though a
    `--dry-run` listed it."""
    out = tmp_path / "out"
    result = run_ckpt("convert", fp16_variant_pipeline, out, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stdout
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {f["path"] for f in result.json["result"]["files"]} == on_disk
    planned = run_ckpt(
        "convert", fp16_variant_pipeline, tmp_path / "plan", "--to", "safetensors", "--dry-run",
        "--json",
    )  # fmt: skip
    assert {f["path"] for f in planned.json["result"]["files"]} == on_disk


def test_a_pipeline_into_a_file_name_is_refused(diffusers_pipeline: Path, tmp_path: Path) -> None:
    """`convert PIPELINE pipe.safetensors` wrote a folder of components named
    `pipe.safetensors` (exit 0), which `safe_open` cannot open; a usage error says what to do,
    and nothing is written."""
    for command in (("convert", "--to", "safetensors"), ("reshard", "--max-shard-size", "40KB")):
        dest = tmp_path / f"{command[0]}.safetensors"
        result = run_ckpt(command[0], diffusers_pipeline, dest, *command[1:])
        assert result.exit_code == 2, result.stderr
        assert "--select unet" in result.stderr
        assert not dest.exists()
    one = tmp_path / "unet.safetensors"
    assert (
        run_ckpt("convert", diffusers_pipeline, one, "--to", "safetensors", "--select", "unet")
    ).exit_code == 0
    assert one.is_file()


def test_a_pipeline_missing_a_component_folder_fails_verify(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """`unet/` deleted whole: verify said OK and convert wrote a pipeline diffusers cannot
    load. model_index.json names it, so it is missing like a lost shard."""
    from diffusers import DiffusionPipeline

    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")
    shutil.rmtree(pipeline / "unet")
    with _quiet(), pytest.raises(Exception):  # noqa: B017 - whatever diffusers raises
        DiffusionPipeline.from_pretrained(pipeline)
    result = run_ckpt("verify", pipeline, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [p["code"] for p in problems] == ["missing_component"]
    assert problems[0]["file"].endswith("unet")
    out = tmp_path / "out"
    converted = run_ckpt("convert", pipeline, out, "--to", "safetensors")
    assert converted.exit_code == 4, converted.stderr
    assert "unet" in converted.stderr and not out.exists()
    # the components that are there still convert one at a time
    one = run_ckpt("convert", pipeline, tmp_path / "vq", "--to", "safetensors", "--select", "vqvae")
    assert one.exit_code == 0, one.stderr


def test_a_pipelines_language_model_component_maps_to_a_framework_naming(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """A pipeline whose text encoder is a Llama (as HiDream's is): `--select text_encoder --to
    torchtitan` took the encoder's tensors out of the whole folder and looked for its
    config.json at the pipeline's root, so it stopped (exit 4) asking for --config though
    `text_encoder/config.json` is there. The component is now converted from its own folder,
    as `--to safetensors` does, and comes back from torchtitan with the same logits. Without
    --select, the whole folder was mapped as one model ("no known model architecture matches
    these 321 tensor names"): a usage error (exit 2) now says to pick the component."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    pipeline = tmp_path / "pipeline"
    shutil.copytree(diffusers_pipeline, pipeline)
    index = json.loads((pipeline / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "LlamaForCausalLM"]
    (pipeline / "model_index.json").write_text(json.dumps(index))
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(pipeline / "text_encoder")

    titan, back = tmp_path / "titan", tmp_path / "back"
    r = run_ckpt("convert", pipeline, titan, "--to", "torchtitan", "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    error = r.json["error"]
    assert "holds several models, and --to torchtitan maps one" in error["problem"], error
    assert "--select" in error["fix"] and not titan.exists()
    r = run_ckpt("convert", pipeline, titan, "--select", "text_encoder", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr
    assert (titan / "config.json").exists() and (titan / ".metadata").exists()
    assert run_ckpt("convert", titan, back, "--to", "hf").exit_code == 0
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(pipeline / "text_encoder")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back)(ids).logits
    assert torch.equal(got, want)


def test_a_pipeline_whose_model_index_is_damaged_is_refused_naming_it(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """`model_index.json` cut short (an interrupted copy): diffusers cannot load the pipeline.
    inspect, verify and convert said "holds no checkpoint files itself, but its subfolders do
    (unet/, vqvae/). Name one of them" (exit 2), as of a folder of unrelated saves. They name
    the damaged index (exit 4), and the component folders still read one at a time."""
    pipeline = shutil.copytree(diffusers_pipeline, tmp_path / "pipeline")
    index = pipeline / "model_index.json"
    index.write_bytes(index.read_bytes()[:40])
    for args in (
        ["inspect", pipeline],
        ["verify", pipeline],
        ["convert", pipeline, tmp_path / "out", "--to", "safetensors"],
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert error["path"] == str(pipeline / "model_index.json"), error
        assert "unet" in error["fix"], error
    assert not (tmp_path / "out").exists()
    assert run_ckpt("verify", pipeline / "unet").exit_code == 0
