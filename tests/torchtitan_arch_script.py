"""torchtitan 0.3.0 models (Llama 3 GQA, Qwen3, Qwen3-MoE) saved and loaded with torchtitan's
own code on CPU, for the architecture tests (`ckpt convert --to hf / --to torchtitan`).

Run in its own process (torchtitan's imports are heavy and register hooks):

    python tests/torchtitan_arch_script.py save FAMILY RUN OUT
        builds a tiny FAMILY model (seed 0), takes one AdamW step, saves RUN/checkpoint/step-1
        with `CheckpointManager.save` (model, optimizer, scheduler, data loader, train state)
        and writes into OUT: `config.json` (the same model as a transformers config),
        `logits.pt` (torchtitan's forward on `IDS`) and `to_hf.safetensors` (torchtitan's own
        `StateDictAdapter.to_hf` of the model's state dict: the bytes an export must equal);
        for `deepseek-v3` and `qwen3.5(-moe)` also `flavor_config.json`, the config.json
        `--flavor` builds from the torchtitan model's config (`args_from_torchtitan`); for
        `qwen3.5(-moe)` also `state.pt`, the model's state dict as saved, `config_vlm.json`
        (Qwen's own config.json layout: `text_config` and `vision_config`) and `vision.pt`
        (torchtitan's vision encoder on one image's patches: `vision_reference`)
    python tests/torchtitan_arch_script.py save-balanced FAMILY RUN OUT
        as `save`, but with torchtitan's own MoE load-balancing hook registered on the
        optimizer (as its Trainer does) and three steps taken, so each MoE layer's
        `expert_bias_E` is trained (non-zero); `to_hf.safetensors` is not written
    python tests/torchtitan_arch_script.py load FAMILY RUN OUT
        builds a fresh FAMILY model (seed 1), restores RUN/checkpoint/step-0 with
        `CheckpointManager.load(step=0)` (torchtitan's model-only load of a converted model),
        writes `OUT/loaded_logits.pt`, then takes one training step and writes
        `OUT/trained.pt` (the loss and whether every parameter moved); a Qwen3.5 is its
        language model alone
    python tests/torchtitan_arch_script.py load-vision FAMILY RUN OUT
        as `load`, a Qwen3.5 with its vision encoder, and `OUT/loaded_vision.pt` beside

FAMILY is `llama3` (dim 32, 4 heads over 2 KV heads, llama3 rope scaling), `qwen3` (q/k norms),
`qwen3.5` / `qwen3.5-moe` (three GatedDeltaNet layers and one gated full-attention layer with
partial multimodal rotary, a tiny vision encoder beside them; MoE: 4 experts, top 2, and a
gated shared expert; see `QWEN35_NOTE`),
`qwen3-moe` (4 experts, top 2), `deepseek-v3` (MLA with a low-rank query, yarn rotary, one dense
layer then MoE layers of 8 sigmoid-routed experts in 2 groups plus a shared expert; saved after
three steps with torchtitan's load-balancing hook, so its `expert_bias_E` is trained and routes
tokens), or `NAME:FLAVOR`, a flavor of torchtitan's own registry
(`llama3:debugmodel`; no `config.json` is written for it). Attention is SDPA (the stock backends are flex / varlen).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_writer import Tokens, TrainState

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN, SEQ = 64, 32, 4, 2, 8, 2, 64, 64
EXPERTS, TOP_K, MOE_FFN = 4, 2, 16
#: DeepSeek-V3's MLA widths and MoE (8 experts in 2 groups, top 2 of the best group)
KV_LORA, Q_LORA, NOPE, ROPE_DIM, V_DIM, DS_LAYERS, DS_EXPERTS = 16, 8, 8, 4, 8, 3, 8
#: DeepSeek-V3's yarn rotary: (factor, original context, mscale)
YARN = (4.0, 16, 0.7)
#: the fixed input ids every forward is judged on
IDS = torch.arange(12).reshape(2, 6) * 5 % VOCAB
#: Qwen3.5's: one sequence (its GatedDeltaNet runs a batch without document offsets as one
#: stream, as transformers' does not)
QWEN35_IDS = IDS.reshape(1, 12)
#: Qwen3.5's linear-attention heads, its MoE and its rotary (a quarter of each head)
LIN_K_HEADS, LIN_V_HEADS, LIN_HEAD_DIM, Q35_HEAD_DIM, Q35_ROTARY = 2, 4, 8, 16, 8
Q35_LAYERS, Q35_MOE_FFN, Q35_SHARED_FFN, MROPE = 4, 24, 40, [2, 1, 1]
#: QWEN35_NOTE: torchtitan's GatedDeltaNet kernel is flash-linear-attention's Triton kernel,
#: which runs on GPUs only; on CPU the forward computes the same gated delta rule with
#: transformers' pure-torch reference of it (`torch_chunk_gated_delta_rule`), swapped in for
#: the kernel call alone: every weight, projection, convolution and norm is torchtitan's own


def _qwen35_cpu_kernel() -> None:
    import torchtitan.models.qwen3_5.model as qwen35
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def kernel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        use_qk_l2norm_in_kernel: bool,
        **_: Any,
    ) -> Any:
        return torch_chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
        )

    qwen35._fla_chunk_gated_delta_rule = kernel  # type: ignore[assignment]


def _qwen35_config(family: str) -> Any:
    import torchtitan.models.qwen3_5 as q35
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3_5.rope import MRoPE

    _qwen35_cpu_kernel()
    common: dict[str, Any] = {
        "rope": MRoPE.Config(
            dim=Q35_ROTARY, max_seq_len=SEQ, theta=10_000_000.0, mrope_section=MROPE
        ),
        "attn_backend": "flex",
        "n_layers": Q35_LAYERS,
        "dim": DIM,
        "n_heads": HEADS,
        "n_kv_heads": KV_HEADS,
        "head_dim": Q35_HEAD_DIM,
        "rotary_dim": Q35_ROTARY,
        "n_key_heads": LIN_K_HEADS,
        "n_value_heads": LIN_V_HEADS,
        "key_head_dim": LIN_HEAD_DIM,
        "value_head_dim": LIN_HEAD_DIM,
    }
    if family == "qwen3.5":
        layers = q35._build_qwen35_layers(hidden_dim=FFN, **common)
    else:
        layers = q35._build_qwen35_moe_layers(
            moe_hidden_dim=Q35_MOE_FFN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            shared_expert_hidden_dim=Q35_SHARED_FFN,
            **common,
        )
    for layer in layers:
        if layer.attention is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return q35.Qwen35Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=q35._offset_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=q35._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=q35._output_linear_init(DIM)
        ),
        layers=layers,
        vision_encoder=q35._qwen35_vision_encoder_config(
            dim=16,
            ffn_dim=32,
            num_layers=1,
            num_heads=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=DIM,
            num_position_embeddings=16,
        ),
    )


def _qwen35_hf_config(family: str) -> dict[str, Any]:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "num_hidden_layers": Q35_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": Q35_HEAD_DIM,
        "linear_num_key_heads": LIN_K_HEADS,
        "linear_num_value_heads": LIN_V_HEADS,
        "linear_key_head_dim": LIN_HEAD_DIM,
        "linear_value_head_dim": LIN_HEAD_DIM,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": SEQ,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": Q35_ROTARY / Q35_HEAD_DIM,
            "mrope_section": MROPE,
            "mrope_interleaved": True,
        },
    }
    config: Any
    if family == "qwen3.5":
        config = transformers.Qwen3_5TextConfig(intermediate_size=FFN, **common)
        config.architectures = ["Qwen3_5ForCausalLM"]
    else:
        config = transformers.Qwen3_5MoeTextConfig(
            moe_intermediate_size=Q35_MOE_FFN,
            shared_expert_intermediate_size=Q35_SHARED_FFN,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            **common,
        )
        config.architectures = ["Qwen3_5MoeForCausalLM"]
    out: dict[str, Any] = json.loads(config.to_json_string())
    return out


#: the tiny vision encoder of `_qwen35_config`, as transformers' `vision_config` says it
Q35_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 32,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": DIM,
    "num_position_embeddings": 16,
}
#: one image of 4 x 4 patches (each 3 channels x 2 frames x 4 x 4 pixels)
Q35_GRID = [[1, 4, 4]]


def _qwen35_vlm_config(family: str) -> dict[str, Any]:
    """Qwen's own config.json layout of the same model: language model and vision encoder."""
    import transformers

    text = _qwen35_hf_config(family)
    text.pop("architectures", None)
    kind = "Qwen3_5MoeConfig" if family == "qwen3.5-moe" else "Qwen3_5Config"
    config = getattr(transformers, kind)(
        text_config=text, vision_config=dict(Q35_VISION), tie_word_embeddings=False
    )
    config.architectures = [kind.replace("Config", "ForConditionalGeneration")]
    out: dict[str, Any] = json.loads(config.to_json_string())
    return out


def vision_reference(model: Any) -> dict[str, torch.Tensor]:
    """torchtitan's vision encoder on one image's patches: what transformers' must give."""
    grid = torch.tensor(Q35_GRID)
    width = 3 * 2 * 4 * 4
    pixels = torch.randn(16, width, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = model.vision_encoder(pixels.unsqueeze(0), grid_thw=grid)[0]
    return {"pixels": pixels, "grid": grid, "out": out}


def forward(family: str, model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's forward of `model` on `tokens` (Qwen3.5's wants positions and its
    vision placeholder ids, none of which text holds)."""
    if not family.startswith("qwen3.5"):
        out: torch.Tensor = model(tokens)
        return out
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    special = {"image_id": -1, "video_id": -2}
    out = model(tokens, positions=positions, special_tokens=special)
    return out


def ids_of(family: str) -> torch.Tensor:
    return QWEN35_IDS if family.startswith("qwen3.5") else IDS


def _sdpa(layers: list[Any]) -> list[Any]:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def model_config(family: str) -> Any:
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    if ":" in family:  # FAMILY:FLAVOR from torchtitan's own registry
        import importlib

        name, flavor = family.split(":")
        config = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor).model
        _sdpa(config.layers)
        return config
    if family == "deepseek-v3":
        return _deepseek_config()
    if family.startswith("qwen3.5"):
        return _qwen35_config(family)
    if family == "llama3":
        import torchtitan.models.llama3 as llama3

        return llama3.Llama3Model.Config(
            dim=DIM,
            vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(
                num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(
                in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
            ),
            layers=_sdpa(
                llama3._build_llama3_layers(
                    fuse_qkv=True,
                    n_layers=LAYERS,
                    dim=DIM,
                    n_heads=HEADS,
                    n_kv_heads=KV_HEADS,
                    hidden_dim=FFN,
                    rope=ComplexRoPE.Config(
                        dim=HEAD_DIM, max_seq_len=SEQ, theta=500000, scaling="llama"
                    ),
                    attn_backend="flex",
                )
            ),
        )
    import torchtitan.models.qwen3 as qwen3

    common = {
        "n_layers": LAYERS,
        "dim": DIM,
        "n_heads": HEADS,
        "n_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "attn_backend": "flex",
        "rope": CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0),
    }
    if family == "qwen3":
        layers = qwen3._build_qwen3_layers(hidden_dim=FFN, **common)
    else:
        layers = qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=MOE_FFN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            moe_comm_backend="standard",
            **common,
        )
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=_sdpa(layers),
    )


def _deepseek_config() -> Any:
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE

    factor, original, mscale = YARN
    layers = ds._build_dsv3_layers(
        n_layers=DS_LAYERS,
        n_dense_layers=1,
        dim=DIM,
        n_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=V_DIM,
        mscale=mscale,
        dense_hidden_dim=FFN,
        moe_hidden_dim=MOE_FFN,
        num_experts=DS_EXPERTS,
        num_shared_experts=1,
        router_top_k=TOP_K,
        router_score_func="sigmoid",
        router_num_expert_groups=2,
        router_num_limited_groups=1,
        router_route_scale=2.5,
        router_route_norm=True,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=ROPE_DIM,
            max_seq_len=SEQ,
            theta=10000.0,
            scaling="yarn",
            rope_factor=factor,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=original,
        ),
    )
    return ds.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=ds._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=ds._output_linear_init(DIM)
        ),
        layers=_sdpa(layers),
        mtp_layers=[],
    )


def _deepseek_hf_config() -> dict[str, Any]:
    import transformers

    factor, original, mscale = YARN
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        moe_intermediate_size=MOE_FFN,
        num_hidden_layers=DS_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        n_shared_experts=1,
        n_routed_experts=DS_EXPERTS,
        routed_scaling_factor=2.5,
        kv_lora_rank=KV_LORA,
        q_lora_rank=Q_LORA,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=TOP_K,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": mscale,
            "mscale_all_dim": mscale,
            "original_max_position_embeddings": original,
        },
        tie_word_embeddings=False,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    out: dict[str, Any] = json.loads(config.to_json_string())
    return out


def hf_config(family: str) -> dict[str, Any]:
    """The same model as transformers builds it."""
    import transformers

    if family == "deepseek-v3":
        return _deepseek_hf_config()
    if family.startswith("qwen3.5"):
        return _qwen35_hf_config(family)

    common: dict[str, Any] = {
        "hidden_size": DIM,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": SEQ,
        "tie_word_embeddings": False,
    }
    config: Any
    if family == "llama3":
        config = transformers.LlamaConfig(
            intermediate_size=FFN,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            **common,
        )
        config.architectures = ["LlamaForCausalLM"]
    elif family == "qwen3":
        config = transformers.Qwen3Config(
            intermediate_size=FFN,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=FFN,
            moe_intermediate_size=MOE_FFN,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    out: dict[str, Any] = json.loads(config.to_json_string())
    return out


def adapter(family: str, config: Any) -> Any:
    if family.startswith("qwen3.5"):
        from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

        return Qwen35StateDictAdapter(config, None)
    if family == "deepseek-v3":
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

        return DeepSeekV3StateDictAdapter(config, None)
    if family == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        return Llama3StateDictAdapter(config, None)
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, None)


def build(family: str, run: Path, seed: int, *, text_only: bool = False) -> tuple[Any, Any, Any]:
    """model, optimizers, checkpoint manager. `text_only`: a Qwen3.5 without its vision
    encoder (the language model an export of it holds; a text forward never calls it)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = model_config(family).build()
    model.init_weights(buffer_device=None)
    if text_only:
        model.vision_encoder = None
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


def train_step(model: Any, optimizers: Any, family: str = "") -> float:
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    logits = forward(family, model, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    return float(loss)


def save(family: str, run: Path, out: Path, *, balanced: bool = False) -> None:
    from safetensors.torch import save_file

    model, optimizers, manager = build(family, run, seed=0)
    # DeepSeek-V3 maps its load-balancing bias (transformers' e_score_correction_bias): a
    # trained one is what its export must keep
    reference = not balanced
    balanced = balanced or family.split(":")[0] == "deepseek-v3"
    if balanced:
        from types import SimpleNamespace

        from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

        # one process, no mesh: the hook's all-reduces are skipped as on a single GPU
        single = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
        register_moe_load_balancing_hook(optimizers, [model], single)  # type: ignore[arg-type]
    for _ in range(3 if balanced else 1):
        train_step(model, optimizers, family)
    manager.save(curr_step=1)
    manager.close()
    out.mkdir(parents=True, exist_ok=True)
    if ":" not in family:
        (out / "config.json").write_text(json.dumps(hf_config(family), indent=2))
    if family == "deepseek-v3" or family.startswith("qwen3.5"):
        # what `--flavor` builds from a torchtitan model config (only 671B of torchtitan's
        # own DeepSeek-V3 flavors routes by sigmoid as transformers' does: too big to build;
        # Qwen3.5's are too, with their 248,320-token vocabulary)
        from ckpt_cli.architectures import get_architecture

        args = get_architecture(family).args_from_torchtitan(model_config(family))
        assert args is not None
        built = args.config
        (out / "flavor_config.json").write_text(json.dumps(built, indent=2))
    if family.startswith("qwen3.5"):
        (out / "config_vlm.json").write_text(json.dumps(_qwen35_vlm_config(family), indent=2))
        torch.save(vision_reference(model), out / "vision.pt")
    with torch.no_grad():
        torch.save(forward(family, model, ids_of(family)), out / "logits.pt")
    if not reference:
        return
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if family.startswith("qwen3.5"):
        torch.save(state, out / "state.pt")
    hf = adapter(family.split(":")[0], model_config(family)).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, out / "to_hf.safetensors")


def load(family: str, run: Path, out: Path, *, vision: bool = False) -> None:
    """Load step-0 of `run` (a Qwen3.5's language model alone, or with its vision encoder:
    `vision`) and train a step from it."""
    text_only = family.startswith("qwen3.5") and not vision
    model, optimizers, manager = build(family, run, seed=1, text_only=text_only)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert manager.load(step=0), f"no checkpoint step-0 under {run}"
    manager.close()
    out.mkdir(parents=True, exist_ok=True)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        torch.save(forward(family, model, ids_of(family)), out / "loaded_logits.pt")
    torch.save(loaded, out / "loaded_state.pt")
    if vision:
        torch.save(vision_reference(model), out / "loaded_vision.pt")
    # a text step trains the language model (the vision encoder sees no image)
    trained = {k: v for k, v in model.named_parameters() if not k.startswith("vision_encoder.")}
    params = {k: v.detach().clone() for k, v in trained.items()}
    loss = train_step(model, optimizers, family)
    moved = all(not torch.equal(v, params[k]) for k, v in trained.items())
    restored = any(not torch.equal(before[k], loaded[k]) for k in loaded)
    torch.save({"loss": loss, "moved": moved, "restored": restored}, out / "trained.pt")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    mode, family, run, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    if mode in ("load", "load-vision"):
        load(family, run, out, vision=mode == "load-vision")
    else:
        save(family, run, out, balanced=mode == "save-balanced")
