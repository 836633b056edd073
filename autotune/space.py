"""Search space → Optuna distributions, and the known constraints between flags.

A constraint is a small boolean expression over flag names and fixed server args, for example
``max_num_batched_tokens >= max_num_seqs`` or ``enable_chunked_prefill or max_num_batched_tokens >=
max_model_len``. Expressions are parsed once with :mod:`ast` and evaluated by a tiny interpreter that
knows only names, numbers, strings, comparisons, ``and``/``or``/``not``, ``+ - * / // %`` and ``in``:
no ``eval``. A config that breaks one is rejected before any launch.
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.errors import SpecError
from autotune.spec import (
    BoolParam,
    CategoricalParam,
    FlagValue,
    FloatParam,
    IntParam,
    ParamSpec,
    SearchSpaceSpec,
    flag_argv,
)

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


@dataclass(frozen=True)
class Impossible:
    """A value of a parameter that no config can take: with the fixed flags, one known constraint fails
    whatever the other parameters are. The study never samples it."""

    param: str
    value: FlagValue
    expr: str
    why: str
    others: str
    """The values of the constraint's other names that were tried (their ranges, or the fixed value)."""

    def __str__(self) -> str:
        reason = f" ({self.why})" if self.why else ""
        return (
            f"{self.param}={self.value} can never hold: {self.expr!r} is false for every config "
            f"with {self.others}{reason}; the study does not sample it"
        )


#: At most this many assignments of a constraint's names are tried to prove a value impossible.
MAX_ASSIGNMENTS = 20000


def _candidates(param: ParamSpec) -> list[FlagValue]:
    """Values of a parameter that stand for its whole range in a constraint: every choice, or a
    numeric range's ends, default and a few points between (constraints are monotone in practice)."""
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    if isinstance(param, BoolParam):
        return [False, True]
    low, high = param.low, param.high
    points = {low, high, param.default}
    for k in range(1, 8):
        if param.log and low > 0:
            points.add(low * (high / low) ** (k / 8))
        else:
            points.add(low + (high - low) * k / 8)
    if isinstance(param, IntParam):
        return sorted({round(v) for v in points})
    return sorted(float(v) for v in points)


def _describe(param: ParamSpec) -> str:
    if isinstance(param, CategoricalParam):
        return "in " + "/".join(str(c) for c in param.choices)
    if isinstance(param, BoolParam):
        return "true or false"
    return f"in [{param.low:g}, {param.high:g}]"


@dataclass(frozen=True)
class Violation:
    """A constraint a config breaks: the expression and why the rule exists."""

    expr: str
    why: str

    def __str__(self) -> str:
        return f"{self.expr} is false" + (f" ({self.why})" if self.why else "")


def _names(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _check_node(node: ast.AST) -> None:
    allowed = (
        ast.Expression,
        ast.BoolOp,
        ast.And,
        ast.Or,
        ast.UnaryOp,
        ast.Not,
        ast.USub,
        ast.BinOp,
        ast.Compare,
        ast.Name,
        ast.Load,
        ast.Constant,
        ast.Tuple,
        ast.List,
        *_BINOPS,
        *_CMPOPS,
    )
    for child in ast.walk(node):
        if not isinstance(child, allowed):
            raise ValueError(f"'{type(child).__name__}' is not allowed in a constraint")


def _eval(node: ast.AST, env: Mapping[str, FlagValue]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env)
        return (not value) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, env) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _eval(comparator, env)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    raise ValueError(f"unsupported expression node {type(node).__name__}")


@dataclass(frozen=True)
class _Compiled:
    expr: str
    why: str
    tree: ast.Expression


def _compile(space: SearchSpaceSpec, fixed: Mapping[str, FlagValue]) -> tuple[_Compiled, ...]:
    known = set(space.params) | set(fixed)
    compiled = []
    for i, constraint in enumerate(space.constraints):
        field = f"search_space.constraints.{i}.expr"
        try:
            tree = ast.parse(constraint.expr, mode="eval")
            _check_node(tree)
        except (SyntaxError, ValueError) as exc:
            raise SpecError(field, f"invalid expression {constraint.expr!r}: {exc}") from exc
        unknown = sorted(_names(tree) - known)
        if unknown:
            raise SpecError(
                field,
                f"{constraint.expr!r} uses {', '.join(unknown)}, which is neither a search-space "
                "parameter nor a fixed flag in server.args: add it to server.args",
            )
        compiled.append(_Compiled(constraint.expr, constraint.why, tree))
    return tuple(compiled)


class SearchSpace:
    """A validated search space bound to the study's fixed flags: sampling, checking, argv."""

    def __init__(self, spec: SearchSpaceSpec, fixed: Mapping[str, FlagValue]) -> None:
        self.spec = spec
        self.fixed: Mapping[str, FlagValue] = dict(fixed)
        self._constraints = _compile(spec, fixed)
        self.impossible = self._impossible()
        """Values no config can take (:class:`Impossible`): left out of sampling."""
        self._excluded = {(i.param, i.value) for i in self.impossible}
        for name, param in spec.params.items():
            if isinstance(param, CategoricalParam | BoolParam) and not self._choices(name, param):
                why = "; ".join(str(i) for i in self.impossible if i.param == name)
                raise SpecError(
                    f"search_space.params.{name}",
                    f"no value can satisfy the constraints with the fixed flags ({why})",
                )

    def _impossible(self) -> tuple[Impossible, ...]:
        """Discrete values that fail a constraint whatever the constraint's other names are."""
        found: list[Impossible] = []
        for c in self._constraints:
            names = sorted(n for n in _names(c.tree) if n in self.spec.params)
            for name in names:
                param = self.spec.params[name]
                if not isinstance(param, CategoricalParam | BoolParam):
                    continue
                others = [n for n in names if n != name]
                pools = [_candidates(self.spec.params[n]) for n in others]
                if math.prod(len(pool) for pool in pools) > MAX_ASSIGNMENTS:
                    continue
                for value in _candidates(param):
                    if not self._can_hold(c, name, value, others, pools):
                        shown = [f"{n} {_describe(self.spec.params[n])}" for n in others]
                        shown += [f"{n}={self.fixed[n]}" for n in sorted(_names(c.tree) & set(self.fixed))]
                        found.append(
                            Impossible(name, value, c.expr, c.why, ", ".join(shown) or "no other flag")
                        )
        return tuple(found)

    def _can_hold(
        self, c: _Compiled, name: str, value: FlagValue, others: list[str], pools: list[list[FlagValue]]
    ) -> bool:
        for combo in itertools.product(*pools):
            env = {**self.fixed, name: value, **dict(zip(others, combo, strict=True))}
            try:
                if _eval(c.tree, env):
                    return True
            except (ArithmeticError, TypeError):
                return True  # not provably impossible
        return False

    def _choices(self, name: str, param: CategoricalParam | BoolParam) -> list[FlagValue]:
        values: list[FlagValue] = (
            list(param.choices) if isinstance(param, CategoricalParam) else [False, True]
        )
        return [v for v in values if (name, v) not in self._excluded]

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in declaration order."""
        return tuple(self.spec.params)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """The Optuna distribution of each parameter (booleans are categorical [False, True])."""
        dists: dict[str, optuna.distributions.BaseDistribution] = {}
        for name, p in self.spec.params.items():
            if isinstance(p, IntParam):
                dists[name] = optuna.distributions.IntDistribution(p.low, p.high, log=p.log, step=p.step)
            elif isinstance(p, FloatParam):
                dists[name] = optuna.distributions.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
            else:
                assert isinstance(p, CategoricalParam | BoolParam)
                dists[name] = optuna.distributions.CategoricalDistribution(self._choices(name, p))
        return dists

    def suggest(self, trial: optuna.Trial) -> dict[str, FlagValue]:
        """Ask the trial for one value per parameter (enqueued values come back as given)."""
        flags: dict[str, FlagValue] = {}
        for name, p in self.spec.params.items():
            if isinstance(p, IntParam):
                flags[name] = trial.suggest_int(name, p.low, p.high, step=p.step, log=p.log)
            elif isinstance(p, FloatParam):
                value = trial.suggest_float(name, p.low, p.high, step=p.step, log=p.log)
                flags[name] = round(value, 10)
            elif isinstance(p, CategoricalParam):
                choice = trial.suggest_categorical(name, self._choices(name, p))
                assert choice is not None
                flags[name] = choice
            else:
                flags[name] = bool(trial.suggest_categorical(name, self._choices(name, p)))
        return flags

    def defaults(self) -> dict[str, FlagValue]:
        """The baseline config: each parameter's vLLM default."""
        return self.spec.defaults()

    def violations(self, flags: Mapping[str, FlagValue]) -> tuple[Violation, ...]:
        """Every known constraint the config breaks (empty when it may be launched).

        Raises :class:`SpecError` naming the constraint when it cannot be evaluated for this config
        (a division by zero, or values of types it cannot compare).
        """
        env = {**self.fixed, **flags}
        broken = []
        for i, c in enumerate(self._constraints):
            try:
                holds = bool(_eval(c.tree, env))
            except (ArithmeticError, TypeError) as exc:
                raise SpecError(
                    f"search_space.constraints.{i}.expr",
                    f"{c.expr!r} cannot be evaluated for {dict(env)}: {type(exc).__name__}: {exc}",
                ) from exc
            if not holds:
                broken.append(Violation(c.expr, c.why))
        return tuple(broken)

    def argv(self, flags: Mapping[str, FlagValue]) -> list[str]:
        """Fixed server args then tuned flags, as separate argv items (never a shell string)."""
        out: list[str] = []
        for name, value in {**self.fixed, **flags}.items():
            out += flag_argv(name, value)
        return out
