"""A torchtitan 0.3.0 Flux transformer saved and loaded with torchtitan's own code on CPU, for the
Flux tests (`ckpt convert --to hf` into diffusers' `FluxTransformer2DModel`, and back).

Run in its own process (torchtitan's imports are heavy and register hooks):

    python tests/torchtitan_flux_script.py save RUN OUT
        builds a tiny Flux (seed 0: 2 double-stream and 2 single-stream blocks, hidden 32, 2
        heads; torchtitan's own block builders, as its flavors use them), takes one AdamW step
        on a flow-matching style loss and saves RUN/checkpoint/step-1 with
        `CheckpointManager.save` (model, optimizer, scheduler, data loader, train state), and
        writes into OUT: `config.json` (the same model as a diffusers config),
        `inputs.pt` / `output.pt` (fixed inputs and torchtitan's forward on them),
        `state.pt` (the model's state dict as saved), `to_hf.safetensors` (torchtitan's own
        `FluxStateDictAdapter.to_hf` of it: the bytes an export must equal) and
        `flavor_config.json` (the config.json `--flavor` builds from the torchtitan model's
        config: ckpt's `Flux.args_from_torchtitan`)
    python tests/torchtitan_flux_script.py load RUN OUT
        builds a fresh model (seed 1), restores RUN/checkpoint/step-0 with
        `CheckpointManager.load(step=0)` (torchtitan's model-only load of a converted model),
        writes `OUT/loaded_state.pt` and `OUT/loaded_output.pt`, then takes one training step
        and writes `OUT/trained.pt` (the loss and whether every parameter moved)

torchtitan's Flux (every flavor) builds its query/key RMSNorms with eps 1e-5, diffusers' with
1e-6: the tiny model keeps torchtitan's, so the forwards differ by what that does (see the test).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_writer import Tokens, TrainState

HIDDEN, HEADS, DEPTH, SINGLE = 32, 2, 2, 2
IN_CHANNELS, CONTEXT, VEC = 8, 12, 10
AXES = (4, 6, 6)  # the rotary widths of the three position axes: HIDDEN / HEADS in all
IMG_TOKENS, TXT_TOKENS, BATCH = 6, 4, 2


def _without_datasets() -> None:
    """torchtitan's `models.flux` package imports its image-text data loader, which imports
    Hugging Face `datasets` (not installed beside torchtitan: its pin conflicts with s3fs's
    fsspec, see the Makefile). Nothing here loads data: stand-ins let the package import."""
    if importlib.util.find_spec("datasets") is not None:
        return
    stub = types.ModuleType("datasets")
    stub.Dataset = object  # type: ignore[attr-defined]
    stub.load_dataset = None  # type: ignore[attr-defined]
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = None  # type: ignore[attr-defined]
    sys.modules["datasets"] = stub
    sys.modules["datasets.distributed"] = distributed


def model_config() -> Any:
    import torchtitan.models.flux as flux
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.flux.model.layers import EmbedND, LastLayer, MLPEmbedder

    double = flux._make_double_block_config(
        hidden_size=HIDDEN, num_heads=HEADS, mlp_ratio=4.0, qkv_bias=True
    )
    single = flux._make_single_block_config(hidden_size=HIDDEN, num_heads=HEADS, mlp_ratio=4.0)

    def linear(i: int, o: int) -> Any:
        return Linear.Config(in_features=i, out_features=o, bias=True, param_init=flux._NORMAL_02)

    return flux.FluxModel.Config(
        in_channels=IN_CHANNELS,
        out_channels=IN_CHANNELS,
        vec_in_dim=VEC,
        context_in_dim=CONTEXT,
        hidden_size=HIDDEN,
        mlp_ratio=4.0,
        num_heads=HEADS,
        depth=DEPTH,
        depth_single_blocks=SINGLE,
        axes_dim=AXES,
        theta=10_000,
        qkv_bias=True,
        img_in=linear(IN_CHANNELS, HIDDEN),
        txt_in=linear(CONTEXT, HIDDEN),
        clip_encoder=flux.FluxEmbedder.Config(version=flux._CLIP_ENCODER_VERSION),
        t5_encoder=flux.FluxEmbedder.Config(version=flux._T5_ENCODER_VERSION),
        pe_config=EmbedND.Config(dim=HIDDEN // HEADS, theta=10_000, axes_dim=AXES),
        time_in_config=MLPEmbedder.Config(
            in_dim=256,
            hidden_dim=HIDDEN,
            in_layer=linear(256, HIDDEN),
            out_layer=linear(HIDDEN, HIDDEN),
        ),
        vector_in_config=MLPEmbedder.Config(
            in_dim=VEC,
            hidden_dim=HIDDEN,
            in_layer=linear(VEC, HIDDEN),
            out_layer=linear(HIDDEN, HIDDEN),
        ),
        double_blocks=[deepcopy(double) for _ in range(DEPTH)],
        single_blocks=[deepcopy(single) for _ in range(SINGLE)],
        final_layer_config=LastLayer.Config(
            hidden_size=HIDDEN,
            patch_size=1,
            out_channels=IN_CHANNELS,
            linear=linear(HIDDEN, IN_CHANNELS),
            adaln_linear=linear(HIDDEN, 2 * HIDDEN),
        ),
    )


def save_diffusers_config(out: Path) -> None:
    """The same model's config.json as diffusers' `FluxTransformer2DModel` saves it."""
    from diffusers import FluxTransformer2DModel

    FluxTransformer2DModel(
        patch_size=1,
        in_channels=IN_CHANNELS,
        num_layers=DEPTH,
        num_single_layers=SINGLE,
        attention_head_dim=HIDDEN // HEADS,
        num_attention_heads=HEADS,
        joint_attention_dim=CONTEXT,
        pooled_projection_dim=VEC,
        guidance_embeds=False,
        axes_dims_rope=AXES,
    ).save_config(out)


def inputs() -> dict[str, torch.Tensor]:
    """Fixed inputs (torchtitan's names): latents, text embeddings, pooled vector, timesteps,
    and the position ids of the image (a 2 x 3 grid) and text tokens."""
    gen = torch.Generator().manual_seed(3)
    rows, cols = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    img_ids = torch.stack([torch.zeros(6), rows.flatten(), cols.flatten()], dim=-1)
    return {
        "img": torch.randn(BATCH, IMG_TOKENS, IN_CHANNELS, generator=gen),
        "img_ids": img_ids.float(),
        "txt": torch.randn(BATCH, TXT_TOKENS, CONTEXT, generator=gen),
        "txt_ids": torch.zeros(TXT_TOKENS, 3),
        "timesteps": torch.tensor([0.25, 0.75]),
        "y": torch.randn(BATCH, VEC, generator=gen),
    }


def forward(model: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = x["img"].shape[0]
    out: torch.Tensor = model(
        img=x["img"],
        img_ids=x["img_ids"].expand(batch, -1, -1),
        txt=x["txt"],
        txt_ids=x["txt_ids"].expand(batch, -1, -1),
        timesteps=x["timesteps"],
        y=x["y"],
    )
    return out


def build(run: Path, seed: int) -> tuple[Any, Any, Any]:
    """model, optimizers, checkpoint manager."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = model_config().build()
    model.init_weights(buffer_device=None)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=10)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=0, dp_world_size=1, batch_size=2)
    manager = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=False
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": TrainState()},
        sd_adapter=None,
        base_folder=str(run),
    )
    return model, optimizers, manager


def train_step(model: Any, optimizers: Any) -> float:
    x = inputs()
    target = torch.randn(x["img"].shape, generator=torch.Generator().manual_seed(7))
    loss = torch.nn.functional.mse_loss(forward(model, x), target)
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    return float(loss)


def save(run: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from torchtitan.models.flux.model.state_dict_adapter import FluxStateDictAdapter

    model, optimizers, manager = build(run, seed=0)
    # the zero-initialised modulations and output layer take values from a few steps
    for _ in range(3):
        train_step(model, optimizers)
    manager.save(curr_step=1)
    manager.close()
    out.mkdir(parents=True, exist_ok=True)
    save_diffusers_config(out)
    from ckpt_cli.architectures import get_architecture

    flavored = get_architecture("flux").args_from_torchtitan(model_config())
    assert flavored is not None and flavored.config is not None
    (out / "flavor_config.json").write_text(json.dumps(flavored.config, indent=2))
    x = inputs()
    torch.save(x, out / "inputs.pt")
    with torch.no_grad():
        torch.save(forward(model, x), out / "output.pt")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, out / "state.pt")
    hf = FluxStateDictAdapter(model_config(), None).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, out / "to_hf.safetensors")


def load(run: Path, out: Path) -> None:
    model, optimizers, manager = build(run, seed=1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert manager.load(step=0), f"no checkpoint step-0 under {run}"
    manager.close()
    out.mkdir(parents=True, exist_ok=True)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(loaded, out / "loaded_state.pt")
    with torch.no_grad():
        torch.save(forward(model, inputs()), out / "loaded_output.pt")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = train_step(model, optimizers)
    moved = all(not torch.equal(v, params[k]) for k, v in model.named_parameters())
    restored = any(not torch.equal(before[k], loaded[k]) for k in loaded)
    torch.save({"loss": loss, "moved": moved, "restored": restored}, out / "trained.pt")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    _without_datasets()
    mode, run, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "load":
        load(run, out)
    else:
        save(run, out)
