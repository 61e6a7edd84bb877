"""The JSON Schema of the `--json` envelope, generated from pydantic models.

`python -m ckpt_cli.cli.render.schema [FILE]` writes it (default `schema/ckpt-json.schema.json`);
a test regenerates it and fails when the committed copy is stale, and validates every
command's `--json` output against it. The `result` member is described per command from the
command's report model; a command without one listed here gets an unconstrained `result`.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from ...models import Record
from . import JSON_VERSION

#: a URN, not a URL: the schema ships in the repository and the package, not on a server
SCHEMA_ID = "urn:ckpt-cli:ckpt-json:1"
DEFAULT_PATH = Path("schema") / "ckpt-json.schema.json"

#: command -> the report model(s) its `result` is, as "module:Class" (one of them)
RESULT_MODELS: dict[str, list[str]] = {
    "inspect": ["ckpt_cli.ops.inspect:InspectReport"],
    "verify": ["ckpt_cli.ops.verify.report:VerifyReport"],
    "convert": ["ckpt_cli.ops.convert.run:ConvertReport"],
    "reshard": ["ckpt_cli.ops.reshard.run:ReshardReport"],
    "prune": [
        "ckpt_cli.ops.prune.retention:PruneReport",
        "ckpt_cli.ops.prune.retention:WatchReport",
    ],
    "latest": ["ckpt_cli.sources.runs:RunReport"],
    "download": ["ckpt_cli.ops.download:DownloadReport"],
    "diff": ["ckpt_cli.ops.diff.run:DiffReport"],
    "doctor": ["ckpt_cli.ops.doctor.models:DoctorReport"],
    "sync": ["ckpt_cli.ops.sync.model:SyncReport"],
    "merge": ["ckpt_cli.ops.merge:MergeReport"],
    "protect": ["ckpt_cli.ops.parity.model:ProtectReport"],
    "repair": ["ckpt_cli.ops.parity.model:RepairReport"],
}


class ErrorObject(Record):
    """Why a run exited non-zero: present whenever `exit_code` is not 0."""

    model_config = ConfigDict(extra="allow")

    code: str = Field(description="Stable error code: usage, not_found, bad_checkpoint, ...")
    exit_code: int = Field(description="The process exit status (DESIGN.md table).")
    message: str = Field(description="The full human message: path, problem and fix.")
    path: str | None = Field(description="The file or location concerned, if any.")
    problem: str = Field(description="What is wrong.")
    fix: str | None = Field(description="What to do about it.")


class Envelope(Record):
    """The one JSON document every `ckpt ... --json` run prints on stdout, whatever happens."""

    ckpt_json: Literal[1] = Field(description="Version of this envelope.")
    command: str = Field(description="The subcommand, or `ckpt` when none was recognised.")
    ok: bool = Field(description="True exactly when exit_code is 0.")
    exit_code: int = Field(description="The process exit status.")
    result: Any = Field(description="The command's report (null when it failed before one).")
    error: ErrorObject | None = Field(description="Why the exit is non-zero; null on success.")


def _model(path: str) -> type[BaseModel]:
    module, name = path.split(":")
    model: type[BaseModel] = getattr(importlib.import_module(module), name)
    return model


def json_schema() -> dict[str, Any]:
    """The envelope's JSON Schema (2020-12), with each command's result described."""
    fields: dict[str, Any] = {}
    for command, paths in RESULT_MODELS.items():
        models = [_model(p) for p in paths]
        fields[command] = (models[0] if len(models) == 1 else models[0] | models[1], None)
    holder = create_model("Results", **fields)  # one schema, shared $defs
    results = holder.model_json_schema(mode="serialization", ref_template="#/$defs/{model}")
    schema = Envelope.model_json_schema(mode="serialization", ref_template="#/$defs/{model}")
    defs = {**results.get("$defs", {}), **schema.pop("$defs", {})}
    conditions = []
    for command, prop in results["properties"].items():
        spec = {k: v for k, v in prop.items() if k not in ("default", "title")}
        conditions.append(
            {
                "if": {"properties": {"command": {"const": command}}, "required": ["command"]},
                "then": {"properties": {"result": {"anyOf": [spec, {"type": "null"}]}}},
            }
        )
    # a non-zero exit always carries an error object; a zero exit never does
    top_if = {
        "if": {"properties": {"exit_code": {"const": 0}}},
        "then": {"properties": {"ok": {"const": True}, "error": {"type": "null"}}},
        "else": {"properties": {"ok": {"const": False}, "error": {"$ref": "#/$defs/ErrorObject"}}},
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        **schema,
        "properties": {**schema["properties"], "ckpt_json": {"const": JSON_VERSION}},
        "allOf": [top_if, *conditions],
        "$defs": defs,
    }


def render_schema() -> str:
    """The schema file's text."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the schema to the path given (default schema/ckpt-json.schema.json)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_schema())


if __name__ == "__main__":
    main()
