"""The HTML report opened in a real headless Chromium (tests/browser.py): no console error, no request
leaving the file, the answer on the first screen and the key elements present, each rate-search probe
painted in its stored verdict's colour, the spec named as typed; a full-page screenshot is kept under the
test's tmp folder. The check itself is shown to catch a page with a deliberate error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autotune.results.htmlreport.style import COLOURS
from autotune.results.status import read_study
from autotune.store.record import full_record
from autotune.study.loop import close_study

from ..browser import INSTALL_HINT, find_chromium, inspect_page
from ..unit.report_study import run_study

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_chromium() is None, reason=INSTALL_HINT),
]

PNG = b"\x89PNG\r\n\x1a\n"
CHECKS = {
    "title": "document.title",
    "answer": "document.querySelector('#answer h2').textContent",
    "answer_top": "document.querySelector('#answer').getBoundingClientRect().top",
    "answer_bottom": "document.querySelector('#answer').getBoundingClientRect().bottom",
    "serve": "document.getElementById('serve-line').textContent",
    "changed": "document.querySelectorAll('#answer tr.changed').length",
    "charts": "document.querySelectorAll('section svg[role=img]').length",
    "front_points": "document.querySelectorAll('#front svg .pt').length",
    "map_points": "document.querySelectorAll('#failures svg a .pt').length",
    "trial_rows": "document.querySelectorAll('#trials tr[id^=trial-]').length",
    "sections": "Array.from(document.querySelectorAll('section')).map(s => s.id).join(',')",
    "opened": "location.hash = '#trial-0'; document.querySelector('#trials details').open",
    "strips": "Array.from(document.querySelectorAll('#searches table.strip tr')).slice(1).map(tr => "
    "[tr.querySelector('a').textContent, Array.from(tr.querySelectorAll('svg .pt'))"
    ".filter(e => e.querySelector('title').textContent.startsWith('probe '))"
    ".map(e => getComputedStyle(e).fill)])",
    "legend": "Array.from(document.querySelectorAll('#searches .legend span')).map(s => "
    "[s.textContent, getComputedStyle(s.querySelector('.pt')).fill])",
    "spec": "document.getElementById('spec-path').textContent",
    "load_points": "document.querySelectorAll('#load svg[role=img] .pt').length",
}


def _rgb(hex_colour: str) -> str:
    """``#1a9850`` as the browser's computed style writes it: ``rgb(26, 152, 80)``."""
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def test_the_report_opens_in_chromium_without_console_errors(tmp_path: Path) -> None:
    """`autotune report` writes a page that loads in Chromium with no console error and no request off
    the file; the answer is on the first screen; charts, marks and rows are all there; a link to a trial
    opens the trials table."""
    (tmp_path / "study").mkdir()
    loaded = run_study(tmp_path / "study")
    page = tmp_path / "report.html"
    written = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "report",
            "study/spec.yaml",  # as a user types it, from the folder above
            "-o",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert written.returncode == 0, written.stderr
    assert f"wrote {page}" in written.stdout
    shot = tmp_path / "report.png"
    report = inspect_page(page, tmp_path / "chromium", expressions=CHECKS, screenshot=shot)
    print(f"report screenshot: {shot}")  # the test's artifact (pytest -s shows this line)

    assert report.errors == []
    assert report.external == []
    assert report.requests == [page.resolve().as_uri()]
    values = report.values
    assert values["title"] == "autotune report: rep"
    assert values["answer"].startswith("The answer: Use trial ")
    assert values["answer_top"] < 150 and values["answer_bottom"] < 1200, "the answer fills the first screen"
    assert values["serve"].startswith("vllm serve my/model --max-model-len 4096")
    assert values["changed"] >= 1
    assert values["charts"] >= 6
    assert values["front_points"] >= 5 and values["map_points"] == values["trial_rows"] == 15
    assert values["sections"].startswith("answer,front,progress,launches,failures,importance,latency,load")
    assert values["opened"] is True
    assert values["spec"] == "study/spec.yaml"
    assert values["load_points"] == 8  # two curve points of two terms, for the pick and the defaults
    # Each probe is painted in its stored verdict's colour; the legend's swatches are those colours.
    study = read_study(loaded)
    assert study is not None
    try:
        expected = {}
        for trial in study.get_trials(deepcopy=False):
            probes = full_record(trial, loaded.trial_dir(trial.number)).probes
            if probes:
                verdicts = [
                    "saturation" if p["saturation"] else "pass" if p["passed"] else "fail" for p in probes
                ]
                expected[str(trial.number)] = [_rgb(COLOURS[v]) for v in verdicts]
    finally:
        close_study(study)
    assert dict(values["strips"]) == expected
    kinds = [_rgb(COLOURS["saturation"]), _rgb(COLOURS["pass"]), _rgb(COLOURS["fail"])]
    assert expected and all(strip == kinds for strip in expected.values())  # the stand-in's every kind
    assert values["legend"][:3] == [
        ["met every SLO term", _rgb(COLOURS["pass"])],
        ["missed a term (or stopped early, or over-saturated)", _rgb(COLOURS["fail"])],
        ["saturation probe (every request at once), at its measured capacity", _rgb(COLOURS["saturation"])],
    ]
    assert shot.read_bytes().startswith(PNG) and shot.stat().st_size > 20_000


def test_the_browser_check_catches_a_console_error(tmp_path: Path) -> None:
    """The same check fails a page with a deliberate script error, a console.error call and an image from
    the network: each is reported (so a clean report above is evidence, not silence)."""
    broken = tmp_path / "broken.html"
    broken.write_text(
        "<!DOCTYPE html><html><head><title>broken</title></head><body><p id='x'>x</p>"
        "<script>console.error('deliberate'); window.notDefinedAnywhere();</script>"
        "<img src='http://example.invalid/chart.png' alt=''></body></html>"
    )
    report = inspect_page(broken, tmp_path / "chromium", expressions={"x": "document.getElementById('x').id"})
    assert any("console.error: deliberate" in e for e in report.errors)
    assert any("uncaught: TypeError" in e and "notDefinedAnywhere" in e for e in report.errors)
    assert any("example.invalid" in e for e in report.errors)
    assert report.external == ["http://example.invalid/chart.png"]
    assert report.values == {"x": "x"}
