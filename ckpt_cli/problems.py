"""The table of every code ckpt reports: problem codes and error codes, with severity and meaning.

A *problem code* is the `code` of a `models.Problem` (what `ckpt verify`, `ckpt diff` and the
training-state report list, one entry per flaw). An *error code* is the `code` of a `CkptError`
subclass (the JSON envelope's `error.code`); a structural check that meets such an error reports
it as a problem with the same code, so error codes are problem codes too.

`models.Problem` refuses a code that is not here, or a severity the code is not listed with: an
unknown code is a bug (a new check whose code was not added), caught by the tests, which also scan
the source for every code literal. The code tables of docs/commands/verify.md are generated from this table:
`python -m ckpt_cli.problems --markdown` prints it (the tests check docs/commands/verify.md is current).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

#: how bad a problem is: an error fails `verify` (exit 1); a warning is reported, exit 0
Severity = Literal["error", "warning"]

_E: tuple[Severity, ...] = ("error",)
_W: tuple[Severity, ...] = ("warning",)
_EW: tuple[Severity, ...] = ("error", "warning")


@dataclass(frozen=True)
class Code:
    """One code ckpt reports.

    Attributes:
        code: the stable string (`missing_shard`).
        severities: the severities it is reported at; several when the context decides
            (`--exact` makes a missing RNG state an error, else a warning).
        meaning: one line: what is wrong.
        raised: also the `error.code` of a `CkptError` subclass (an error that stops a
            command), not only a finding of a check.
    """

    code: str
    severities: tuple[Severity, ...]
    meaning: str
    raised: bool = False


def _codes(*codes: Code) -> dict[str, Code]:
    table: dict[str, Code] = {}
    for entry in codes:
        assert entry.code not in table, f"problem code {entry.code!r} is listed twice"
        table[entry.code] = entry
    return table


#: every code, by name (kept in alphabetical order within each group)
CODES: dict[str, Code] = _codes(
    # ---- errors (CkptError subclasses; also reported as problems when a check meets one)
    Code("bad_checkpoint", _E, "a file is corrupt, hostile, unsupported or ambiguous", raised=True),
    Code(
        "corrupt_data",
        _E,
        "stored bytes fail the CRC-32 their own file records for them (a torch.save record "
        "changed after it was written)",
        raised=True,
    ),
    Code(
        "dcp_interrupted",
        _E,
        "a DCP folder with data files but no `.metadata`, or a rank's "
        "data file without its `__N.metadata`: the save did not finish",
        raised=True,
    ),
    Code(
        "destination_exists",
        _E,
        "the output exists already and `--force` was not given",
        raised=True,
    ),
    Code("hangup", _E, "stopped by SIGHUP; partial outputs were removed", raised=True),
    Code("hub", _E, "a Hub, network or authentication failure", raised=True),
    Code("internal", _E, "a bug in ckpt", raised=True),
    Code("interrupted", _E, "interrupted by the user; partial outputs were removed", raised=True),
    Code("io_error", _E, "the operating system refused a read or a write", raised=True),
    Code(
        "missing_rank_folder",
        _E,
        "a legacy Megatron-LM save (`iter_N/mp_rank_*/`) lacks rank folders its args call for "
        "(exit 4; an error of `verify`)",
        raised=True,
    ),
    Code("no_checkpoint", _E, "a folder that exists and holds no checkpoint (exit 3)", raised=True),
    Code("not_found", _E, "a path, tensor, repository or revision does not exist", raised=True),
    Code("problems_found", _E, "the command finished and found problems (exit 1)", raised=True),
    Code("rank_failed", _E, "a rank of a torchrun launch failed", raised=True),
    Code(
        "rendezvous",
        _E,
        "a rank of a torchrun launch did not join within CKPT_DIST_TIMEOUT (exit 5)",
        raised=True,
    ),
    Code("terminated", _E, "stopped by SIGTERM; partial outputs were removed", raised=True),
    Code(
        "unsafe_input", _E, "input that would run code or escape the checkpoint folder", raised=True
    ),
    Code("usage", _E, "bad arguments or option combinations", raised=True),
    # ---- file headers and layout (safetensors, GGUF)
    Code(
        "bad_header",
        _E,
        "a header that cannot be parsed or has a malformed entry (not JSON, "
        "bad shape or offsets, bad `__metadata__`), or a file that is not safetensors",
    ),
    Code("duplicate_key", _E, "a safetensors header names a key twice (readers disagree)"),
    Code(
        "gap", _E, "unused bytes between two tensors' data (safetensors requires contiguous data)"
    ),
    Code("misaligned", _E, "a sub-byte (F4/F6) tensor whose bits do not end on a byte boundary"),
    Code("misaligned_tensor", _E, "a GGUF tensor whose offset breaks the file's alignment"),
    Code("missing_split", _E, "a split GGUF file is missing"),
    Code(
        "noncontiguous_tensors",
        _E,
        "a GGUF file's tensor data out of order or with gaps (llama.cpp's loader refuses it)",
    ),
    Code("overlap", _E, "two tensors' bytes overlap in a safetensors file"),
    Code("overlapping_tensors", _E, "two tensors' bytes overlap in a GGUF file"),
    Code("size_mismatch", _E, "a tensor's byte range does not match its dtype and shape"),
    Code(
        "split_count_mismatch",
        _E,
        "a GGUF split's `split.count` disagrees with the count in its file names",
    ),
    Code(
        "split_number_mismatch",
        _E,
        "a GGUF split's `split.no` is not its place in the set, as its file name gives it",
    ),
    Code(
        "split_tensor_count",
        _E,
        "the GGUF splits hold another number of tensors than `split.tensors.count` says",
    ),
    Code(
        "too_many_dims",
        _E,
        "a GGUF tensor of more than the 4 dimensions GGUF allows (llama.cpp's loader refuses it)",
    ),
    Code("trailing_bytes", _E, "bytes after the last tensor's data"),
    Code("truncated", _E, "a file shorter than its header says (data past the end)"),
    Code("unknown_dtype", _E, "a tensor of a dtype ckpt does not know (the rest is still read)"),
    # ---- the weight-map index (`*.safetensors.index.json`, `*.bin.index.json`)
    Code(
        "bad_index",
        _E,
        "a weight-map index that is not valid JSON, has no valid `weight_map`, "
        "or has a `total_size` that is not a byte count",
    ),
    Code("duplicate_tensor", _E, "one tensor stored in several shards or files"),
    Code("missing_shard", _E, "a shard the index names is missing"),
    Code("missing_tensor", _E, "the index maps a tensor to a shard, and no shard holds it"),
    Code("not_in_index", _E, "a shard holds a tensor the index does not list"),
    Code(
        "total_size",
        _W,
        "the index's `metadata.total_size` differs from the shards' tensor "
        "bytes (loaders ignore it)",
    ),
    Code("unreferenced_shard", _W, "a shard file the index does not name (a leftover?)"),
    Code("wrong_shard", _E, "the index maps a tensor to one shard; it is stored in another"),
    # ---- DCP and Megatron-Core torch_dist
    Code(
        "dcp_bad_chunk",
        _E,
        "a chunk entry of `.metadata` (or of the safetensors serialization's "
        "sharding info) is malformed",
    ),
    Code(
        "dcp_bad_planner_data",
        _E,
        "`.metadata`'s `planner_data` places an entry at a key path that does not spell "
        "its name (torch's loaders without a template refuse it)",
    ),
    Code("dcp_chunk_out_of_bounds", _E, "a chunk reaches past its tensor's shape"),
    Code(
        "dcp_coverage", _E, "a tensor's chunks cannot cover it (a 0-dim tensor with several chunks)"
    ),
    Code("dcp_hole", _E, "part of a tensor is stored in no chunk"),
    Code(
        "dcp_mismatch",
        _E,
        "`.metadata`, the ranks' metadata and the data files disagree on a "
        "tensor's dtype, size or kind",
    ),
    Code("dcp_missing_file", _E, "a data file `.metadata` stores chunks in is missing"),
    Code("dcp_missing_storage", _E, "an entry of `.metadata` has no storage record"),
    Code("dcp_overlap", _E, "two chunks of one tensor overlap"),
    Code("dcp_truncated", _E, "a chunk's byte range lies past the end of its data file"),
    Code(
        "megatron_backend",
        _E,
        "Megatron-Core's metadata.json names a backend other than torch_dist",
    ),
    Code(
        "megatron_common", _E, "Megatron-Core's common.pt is not a torch.save dict with string keys"
    ),
    Code(
        "megatron_common_clash",
        _W,
        "a common.pt key is also a sharded entry (the sharded one is read)",
    ),
    Code("megatron_metadata", _E, "Megatron-Core's metadata.json cannot be read"),
    Code("megatron_missing_common", _E, "Megatron-Core's common.pt is missing"),
    # ---- content (`--deep`)
    Code(
        "changed_while_read",
        _E,
        "a file was rewritten or replaced by another process while `--deep` read it: what was "
        "read may be two versions",
    ),
    Code("nonfinite", _E, "a tensor holds NaN or Inf values"),
    Code("shape_mismatch", _E, "a tensor read back has another shape or dtype than its metadata"),
    Code(
        "unloadable_object",
        _E,
        "a non-tensor entry needs a global ckpt's restricted reader refuses (nothing was run)",
    ),
    Code("unreadable", _E, "a tensor or object does not deserialise"),
    Code(
        "torch_load_refuses",
        _W,
        "torch.load(weights_only=True) refuses a file ckpt reads (a global off torch's "
        "allow-list, a pickle protocol above 2, or a legacy file torch's loader fails on; named)",
    ),
    # ---- checksums (`--checksums`, `--write-manifest`)
    Code("checksum_mismatch", _E, "a file's digest differs from the manifest's"),
    Code(
        "manifest_not_written",
        _E,
        "`--write-manifest` refused: the checkpoint has problems, or a file changed while it "
        "was hashed",
    ),
    Code(
        "missing_file",
        _EW,
        "a file the manifest lists is missing (a warning for the Hub's "
        "files absent from the local cache)",
    ),
    Code(
        "no_content_address",
        _W,
        "`--checksums` on an HF cache snapshot: the file is no link into the cache's `blobs/`, "
        "so it has no address to check",
    ),
    Code("no_local_copy", _W, "no file of the Hub commit is in the local cache to check"),
    Code("not_checked", _W, "checks skipped because of the problems above"),
    Code(
        "nested_saves",
        _W,
        "the checkpoint's folder also holds saves of a run (`checkpoint-N/`...): not checked "
        "or counted with it",
    ),
    Code("size_changed", _E, "a file's size differs from the manifest's"),
    Code(
        "rewritten_index",
        _W,
        "checked against the Hub: a shard index that is a subset of the Hub's (what `ckpt "
        "download --filter` writes), each tensor in the shard the Hub's index names",
    ),
    Code("unlisted_file", _EW, "a file the manifest does not list (a warning for one added since)"),
    # ---- protected checkpoints (`ckpt protect`)
    Code("damaged_blocks", _E, "a protected file's blocks differ from their parity digests"),
    Code("lost_file", _E, "a protected file is missing"),
    Code("parity_damaged", _W, "a parity file is damaged (the data is intact)"),
    Code("parity_stale", _W, "a file was modified after `ckpt protect` wrote the parity"),
    Code("unprotected_file", _W, "a file added after `ckpt protect` (no parity covers it)"),
    # ---- training state (`--resumable`, `--exact`) and training folders
    Code(
        "missing_component",
        _E,
        "a Trainer or accelerate save lacks a model's, optimizer's or scheduler's state it "
        "was saved with, or a "
        "diffusers pipeline a component folder its model_index.json names",
    ),
    Code(
        "missing_component_weights",
        _E,
        "a sentence-transformers module or diffusers model component has no weights file",
    ),
    Code("missing_dataloader", _EW, "no data-loader state (an error with `--exact`)"),
    Code("missing_optimizer", _EW, "no optimizer state"),
    Code("missing_partition", _E, "a DeepSpeed ZeRO data-parallel rank's partition is missing"),
    Code(
        "missing_rank_file",
        _E,
        "a rank's file of a per-rank FSDP save (accelerate `*_rank{N}.bin`) is missing",
    ),
    Code(
        "missing_rank_rng",
        _E,
        "a process's RNG state file of a multi-process save (accelerate "
        "`random_states_{N}.pkl`, Trainer `rng_state_{N}.pth`) is missing",
    ),
    Code("missing_rng", _EW, "no RNG state (an error with `--exact`)"),
    Code(
        "missing_scheduler",
        _EW,
        "no LR scheduler state (an error with `--exact`); a run whose optimizer no torch "
        "scheduler ever stepped (no `initial_lr` in its param groups: a constant learning "
        "rate) lacks none",
    ),
    Code("missing_step", _EW, "no step or epoch counter"),
    Code("missing_weights", _EW, "no model weights"),
    Code("not_resumable", _E, "no training state at all (weights only)"),
    Code(
        "resharded_world_size",
        _EW,
        "a training folder `ckpt reshard --world-size` cut for another world size: it "
        "resumes, never bit-identically (an error with `--exact`)",
    ),
    Code(
        "one_rank_folder",
        _W,
        "one rank folder of a legacy Megatron-LM save named alone (`iter_N/mp_rank_00/`): "
        "only that rank's slices were checked; `ckpt verify iter_N/` checks the whole save",
    ),
    Code(
        "optimizer_ids_as_strings",
        _E,
        'optimizer state keyed by the strings "0", "1"… while its param_groups name int ids '
        "(`optimizer.load_state_dict` restores none of it)",
    ),
    Code("optimizer_incomplete", _E, "optimizer state does not cover every parameter"),
    Code("optimizer_shape_mismatch", _E, "optimizer state whose shape matches no weight"),
    Code(
        "optimizer_state_pending",
        _W,
        "parameters the optimizer lists hold no state yet (torch keeps none before a "
        "parameter's first gradient: frozen or staged unfreezing)",
    ),
    Code("optimizer_unknown_param", _E, "optimizer state for a parameter the weights do not have"),
    Code(
        "rank_rng_elsewhere",
        _W,
        "a process's RNG state file of a multi-process save is not in its folder: lost, or "
        "on another node's disk (`save_on_each_node`)",
    ),
    Code(
        "trainer_state_mismatch",
        _E,
        "a Trainer `checkpoint-N`'s trainer_state.json records another global_step than N, or "
        "than the DeepSpeed tag its `latest` names (another save's file)",
    ),
    Code(
        "stray_partition",
        _W,
        "a DeepSpeed ZeRO partition of a rank past the save's recorded dp_world_size (another "
        "save's, copied in): DeepSpeed's resume ignores it, zero_to_fp32 fails on it",
    ),
    Code("unreadable_component", _E, "a component of a training folder cannot be read"),
    Code("zero_partition_mismatch", _E, "ZeRO partitions do not add up to the recorded shapes"),
    Code(
        "zero_world_size_unknown",
        _W,
        "a ZeRO save records no dp_world_size (completeness unchecked)",
    ),
    # ---- quantized checkpoints
    Code("bad_scale", _E, "a scale holds NaN or non-finite values (`--deep`)"),
    Code("config_mismatch", _EW, "the quantization config and the tensors disagree"),
    Code("missing_scale", _E, "a quantized weight without its scale"),
    Code("orphan_scale", _E, "a scale whose weight is absent"),
    Code("reciprocal_scale", _W, "a scale that looks like its reciprocal (`--deep`)"),
    Code("scale_dtype", _E, "a scale of a dtype the scheme does not allow"),
    Code("scale_grid", _E, "a scale whose shape is not the grid the scheme implies"),
)


class UnknownProblemCode(ValueError):
    """A code or severity not in `CODES`: a bug in ckpt (a check whose code was not listed)."""


def check(code: str, severity: str) -> Code:
    """The table entry of `code`; `UnknownProblemCode` when it is unknown or not at `severity`."""
    entry = CODES.get(code)
    if entry is None:
        raise UnknownProblemCode(
            f"problem code {code!r} is not in the table of ckpt_cli/problems.py: add it to "
            "CODES with its severity and meaning, then regenerate the docs/commands/verify.md table with "
            "`python -m ckpt_cli.problems --markdown`"
        )
    if severity not in entry.severities:
        raise UnknownProblemCode(
            f"problem code {code!r} is listed as {'/'.join(entry.severities)} in "
            f"ckpt_cli/problems.py but was reported as {severity!r}: add the severity there"
        )
    return entry


def markdown() -> str:
    """The code tables of docs/commands/verify.md (problem codes, then error codes), in markdown."""
    lines = ["| code | severity | meaning |", "|---|---|---|"]
    errors = ["| code | meaning |", "|---|---|"]
    for entry in sorted(CODES.values(), key=lambda e: e.code):
        meaning = entry.meaning.replace("|", "\\|")
        if entry.raised:
            errors.append(f"| `{entry.code}` | {meaning} |")
        else:
            lines.append(f"| `{entry.code}` | {', '.join(entry.severities)} | {meaning} |")
    intro = (
        "Error codes: the JSON envelope's `error.code` when a command stops; a check that "
        "meets such an error reports it as a problem (severity error) with the same code."
    )
    return "\n".join([*lines, "", intro, "", *errors]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m ckpt_cli.problems --markdown`: print the tables of docs/commands/verify.md."""
    import argparse  # only this entry point parses arguments

    parser = argparse.ArgumentParser(prog="python -m ckpt_cli.problems")
    parser.add_argument(
        "--markdown", action="store_true", help="print the tables of docs/commands/verify.md"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for entry in CODES.values():
            sys.stdout.write(f"{entry.code}\t{','.join(entry.severities)}\t{entry.meaning}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
