"""`--help` pages that read at 80 columns: every command's page drawn by us, not by typer's panels.

Typer's rich panels put four columns side by side (option, short flag, metavar, help), which at 80 columns left
26-30 characters for a description, cut 16 defaults with "...", broke a docstring's own lines raggedly, showed a
`<bool>` placeholder after every flag and `{results}` in gate's usage. Here, for any terminal width (at most
MAX_WIDTH used):

- the usage line names the arguments in capitals (`Usage: mla-eval gate [OPTIONS] RESULTS`);
- the command's text is reflowed paragraph by paragraph (a blank line separates paragraphs);
- options come in panels (the settings they belong to: model and device, text, the evaluation's own, output), each
  option on its own line -- flags, then the kind of value it takes (none for a switch) -- and its description below
  it, indented;
- a default is printed whole, `[default: ...]`, on the description's last line where it fits, else on lines of its
  own, broken only after a comma (`re.sub(r"\\n\\s*", "", page)` gives it back).

The root page lists the commands, one line each where it fits. `HelpCommand` / `HelpGroup` are the typer classes
every command and the app use (`mla_eval.cli.build_app`); they change nothing but `format_help`.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

from typer.core import TyperCommand, TyperGroup

MAX_WIDTH = 100  # wider terminals get this: a description line longer than that is hard to read
MIN_WIDTH = 40
INDENT = "  "  # an option's line
BODY = "      "  # its description
DEFAULT_PANEL = "Options"
_TYPE_NAMES = {str: "TEXT", int: "INTEGER", float: "FLOAT", Path: "PATH", bool: ""}


def page_width() -> int:
    return max(MIN_WIDTH, min(MAX_WIDTH, shutil.get_terminal_size((80, 24)).columns))


def _plain(text: str | None) -> str:
    """Help text as written for rich markup (`\\[gate]` escapes a bracket) made plain."""
    return re.sub(r"\\\[", "[", text or "")


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """Words wrapped to `width`, never broken inside a word (a path, a flag, a format list)."""
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [indent.rstrip()]


def _paragraphs(text: str, width: int, indent: str = INDENT) -> list[str]:
    out: list[str] = []
    for para in re.split(r"\n\s*\n", _plain(text).strip()):
        if para.strip():
            out += _wrap(" ".join(para.split()), width, indent) + [""]
    return out


def _value_kind(p: Any) -> str:
    """What an option takes: TEXT, INTEGER, FLOAT, PATH; '' for a switch (whatever typer/click version built it)."""
    if getattr(p, "is_flag", False) or getattr(p, "count", False):
        return ""
    ptype = getattr(p, "type", None)
    name = getattr(ptype, "name", None)
    if isinstance(name, str):
        return "" if name == "boolean" else name.upper()
    annotation = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    return _TYPE_NAMES.get(annotation, "VALUE")


def _default_text(p: Any) -> str | None:
    """The default as the user would type it, or None where none is shown (none set, a switch that is off)."""
    if getattr(p, "required", False) or not getattr(p, "show_default", True):
        return None
    default = getattr(p, "default", None)
    if callable(default):
        return None
    if getattr(p, "is_flag", False):
        secondary = getattr(p, "secondary_opts", None) or []
        if not secondary:  # a single switch: on when given
            return None
        return p.opts[0] if default else secondary[0]
    if default is None or default == "" or default == ():
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default))
    return str(default)


def _default_lines(text: str, width: int) -> list[str]:
    """'[default: a,b,c]' on lines of `width` starting with BODY, broken only after commas."""
    pieces = re.findall(r"[^,]+,?|,", f"[default: {text}]")
    lines, line = [], BODY
    for piece in pieces:
        if len(line) + len(piece) > width and line.strip():
            lines.append(line)
            line = BODY
        line += piece
    return lines + [line]


def _option_lines(p: Any, width: int) -> list[str]:
    flags = ", ".join(p.opts)
    if getattr(p, "secondary_opts", None):
        flags += " / " + ", ".join(p.secondary_opts)
    kind = _value_kind(p)
    head = INDENT + flags + (f" {kind}" if kind else "") + ("  (required)" if getattr(p, "required", False) else "")
    lines = [head]
    help_text = " ".join(_plain(getattr(p, "help", "") or "").split())
    body = _wrap(help_text, width, BODY) if help_text else []
    default = _default_text(p)
    if default is not None:
        tail = f" [default: {default}]"
        if body and len(body[-1]) + len(tail) <= width:
            body[-1] += tail
        else:
            body += _default_lines(default, width)
    return lines + body


def _usage(ctx: Any, cmd: Any, params: list) -> str:
    args = []
    for p in params:
        if type(p).__name__.endswith("Argument") or getattr(p, "param_type_name", "") == "argument":
            name = (p.name or "arg").upper() + ("..." if getattr(p, "nargs", 1) == -1 else "")
            args.append(name if getattr(p, "required", False) else f"[{name}]")
    extra = " COMMAND [ARGS]..." if hasattr(cmd, "commands") else ""
    return f"Usage: {ctx.command_path} [OPTIONS]{extra}" + "".join(f" {a}" for a in args)


def render_help(ctx: Any, cmd: Any, width: int | None = None) -> str:
    """The whole page of `cmd` (a click command or group of any version typer builds)."""
    width = width or page_width()
    params = cmd.get_params(ctx)
    lines = [_usage(ctx, cmd, params), ""]
    lines += _paragraphs(cmd.help or "", width)
    arguments = [p for p in params if type(p).__name__.endswith("Argument")
                 or getattr(p, "param_type_name", "") == "argument"]
    if arguments:
        lines.append("Arguments:")
        for p in arguments:
            lines.append(INDENT + (p.name or "arg").upper() + ("  (required)" if getattr(p, "required", False) else ""))
            lines += _wrap(" ".join(_plain(getattr(p, "help", "") or "").split()), width, BODY)
        lines.append("")
    panels: dict[str, list] = {}
    for p in params:
        if p in arguments or getattr(p, "hidden", False):
            continue
        panels.setdefault(getattr(p, "rich_help_panel", None) or DEFAULT_PANEL, []).append(p)
    for title, members in panels.items():
        lines.append(f"{title}:")
        for p in members:
            lines += _option_lines(p, width)
        lines.append("")
    commands = getattr(cmd, "commands", None)
    if commands:
        names = [n for n in cmd.list_commands(ctx) if not getattr(commands[n], "hidden", False)]
        col = max(len(n) for n in names) + 2
        lines.append("Commands:")
        for n in names:
            summary = " ".join(_plain((commands[n].help or "").split("\n\n")[0]).split())
            wrapped = _wrap(summary, width - len(INDENT) - col, "")
            lines.append(f"{INDENT}{n:<{col}}{wrapped[0]}")
            lines += [INDENT + " " * col + w for w in wrapped[1:]]
        lines.append("")
    if getattr(cmd, "epilog", None):
        lines += _paragraphs(cmd.epilog, width)
    return "\n".join(lines).rstrip() + "\n"


class HelpCommand(TyperCommand):
    """A typer command whose --help page is `render_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_help(ctx, self))


class HelpGroup(TyperGroup):
    """The app: its --help page (the commands) is `render_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_help(ctx, self))
