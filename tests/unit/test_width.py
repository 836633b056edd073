"""Output that fits: what `best`, `status` and `export` print wraps at COLUMNS (80 for a pipe) with hanging
indents and never inside a value; a narrow `best` leaves whole columns out and says which; `--help` flows
each paragraph, labels no switch `<bool>` and keeps each `[a|b]` choice list on one line."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from autotune.cli import _choices, app
from autotune.formats import BestFormat, Format, Policy
from autotune.inputs.loader import LoadedStudy
from autotune.results.export import choose, headline
from autotune.results.status import read_study
from autotune.study.loop import close_study
from autotune.units import wrap

from .report_study import run_study

HELP_WIDTH = 80
"""The width CliRunner lays help out at (it forces click's formatter to 80 columns)."""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> LoadedStudy:
    """The stand-in study run to its budget (shared: the tests here only read it)."""
    return run_study(tmp_path_factory.mktemp("w"))


def _run(*args: str, columns: int) -> str:
    """What the CLI prints for ``args`` at ``COLUMNS=columns`` (stdout not a terminal)."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def _too_wide(text: str, width: int, root: Path) -> list[str]:
    """The lines of ``text`` wider than ``width``, but for a lone path of the study's folder (a path longer
    than the width cannot be wrapped without cutting it; pytest chooses how long its folder is)."""
    return [
        line
        for line in text.splitlines()
        if len(line) > width and not (len(line.split()) == 1 and str(root) in line)
    ]


def _flat(text: str) -> str:
    """``text`` with every run of whitespace one space (what a wrapped text says, whatever its width)."""
    return " ".join(text.split())


def test_wrap_breaks_between_words_with_a_hanging_indent() -> None:
    """A long line breaks at spaces only (a flag, a value, a path stays whole), its continuation lines one
    step deeper than its own indent (a comment keeps its `#`); short lines and width 0 are untouched."""
    line = "  flags: " + " ".join(f"--max-num-batched-tokens={n}" for n in range(6))
    shown = wrap(line, 40).splitlines()
    assert shown[0].startswith("  flags: --max-num-batched-tokens=0")
    assert all(len(s) <= 40 and s.startswith("    ") for s in shown[1:]), shown
    assert _flat("\n".join(shown)) == _flat(line)
    assert [s.split()[-1] for s in shown][-1] == "--max-num-batched-tokens=5"
    comment = wrap("# trial 9, +8.0% over the vLLM defaults; SLO-constrained throughput 995 tok/s", 40)
    assert comment.splitlines()[1].startswith("#   ")
    path = "/a/" + "x" * 60
    assert wrap(f"storage: {path} (new)", 30).splitlines() == ["storage:", f"  {path}", "  (new)"]
    assert wrap("short\n\nlines", 30) == "short\n\nlines"
    assert wrap("a " * 60, 0) == "a " * 60


def test_best_status_and_export_fit_80_columns_and_say_everything(study: LoadedStudy) -> None:
    """At COLUMNS=80 (not a terminal): no line of `best`, `status`, `export --diff` or the export's header
    is wider than 80, and the wrapped sentences still say all they said (the recommendation's headline)."""
    spec = str(study.spec_path)
    stored = read_study(study)
    assert stored is not None
    try:
        said = headline(choose(stored, study, trial=None, policy=None))
    finally:
        close_study(stored)
    for args in (("best",), ("status",), ("export", "--diff"), ("export",), ("export", "--format", "helm")):
        text = _run(args[0], spec, *args[1:], columns=80)
        body = "\n".join(line for line in text.splitlines() if not line.startswith("# use: "))  # to copy
        assert not _too_wide(body, 80, study.workdir), (args, text)
        assert _flat(said) in _flat(re.sub(r"^#", "", text, flags=re.MULTILINE)), (args, text)
    status = _run("status", spec, columns=80)
    assert max(len(line) for line in status.splitlines()) > 60  # it uses the width it is given
    assert not _too_wide(_run("status", spec, columns=60), 60, study.workdir)


def test_best_at_60_columns_leaves_whole_columns_out_and_names_them(study: LoadedStudy) -> None:
    """At 60 columns `best` cuts no value short ("…"): it leaves the least important columns out whole and
    one line names them; wide, it shows every column and no such line."""
    spec = str(study.spec_path)
    narrow = _run("best", spec, columns=60)
    assert "…" not in narrow and not _too_wide(narrow, 60, study.workdir), narrow
    flat = _flat(narrow)
    notes = re.findall(r"Not shown at 60 columns: (.*?) \(a wider terminal", flat)
    assert notes, narrow
    dropped = [name for note in notes for name in note.split(", ")]
    assert "req/s" in dropped and "SLO tok/s" not in dropped and "vs defaults" not in dropped
    tables = narrow.split("Recommended:")[0]
    for name in dropped:
        if name.startswith("#"):  # a config of the flags table: its column header is gone
            assert name not in tables.split("Flags")[1].split("Not shown")[0]
        else:  # a figure of the measurements: its header's first word is gone from the header rows
            assert name.split()[0] not in "\n".join(tables.splitlines()[2:4]), (name, tables)
    assert "defaults" in narrow and "vs" in narrow  # the gain column stays, its values whole
    wide = _run("best", spec, columns=200)
    assert "Not shown" not in wide and "E2EL" in wide and "req/s" in wide


def test_machine_readable_outputs_are_the_same_at_any_width(study: LoadedStudy) -> None:
    """JSON, CSV, args and the YAML a program reads do not depend on the width; only comments wrap."""
    spec = str(study.spec_path)
    for args in (
        ("best", "-f", "json"),
        ("best", "-f", "csv"),
        ("export", "-f", "json"),
        ("export", "-f", "args"),
    ):
        assert _run(*args[:1], spec, *args[1:], columns=40) == _run(*args[:1], spec, *args[1:], columns=300)
    assert json.loads(_run("export", spec, "-f", "json", columns=40))["trial"] >= 0
    for fmt in ("vllm-yaml", "helm"):
        narrow, wide = (_run("export", spec, "-f", fmt, columns=c) for c in (40, 300))
        assert yaml.safe_load(narrow) == yaml.safe_load(wide)
        assert [s for s in narrow.splitlines() if not s.startswith("#")] == [
            s for s in wide.splitlines() if not s.startswith("#")
        ]
        assert narrow.count("\n# use: ") == 1  # the command to copy stays whole on its line


def _commands() -> list[str]:
    """Every command whose --help is autotune's (sim-serve's is the simulated server's own)."""
    group = get_command(app)
    assert hasattr(group, "commands")
    return [name for name, command in group.commands.items() if name != "sim-serve" and not command.hidden]


def _paragraphs(text: str) -> list[list[str]]:
    """The prose paragraphs that head a help page (between its usage line and its first section)."""
    lines = [line.rstrip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    prose: list[list[str]] = [[]]
    for line in lines[start:]:
        if line.strip().startswith(("Arguments", "Options", "Commands", "╭")):
            break
        if line.strip():
            prose[-1].append(line)
        elif prose[-1]:
            prose.append([])
    return [p for p in prose if p]


@pytest.mark.parametrize("command", ["", *_commands()])
def test_help_flows_sentences_and_keeps_labels_and_choices_whole(command: str) -> None:
    """Each --help at COLUMNS=80: no line wider than 80, no `<bool>` label, no `[a|b]` choice list split
    over lines, and each paragraph flowed (a line ends early only where the next word would not fit: no
    line break of the docstring kept mid-sentence)."""
    text = _run(*([command] if command else []), "--help", columns=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert "<bool>" not in text
    assert not [line for line in lines if re.search(r"\[[^\]\s]*\|[^\]\s]*$", line)], text
    for paragraph in _paragraphs(text):
        for line, after in itertools.pairwise(paragraph):
            assert len(line) + 1 + len(after.split()[0]) > HELP_WIDTH, (line, after)
    choices = {"best": [BestFormat], "export": [Format, Policy]}.get(command, [])
    for choice in choices:
        assert _choices(choice) in text, text


def test_the_command_list_gives_each_first_sentence_whole() -> None:
    """`autotune --help` lists each command with its help's first sentence, wrapped, never cut with ..."""
    text = _run("--help", columns=80)
    assert "..." not in text.split("Commands:")[1]
    assert "without launching anything or writing anything." in _flat(text)
