"""autotune: find the best `vllm serve` flags for a model, a GPU and a traffic pattern.

The public API (everything else is internal and may change):

- :func:`load_study` reads and validates a study spec and its search space;
- :func:`run_study` runs or resumes it (one server launch per trial), :func:`open_study` opens it;
- :func:`choose` / :func:`render` pick and export a config from the Pareto front;
- :class:`Cause` and :class:`TrialOutcome` describe how trials end;
- :class:`AutotuneError` roots every error autotune raises on purpose (:class:`SpecError` for bad input).
"""

from autotune.errors import AutotuneError, SpecError
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.results.export import Format, Policy, choose, render
from autotune.study.loop import open_study
from autotune.study.trial import run_study

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "Cause",
    "Format",
    "LoadedStudy",
    "Policy",
    "SpecError",
    "TrialOutcome",
    "__version__",
    "choose",
    "load_study",
    "open_study",
    "render",
    "run_study",
]
