"""A tiny Megatron-Core `GPTModel` (local spec: RMSNorm, SwiGLU, GQA, rotary, no bias, untied
output) saved and loaded with megatron-core's own `dist_checkpointing`, on CPU with gloo.

Modes (run under `torchrun`, any number of ranks = the tensor-parallel size, or as one process
with a free port as the last argument):

- `save DIR`: build the model (seeded), save `{"model": model.sharded_state_dict()}` plus the
  common state Megatron-LM's `save_checkpoint` keeps (`iteration`, `checkpoint_version`,
  `args` as an `argparse.Namespace` with Megatron-LM's argument names) to DIR, and write DIR.logits.pt: the forward's logits on
  `INPUT_IDS`.
- `save-pp DIR`: the same model as a pipeline of one stage per rank (layers split across the
  ranks, the embedding on the first and the output layer on the last), saved, no logits.
- `load DIR OUT`: build a fresh model (a different seed), `dist_checkpointing.load` DIR into
  it (`{"model": model.sharded_state_dict()}`, as Megatron-LM's `load_checkpoint` asks), write OUT.logits.pt (its logits on `INPUT_IDS`), then run one training step (SGD on the
  next-token loss) and write OUT.step.pt: the loss and whether every parameter moved and
  stayed finite.

megatron-core calls `torch.cuda.synchronize` / `torch.cuda.current_device` in its writer and
builds its default causal mask on "cuda"; on a CPU-only machine the first two are stubbed here,
in the script's own process only, and the mask is passed explicitly.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first

#: the model's dimensions (GQA: 4 query heads in 2 groups; head size 8)
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, MAX_POS = 2, 32, 4, 2, 48, 64, 64
ROTARY_BASE, EPS = 500000.0, 1e-5
INPUT_IDS = [[3, 17, 5, 60, 2, 41, 9, 33, 12, 0], [7, 7, 1, 58, 30, 22, 11, 4, 63, 19]]
#: `MEGATRON_ROPE=llama3`: Llama 3.x rope scaling (`--use-rope-scaling`, factor 8, or F with
#: `MEGATRON_ROPE_SCALING=F`, which alone also asks for it);
#: `MEGATRON_ROPE=linear`: positions interpolated (`--rotary-seq-len-interpolation-factor 4`)
_SCALING = os.environ.get("MEGATRON_ROPE_SCALING", "")
ROPE = os.environ.get("MEGATRON_ROPE", "llama3" if _SCALING else "")
ROPE_FACTOR, INTERPOLATION = float(_SCALING or 8.0), 4
#: `MEGATRON_FAMILY=qwen2`: q/k/v biases (`--add-qkv-bias`, Megatron-Bridge's Qwen2 / 2.5);
#: `MEGATRON_FAMILY=qwen3`: q/k norms over each head (`--qk-layernorm`, its Qwen3)
FAMILY = os.environ.get("MEGATRON_FAMILY", "")
QKV_BIAS, QK_LAYERNORM = FAMILY == "qwen2", FAMILY == "qwen3"


def megatron_args() -> argparse.Namespace:
    """The model arguments as Megatron-LM's `save_checkpoint` stores them in `common.pt`."""
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=HIDDEN // HEADS,
        padded_vocab_size=VOCAB,
        max_position_embeddings=MAX_POS,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=EPS,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=QKV_BIAS,
        qk_layernorm=QK_LAYERNORM,
        untie_embeddings_and_output_weights=True,
        bf16=False,
        fp16=False,
        tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")),
        pipeline_model_parallel_size=1,
        lr=3e-4,
        seed=1234,
        use_rope_scaling=ROPE == "llama3",
        rope_scaling_factor=ROPE_FACTOR,
        rotary_seq_len_interpolation_factor=INTERPOLATION if ROPE == "linear" else None,
    )


def build_model(seed: int, pipeline: int = 1) -> Any:
    """The GPTModel on this rank: tensor parallel over every rank, or (`pipeline` > 1) a
    pipeline stage of `LAYERS / pipeline` layers, the first holding the embedding and the last
    the output layer."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    # dropout is 0: the RNG tracker's fork is never needed (its CUDA state would be)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=QKV_BIAS,
        qk_layernorm=QK_LAYERNORM,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=1 if pipeline > 1 else int(os.environ.get("WORLD_SIZE", "1")),
        pipeline_model_parallel_size=pipeline,
        pipeline_dtype=torch.float32 if pipeline > 1 else None,
    )
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed + stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=QK_LAYERNORM
        ),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        position_embedding_type="rope",
        rotary_base=int(ROTARY_BASE),
        rope_scaling=ROPE == "llama3",
        rope_scaling_factor=ROPE_FACTOR,
        seq_len_interpolation_factor=INTERPOLATION if ROPE == "linear" else None,
        share_embeddings_and_output_weights=False,
        parallel_output=False,  # every rank gets the whole vocabulary's logits
        pre_process=stage == 0,
        post_process=stage == pipeline - 1,
    )
    # the model's random init is small; scale it so the logits are not all near zero
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    return model


def forward(model: Any, ids: torch.Tensor) -> torch.Tensor:
    length = ids.shape[1]
    positions = torch.arange(length).expand_as(ids)
    mask = torch.triu(torch.ones(length, length), diagonal=1).bool().view(1, 1, length, length)
    return model(ids, positions, attention_mask=mask)  # type: ignore[no-any-return]


def main() -> None:
    import torch.distributed as dist

    # this process only (the test imports this module for its constants)
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

    if "LOCAL_RANK" in os.environ:
        dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
        args = sys.argv[1:]
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", sys.argv[-1])
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=RANK_TIMEOUT)
        args = sys.argv[1:-1]
    from megatron.core import dist_checkpointing, parallel_state

    pipeline = dist.get_world_size() if args[0] == "save-pp" else 1
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dist.get_world_size() // pipeline,
        pipeline_model_parallel_size=pipeline,
    )
    rank = dist.get_rank()
    ids = torch.tensor(INPUT_IDS)
    if args[0] == "save-pp":
        # each stage saves its layers under their global numbers; no forward (that takes
        # Megatron's pipeline schedule): the truth is megatron's own load of the save
        model = build_model(seed=0, pipeline=pipeline)
        margs = megatron_args()
        margs.tensor_model_parallel_size, margs.pipeline_model_parallel_size = 1, pipeline
        state = {
            "model": model.sharded_state_dict(),
            "iteration": 3,
            "checkpoint_version": 3.0,
            "args": margs,
        }
        os.makedirs(args[1], exist_ok=True)
        dist_checkpointing.save(state, args[1])
    elif args[0] == "save":
        model = build_model(seed=0)
        model.eval()
        with torch.no_grad():
            logits = forward(model, ids)
        # the shape of Megatron-LM's save_checkpoint state: the model under "model"
        state: dict[str, Any] = {
            "model": model.sharded_state_dict(),
            "iteration": 7,
            "checkpoint_version": 3.0,
            "args": megatron_args(),
        }
        os.makedirs(args[1], exist_ok=True)
        dist_checkpointing.save(state, args[1])
        if rank == 0:
            torch.save(logits, f"{args[1]}.logits.pt")
    else:
        model = build_model(seed=99)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, args[1])
        model.load_state_dict(loaded["model"])
        model.eval()
        with torch.no_grad():
            logits = forward(model, ids)
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out = forward(model, ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        moved = all(
            not torch.equal(before[n], p) and bool(torch.isfinite(p).all())
            for n, p in model.named_parameters()
        )
        if rank == 0:
            torch.save(logits, f"{args[2]}.logits.pt")
            torch.save({"loss": float(loss), "moved": moved}, f"{args[2]}.step.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
