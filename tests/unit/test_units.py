"""Figures as people read them (autotune/units.py): thousands separators, three significant figures below
1,000, never exponent notation; and the unit of each objective."""

from __future__ import annotations

import math

import pytest

from autotune.inputs.spec import objective_unit
from autotune.units import figure_spread, format_figure, gain_spread


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (19926.4, "19,926"),
        (1.993e4, "19,930"),  # what `:.4g` wrote as 1.993e+04
        (1_234_567.8, "1,234,568"),
        (1e20, "100,000,000,000,000,000,000"),
        (1000.0, "1,000"),
        (999.6, "1,000"),  # three significant figures round up to 1,000: written whole
        (999.4, "999"),
        (87.44, "87.4"),
        (12.5, "12.5"),
        (5.0, "5"),  # no trailing zeros
        (100, "100"),
        (0.9123, "0.912"),
        (0.05, "0.05"),
        (1.2e-5, "0.000012"),  # small: fixed decimals, never 1.2e-05
        (1e-7, "0"),  # below the last decimal shown
        (0, "0"),
        (-0.0, "0"),
        (-19926.4, "-19,926"),
        (-0.912, "-0.912"),
        (-1e-9, "0"),  # no "-0"
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "n/a"),
    ],
)
def test_a_figure_reads_without_exponent(value: float, shown: str) -> None:
    """Whole with thousands separators from 1,000, three significant figures below, never `e`."""
    assert format_figure(value) == shown
    assert "e" not in format_figure(value).replace("inf", "")


def test_a_figure_carries_its_unit_after_a_space() -> None:
    """The unit follows the digits; a nan stands alone (no unit to a figure that is not there)."""
    assert format_figure(19926.4, "tok/s") == "19,926 tok/s"
    assert format_figure(87.44, "req/s") == "87.4 req/s"
    assert format_figure(0.9123, "req/s") == "0.912 req/s"
    assert format_figure(412.3, "ms") == "412 ms"
    assert format_figure(math.inf, "req/s") == "inf req/s"
    assert format_figure(math.nan, "tok/s") == "n/a"


@pytest.mark.parametrize(
    ("metric", "unit"),
    [
        ("slo_throughput", "tok/s"),
        ("request_throughput", "req/s"),
        ("goodput", "req/s"),
        ("ttft:p95", "ms"),  # latency objectives are stored in milliseconds
        ("something_else", ""),
    ],
)
def test_each_objective_has_its_unit(metric: str, unit: str) -> None:
    assert objective_unit(metric) == unit


def test_an_interval_reads_as_plus_minus_where_symmetric_and_as_a_range_where_not() -> None:
    """A log-scale interval of ±85 % is really [486, 2,261]: printed as ± it would hide that; a symmetric
    one stays ± (half its width, relative for a figure, in points for a gain)."""
    assert figure_spread(1000.0, 970.0, 1030.0) == " ±3.0%"
    assert figure_spread(1048.2, 486.0, 2261.0) == " [486.0–2261.0]"
    assert gain_spread(0.415, 0.257, 0.573) == "+41.5% ±15.8%"
    assert gain_spread(0.397, -0.436, 2.46) == "+39.7% [-43.6%, +246.0%]"
    assert gain_spread(0.0, 0.0, 0.0) == "+0.0% ±0.0%"
