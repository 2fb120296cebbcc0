"""The command line's arguments: engine flags derived from `EngineConfig`, exit codes, help format.

Every `EngineConfig` field declared with `config.flag(default, help)` is an engine flag of `generate`,
`demo`, `serve` and `bench serve` (which forwards it to its servers): `--max-num-seqs` for
`max_num_seqs`, the field's default, a type from its annotation (a bool is `--x` / `--no-x`, a tuple
of ints is comma-separated), and the `choices` / `metavar` / `name` given in the field. The parsed
namespace keeps the field names, and `engine_config(args)` builds the `EngineConfig` back from it
(the pattern of vLLM's `EngineArgs.add_cli_args` / `from_cli_args`). A new engine setting is one
field; the command line follows.

The subcommands import this module; nothing in the package imports `cli.py`, which only registers them.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator
from pathlib import Path

from neuron_async_sm.config import ConfigError, EngineConfig

EXIT_OK = 0  # every request succeeded
EXIT_FAILED = 1  # at least one request failed (bad line, engine error); every other result is still written
EXIT_USAGE = 2  # usage or configuration error: nothing ran
# 128 + signum (130 SIGINT, 143 SIGTERM): interrupted; the finished results are kept, the rest is 'abort'

EXIT_CODES_HELP = """exit codes: 0 every request succeeded; 1 at least one request failed (every other result is
still written); 2 usage or configuration error (nothing ran); 130/143 interrupted by SIGINT/SIGTERM
(finished results kept, the others written as "abort"; a second Ctrl-C exits at once)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every flag that has one; descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def int_list(text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def positive_floats(text: str) -> tuple[float, ...]:
    """`2,4,inf` -> (2.0, 4.0, inf); at least one, every one > 0."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def engine_fields() -> Iterator[dataclasses.Field]:
    """The `EngineConfig` fields that are flags, in declaration order."""
    return (f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata)


def _flag_options(f: dataclasses.Field, hint: object) -> dict:
    """argparse's keywords for one field: dest, default, help, and an action or a type."""
    options = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
    options.update({k: v for k, v in f.metadata.items() if k in ("choices", "metavar")})
    if "parse" in f.metadata:  # a value the field's own validation parses (JSON text)
        options["type"] = f.metadata["parse"]
        return options
    if isinstance(hint, types.UnionType):  # `int | None`: the flag parses the int; None is the default
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is tuple:
        # A string default, as the user would type it: argparse parses it with the flag's type.
        options.update(type=int_list, default=",".join(map(str, f.default)))
    elif hint is not str:
        options["type"] = hint
    return options


def add_engine_args(p: argparse.ArgumentParser, *, progress: bool = True) -> None:
    """The engine's flags (one per `config.flag` field), plus --stats; --no-progress only where a
    progress bar exists (`serve` has none)."""
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_fields():
        _add_flag(p, f, hints[f.name])
    p.add_argument("--stats", default=None, metavar="STATS.json", help="write run statistics as JSON")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_engine_flag(p: argparse.ArgumentParser, name: str) -> None:
    """The engine flag of the `EngineConfig` field `name` alone, spelt, typed and parsed as
    `add_engine_args` has it: for a command that takes a few engine settings (`bench`)."""
    (f,) = (f for f in engine_fields() if f.name == name)
    _add_flag(p, f, typing.get_type_hints(EngineConfig)[name])


def _add_flag(p: argparse.ArgumentParser, f: dataclasses.Field, hint: object) -> None:
    p.add_argument(f.metadata.get("name", "--" + f.name.replace("_", "-")), **_flag_options(f, hint))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the engine flags in `args` describe; ConfigError names a bad field."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in engine_fields()})


def create_output_file(path: str | None, flag: str) -> None:
    """Create a file written at the end of a run (and its directory) before any compute: an
    unwritable path must not cost the whole run. ConfigError naming the flag."""
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from exc
