"""The commands README.md prints are commands moeshard takes: every ``moeshard ...`` line of its
code blocks (and ``torchrun ... -m moeshard ...``) parses with the real parser; each CPU
``moeshard check`` whose filters carry values (``--layouts``, ``--quants``, ``--only``, ...) selects
cases with them (``--list``: what parsing cannot tell); ``moeshard backends`` runs; every script
and make target it names exists. Placeholders (``DIR``, ``ID``, ``in.safetensors``) parse like any
value; running the commands that need a model directory, a GPU or minutes is left to the tests
of those commands (the README's commands were run as printed on CPU by hand: see
docs/reliability.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from moeshard.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _command_lines() -> list[str]:
    """Every line of README.md's fenced blocks (python blocks excepted) that runs something. In a
    block that shows a session (commands after ``$ ``, then what they print), only the ``$ ``
    lines are commands: the output may begin with ``moeshard train: ...``."""
    lines, fence, block = [], None, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if fence is not None and fence != "python":
                session = any(b.strip().startswith("$ ") for b in block)
                for b in block:
                    text = b.strip()
                    if session and not text.startswith("$ "):
                        continue
                    text = text.removeprefix("$ ")
                    if re.match(r"(moeshard|torchrun|python3?|make) ", text + " "):
                        lines.append(text)
            fence, block = (None if fence is not None else line[3:].strip()), []
            continue
        if fence is not None:
            block.append(line)
    return lines


def _argv(line: str) -> list[str]:
    """The words of a command line, its trailing ``# comment`` dropped."""
    words = shlex.split(line, comments=True)
    if words[0] == "torchrun":  # torchrun [its options] -m moeshard ARGS
        words = words[words.index("-m") + 1:]
    return words


COMMANDS = [line for line in _command_lines() if _argv(line)[0] == "moeshard"]
PLACEHOLDERS = {"DIR", "ID"}  # words the README means to be replaced
FILTERS = {"--layouts", "--quants", "--dtypes", "--models", "--world-sizes", "--tokens-per-rank", "--only"}


def _name(line: str) -> str:
    return " ".join(_argv(line))


def test_the_readme_prints_commands_of_every_kind():
    assert len(COMMANDS) >= 15 and any(line.startswith("torchrun") for line in COMMANDS), COMMANDS
    assert {_argv(line)[1] for line in COMMANDS} >= {"check", "run", "generate", "train", "eplb"}


@pytest.mark.parametrize("line", COMMANDS, ids=_name)
def test_every_readme_command_parses(line):
    try:
        build_parser().parse_args(_argv(line)[1:])
    except SystemExit as exc:
        pytest.fail(f"README.md's `{line}` does not parse (exit {exc.code})")


@pytest.mark.parametrize("line", [c for c in COMMANDS if _argv(c)[1] == "check" and "cuda" not in _argv(c)
                                  and FILTERS & set(_argv(c)) and not PLACEHOLDERS & set(_argv(c))], ids=_name)
def test_every_readme_check_filter_selects_cases(line, capsys):
    argv = _argv(line)[1:]
    assert main([*argv, "--list"]) == 0, capsys.readouterr().err
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"[1-9]\d* of \d+ cases valid .*", last), (line, last)


def test_readme_backends_runs_and_its_scripts_exist(capsys):
    assert main(["backends"]) == 0 and "all2all" in capsys.readouterr().out
    for line in _command_lines():
        words = _argv(line)
        if words[0].startswith("python"):
            assert (ROOT / words[1]).is_file(), f"README.md's `{line}`: no {words[1]}"
        if words[0] == "make":
            makefile = (ROOT / "Makefile").read_text()
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"README.md's `{line}`: no target {words[1]}"
