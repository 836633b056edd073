"""`autotune validate` and option checks as a real subprocess: one `error:` line, exit 2, nothing written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]


def _autotune(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI exactly as the console script does, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *map(str, args)],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


def _demo_copy(root: Path) -> Path:
    """Copy the demo spec and its search space into ``root`` with the repo's layout; return the spec."""
    (root / "studies").mkdir()
    (root / "search_spaces").mkdir()
    shutil.copy(REPO / "studies" / "demo.yaml", root / "studies" / "demo.yaml")
    shutil.copy(REPO / "search_spaces" / "sim.yaml", root / "search_spaces" / "sim.yaml")
    return root / "studies" / "demo.yaml"


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_one_error_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith("error: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in line, line
    return line


def _edit_demo(spec: Path, section: str, key: str, value: Any) -> None:
    data = yaml.safe_load(spec.read_text(encoding="utf-8"))
    data[section][key] = value
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")


BAD: list[Any] = [
    pytest.param(
        "server", "start_timeout", "soon", ("server.start_timeout", "'soon'"), id="garbage-duration"
    ),
    pytest.param("server", "port", 70000, ("server.port", "70000"), id="port-out-of-range"),
    pytest.param("server", "colour", "red", ("server.colour", "unknown key"), id="unknown-key"),
    pytest.param("slo", "terms", ["foo:p95<=1ms"], ("slo.terms.0", "'foo'"), id="unknown-slo-metric"),
    pytest.param(
        "server",
        "args",
        {"max-model-len": 2048, "max-num-seqs": 64},
        ("server.args.max_num_seqs", "search-space parameter"),
        id="fixed-flag-also-searched",
    ),
    pytest.param("study", "name", "my study", ("study.name", "'my study'"), id="invalid-study-name"),
    pytest.param(
        "workload",
        "conversation",
        {"turns": 3, "think_time": "a while"},
        ("workload.conversation.think_time.value", "'a while'"),
        id="bad-think-time",
    ),
    pytest.param(
        "workload",
        "dataset",
        {"kind": "synthetic", "prefix": {"groups": 4, "hit_rate": 0.8, "weights": [1, 2]}},
        ("workload.dataset.prefix.weights", "one weight per group (4)", "[1.0, 2.0]"),
        id="prefix-weights-per-group",
    ),
    pytest.param(
        "workload",
        "dataset",
        {"kind": "synthetic", "time_scale": 2},
        ("workload.dataset.time_scale", "needs kind 'trace'"),
        id="time-scale-without-trace",
    ),
]


@pytest.mark.parametrize(("section", "key", "value", "needles"), BAD)
def test_validate_bad_spec_prints_one_line_exits_2_and_writes_nothing(
    tmp_path: Path, section: str, key: str, value: Any, needles: tuple[str, ...]
) -> None:
    """A bad spec: exit 2, stderr is one `error: <field>: ... <value>` line, no traceback, nothing written."""
    spec = _demo_copy(tmp_path)
    _edit_demo(spec, section, key, value)
    before = _tree(tmp_path)
    result = _autotune("validate", spec, cwd=tmp_path)
    _assert_one_error_line(result, *needles)
    assert result.stdout == ""
    assert _tree(tmp_path) == before
    assert not (tmp_path / "studies" / "demo").exists()


def test_validate_inverted_range_in_the_search_space(tmp_path: Path) -> None:
    """An inverted range in the search space prints the documented one-line message and exits 2."""
    spec = _demo_copy(tmp_path)
    space = tmp_path / "search_spaces" / "sim.yaml"
    text = space.read_text(encoding="utf-8")
    bad = text.replace("{type: int, low: 8, high: 512,", "{type: int, low: 512, high: 256,")
    assert bad != text
    space.write_text(bad, encoding="utf-8")
    before = _tree(tmp_path)
    line = _assert_one_error_line(_autotune("validate", spec))
    assert line == "error: search_space.params.max_num_seqs: low (512) must be <= high (256)"
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        pytest.param("study: {name: demo\n", ("spec: malformed YAML", "line 2"), id="malformed-yaml"),
        pytest.param("- just\n- a list\n", ("spec:", "list"), id="not-a-mapping"),
    ],
)
def test_validate_unreadable_spec_prints_one_line(
    tmp_path: Path, text: str, needles: tuple[str, ...]
) -> None:
    """Malformed YAML or a non-mapping file is one error line naming the problem, exit 2, file unchanged."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(text, encoding="utf-8")
    _assert_one_error_line(_autotune("validate", spec), *needles)
    assert spec.read_text(encoding="utf-8") == text
    assert [p.name for p in tmp_path.iterdir()] == ["spec.yaml"]


def test_validate_missing_spec_file(tmp_path: Path) -> None:
    """A spec path that does not exist is one error line naming the path, exit 2."""
    missing = tmp_path / "nope.yaml"
    _assert_one_error_line(_autotune("validate", missing), "nope.yaml")
    assert list(tmp_path.iterdir()) == []


def test_validate_demo_exits_0() -> None:
    """`autotune validate studies/demo.yaml` (the shipped demo, from the repo root) succeeds."""
    result = _autotune("validate", "studies/demo.yaml")
    assert result.returncode == 0, result.stderr
    assert "ok: study 'demo'" in result.stdout
    assert "storage: sqlite:///" in result.stdout


@pytest.mark.parametrize("name", ["prefix-chat", "layout-4gpu", "trace-replay"])
def test_validate_the_traffic_studies_exit_0(name: str) -> None:
    """The shipped traffic studies (multi-turn chat with prefix groups, the 4-GPU layout, a trace replay)
    validate from the repo root."""
    result = _autotune("validate", f"studies/{name}.yaml")
    assert result.returncode == 0, result.stderr
    assert f"ok: study '{name}'" in result.stdout


def test_validate_good_copy_reports_storage_and_writes_nothing(tmp_path: Path) -> None:
    """A good spec validates with exit 0, reports its default storage, and creates neither workdir nor db."""
    spec = _demo_copy(tmp_path)
    before = _tree(tmp_path)
    result = _autotune("validate", spec)
    assert result.returncode == 0, result.stderr
    workdir = (tmp_path / "studies" / "demo").resolve()
    assert f"storage: sqlite:///{workdir / 'study.db'}" in " ".join(result.stdout.split())  # wrapped at 80
    assert result.stderr == ""
    assert _tree(tmp_path) == before
    assert not workdir.exists()


def test_debug_shows_the_traceback_and_keeps_exit_2(tmp_path: Path) -> None:
    """With --debug the traceback is shown, the last line is still the error line, and the exit is 2."""
    spec = _demo_copy(tmp_path)
    _edit_demo(spec, "server", "port", 70000)
    result = _autotune("--debug", "validate", spec)
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: server.port: ")


def test_export_bad_format_is_one_line_before_the_study_is_opened(tmp_path: Path) -> None:
    """`export --format xml` exits 2 with one line naming --format and 'xml', without needing the study."""
    absent = tmp_path / "absent.yaml"
    line = _assert_one_error_line(_autotune("export", absent, "--format", "xml"), "--format", "'xml'")
    assert "vllm-yaml" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "args"),
    [
        ("--gpus", ("--gpus", "0,²")),
        ("--gpus-per-trial", ("--gpus", "0,1", "--gpus-per-trial", "²")),
    ],
)
def test_tune_with_a_superscript_digit_in_gpus_is_one_line(
    tmp_path: Path, option: str, args: tuple[str, ...]
) -> None:
    """'²' passes str.isdigit() but not int(): still one line naming the option and the value, exit 2,
    nothing written (a traceback before)."""
    spec = _demo_copy(tmp_path)
    before = _tree(tmp_path)
    _assert_one_error_line(_autotune("tune", spec, *args), f"error: {option}: ", "'²'")
    assert _tree(tmp_path) == before
