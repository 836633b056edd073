"""The defaults' trial: what the server reported it runs with, against what the search space declares.

Trial 0 launches with none of the tuned flags, so vLLM picks every value itself; its record keeps what
the server reported (:mod:`autotune.server.effective`) as ``reported_defaults``. Optuna still needs a
value of each parameter for that trial (the sampler learns from it), taken in this order:

1. the space's ``default:`` when it declares one (queued before the launch, so a trial given back keeps
   its config); a reported value that differs is a warning, and the trial's record (``flags``, what the
   memory model, the crash boundary and the surrogate read) holds the reported value, the one it ran with;
2. else the reported value, as the space holds it (:meth:`autotune.inputs.space.SearchSpace.snap`: a value
   between two steps or choices is taken as the nearest, one past an end as that end, with a warning);
3. else the space's nominal value (:meth:`~autotune.inputs.space.SearchSpace.nominal`), with a warning that
   the server did not report it.

The gain over the defaults is always measured against this trial's measurement, whatever its params.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.flags import FlagValue
from autotune.inputs.space import SearchSpace
from autotune.server.effective import Effective


@dataclass(frozen=True)
class DefaultsCheck:
    """The defaults' trial judged against the space: each parameter's value for Optuna, and warnings."""

    params: Mapping[str, FlagValue] = field(default_factory=dict)
    """A value for every parameter that had none before the launch (declared defaults are not here)."""
    warnings: tuple[str, ...] = ()
    contradicted: Mapping[str, FlagValue] = field(default_factory=dict)
    """The declared defaults the server reported otherwise: name → the reported value, the one the trial
    ran with (its record's ``flags`` say so; its Optuna params keep the declared value)."""


def _same(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    return str(a) == str(b)


def _reported(space: SearchSpace, name: str, effective: Effective) -> tuple[bool, Any]:
    """What the server reported for parameter ``name`` (a key of a JSON flag reported off: the
    parameter's ``unset`` value)."""
    known, value = effective.get(name)
    if known and value is None and "." in name:
        unset = space.params[name].unset
        return (unset is not None, unset)
    return known, value


def check_defaults(
    space: SearchSpace, declared: Mapping[str, FlagValue], effective: Effective
) -> DefaultsCheck:
    """Judge the defaults' trial: ``declared`` are the params it already has (the space's defaults),
    ``effective`` what the server reported. Environment parameters are never reported (the server's
    environment is what the tuner gave it)."""
    params: dict[str, FlagValue] = {}
    contradicted: dict[str, FlagValue] = {}
    warnings: list[str] = []
    for name, param in space.params.items():
        known, value = (False, None) if name in space.spec.env else _reported(space, name, effective)
        where = effective.sources.get(name.partition(".")[0], "the server")
        if name in declared:
            if known and value is not None and not _same(value, declared[name]):
                warnings.append(
                    f"{name}: the space declares {declared[name]!r} as vLLM's default, the server "
                    f"reported {value!r} ({where}); the defaults' trial ran with {value!r}"
                )
                contradicted[name] = value
            continue
        if known and value is not None:
            snapped, why = space.snap(name, value)
            if snapped is not None:
                params[name] = snapped
                if why:
                    warnings.append(f"{name}: the server's default {why}")
                continue
            warnings.append(f"{name}: the server's default {why}: {space.nominal(name)!r} stands for it")
        elif param.default is None:
            warnings.append(
                f"{name}: no default declared and the server did not report one: "
                f"{space.nominal(name)!r} stands for it"
            )
        params[name] = space.nominal(name)
    return DefaultsCheck(params, tuple(warnings), contradicted)
