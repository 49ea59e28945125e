"""The command reference of the docs site, read from the real typer app.

`python tools/cli_reference.py` prints it; the docs build (tools/docs_hooks.py) puts it into
docs/reference/cli.md at build time, so every command, argument, option, default and
environment variable on that page is the code's own and cannot drift from it. It asks each
parameter for the help record `fedgpu X --help` prints, so it follows the CLI's own words.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any


def commands() -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, command) for the root and every visible command and group below it."""
    import typer

    from fedgpu.cli.app import app

    def walk(cmd: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        yield path, cmd
        for name in sorted(getattr(cmd, "commands", None) or {}):
            sub = cmd.commands[name]
            if not getattr(sub, "hidden", False):
                yield from walk(sub, (*path, name))

    yield from walk(typer.main.get_command(app), ())


def anchor(path: tuple[str, ...]) -> str:
    """The heading id MkDocs gives the section of `fedgpu PATH`."""
    return "-".join(("fedgpu", *path))


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _clean(text: str) -> str:
    # click's "\b" marks a paragraph not to rewrap; Markdown needs no such mark.
    return "\n".join(line for line in text.strip().splitlines() if line.strip() != "\b")


def _help(cmd: Any) -> str:
    """The command's help; its "Example: ..." / "Examples: a; b" paragraph as a code block
    (the help wraps it to the terminal; a reader copies it as one line per command)."""
    out = []
    for para in re.split(r"\n\s*\n", _clean(getattr(cmd, "help", None) or "")):
        m = re.match(r"(Examples?):\s+(fedgpu\b.*)", " ".join(para.split()))
        if m:
            commands = [c.strip() for c in m.group(2).split("; ")]
            out.append(f"{m.group(1)}:\n\n```bash\n" + "\n".join(commands) + "\n```")
        else:
            out.append(para)
    return "\n\n".join(out)


def _context(cmd: Any, name: str) -> Any:
    # Typer ships its own copy of click; a context of that copy's kind, as its parser makes.
    return cmd.context_class(cmd, info_name=name)


def markdown(heading: str = "##") -> str:
    """One section per command (groups included), in the order of `fedgpu --help`'s tree."""
    out: list[str] = []
    for path, cmd in commands():
        name = " ".join(("fedgpu", *path))
        ctx = _context(cmd, name)
        out += [f"{heading} `{name}` {{#{anchor(path)}}}", ""]
        if _help(cmd):
            out += [_help(cmd), ""]
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out += ["```text", f"{name} {usage}".rstrip(), "```", ""]  # a synopsis, not a command
        epilog = _clean(getattr(cmd, "epilog", None) or "")
        if epilog:  # examples, as the command's --help prints them after its options
            out += ["```text", epilog, "```", ""]
        subs = [(n, c) for n, c in sorted((getattr(cmd, "commands", None) or {}).items())
                if not getattr(c, "hidden", False)]
        if subs:
            out += ["| command | what it does |", "|---|---|"]
            out += [f"| [`{name} {n}`](#{anchor((*path, n))}) | "
                    f"{_cell(c.get_short_help_str(limit=300))} |" for n, c in subs]
            out.append("")
        records = [(p.param_type_name, p.get_help_record(ctx)) for p in cmd.params
                   if not getattr(p, "hidden", False)]
        for kind, title in (("argument", "argument"), ("option", "option")):
            rows = [r for k, r in records if k == kind and r]
            if rows:
                out += [f"| {title} | what it does |", "|---|---|"]
                out += [f"| `{_cell(term)}` | {_cell(text)} |" for term, text in rows]
                out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
