"""Every --help page reads at 80 columns (issue 44): no line wider than the terminal, no default cut short, no
`<bool>` placeholder after a switch, arguments named plainly in the usage line, each option's description on lines
of its own.

The pages are rendered in-process with COLUMNS=80 (what a user's 80-column terminal says); the defaults checked are
the click parameters' own, read from the app, not from the renderer."""

from __future__ import annotations

import re

import pytest
import typer

from mla_eval.cli import TOOL_COMMANDS, current_app, main
from mla_eval.evaluation import evaluations

WIDTH = 80
PAGES = [[], *[[ev.name] for ev in evaluations()], *[[name] for name in TOOL_COMMANDS]]


def _page(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    capsys.readouterr()
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def _shown_defaults(command) -> list[tuple[str, str]]:
    """(flag, default as typed) of each option whose default a page must show: set, not a switch, shown."""
    out = []
    for p in command.params:
        default = getattr(p, "default", None)
        if (getattr(p, "required", False) or not getattr(p, "show_default", True) or getattr(p, "is_flag", False)
                or default is None or isinstance(default, bool) or callable(default) or default == ""):
            continue
        if type(p).__name__.endswith("Argument"):
            continue
        out.append((p.opts[0], str(default)))
    return out


@pytest.mark.parametrize("argv", PAGES, ids=lambda a: " ".join(a) or "mla-eval")
def test_every_help_page_reads_at_80_columns(argv, capsys, monkeypatch):
    page = _page(argv, capsys, monkeypatch)
    lines = page.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert "…" not in page and "<bool>" not in page and "╭" not in page
    usage = lines[0]
    assert usage.startswith("Usage: mla-eval") and "{" not in usage, usage
    root = typer.main.get_command(current_app())
    command = root.commands[argv[0]] if argv else root
    glued = re.sub(r"\s*\n\s*", "", page)  # a default broken over lines (after its commas) reads whole again
    for flag, default in _shown_defaults(command):
        assert f"{flag}" in page, flag
        assert f"[default: {default}]" in glued, (flag, default)
    for p in command.params:  # every option and its description, the description on lines below the option's
        if getattr(p, "hidden", False) or type(p).__name__.endswith("Argument"):
            continue
        first_panel = next(i for i, line in enumerate(lines) if line.endswith(":") and not line.startswith(" "))
        head = "  " + ", ".join(p.opts)
        at = next(i for i, line in enumerate(lines) if i > first_panel and (line == head or line.startswith(head + " ")))
        if getattr(p, "help", None):
            assert lines[at + 1].startswith("      ") and lines[at + 1].strip(), (p.opts[0], lines[at: at + 2])


def test_the_long_defaults_are_whole(capsys, monkeypatch):
    """The ones the panels cut: kld's format list, and needle's and capacity's defaults."""
    from mla_eval.evals.kld_evaluation import DEFAULT_FORMATS

    glued = re.sub(r"\s*\n\s*", "", _page(["kld"], capsys, monkeypatch))
    assert f"[default: {DEFAULT_FORMATS}]" in glued
    gate = _page(["gate"], capsys, monkeypatch)
    assert "Usage: mla-eval gate [OPTIONS] RESULTS" in gate and "[gate] table" in gate
    assert len(_page(["kld"], capsys, monkeypatch).splitlines()) < 200  # was 273 lines at 80 columns
