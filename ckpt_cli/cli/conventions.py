"""The command conventions every `ckpt` subcommand follows, applied by `CkptTyper`.

Metavars, the Hub options (`--revision`, `--repo-type`, `--token`), the deprecated spellings
still accepted, closed-pipe handling and the parser-error envelopes; `ckpt_cli.cli.app` builds
the app with them.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Generic, NoReturn, TypeVar

import typer
import typer.core
import typer.models
from typer._coercion import RuntimeParam, build_runtime_param

from ..errors import CkptError, UsageError
from ..storage.uri import is_hub_url, with_hub_options

T = TypeVar("T")
V = TypeVar("V")

# --- the conventions every command gets (issue #13) ------------------------------------------
#
# Commands register with `@app.command(...)` as before; `CkptTyper.command` adds, to every
# command, present and future: `-q/--quiet` and `-v/--verbose`, the Hub options where a
# command takes a SRC, and real metavars in help.
# `CkptGroup.main` makes parser errors one-line messages (and one JSON envelope with --json)
# and a closed stdout pipe a quiet exit 141.

#: the metavar help shows for an option's value, by long name; others fall back on the type
METAVARS: dict[str, str] = {
    "--to": "FMT",
    "--format": "FMT",
    "--format-a": "FMT",
    "--format-b": "FMT",
    "--max-shard-size": "SIZE",
    "--dtype": "DTYPE",
    "--filter": "GLOB",
    "--filter-out": "GLOB",
    "--include": "GLOB",
    "--exclude": "GLOB",
    "--rename": "OLD=NEW",
    "--select": "PREFIX",
    "--world-size": "N",
    "--manifest": "PATH",
    "--algo": "ALGO",
    "--settle": "DURATION",
    "--watch": "DURATION",
    "--keep-last": "N",
    "--keep-every": "K",
    "--keep-best": "METRIC",
    "--keep": "STEP",
    "--shard-dim": "GLOB=DIM",
    "--plan": "FILE",
    "--revision": "REV",
    "--repo-type": "TYPE",
    "--token": "TOKEN",
    "--atol": "TOL",
    "--rtol": "TOL",
    "--max-iterations": "N",
    "--dcp-serialization": "KIND",
    "--dcp-compression": "zstd|none",
    "--rank-state": "POLICY",
    "--parity": "K",
    "--naming": "NAMING",
}

#: values the shell completions offer, by long option name (enums complete their own choices)
#: (tests/test_cli_shell.py holds them to the format registry and the namings)
OPTION_VALUES: dict[str, list[str]] = {
    "--to": ["safetensors", "dcp", "torch", "hf", "torchtitan", "megatron"],
    "--format": ["safetensors", "dcp", "torch", "hub", "gguf"],
    "--format-a": ["safetensors", "dcp", "torch", "hub", "gguf"],
    "--format-b": ["safetensors", "dcp", "torch", "hub", "gguf"],
    "--dtype": ["bf16", "fp16", "fp32"],
    "--algo": ["sha256", "blake3", "xxh3"],
    "--dcp-serialization": ["torch_save", "safetensors"],
    "--dcp-compression": ["zstd", "none"],
    "--expect": [
        "batch",
        "world-size",
        "precision",
        "config",
        "tokenizer",
        "scheduler",
        "optimizer",
        "optimizer-settings",
        "data",
        "rng",
        "ema",
        "scaler",
        "schedule",
        "grad-clip",
    ],
    "--rank-state": ["keep", "drop", "replicate"],
    "--naming": ["auto", "off", "hf", "torchtitan", "megatron"],
    "--repo-type": ["model", "dataset", "space"],
}

# --- deprecated spellings ----------------------------------------------------------------------
#
# An option name means one thing in every command. When a name had to change for that, its old
# spelling keeps working for a while: hidden from help and completions, saying once on stderr
# (never on stdout, so never in the --json document) which option replaces it.


class DeprecatedOption(Generic[V]):
    """An old option spelling still accepted, each of its values replaced by a visible option.

    Attributes:
        name: the old spelling (`--mode`).
        replacements: each old value -> (the option that replaces it, the value that option
            gives the command's parameter): `"max" -> ("--higher-is-better", True)`.
    """

    def __init__(self, name: str, replacements: Mapping[str, tuple[str, V]]) -> None:
        self.name = name
        self.replacements = dict(replacements)

    def resolve(self, command: str, old: str | None, new: V | None) -> V | None:
        """The value the command line chose: `new` (the replacing option's, None when not
        given), or what `old` (the deprecated option's, None when not given) means.

        The old spelling prints one deprecation line on stderr (silenced by --quiet, as every
        warning); old and new spellings that disagree are a UsageError (exit 2).
        """
        if old is None:
            return new
        spelling, meant = self.replacements[old]
        if new is not None and new != meant:
            given = next(s for s, value in self.replacements.values() if value == new)
            raise UsageError(
                f"{self.name} {old} and {given} contradict each other "
                f"({self.name} {old} is the deprecated spelling of {spelling})",
                fix=f"Leave {self.name} out and keep {given} or {spelling}.",
            )
        from . import render

        render.warn(command, f"{self.name} {old} is deprecated and will be removed: use {spelling}")
        return meant


#: `prune` / `sync --mode min|max`: `download --mode` is how to fetch (shards|tensors)
BEST_END_MODE = DeprecatedOption(
    "--mode", {"min": ("--lower-is-better", False), "max": ("--higher-is-better", True)}
)

#: every hidden option of the app: (command, old spelling) -> what replaces it
#: (tests/test_conventions.py holds the app's hidden options to this table)
DEPRECATED_OPTIONS: dict[tuple[str, str], DeprecatedOption[Any]] = {
    ("prune", "--mode"): BEST_END_MODE,
    ("sync", "--mode"): BEST_END_MODE,
}

#: parameter names whose value is a checkpoint location (they get --revision/--repo-type/--token)
LOCATION_PARAMS = ("src", "a", "b", "run_dir", "base", "adapter")

QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="Print nothing on stderr but errors: no progress, warnings or notes."
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Say more on stderr: the error code and exit status, timings, and the traceback "
        "of an internal error.",
    ),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--revision",
        help="Hub SRC: branch, tag or commit to read (as hf download; same as hf://org/repo@REV).",
    ),
]
RepoTypeOpt = Annotated[
    str | None,
    typer.Option("--repo-type", help="Hub SRC: model (default), dataset or space."),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="Hub SRC: the access token (default: HF_TOKEN or the saved login)."
    ),
]


def _long_name(info: Any) -> str | None:
    # typer keeps an Annotated Option's first name in `default`, the others in `param_decls`
    decls = [info.default, *(info.param_decls or ())]
    names = [n for n in decls if isinstance(n, str) and n.startswith("--")]
    return names[0] if names else None


def _fallback_metavar(base: Any, long: str | None, name: str) -> str:
    if base is int:
        return "N"
    if base is float:
        return "NUMBER"
    if isinstance(base, type) and issubclass(base, PurePath):
        return "PATH"
    return (long or name).lstrip("-").replace("-", "_").upper()


def _base_type(annotation: Any) -> Any:
    # `list[str] | None` -> str; `int | None` -> int
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (list, tuple) and args:
        return args[0]
    if len(args) == 1 and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    return annotation


def _with_metavar(name: str, annotation: Any) -> Any:
    """The parameter's annotation with a real metavar on its typer Option/Argument."""
    if typing.get_origin(annotation) is not Annotated:
        return annotation
    base, *extras = typing.get_args(annotation)
    changed = []
    for info in extras:
        if isinstance(info, typer.models.ArgumentInfo) and info.metavar is None:
            info = copy.copy(info)
            info.metavar = name.upper()
        elif isinstance(info, typer.models.OptionInfo) and info.metavar is None:
            inner = _base_type(base)
            is_flag = (
                inner is bool or getattr(info, "is_flag", None) or getattr(info, "count", False)
            )
            is_enum = isinstance(inner, type) and issubclass(inner, enum.Enum)
            if not is_flag and not is_enum:
                info = copy.copy(info)
                long = _long_name(info)
                info.metavar = METAVARS.get(long or "", "") or _fallback_metavar(inner, long, name)
        if isinstance(info, typer.models.OptionInfo) and info.autocompletion is None:
            values = OPTION_VALUES.get(_long_name(info) or "")
            if values:
                # `ckpt --install-completion` (typer's own, asking ckpt at each Tab) offers
                # the values the static scripts of completions/ offer
                info = copy.copy(info)
                info.autocompletion = _offering(values)
        changed.append(info)
    return Annotated[(base, *changed)]


def _offering(values: list[str]) -> Callable[[str], list[str]]:
    """A typer autocompletion callback offering `values` that start with what was typed."""

    def complete(incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]

    return complete


def hub_hint(text: str) -> str | None:
    """`did you mean hf://org/repo?` for a bare `org/repo` that names no local path.

    Called only once SRC was not found (no such path and no cached snapshot), so it is a hint,
    never a guess that changes what is read.
    """
    if "://" in text or text.startswith(("/", ".", "~")) or os.path.exists(text):
        return None
    parts = text.split("@", 1)[0].split("/")
    if os.path.exists(parts[0]):
        return None  # a file missing from a local folder (`model/ckpt-manifest.json`)
    if len(parts) == 2 and all(re.fullmatch(r"[A-Za-z0-9][\w.-]*", p) for p in parts):
        return f"did you mean hf://{text}?"
    return None


def _conventions(function: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Wrap a command function: -q/-v, Hub options for its SRC, metavars (see above).

    `name` is the command's name when it is not the function's (`@app.command("sync")`).
    """
    command_name = name or function.__name__.replace("_", "-")
    signature = inspect.signature(function, eval_str=True)
    hints = typing.get_type_hints(function, include_extras=True)
    params = [
        p.replace(annotation=_with_metavar(p.name, hints.get(p.name, p.annotation)))
        for p in signature.parameters.values()
    ]
    taken = {p.name for p in params}
    locations = [name for name in LOCATION_PARAMS if name in taken]
    # a command that defines its own --quiet/--verbose keeps them (and must mean the same)
    extra: list[tuple[str, Any]] = [
        (name, opt)
        for name, opt in (("ckpt_quiet", QuietOpt), ("ckpt_verbose", VerboseOpt))
        if name.removeprefix("ckpt_") not in taken
    ]
    if locations and "revision" not in taken:
        extra += [
            ("ckpt_revision", RevisionOpt),
            ("ckpt_repo_type", RepoTypeOpt),
            ("ckpt_token", TokenOpt),
        ]
    default = {"ckpt_quiet": False, "ckpt_verbose": False}
    for name, annotation in extra:
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=_with_metavar(name, annotation),
                default=default.get(name),
            )
        )

    @functools.wraps(function)
    def command(*args: Any, **kwargs: Any) -> Any:
        from . import render

        quiet = kwargs.pop("ckpt_quiet", False)
        verbose = kwargs.pop("ckpt_verbose", False)
        revision = kwargs.pop("ckpt_revision", None)
        repo_type = kwargs.pop("ckpt_repo_type", None)
        token = kwargs.pop("ckpt_token", None)
        json_output = bool(kwargs.get("json_output"))
        try:
            if quiet and verbose:
                raise UsageError("--quiet and --verbose contradict each other", fix="Pick one.")
            render.set_verbosity(-1 if quiet else 1 if verbose else 0)
            given = [n for n in locations if isinstance(kwargs.get(n), str)]
            # with two locations (diff A B) the Hub options apply to the hf:// one(s)
            hub = [n for n in given if is_hub_url(kwargs[n])] if len(given) > 1 else given
            for location in hub or given[:1]:
                kwargs[location] = with_hub_options(kwargs[location], revision, repo_type)
            named = [
                str(v)
                for value in kwargs.values()
                for v in (value if isinstance(value, (list, tuple)) else [value])
                if isinstance(v, str)
            ]
            if token is not None and not any(is_hub_url(v) for v in named):
                # as --revision is: a token for no Hub location would be silently unused
                raise UsageError(
                    "--token applies to a Hub location (hf://…), and this command names none",
                    fix="Leave --token out (object stores take their credentials from their "
                    "usual environment and config), or name an hf:// location.",
                )
        except CkptError as error:
            render.emit_error(command_name, error, json_output)
            raise typer.Exit(error.exit_code) from None
        if token is None:
            return function(*args, **kwargs)
        # huggingface_hub and ckpt's Hub settings read the token from the environment; put it
        # back afterwards so an in-process caller's environment is left as it was
        saved = os.environ.get("HF_TOKEN")
        os.environ["HF_TOKEN"] = token
        try:
            return function(*args, **kwargs)
        finally:
            if saved is None:
                os.environ.pop("HF_TOKEN", None)
            else:
                os.environ["HF_TOKEN"] = saved

    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer reads the signature above, not the original's
    return command


@dataclasses.dataclass(frozen=True)
class PlainValues(RuntimeParam):
    """Typer's coercion of an option or argument, without building a pydantic adapter for a
    value that is already what the annotation asks for.

    typer 0.29 builds a pydantic `TypeAdapter` for every parameter of the command being run,
    given or not, before it coerces its value: for `inspect` 11 of them, about a tenth of a
    metadata command's CPU (#30). The values the parser hands over are mostly of their type
    already: a `str` for `str`, a `bool` flag, a default `int`, a tuple of `str` for
    `list[str]`. Those are returned as typer's adapter would return them; any other value
    (`--keep-last 3` arrives as the text "3") goes to typer's own coercion, built then, so that
    its conversions and messages stay typer's.
    """

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        kind = self.annotation
        if kind is str and isinstance(value, str):
            return value
        bounded = self.parameter_info.min is not None or self.parameter_info.max is not None
        if kind in (bool, int, float) and type(value) is kind and not bounded:
            return value
        if (
            kind == list[str]
            and isinstance(value, (list, tuple))
            and all(isinstance(item, str) for item in value)
        ):
            return list(value)
        return build_runtime_param(param.type_descriptor)._coerce_value(value, param, ctx)


#: the annotations `PlainValues` takes (others, e.g. enums and paths, keep typer's adapters)
_PLAIN_ANNOTATIONS: tuple[Any, ...] = (str, bool, int, float, list[str])


def coerce_plain_values(params: Iterable[Any]) -> None:
    """Give each plain parameter of `params` `PlainValues`, before its values are parsed."""
    for param in params:
        if not isinstance(param, (typer.core.TyperOption, typer.core.TyperArgument)):
            continue
        described = param.type_descriptor
        if (
            param._runtime_param is None
            and described.annotation in _PLAIN_ANNOTATIONS
            and described.parameter_info.parser is None
            and described.file_annotation is None
        ):
            param._runtime_param = PlainValues(
                parameter_info=described.parameter_info, annotation=described.annotation
            )


class PlainHelpOption:
    """Mixin for typer's commands and groups: `--help`, which typer makes on first use, is a
    plain flag too."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        coerce_plain_values([option])
        return option


class CkptGroup(PlainHelpOption, typer.core.TyperGroup):
    """The root command: parser errors as one line (or one JSON envelope), EPIPE as exit 141."""

    #: the command line being run (set by `main`), for what is reported before a command runs
    argv: ClassVar[list[str]] = []

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        coerce_plain_values(self.params)
        try:
            return super().make_context(*args, **kwargs)
        except OSError as exc:  # the help on stdout: `ckpt --help | head -1`, `> /dev/full`
            _output_failed(exc)
        except KeyboardInterrupt as exc:  # a signal while the arguments are parsed
            raise typer.Exit(_interrupted(exc, self.argv)) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # `ckpt inspect X --list | head -1`
            _closed_pipe()
        except KeyboardInterrupt as exc:  # a signal before `run_command` (modules importing)
            raise typer.Exit(_interrupted(exc, self.argv)) from None

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        # a parser error comes before any command sets the verbosity; reset a previous run's
        # (in-process callers). Not imported for nothing: rich costs `ckpt --help` a third
        # of its start-up, and the module's own default is 0
        render = sys.modules.get(f"{__package__}.render")
        if render is not None:
            render.set_verbosity(0)
        argv = list(sys.argv[1:] if args is None else args)
        CkptGroup.argv = argv
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            code = 130
        except Exception as exc:
            if not _is_parser_error(exc):
                raise
            try:
                code = _report_parser_error(exc, argv)
            except OSError as failed:  # its envelope or the help on a stdout that refuses
                _output_failed(failed)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _interrupted(exc: KeyboardInterrupt | None, argv: list[str]) -> int:
    """The exit code of a signal that reached typer rather than `run_command`, its message on
    stderr (and with `--json` its envelope): 143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C.

    A command module or its operation still importing (a loaded machine makes that seconds),
    or arguments being parsed: typer would map every `KeyboardInterrupt`, SIGTERM's and
    SIGHUP's too (`faults.Signalled`), to 130 and say nothing.
    """
    from .. import faults
    from .render import emit_early_interruption

    error = faults.interruption(exc)
    emit_early_interruption(error, argv)
    return error.exit_code


def _closed_pipe() -> NoReturn:
    from .render import closed_pipe_exit

    closed_pipe_exit()


def _output_failed(exc: OSError) -> NoReturn:
    from .render import output_failed

    output_failed("ckpt", exc, what="the help or the usage error")


def _is_parser_error(exc: BaseException) -> bool:
    # click's ClickException, recognised by its interface (typer re-exports no base class)
    return isinstance(getattr(exc, "exit_code", None), int) and hasattr(exc, "format_message")


def _report_parser_error(exc: Any, argv: list[str]) -> int:
    """A usage error from the parser: one line on stderr, one envelope with --json; exit 2."""
    from . import render

    ctx = getattr(exc, "ctx", None)
    command = "ckpt"  # the root's own error (no such command): no subcommand was recognised
    if ctx is not None and getattr(ctx, "parent", None) is not None:
        command = ctx.info_name or "ckpt"
    elif ctx is None:
        command = render.command_of(argv) or "ckpt"
    message = str(exc.format_message()).strip()
    if type(exc).__name__ == "NoArgsIsHelpError":
        # `ckpt` alone: the help is the message, for people; not an error box
        render.stdout_text(message)
        return int(exc.exit_code)
    where = f"ckpt {command}" if command != "ckpt" else "ckpt"
    error = UsageError(message, fix=f"Run '{where} --help' for the options.")
    render.emit_error(command, error, render.json_requested(argv), exit_code=int(exc.exit_code))
    return int(exc.exit_code)


class CkptCommand(PlainHelpOption, typer.core.TyperCommand):
    """A command whose help names arguments by their metavar (SRC, DEST), bare, as git does, and
    whose help on a stdout that refuses it is an I/O error (exit 74), as the root's is."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        coerce_plain_values(self.params)
        try:
            return super().make_context(*args, **kwargs)
        except OSError as exc:  # its help, printed while its options are parsed: `> /dev/full`
            _output_failed(exc)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                help_text = getattr(param, "help", None) or ""
                arguments.append((param.metavar or (param.name or "").upper(), help_text))
            elif param.param_type_name == "option":
                record = param.get_help_record(ctx)
                if record is not None:
                    options.append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        if options:
            with formatter.section("Options"):
                formatter.write_dl(options)


#: where the documentation site is published (docs/, built by mkdocs); the one place the CLI
#: names it: `ckpt --help` ends with it, and every command's help with its own page
DOCS_URL = "https://ckpt-dev.github.io/ckpt/"


def docs_url(page: str = "") -> str:
    """The published URL of a docs page, `page` being its path under docs/ without `.md`
    (mkdocs serves `docs/commands/inspect.md` as `commands/inspect/`)."""
    return DOCS_URL + (f"{page}/" if page else "")


def command_docs_url(command: str) -> str:
    """The URL of a command's page, `docs/commands/COMMAND.md`."""
    return docs_url(f"commands/{command}")


class CkptTyper(typer.Typer):
    """A Typer whose commands all get the conventions above, including ones added later."""

    def command(  # type: ignore[override]
        self, *args: Any, **kwargs: Any
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        kwargs.setdefault("cls", CkptCommand)
        name = args[0] if args and isinstance(args[0], str) else kwargs.get("name")

        def decorator(function: Callable[..., T]) -> Callable[..., T]:
            # every command's help ends with its documentation page, added here so that a
            # command added later cannot forget it (tests/test_cli.py checks the page exists)
            command_name = name or function.__name__.replace("_", "-")
            epilog = kwargs.get("epilog")
            link = f"Documentation: {command_docs_url(command_name)}"
            register = super(CkptTyper, self).command(
                *args, **{**kwargs, "epilog": f"{epilog}\n\n{link}" if epilog else link}
            )
            register(_conventions(function, name))
            return function

        return decorator
