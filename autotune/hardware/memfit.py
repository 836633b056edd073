"""Fit the memory model's free terms to the KV capacity that launched servers reported.

Each observation is one launch: its plan's activation and CUDA-graph estimates and the residual
``r = observed - predicted`` KV bytes. The fit is

    r ≈ c0 - c1 x activation_bytes - c2 x cuda_graph_bytes

so the true activation peak is ``(1 + c1) x`` the estimate (``c1 = -0.7``: the model over-estimates
activations by 70 %), the true CUDA-graph memory ``(1 + c2) x`` its estimate, and ``c0`` is what neither
explains (non-torch memory, weights). ``c1`` and ``c2`` come from ridge-penalised least squares (a
Gaussian prior around 0 with :data:`PRIOR_SD`, against a reported capacity's noise :data:`NOISE_GIB`), so
without spread in a term (one observation, or all at one size) its coefficient stays 0 and the fit is the
constant offset: ``c0`` is the median of what the slopes leave, the spread the largest distance of a
residual from the fit. The factors ``1 + c`` are kept within :data:`FACTOR_RANGE`.

The uncertainty of a correction for a new plan is the spread plus, per term, the coefficient's standard
error times the distance of the plan's term outside the observed range: cautious where no launch was seen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.hardware.memory import MemoryPlan

_GIB = 1024**3

NOISE_GIB = 0.125
"""Noise of one reported KV capacity (GiB): the floor of the residuals' scatter in the coefficients'
standard errors."""
PRIOR_SD = (1.0, 1.0)
"""Prior standard deviation of ``c1`` (activations) and ``c2`` (CUDA graphs) around 0: the ridge."""
FACTOR_RANGE = ((0.1, 3.0), (0.1, 4.0))
"""Physically sensible range of the factors ``1 + c1`` (activations) and ``1 + c2`` (CUDA graphs)."""


@dataclass(frozen=True)
class Observation:
    """One launch that reported its KV capacity."""

    activation_bytes: int
    """The plan's activation-peak estimate."""
    cuda_graph_bytes: int
    """The plan's CUDA-graph estimate."""
    residual_bytes: int
    """Observed - predicted KV-cache bytes."""

    @classmethod
    def of(cls, plan: MemoryPlan, observed_kv_bytes: int) -> Observation:
        """The observation of a launch with ``plan`` whose server reported ``observed_kv_bytes``."""
        return cls(plan.activation_bytes, plan.cuda_graph_bytes, observed_kv_bytes - plan.kv_cache_bytes)


@dataclass(frozen=True)
class ResidualFit:
    """The fitted correction of the memory model's KV prediction (all zero without observations)."""

    offset_bytes: int = 0
    """``c0``: the part of the residual no term explains."""
    activation_coef: float = 0.0
    """``c1``: the true activation peak is ``(1 + c1) x`` the estimate."""
    cuda_graph_coef: float = 0.0
    """``c2``: the true CUDA-graph memory is ``(1 + c2) x`` the estimate."""
    observations: int = 0
    spread_bytes: int = 0
    """Largest distance of an observed residual from the fit."""
    activation_sd: float = 0.0
    """Standard error of ``c1``."""
    cuda_graph_sd: float = 0.0
    """Standard error of ``c2``."""
    activation_range: tuple[int, int] = (0, 0)
    """Smallest and largest observed activation estimate (bytes)."""
    cuda_graph_range: tuple[int, int] = (0, 0)
    """Smallest and largest observed CUDA-graph estimate (bytes)."""

    @property
    def activation_factor(self) -> float:
        """True activation peak / the model's estimate."""
        return 1.0 + self.activation_coef

    @property
    def cuda_graph_factor(self) -> float:
        """True CUDA-graph memory / the model's estimate."""
        return 1.0 + self.cuda_graph_coef

    def correction(self, activation_bytes: int, cuda_graph_bytes: int) -> int:
        """Bytes to add to the predicted KV cache of a plan with these estimates."""
        if not self.observations:
            return 0
        return self.offset_bytes - round(
            self.activation_coef * activation_bytes + self.cuda_graph_coef * cuda_graph_bytes
        )

    def uncertainty(self, activation_bytes: int, cuda_graph_bytes: int) -> int:
        """How far the correction may be off: the spread, plus each coefficient's standard error times how
        far the plan's term lies outside the observed range."""
        if not self.observations:
            return 0
        extrapolation = self.activation_sd * _outside(activation_bytes, self.activation_range)
        extrapolation += self.cuda_graph_sd * _outside(cuda_graph_bytes, self.cuda_graph_range)
        return self.spread_bytes + round(extrapolation)

    def predict(self, plan: MemoryPlan) -> tuple[int, int]:
        """(correction, uncertainty) in bytes for ``plan``."""
        a, g = plan.activation_bytes, plan.cuda_graph_bytes
        return self.correction(a, g), self.uncertainty(a, g)


def _outside(value: int, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return max(0, low - value, value - high)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the matrix is small and positive definite)."""
    n = len(vector)
    m = [[*row, v] for row, v in zip(matrix, vector, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            raise ZeroDivisionError("singular normal equations")
        for row in range(col + 1, n):
            factor = m[row][col] / m[col][col]
            for k in range(col, n + 1):
                m[row][k] -= factor * m[col][k]
    solution = [0.0] * n
    for row in reversed(range(n)):
        total = m[row][n] - sum(m[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = total / m[row][row]
    return solution


def _normal_equations(
    terms: Sequence[tuple[float, float]], targets: Sequence[float], free: Sequence[int]
) -> tuple[list[list[float]], list[float]]:
    """``Z'Z + ridge`` and ``Z'y`` for columns (1, -term_k for k in free), in GiB."""
    ridge = [(NOISE_GIB / sd) ** 2 for sd in PRIOR_SD]
    rows = [[1.0, *(-x[k] for k in free)] for x in terms]
    size = 1 + len(free)
    matrix = [[sum(z[i] * z[j] for z in rows) for j in range(size)] for i in range(size)]
    for i, k in enumerate(free, start=1):
        matrix[i][i] += ridge[k]
    vector = [sum(z[i] * y for z, y in zip(rows, targets, strict=True)) for i in range(size)]
    return matrix, vector


def fit_residuals(observations: Sequence[Observation]) -> ResidualFit:
    """Fit ``c0``, ``c1``, ``c2`` to the observations (see the module's docstring)."""
    if not observations:
        return ResidualFit()
    terms = [(o.activation_bytes / _GIB, o.cuda_graph_bytes / _GIB) for o in observations]
    residuals = [o.residual_bytes / _GIB for o in observations]
    coefs = [0.0, 0.0]
    free = [0, 1]
    fixed: dict[int, float] = {}
    while free:  # clip a coefficient out of its range, then fit the others with it held
        targets = [r + sum(c * x[k] for k, c in fixed.items()) for r, x in zip(residuals, terms, strict=True)]
        solution = _solve(*_normal_equations(terms, targets, free))
        out = {}
        for k, value in zip(free, solution[1:], strict=True):
            low, high = (f - 1.0 for f in FACTOR_RANGE[k])
            coefs[k] = value
            if not low <= value <= high:
                out[k] = min(high, max(low, value))
        if not out:
            break
        fixed.update(out)
        for k, value in out.items():
            coefs[k] = value
        free = [k for k in free if k not in fixed]
    left = [  # what the slopes leave, in bytes (the residuals themselves when both are 0)
        o.residual_bytes + round(coefs[0] * o.activation_bytes + coefs[1] * o.cuda_graph_bytes)
        for o in observations
    ]
    offset = int(statistics.median(left))
    spread = max(abs(v - offset) for v in left)
    scatter = math.sqrt(sum((v - offset) ** 2 for v in left) / max(1, len(left) - 3)) / _GIB
    noise = max(NOISE_GIB, scatter)
    matrix, _ = _normal_equations(terms, residuals, [0, 1])
    sds = [noise * math.sqrt(_solve(matrix, [float(i == k) for i in range(3)])[k]) for k in (1, 2)]
    actual = [o.activation_bytes for o in observations]
    graphs = [o.cuda_graph_bytes for o in observations]
    return ResidualFit(
        offset_bytes=offset,
        activation_coef=coefs[0],
        cuda_graph_coef=coefs[1],
        observations=len(observations),
        spread_bytes=spread,
        activation_sd=sds[0],
        cuda_graph_sd=sds[1],
        activation_range=(min(actual), max(actual)),
        cuda_graph_range=(min(graphs), max(graphs)),
    )
