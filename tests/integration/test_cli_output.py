"""What `autotune tune`, `best` and `export` print, as real subprocesses of the CLI on a small study over the
simulated server: lines within COLUMNS with the verdict and the best first, where the records are,
tables that fit, JSON and CSV that parse back, Helm values, the diff, and bad choices refused."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from optuna.trial import TrialState

from autotune.inputs.loader import load_study
from autotune.results.export import choose
from autotune.study.loop import close_study, open_study

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SPACE = {
    "params": {
        "max_num_seqs": {"type": "int", "low": 8, "high": 128, "log": True, "default": 32},
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.9, "step": 0.05, "default": 0.9},
        "enable_chunked_prefill": {"type": "bool", "default": True},
    },
}


def autotune(
    *args: str | Path, columns: int | None = 80, cwd: Path = REPO, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The CLI as the console script runs it, stdout a pipe (not a terminal), COLUMNS as given."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | (extra_env or {})
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@dataclass(frozen=True)
class Tuned:
    spec: Path
    workdir: Path
    proc: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    """A 3-launch study over the simulated server, tuned once by `autotune tune` at COLUMNS=80."""
    root = tmp_path_factory.mktemp("cli-output")
    (root / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec: dict[str, Any] = {
        "study": {"name": "out"},
        "server": {
            "command": [
                sys.executable,
                "-m",
                "autotune.sim",
                "Llama-3.1-8B",
                "--sim-hardware",
                "H100-80GB",
                "--sim-start-delay",
                "0.2",
                "--sim-seed",
                "1",
            ],
            "model": "Llama-3.1-8B",
            "args": {"max-model-len": 2048},
            "port": 0,
            "start_timeout": "30s",
            "stop_timeout": "5s",
        },
        "search_space": "space.yaml",
        "workload": {
            "dataset": {
                "input_len": {"dist": "uniform", "low": 32, "high": 128},
                "output_len": {"dist": "uniform", "low": 8, "high": 32},
            },
            "seed": 3,
        },
        "slo": {"terms": ["ttft:p95<=2s", "tpot:p95<=200ms"]},
        "measurement": {
            "probe_duration": "1s",
            "min_requests": 20,
            "min_tail_samples": 1,
            "saturation_requests": 20,
            "max_probes": 3,
            "rate_tolerance": 0.3,
            "request_timeout": "20s",
        },
        "budget": {"launches": 3},
        "finalists": {"count": 0},
        "sampler": {"name": "random", "seed": 7},
    }
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = autotune("tune", path, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Tuned(path, root / "out", proc)


def test_tune_lines_fit_80_columns_with_the_verdict_and_the_best_first(tuned: Tuned) -> None:
    """Not a terminal, COLUMNS=80: one plain line per event, none wider than 80; each trial's end says
    complete or pruned right after the trial number; the best so far comes before it; the run says first
    where its storage, trial folders and event log are."""
    lines = tuned.proc.stdout.splitlines()
    commands = [line for line in lines if line.startswith("  autotune ")]  # never cut: to be copied
    uncut = [*commands, *(line for line in lines if line.startswith("  storage  "))]  # a URL, to be copied
    loaded = load_study(tuned.spec)
    study = open_study(loaded, create=False, heartbeat=False)
    try:
        beats = choose(study, loaded, trial=None, policy=None).beats_defaults
    finally:
        close_study(study)
    if beats:  # the export is offered; otherwise the run says to keep the defaults, and no command
        assert commands == [f"  autotune export {tuned.spec} -o best.yaml"]
    else:
        assert commands == [] and "No config beats vLLM's defaults beyond the noise" in tuned.proc.stdout
    too_wide = [line for line in lines if len(line) > 80 and line not in uncut]
    assert not too_wide, too_wide
    assert lines[0] == "tune study 'out': budget 3 launches"
    assert lines[1].split() == ["storage", f"sqlite:///{tuned.workdir / 'study.db'}"]
    assert lines[2].startswith("  records  out/trials/<n>/server.log, out/trials/<n>/probes/"), lines[2]
    assert lines[3].startswith("  events   out/events.jsonl"), lines[3]
    ends = [line for line in lines if re.search(r"\| #\d+ (complete|pruned)", line)]
    assert len(ends) >= 3, lines
    assert all(re.match(r"\[ *\S+\] \d+/3 ", line) for line in ends), ends
    assert any(" best #" in line.split("|")[0] for line in ends[1:]), ends
    probes = [line for line in lines if re.search(r"\| #\d+ probe \d+ at \S+ req/s: (pass|fail)", line)]
    assert probes, lines
    logged = [json.loads(x) for x in (tuned.workdir / "events.jsonl").read_text().splitlines()]
    assert len(logged) == sum(1 for line in lines if line.startswith("[")), "one line per event"
    # Figures as people read them: with their units, never in exponent notation.
    done = [e["text"] for e in logged if e["kind"] == "trial_done" and e["text"].startswith("complete")]
    assert done and all(re.search(r"slo_throughput=[\d,.]+ tok/s, ttft:p95=[\d,.]+ ms", t) for t in done), (
        done
    )
    said = [e["text"] for e in logged if e["kind"] in ("phase", "trial_done", "new_best", "finished")]
    said += [e["best"] for e in logged if e["best"]]
    assert not [text for text in said if re.search(r"\d[eE][+-]?\d", text)], said


def test_best_table_fits_and_formats_parse_back(tuned: Tuned, tmp_path: Path) -> None:
    """`best` at 80 columns fits; --format json and csv parse back to the same configs; -o writes the
    file and says so on stderr."""
    table = autotune("best", tuned.spec)
    assert table.returncode == 0, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80, table.stdout
    assert "Recommended: " in table.stdout
    wide = autotune("best", tuned.spec, columns=200)
    assert max(len(line) for line in wide.stdout.splitlines()) > 80  # it uses the width it is given
    data = json.loads(autotune("best", tuned.spec, "--format", "json").stdout)
    assert data["study"] == "out" and data["configs"]
    out = tmp_path / "best.csv"
    written = autotune("best", tuned.spec, "-f", "csv", "-o", out)
    assert written.returncode == 0 and written.stdout == ""
    assert f"wrote {out}" in written.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [int(r["trial"]) for r in rows] == [c["trial"] for c in data["configs"]]


def test_export_helm_and_diff(tuned: Tuned) -> None:
    """--format helm is YAML with the flags in vllmConfig.extraArgs as strings; --diff is a unified diff
    against the defaults' trial."""
    study = open_study(load_study(tuned.spec), create=False, heartbeat=False)
    other = next(t for t in study.get_trials(deepcopy=False) if t.number and t.state == TrialState.COMPLETE)
    close_study(study)
    # a tuned trial (the defaults' own export passes no tuned flag, as their launch did)
    helm = autotune("export", tuned.spec, "--format", "helm", "--trial", str(other.number))
    assert helm.returncode == 0, helm.stderr
    values = yaml.safe_load(helm.stdout)
    (model,) = values["servingEngineSpec"]["modelSpec"]
    extra = model["vllmConfig"]["extraArgs"]
    assert extra[:2] == ["--max-model-len", "2048"]
    assert all(isinstance(x, str) for x in extra)
    assert any(x in extra for x in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"))
    shown = autotune("export", tuned.spec, "--diff", "--trial", str(other.number))
    assert shown.returncode == 0, shown.stderr
    assert "--- vLLM defaults (trial 0)" in shown.stdout and "\n+++ trial " in shown.stdout


@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        (("best", "--format", "xml"), "--format", "'xml'"),
        (("export", "--format", "yaml"), "--format", "'yaml'"),
        (("export", "--policy", "fastest"), "--policy", "'fastest'"),
        (("export", "--diff", "--format", "json"), "--diff", "json"),
    ],
)
def test_bad_choices_are_one_line_and_exit_2(
    tuned: Tuned, tmp_path: Path, args: tuple[str, ...], option: str, value: str
) -> None:
    """A --format or --policy outside its choices: one `error:` line naming the option, the value and
    the choices, exit 2, nothing written."""
    out = tmp_path / "out.txt"
    proc = autotune(args[0], tuned.spec, *args[1:], "-o", out)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {option}: ") and value in line, line
    assert not out.exists()


@pytest.mark.slow
def test_version_completion_and_choices_in_help() -> None:
    """--version names autotune's version; completion is offered and completes --format's values; --help
    lists the formats and policies."""
    version = autotune("--version")
    assert version.returncode == 0 and version.stdout.startswith("autotune 0."), version
    assert "--install-completion" in autotune("--help", columns=200).stdout
    export_help = autotune("export", "--help", columns=200).stdout
    assert "[vllm-yaml|args|json|helm]" in export_help
    assert "[max-throughput|min-latency]" in export_help
    assert "[table|json|csv]" in autotune("best", "--help", columns=200).stdout
    words = {"_AUTOTUNE_COMPLETE": "complete_bash", "COMP_WORDS": "autotune export s.yaml --format h"}
    assert autotune(extra_env={**words, "COMP_CWORD": "4"}).stdout.split() == ["helm"]


def test_verify_measures_an_exported_config_again_from_its_reproduce_record(
    tuned: Tuned, tmp_path: Path
) -> None:
    """export --format json pins what the figure was measured with; verify --record launches that config
    again on a fresh stream, leaves the study as it is, says what differs from the record (here a vLLM
    version edited into it) and whether the figures agree, exit 0 when they do and 1 when not."""
    exported = autotune("export", tuned.spec, "--format", "json")
    assert exported.returncode == 0, exported.stderr
    data = json.loads(exported.stdout)
    pinned = data["reproduce"]
    assert pinned["vllm"] == "0.34.0" and pinned["python"] and pinned["optuna"] and pinned["autotune"]
    assert len(pinned["workload_sha256"]) == 64
    assert pinned["baseline"] == (data["trial"] == data["defaults"]["trial"])
    pinned["vllm"] = "0.0.1"
    record = tmp_path / "record.json"
    record.write_text(json.dumps(data))
    study = open_study(load_study(tuned.spec), create=False, heartbeat=False)
    before = len(study.get_trials(deepcopy=False))
    close_study(study)
    again = autotune("verify", tuned.spec, "--record", record, columns=200)
    assert again.returncode in (0, 1), again.stdout + again.stderr
    lines = again.stdout.splitlines()
    assert "differs: vllm: 0.0.1 then, 0.34.0 now" in lines
    (verdict,) = [line for line in lines if line.startswith("measured ")]
    assert ("agrees with the record's" in verdict) == (again.returncode == 0), verdict
    (folder,) = (tuned.workdir / "reproduced").iterdir()
    assert (folder / "server.log").is_file() and list((folder / "probes").glob("probe-*.json"))
    study = open_study(load_study(tuned.spec), create=False, heartbeat=False)
    assert len(study.get_trials(deepcopy=False)) == before
    close_study(study)
