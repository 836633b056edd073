"""A misspelt command or option is refused with exit 2 and the closest valid one named (the spec's keys are
tested in test_spec.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from autotune.cli import app


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["statsu", "spec.yaml"], "Did you mean 'status'?"),
        (["exprot", "spec.yaml"], "Did you mean 'export'?"),
        (["best", "--fromat", "json", "spec.yaml"], "(Possible options: --format)"),
        (["init", "--modle", "Llama-3.1-8B"], "--model, --name)"),  # the close ones, --model among them
    ],
)
def test_a_misspelt_word_names_the_closest_valid_one(args: list[str], named: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert named in result.output
