"""`autotune best` as a table within a width, JSON and CSV, and `export --diff` (results/best.py,
results/export.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from autotune.formats import BestFormat
from autotune.results.best import best_record, best_table, render_best
from autotune.results.export import choose, diff, headline

from .test_export import make_study, open_, surface


@pytest.mark.parametrize("width", [80, 100, 60])
def test_the_table_fits_the_width_and_names_the_pick(tmp_path: Path, width: int) -> None:
    """No line is wider than the terminal; the export's pick and its headline (from choose) are there,
    and each front member's trial number starts a row."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    text = best_table(study, loaded, width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    pick = choose(study, loaded, trial=None, policy=None)
    flat = " ".join(text.split())
    sentence = f"Recommended: {' '.join(headline(pick).split())}."
    assert sentence in flat and sentence.count(f"trial {pick.trial.number}") == 1, sentence
    rows = {line.split()[0].rstrip("*") for line in text.splitlines() if line[:1].isdigit()}
    assert {str(t.number) for t in study.best_trials} <= rows


def test_flags_equal_to_the_defaults_are_folded(tmp_path: Path) -> None:
    """The flags table lists a flag only where a config differs from vLLM's default (`·` marks an equal
    cell); a flag at its default in every config is named once, with its value, below it."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    text = best_table(study, loaded, 80)
    front = study.best_trials
    seqs_differ = any(t.params["max_num_seqs"] != 256 for t in front)
    assert ("max-num-seqs" in text.split("Flags")[1].split("\n\n")[1]) == seqs_differ
    if all(t.params["enable_chunked_prefill"] is True for t in front):
        assert "The defaults in every config: enable-chunked-prefill=true" in text
    else:
        assert "enable-chunked-prefill" in text.split("Flags")[1]


def test_json_and_csv_parse_back_to_the_same_configs(tmp_path: Path) -> None:
    """--format json is one object (front, defaults, pick, outcomes); --format csv has one row per config
    with the same trials, flags and figures, intervals as their low and high ends; gains are choose()'s."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    data = json.loads(render_best(study, loaded, BestFormat.JSON))
    assert data == best_record(study, loaded)
    assert data["pick"]["trial"] == choose(study, loaded, trial=None, policy=None).trial.number
    assert [c["trial"] for c in data["configs"] if c["on_front"]] == sorted(
        t.number for t in study.best_trials
    )
    assert sum(c["picked"] for c in data["configs"]) == 1
    for config in data["configs"]:
        gain = choose(study, loaded, trial=config["trial"], policy=None).gain
        if config["role"] == "front":
            assert config["gain_over_defaults"] == (gain.value if gain else None)
        assert set(config["changed"]) <= set(config["flags"])
    assert data["trials"]["pruned:oom"] >= 1
    rows = list(csv.DictReader(io.StringIO(render_best(study, loaded, BestFormat.CSV))))
    assert [int(r["trial"]) for r in rows] == [c["trial"] for c in data["configs"]]
    for row, config in zip(rows, data["configs"], strict=True):
        measured = config["slo_throughput"]  # none on a repeat of a measured config (not launched)
        assert row["slo_throughput"] == ("" if measured is None else str(measured))
        interval = config["slo_throughput_interval"] or [None, None]
        assert [row["slo_throughput_low"], row["slo_throughput_high"]] == [
            "" if v is None else str(v) for v in interval
        ]
        gain = config["gain_interval"] or [None, None]
        assert [row["gain_low"], row["gain_high"]] == ["" if v is None else str(v) for v in gain]
        assert row["max-num-seqs"] == str(config["flags"]["max-num-seqs"])
        assert row["enable-chunked-prefill"] in ("true", "false")


def test_diff_shows_every_flag_against_the_defaults(tmp_path: Path) -> None:
    """export --diff: a unified diff of the `vllm serve --config` YAML, defaults (trial 0) against the
    chosen trial, every line shown, the headline on top."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=None)
    text = diff(choice, loaded)
    lines = text.splitlines()
    assert lines[0] == f"# autotune: study 'exp', trial {choice.trial.number} against vLLM's defaults"
    assert lines[1] == f"# {headline(choice)}"
    assert lines[2:4] == ["--- vLLM defaults (trial 0)", f"+++ trial {choice.trial.number}"]
    body = lines[5:]
    assert " max-model-len: 4096" in body  # fixed: the same on both sides
    defaults = loaded.search_space.defaults()
    for name, value in choice.tuned.items():
        key, was = name.replace("_", "-"), defaults[name]
        if value == was:
            assert f" {key}: {_yaml(value)}" in body
        else:
            assert f"-{key}: {_yaml(was)}" in body and f"+{key}: {_yaml(value)}" in body


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_diff_of_the_defaults_says_nothing_differs(tmp_path: Path) -> None:
    """--diff of the defaults' own trial: no diff lines, one line saying so."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    text = diff(choose(study, loaded, trial=0, policy=None), loaded)
    assert text.splitlines()[2:] == ["# no flag differs from vLLM's defaults"]


def test_a_pick_off_the_search_front_still_gets_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recommendation comes from the finalists' reruns and may be dominated on the search's figures:
    `best` then still lists it, marked, rather than naming a trial no row shows."""
    import autotune.results.best as report

    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    recommended = choose(study, loaded, trial=None, policy=None).trial.number
    members = report.pareto_front(study)
    monkeypatch.setattr(report, "pareto_front", lambda s: [t for t in members if t.number != recommended])
    configs = json.loads(render_best(study, loaded, BestFormat.JSON, 100))["configs"]
    rows = {row["trial"]: row for row in configs}
    assert rows[recommended]["picked"] is True
    assert rows[recommended]["on_front"] is False
