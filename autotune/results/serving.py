"""The gain in GPUs: how many replicas of a config serve the expected traffic within the SLOs, and what its
output tokens cost at a GPU's price.

A replica sustains the config's SLO rate: its stated figure (:attr:`autotune.results.export.Choice.figure`,
the reruns' mean once it was measured again) over the output tokens of a request. The traffic is
``workload.expected_rate``; the price ``cost.gpu_hour``. A replica takes ``tensor_parallel_size ×
pipeline_parallel_size × data_parallel_size`` GPUs. Each count comes with the counts at the two ends of the
figure's interval, so a reader sees when the answer hangs on the noise. Measured, not modelled: the SLO
rate is what the server sustained.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.results.export import Choice
from autotune.store.record import TrialRecord
from autotune.units import format_figure, plural

PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
"""The flags whose product is the GPUs one server takes."""


@dataclass(frozen=True)
class Serving:
    """One config serving the study's expected traffic."""

    trial: int
    rate: float | None
    """Requests per second one replica sustains within the SLOs (``None``: unknown)."""
    rate_interval: tuple[float, float] | None
    gpus_per_replica: int
    replicas: int | None
    """Replicas for the expected traffic (``None``: no expected traffic, or no rate)."""
    replicas_range: tuple[int, int] | None
    """Replicas at the high and the low end of the rate's interval (fewest first)."""
    cost_per_million: float | None
    """The price of a million output tokens at its SLO rate (``None``: no price, or no figure)."""

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica

    def as_dict(self) -> dict[str, Any]:
        """The JSON fields (``best --format json``, each config)."""
        return {
            "replica_request_rate": self.rate,
            "gpus_per_replica": self.gpus_per_replica,
            "replicas": self.replicas,
            "replicas_range": list(self.replicas_range) if self.replicas_range else None,
            "gpus": self.gpus,
            "cost_per_million_output_tokens": self.cost_per_million,
        }


def gpus_per_replica(flags: Mapping[str, FlagValue]) -> int:
    """The GPUs one server with ``flags`` (snake-case keys, fixed args included) takes."""
    count = 1
    for name in PARALLEL:
        value = flags.get(name, 1)
        count *= (
            int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1 else 1
        )
    return count


def tokens_per_request(record: TrialRecord) -> float | None:
    """Mean output tokens of a judged request of the trial's search (from its estimate, else from its
    operating point)."""
    est = record.estimate or {}
    tokens = est.get("tokens_per_request")
    if isinstance(tokens, int | float) and tokens > 0:
        return float(tokens)
    point = record.operating_point or {}
    out, req = point.get("output_throughput"), point.get("request_throughput")
    if isinstance(out, int | float) and isinstance(req, int | float) and out > 0 and req > 0:
        return float(out) / float(req)
    return None


def serving(choice: Choice, loaded: LoadedStudy) -> Serving:
    """How ``choice`` serves the study's expected traffic, and its cost per million output tokens."""
    figure = choice.figure
    tokens = tokens_per_request(TrialRecord.from_trial(choice.trial))
    per = gpus_per_replica(choice.flags)
    rate = figure.value / tokens if figure.value and tokens else None
    interval = None
    if rate is not None and tokens and figure.interval is not None:
        interval = (figure.interval[0] / tokens, figure.interval[1] / tokens)
    expected = loaded.spec.workload.expected_rate
    replicas = _replicas(expected, rate)
    spread = None
    if expected is not None and interval is not None and interval[0] > 0:
        fewest, most = _replicas(expected, interval[1]), _replicas(expected, interval[0])
        spread = (fewest, most) if fewest is not None and most is not None else None
    cost = loaded.spec.cost
    per_million = None
    if cost is not None and figure.value:
        per_million = cost.gpu_hour * per / (figure.value * 3600 / 1e6)
    return Serving(choice.trial.number, rate, interval, per, replicas, spread, per_million)


def _replicas(expected: float | None, rate: float | None) -> int | None:
    """Replicas of ``rate`` each that serve ``expected`` (``None`` when either is unknown or unbounded)."""
    if expected is None or rate is None or not 0 < rate < math.inf:
        return None
    return max(1, math.ceil(expected / rate - 1e-9))


def serving_lines(pick: Serving, defaults: Serving | None, loaded: LoadedStudy) -> list[str]:
    """What the pick and the defaults need for the expected traffic and what their tokens cost, in words
    (nothing without an expected traffic or a price)."""
    lines = []
    other = defaults if defaults is not None and defaults.trial != pick.trial else None
    expected = loaded.spec.workload.expected_rate
    if expected is not None and pick.replicas is not None:
        text = (
            f"Serving the expected {format_figure(expected)} req/s within the SLOs: trial {pick.trial} needs "
        )
        text += _need(pick)
        if other is not None and other.replicas is not None:
            saved = (other.gpus or 0) - (pick.gpus or 0)
            fewer = f": {plural(abs(saved), 'GPU')} {'fewer' if saved > 0 else 'more'}" if saved else ""
            text += f"; vLLM's defaults need {_need(other)}{fewer}"
        lines.append(text + ".")
    cost = loaded.spec.cost
    if cost is not None and pick.cost_per_million is not None:
        price = f"{cost.currency}{cost.gpu_hour:g} a GPU-hour"
        text = f"Cost per million output tokens at its SLO rate ({price}): trial {pick.trial} "
        text += f"{cost.currency}{pick.cost_per_million:.3g}"
        if other is not None and other.cost_per_million is not None:
            text += f", vLLM's defaults {cost.currency}{other.cost_per_million:.3g}"
        lines.append(text + ".")
    return lines


def _need(one: Serving) -> str:
    """``3 replicas (3 GPUs)``, with the range the figure's interval allows when it differs."""
    count = one.replicas or 0
    text = f"{plural(count, 'replica')} ({plural(one.gpus or 0, 'GPU')})"
    if one.replicas_range is not None and one.replicas_range[0] != one.replicas_range[1]:
        text += f", {one.replicas_range[0]}-{one.replicas_range[1]} within its interval"
    return text
