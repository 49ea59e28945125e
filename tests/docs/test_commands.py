"""Every `fedgpu ...` command line in the docs and the README (run by the tests or not) names a
command that exists and only flags that command has: a renamed command or flag fails here until
the pages follow. Placeholders such as `[--gpu none|offer|enforce]` and alternatives such as
`fedgpu status|rounds` are read as the pages mean them."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from tests.fixtures.doc_blocks import ROOT
from tools import cli_reference

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
# Blocks a reader types from; `text` blocks hold output and diagrams.
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


@functools.cache
def _root() -> Any:
    return next(cmd for path, cmd in cli_reference.commands() if path == ())


def _options(cmd: Any) -> set[str]:
    names = {"--help"}
    for p in cmd.params:
        names |= set(getattr(p, "opts", [])) | set(getattr(p, "secondary_opts", []))
    return names


def _is_flag(cmd: Any, name: str) -> bool:
    for p in cmd.params:
        if name in getattr(p, "opts", []) or name in getattr(p, "secondary_opts", []):
            return bool(getattr(p, "is_flag", False))
    return True  # --help


def _resolve(words: list[str]) -> tuple[list[tuple[tuple[str, ...], Any]], str | None]:
    """The commands a line names (several for `a|b`), and the first word that should have been
    a subcommand and is not (None when all resolved)."""
    cmds: list[tuple[tuple[str, ...], Any]] = [((), _root())]
    value_next = False
    for word in words:
        if value_next:  # the value of a group's own option
            value_next = False
            continue
        if not all(getattr(c, "commands", None) for _, c in cmds):
            return cmds, None
        if word == "...":  # "and the rest", as the page says
            return cmds, None
        if word.startswith("[-"):
            word = word.strip("[]").split()[0]
        if word.startswith("-") and all(word in _options(c) for _, c in cmds):
            # A group's own option: `fedgpu --help`, `fedgpu nodes --address A --json`.
            value_next = not _is_flag(cmds[0][1], word)
            continue
        if word.startswith(("-", "[")):
            return cmds, word
        alts = word.split("|")
        nxt = []
        for path, cmd in cmds:
            if not all(a in cmd.commands for a in alts):
                return cmds, word
            nxt += [((*path, a), cmd.commands[a]) for a in alts]
        cmds = nxt
    groups = [c for _, c in cmds if getattr(c, "commands", None)]
    bare = groups and not any(w.startswith("-") for w in words)
    return cmds, ("(a group, no command)" if bare else None)


def command_lines(page: Path) -> list[str]:
    """The `fedgpu ...` commands in a page's shell blocks, one per command (continuation lines
    joined, comments dropped, `a && b`, `a; b` and pipes split)."""
    out = []
    for m in FENCE.finditer(page.read_text()):
        if m.group(1) not in SHELL_LANGS:
            continue
        for line in m.group(2).replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line)
            for seg in re.split(r"&&|;|\s\|\s|\$\(", line):
                seg = re.sub(r"^(\$ |\.venv/bin/|[A-Z_]+=\S+ )+", "", seg.strip())
                if seg.startswith("fedgpu "):
                    out.append(seg)
    return out


def problems(page: Path) -> list[str]:
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    found = []
    for line in command_lines(page):
        cmds, bad = _resolve(line.split()[1:])
        if bad is not None:
            found.append(f"{name}: {line!r}: no command at {bad!r}")
            continue
        flags = set(FLAG.findall(line))
        for path, cmd in cmds:
            missing = sorted(flags - _options(cmd) - {"--debug"})
            if missing:
                found.append(f"{name}: {line!r}: `fedgpu {' '.join(path)}` "
                             f"has no {missing}")
    return found


def test_every_documented_command_and_flag_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    lines = [line for page in pages for line in command_lines(page)]
    assert len(lines) > 50, "the docs should be full of commands; is the parser broken?"
    found = [p for page in pages for p in problems(page)]
    assert not found, "\n".join(found)


def test_every_example_in_the_cli_help_is_a_real_command(tmp_path: Path) -> None:
    """The examples the commands' --help shows (rendered into docs/reference/cli.md at build
    time) name real commands and flags, like every other command line in the docs."""
    page = tmp_path / "cli.md"
    page.write_text(cli_reference.markdown())
    examples = command_lines(page)
    leaves = [p for p, c in cli_reference.commands() if not getattr(c, "commands", None)]
    assert len(examples) >= len(leaves), "every command's help should carry an example"
    found = problems(page)
    assert not found, "\n".join(found)


def test_a_wrong_command_or_flag_is_found(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("```bash\nfedgpu job sumbit job.toml\nfedgpu run --nodez 3\n"
                    "fedgpu status|rounds --job X\nfedgpu nodes --json\n```\n"
                    "```text\nfedgpu job / status\n```\n")
    found = problems(page)
    assert len(found) == 2, found
    assert "no command at 'sumbit'" in found[0] and "['--nodez']" in found[1]
