"""The console examples of README.md and docs/: found, run, compared, and refreshed.

A console example is a fenced block of language `console` in README.md or docs/**/*.md: lines
`$ COMMAND` each followed by the output the command prints. A comment on the line before the
fence names the fixture it runs in:

    <!-- fixture: demo -->
    ```console
    $ ckpt inspect build/demo/model
    ...
    ```

Rules (tests/test_docs_examples.py holds every block to them):

- Every console block has a fixture marker; a block that is not a transcript of commands and
  their output (shell set-up, `pip`, `make`, Python) uses another fence (`bash`, `python`).
- Each block runs in a fresh scratch folder holding its fixture (`FIXTURES` below; a fixture
  may also serve something, the test Hub, and set the variables that point at it). Its
  commands run in order, each through `bash -c` in that folder, `ckpt` being the real
  `python -m ckpt_cli` of this checkout (and `python` the suite's interpreter); stdout and stderr are read together, as a terminal
  shows them. Commands of a block share the folder (a `convert` then a `diff` of its output).
- A command continues on the next line after a trailing backslash.
- Exit status: 0 unless the command line says `# exit N`; a command followed by `$ echo $?`
  may exit with anything, since the echo's output checks it.
- Output matches line for line after this normalisation and nothing else: trailing spaces are
  dropped (tables pad their last column), trailing blank lines too, and the scratch folder's
  absolute path reads `/tmp/demo`. A line that is only `…` (indented or not) stands for any number of lines
  (an example shows the head of a long listing).
- `CKPT_UPDATE_DOCS=1 pytest tests/test_docs_examples.py` rewrites each block's outputs with
  what the commands print now (keeping each `…` line, as many lines before and after them as
  before, and the lines between two `…` that the output still has), so
  a change of output is refreshed by running it, never by hand.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ELLIPSIS = "…"
#: the scratch folder's absolute path, as examples show it
SCRATCH_SHOWN = "/tmp/demo"
MARKER = re.compile(r"<!--\s*fixture:\s*([a-z0-9_-]+)((?:\s*;\s*[a-z]+)*)\s*-->")
EXIT_COMMENT = re.compile(r"#[^\n]*?\bexit\s+(\d+)\b")


@dataclass
class Step:
    """One `$ command` of an example and the output written under it."""

    command: str
    expected: list[str]

    @property
    def expected_exit(self) -> int:
        """The exit status the example states: `# exit N` on the command line, else 0."""
        found = EXIT_COMMENT.search(self.command)
        return int(found.group(1)) if found else 0


@dataclass
class Example:
    """One console block: where it is, the fixture it runs in, its steps."""

    path: Path
    line: int  # of the opening fence, 1-based
    fixture: str | None
    flags: set[str]
    text: str  # the block's lines between the fences, as written
    steps: list[Step] = field(default_factory=list)
    malformed: str | None = None  # why the block is no transcript, if it is not

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def parse_steps(body: list[str]) -> list[Step]:
    """The `$ ` commands of a block (joined across trailing backslashes) and their outputs."""
    steps: list[Step] = []
    lines = iter(body)
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):  # bash reads the backslash-newline as one line
                command = command + "\n" + next(lines, "")
            steps.append(Step(command, []))
        elif steps:
            steps[-1].expected.append(line)
        else:
            raise ValueError(f"output before the first `$ ` command: {line!r}")
    return steps


def find_examples(path: Path) -> list[Example]:
    """Every console block of one markdown file."""
    lines = path.read_text().split("\n")
    examples: list[Example] = []
    fence: str | None = None
    for number, line in enumerate(lines, 1):
        if fence is not None:
            if line.strip() == fence:
                fence = None
            continue
        opening = re.match(r"^(\s*)(`{3,})(\S*)", line)
        if not opening:
            continue
        fence = opening.group(2)
        if opening.group(3) != "console":
            continue
        end = next(i for i in range(number, len(lines)) if lines[i].strip() == fence)
        before = next((lines[i] for i in range(number - 2, -1, -1) if lines[i].strip()), "")
        marker = MARKER.search(before)
        body = lines[number:end]
        example = Example(
            path,
            number,
            marker.group(1) if marker else None,
            {flag.strip() for flag in marker.group(2).split(";") if flag.strip()}
            if marker
            else set(),
            "\n".join(body),
        )
        try:
            example.steps = parse_steps(body)
        except ValueError as error:
            example.malformed = str(error)
        examples.append(example)
    return examples


def normalise(output: str, scratch: Path) -> list[str]:
    """The documented normalisation: the scratch path, trailing spaces and blank lines."""
    text = output.replace(str(scratch.resolve()), SCRATCH_SHOWN).replace(
        str(scratch), SCRATCH_SHOWN
    )
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line-for-line equality, a `…` line standing for any number of lines."""
    expected = [line.rstrip() for line in expected]
    while expected and not expected[-1]:
        expected.pop()
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line.strip() == ELLIPSIS else re.escape(line) + r"\n"
        for line in expected
    )
    return re.fullmatch(pattern, "".join(line + "\n" for line in actual)) is not None


def refreshed(expected: list[str], actual: list[str]) -> list[str]:
    """What a step's output becomes under CKPT_UPDATE_DOCS=1: the actual output, shortened to
    the head and tail the example showed around its `…`; lines it showed between two `…` are
    kept where the output still has them in that order."""
    marks = [i for i, line in enumerate(expected) if line.strip() == ELLIPSIS]
    if not marks:
        return actual
    head, tail = marks[0], len(expected) - 1 - marks[-1]
    if head + tail >= len(actual):
        return actual
    out = [*actual[:head], expected[marks[0]]]
    position = head
    for start, end in itertools.pairwise(marks):
        group = expected[start + 1 : end]
        found = next(
            (
                i
                for i in range(position, len(actual) - tail - len(group) + 1)
                if actual[i : i + len(group)] == group
            ),
            None,
        )
        if group and found is not None:
            out += [*group, expected[end]]
            position = found + len(group)
    return out + (actual[len(actual) - tail :] if tail else [])


@dataclass
class StepResult:
    step: Step
    exit_code: int
    output: list[str]


def command_env(scratch: Path, bin_dir: Path) -> dict[str, str]:
    """The environment the examples run in: this checkout's ckpt first on PATH, no CKPT_*
    switches from the caller's shell, an empty Hugging Face cache, offline unless a fixture
    serves a Hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "HF_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        PYTHONIOENCODING="utf-8",
        HF_HOME=str(scratch.parent / "hf-home"),
        HF_HUB_OFFLINE="1",
        TZ="UTC",
    )
    env.pop("COLUMNS", None)
    return env


def ckpt_wrapper(bin_dir: Path) -> None:
    """`ckpt` on PATH: the real `python -m ckpt_cli` of this checkout; `python` is the
    suite's own interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    # a script, not a link: a link to a virtualenv's interpreter from elsewhere is no venv
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    script = bin_dir / "ckpt"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckpt_cli "$@"\n')
    script.chmod(0o755)


def run_example(
    example: Example, scratch: Path, env: dict[str, str], timeout: float = 600
) -> list[StepResult]:
    """Run every step of `example` in `scratch`; `$?` carries over from step to step."""
    results: list[StepResult] = []
    previous = 0
    for step in example.steps:
        proc = subprocess.run(
            ["bash", "-c", f"(exit {previous}); {step.command}"],
            cwd=scratch,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        previous = proc.returncode
        results.append(StepResult(step, proc.returncode, normalise(proc.stdout, scratch)))
    return results


def problems(example: Example, results: list[StepResult]) -> list[str]:
    """Every way the run differs from the example (exit status, output), one message each."""
    found: list[str] = []
    for index, result in enumerate(results):
        step = result.step
        echoed = index + 1 < len(example.steps) and example.steps[index + 1].command.strip() in (
            "echo $?",
        )
        if not echoed and result.exit_code != step.expected_exit:
            found.append(
                f"$ {step.command}\n  exit {result.exit_code}, the example says "
                f"{step.expected_exit}\n  output:\n" + "\n".join(result.output)
            )
        if not matches(step.expected, result.output):
            found.append(
                f"$ {step.command}\n  --- the example\n"
                + "\n".join(step.expected)
                + "\n  --- the command now\n"
                + "\n".join(result.output)
            )
    return found


def rewrite(example: Example, results: list[StepResult]) -> None:
    """Replace the block's outputs in its file with what the commands printed now."""
    lines: list[str] = []
    for result in results:
        lines.append("$ " + result.step.command)
        lines.extend(refreshed(result.step.expected, result.output))
    new_text = "\n".join(lines)
    document = example.path.read_text()
    if document.count(example.text) != 1:
        raise RuntimeError(f"{example.id}: the block is not unique in its file; cannot rewrite")
    example.path.write_text(document.replace(example.text, new_text))


# --- fixtures: what a block's scratch folder holds before its first command -----------------


def build_demo(dest: Path) -> None:
    """`make demo`'s checkpoints: build/demo/{model, checkpoint-4, run}, written as `make demo`
    writes them, from the folder above `build/` (the Trainer's `training_args.bin` records the
    output folder as given, so its size, and the sizes the examples show, follow the path)."""
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_demo.py"), "build/demo"],
        check=True,
        capture_output=True,
        cwd=dest,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def build_empty(dest: Path) -> None:
    """An empty folder."""


def build_examples(dest: Path) -> None:
    """The repository's `examples/` folder, so `python examples/...` runs as in a checkout."""
    (dest / "examples").symlink_to(REPO / "examples")


def build_restart_without_rng(dest: Path) -> None:
    """`examples/restart_test` run with the RNG left out of its saves: `restart/straight/` and
    `restart/resumed/`, whose final steps differ (the driver exits 1 saying so)."""
    driver = REPO / "examples" / "restart_test" / "run.py"
    subprocess.run(
        [sys.executable, str(driver), "restart", "--omit", "rng"],
        cwd=dest,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if not (dest / "restart" / "resumed" / "step-24").exists():
        raise RuntimeError("examples/restart_test did not finish its resumed run")


TIED_WEIGHTS_WRITER = """
import sys, torch
torch.manual_seed(0)
wte = torch.randn(64, 16)
state = {"transformer.wte.weight": wte, "lm_head.weight": wte}  # one storage, two names
for i in range(2):
    for name in ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                 "mlp.c_proj.weight", "ln_2.weight", "ln_2.bias", "ln_1.bias"):
        state[f"transformer.h.{i}.{name}"] = torch.randn(16, 16)
state["transformer.ln_f.weight"] = torch.ones(16)
torch.save(state, sys.argv[1])
"""


def build_tied(dest: Path) -> None:
    """`shared.pt`: a torch.save state dict with GPT-2's tied input and output embeddings (one
    storage under `transformer.wte.weight` and `lm_head.weight`), written by torch.save."""
    subprocess.run(
        [sys.executable, "-c", TIED_WEIGHTS_WRITER, str(dest / "shared.pt")],
        check=True,
        capture_output=True,
    )


def build_fp8(dest: Path) -> None:
    """A DeepSeek-V3-style block-FP8 checkpoint (`DeepSeek-tiny-FP8/`: two shards, each weight
    with its `weight_scale_inv`, and the `quantization_config`), the bf16 model it was quantized
    from (`full-precision/`), and a copy that lost one scale (`DeepSeek-tiny-FP8-no-scale/`)."""
    from safetensors.torch import load_file, save_file

    from .test_quant import fp8_source, hf_shards, write_fp8_block

    full = fp8_source()
    write_fp8_block(dest / "DeepSeek-tiny-FP8", full)
    # the source's own config: the FP8 one's but for its quantization_config
    source_config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
    }
    hf_shards(dest / "full-precision", [full], source_config)
    broken = dest / "DeepSeek-tiny-FP8-no-scale"
    write_fp8_block(broken, full)
    lost = "model.layers.1.mlp.down_proj.weight_scale_inv"
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = broken / index["weight_map"].pop(lost)
    tensors = load_file(shard)
    index["metadata"]["total_size"] -= tensors[lost].numel() * tensors[lost].element_size()
    del tensors[lost]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))


def torchrun_in(folder: Path, script: str, *args: str, timeout: int = 600) -> None:
    """`torchrun --standalone --nproc-per-node 2 tests/SCRIPT ARGS` run in `folder`, so the
    paths the saves record are the relative ones the examples show, whatever the temporary
    folder is called."""
    from .dist_helpers import require_torchrun_marker, run_launch, torchrun_command, torchrun_env

    require_torchrun_marker()
    command = torchrun_command(2, REPO / "tests" / script, *args)
    proc = run_launch(command, timeout, env=torchrun_env(), cwd=folder)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {script} {args} failed:\n{proc.stdout}{proc.stderr}")


def build_step_200(dest: Path) -> None:
    """`step-200/`: a DCP training save of 2 ranks under torchrun (model, AdamW state, a step
    counter, and per-rank RNG and data-loader state), by tests/reshard_worker.py."""
    torchrun_in(dest, "reshard_worker.py", "save", "step-200")
    (dest / "step-200.expected.pt").unlink()


def build_trainer_fsdp(dest: Path) -> None:
    """`run/checkpoint-2/`: a transformers Trainer run with FSDP2 on 2 ranks (torchrun, CPU),
    saved by the Trainer's own code (tests/trainer_fsdp_script.py)."""
    torchrun_in(dest, "trainer_fsdp_script.py", "train", "run")


def build_lora(dest: Path) -> None:
    """`base/`: a 2-layer Llama saved by transformers' `save_pretrained`, and `adapter/`: a
    LoRA adapter on it (r=4, alpha=8, q_proj and v_proj) saved by peft."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(dest / "base")
    torch.manual_seed(1)
    base = LlamaForCausalLM.from_pretrained(dest / "base")
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(base, config).save_pretrained(dest / "adapter")


def doctor_case(kind: str, case: str, dest: Path, name: str) -> None:
    """One case of tests/doctor_jobs.py (a real tiny job resumed with one fault planted, or
    none) copied to `dest/name`, file times kept (the doctor reads them)."""
    jobs = dest.parent / f"{dest.name}-jobs"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("HF_ENDPOINT", None)
    subprocess.run(
        [sys.executable, "-m", "tests.doctor_jobs", kind, str(jobs)],
        check=True,
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    shutil.copytree(jobs / case, dest / name, symlinks=True)


def build_doctor_trainer(dest: Path) -> None:
    """`out/`: a transformers Trainer run resumed from checkpoint-4 by a trainer that skipped
    loading the optimizer (tests/doctor_jobs.py, case skip_optimizer)."""
    doctor_case("trainer", "skip_optimizer", dest, "out")


def build_doctor_dcp(dest: Path) -> None:
    """`run/`: a plain DCP loop resumed at step 4 on 1 rank of batch 4 after 2 ranks of batch 2,
    the global batch kept (tests/doctor_jobs.py, case clean_world_size)."""
    doctor_case("dcp", "clean_world_size", dest, "run")


#: servers fixtures started (the test Hub), stopped when the session ends
SERVICES: list[Callable[[], None]] = []


def build_hub(dest: Path) -> dict[str, str]:
    """A test Hub (tests/hub_server.py, a real HTTP server on 127.0.0.1) serving the demo's
    sharded model as `org/model` (branch main, tag v1.0) with a config and a tokenizer; the
    examples' environment points HF_ENDPOINT at it and lets huggingface_hub go online."""
    from huggingface_hub import save_torch_state_dict

    from .hub_fixtures import CONFIG_JSON, TOKENIZER_JSON
    from .hub_server import TestHub

    sys.path.insert(0, str(REPO / "examples"))
    try:
        from make_demo import tiny_transformer_state
    finally:
        sys.path.remove(str(REPO / "examples"))
    folder = dest.parent / f"{dest.name}-hub-repo"
    folder.mkdir()
    save_torch_state_dict(tiny_transformer_state(), folder, max_shard_size="100KB")
    (folder / "config.json").write_bytes(CONFIG_JSON)
    (folder / "tokenizer.json").write_bytes(TOKENIZER_JSON)
    server = TestHub().start()
    SERVICES.append(server.stop)
    server.add_repo("org/model", folder, tags=("v1.0",))
    return {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0"}


def build_s3(dest: Path) -> dict[str, str]:
    """The demo (`build/demo/`), and an empty bucket `s3://bucket/` in moto's S3 server run as
    its own process on 127.0.0.1 (its own state: other tests' moto servers never touch it); the
    examples' environment points the AWS clients at it."""
    import socket
    import time

    import boto3

    build_demo(dest)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        server.terminate()
        server.wait(timeout=30)

    SERVICES.append(stop)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="bucket")
    return env


def build_llama_hf(dest: Path) -> None:
    """`llama-hf/`: a tiny Llama in Hugging Face names (2 layers, 4 heads over 2 KV heads of
    8, seeded random weights) with its `config.json`, as `save_pretrained` lays one out."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, head_dim, dim, vocab, ffn, layers = 4, 2, 8, 32, 64, 48, 2
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, dim, generator=gen)}
    for i in range(layers):
        shapes = {
            "self_attn.q_proj.weight": (heads * head_dim, dim),
            "self_attn.k_proj.weight": (kv_heads * head_dim, dim),
            "self_attn.v_proj.weight": (kv_heads * head_dim, dim),
            "self_attn.o_proj.weight": (dim, heads * head_dim),
            "mlp.gate_proj.weight": (ffn, dim),
            "mlp.up_proj.weight": (ffn, dim),
            "mlp.down_proj.weight": (dim, ffn),
            "input_layernorm.weight": (dim,),
            "post_attention_layernorm.weight": (dim,),
        }
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}"] = torch.randn(*shape, generator=gen)
    tensors["model.norm.weight"] = torch.randn(dim, generator=gen)
    tensors["lm_head.weight"] = torch.randn(vocab, dim, generator=gen)
    folder = dest / "llama-hf"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "intermediate_size": ffn,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


FIXTURES: dict[str, Callable[[Path], dict[str, str] | None]] = {
    "demo": build_demo,
    "empty": build_empty,
    "examples": build_examples,
    "restart-norng": build_restart_without_rng,
    "tied": build_tied,
    "fp8": build_fp8,
    "step-200": build_step_200,
    "trainer-fsdp": build_trainer_fsdp,
    "hub": build_hub,
    "s3": build_s3,
    "lora": build_lora,
    "doctor-trainer": build_doctor_trainer,
    "doctor-dcp": build_doctor_dcp,
    "llama-hf": build_llama_hf,
}


def copy_fixture(source: Path, dest: Path) -> None:
    """A fresh copy of a built fixture, modification times kept (run tables show them)."""
    shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
