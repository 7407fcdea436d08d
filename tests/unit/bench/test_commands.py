"""The benchmarks' table (bench/__init__.py): one row per `kvdepot bench` subcommand, each module
with its argument builder and runner; the sidecar's own commands never import the package."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import import_module

from app.cli import build_parser
from bench import COMMANDS


def test_every_row_names_a_module_with_its_builder_and_runner() -> None:
    assert len({c.name for c in COMMANDS}) == len(COMMANDS)
    for command in COMMANDS:
        module = import_module(command.module)
        assert callable(module.add_arguments) and callable(module.run), command.name
        assert command.help


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action


def test_the_subparsers_are_the_table_in_its_order() -> None:
    bench = _subparsers(build_parser()).choices["bench"]
    listed = [(a.dest, a.help) for a in _subparsers(bench)._choices_actions]
    assert listed == [(c.name, c.help) for c in COMMANDS]


def test_the_sidecar_commands_never_import_the_benchmarks() -> None:
    code = (
        "import sys; from app.cli import build_parser; "
        "build_parser(benches=False).parse_args(['serve']); "
        "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
