"""Search space → Optuna distributions, the server's command line and environment, and the known
constraints between flags.

A constraint is a small boolean expression over flag names, fixed server args and facts, for example
``max_num_batched_tokens >= max_num_seqs`` or ``num_attention_heads % tensor_parallel_size == 0``.
Expressions are parsed once with :mod:`ast` and evaluated by a tiny interpreter that knows only names
(dotted ones too: ``speculative_config.num_speculative_tokens``), numbers, strings, comparisons,
``and``/``or``/``not``, ``+ - * / // %`` and ``in``: no ``eval``. A config that breaks one is rejected
before any launch.

Facts (:data:`FACTS`) are names a constraint may use beside the flags: ``gpus_per_trial`` (the trial's
GPU set) and the model's architecture (``num_attention_heads``, ``num_key_value_heads``,
``num_hidden_layers``) from the memory model's ``model`` (or ``server.model`` when it is a catalog name or
a local folder). A constraint that names a fact whose value is unknown is not checked (``validate`` says
so). With ``gpus_per_trial`` known, a config whose ``tensor_parallel_size × data_parallel_size`` exceeds
it is always rejected (vLLM would fail for want of GPUs).

The command line: ``json_flag.key`` parameters (``speculative_config.method``,
``compilation_config.cudagraph_mode``) are composed into one JSON flag (``--speculative-config
'{"method": "ngram", "num_speculative_tokens": 3}'``), with any fixed ``json_flag.key`` of
``server.args``; a parameter's ``unset`` value passes nothing (for a JSON key: the whole JSON flag is left
out). Environment parameters go to the server's environment, never to argv. The defaults' trial
(:meth:`SearchSpace.baseline_argv`) passes none of the tuned flags or variables.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.errors import SpecError
from autotune.flags import FlagValue, flag_argv
from autotune.hardware.catalog import ModelArch
from autotune.inputs.spec import BoolParam, CategoricalParam, FloatParam, IntParam, ParamSpec, SearchSpaceSpec

FACTS = ("gpus_per_trial", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
"""Names a constraint may use beside flags: the trial's GPU count and the model's architecture."""


def model_facts(arch: ModelArch) -> dict[str, FlagValue]:
    """The architecture facts of :data:`FACTS` (config.json's names) for ``arch``."""
    return {
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "num_hidden_layers": arch.num_layers,
    }


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
    points = {low, high} | ({param.default} if param.default is not None else set())
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


def _dotted(node: ast.AST) -> str | None:
    """``a.b`` for an attribute chain on a name (a JSON flag's key), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _names(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        name = _dotted(node)
        if name is not None:
            found.add(name)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


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
        ast.Attribute,
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
        if isinstance(child, ast.Attribute) and _dotted(child) is None:
            raise ValueError("only names may be dotted (json_flag.key)")


def _eval(node: ast.AST, env: Mapping[str, FlagValue]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name | ast.Attribute):
        name = _dotted(node)
        assert name is not None
        return env[name]
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
    known = set(space.all_params()) | set(fixed) | set(FACTS)
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
                f"parameter, a fixed flag in server.args nor a fact ({', '.join(FACTS)}): add it to "
                "server.args",
            )
        compiled.append(_Compiled(constraint.expr, constraint.why, tree))
    return tuple(compiled)


TP, DP = "tensor_parallel_size", "data_parallel_size"


def _int(value: FlagValue | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SearchSpace:
    """A validated search space bound to the study's fixed flags and known facts: sampling, checking,
    the server's argv and environment."""

    def __init__(
        self,
        spec: SearchSpaceSpec,
        fixed: Mapping[str, FlagValue],
        facts: Mapping[str, FlagValue] | None = None,
    ) -> None:
        self.spec = spec
        self.fixed: Mapping[str, FlagValue] = dict(fixed)
        self.facts: Mapping[str, FlagValue] = dict(facts or {})
        """Known values of :data:`FACTS` (``gpus_per_trial``, the model's head counts)."""
        self.params = spec.all_params()
        """Flag parameters, then environment parameters."""
        self._constraints = _compile(spec, fixed)
        self.unchecked = tuple(
            c.expr for c in self._constraints if (_names(c.tree) & set(FACTS)) - set(self.facts)
        )
        """Constraints left unchecked: they name a fact whose value is unknown here."""
        self._checked = tuple(c for c in self._constraints if c.expr not in self.unchecked)
        self.impossible = self._impossible()
        """Values no config can take (:class:`Impossible`): left out of sampling."""
        self._excluded = {(i.param, i.value) for i in self.impossible}
        for name, param in self.params.items():
            if isinstance(param, CategoricalParam | BoolParam) and not self._choices(name, param):
                why = "; ".join(str(i) for i in self.impossible if i.param == name)
                raise SpecError(
                    f"search_space.params.{name}",
                    f"no value can satisfy the constraints with the fixed flags ({why})",
                )

    def with_facts(self, **facts: FlagValue) -> SearchSpace:
        """The same space with more facts known (``gpus_per_trial=4``)."""
        return SearchSpace(self.spec, self.fixed, {**self.facts, **facts})

    def _gpu_rule(self) -> _Compiled | None:
        """``tensor_parallel_size * data_parallel_size <= gpus_per_trial`` when the GPU count is known and
        the space or the fixed flags name either size."""
        if "gpus_per_trial" not in self.facts or not ({TP, DP} & (set(self.params) | set(self.fixed))):
            return None
        tp = TP if TP in self.params or TP in self.fixed else "1"
        dp = DP if DP in self.params or DP in self.fixed else "1"
        expr = f"{tp} * {dp} <= gpus_per_trial"
        why = f"a trial has {self.facts['gpus_per_trial']} GPUs (--gpus-per-trial)"
        return _Compiled(expr, why, ast.parse(expr, mode="eval"))

    def _rules(self) -> tuple[_Compiled, ...]:
        rule = self._gpu_rule()
        return (*self._checked, *((rule,) if rule is not None else ()))

    def _impossible(self) -> tuple[Impossible, ...]:
        """Discrete values that fail a constraint whatever the constraint's other names are."""
        found: list[Impossible] = []
        for c in self._rules():
            names = sorted(n for n in _names(c.tree) if n in self.params)
            for name in names:
                param = self.params[name]
                if not isinstance(param, CategoricalParam | BoolParam):
                    continue
                others = [n for n in names if n != name]
                pools = [_candidates(self.params[n]) for n in others]
                if math.prod(len(pool) for pool in pools) > MAX_ASSIGNMENTS:
                    continue
                for value in _candidates(param):
                    if not self._can_hold(c, name, value, others, pools):
                        shown = [f"{n} {_describe(self.params[n])}" for n in others]
                        context = {**self.fixed, **self.facts}
                        shown += [f"{n}={context[n]}" for n in sorted(_names(c.tree) & set(context))]
                        found.append(
                            Impossible(name, value, c.expr, c.why, ", ".join(shown) or "no other flag")
                        )
        return tuple(found)

    def _can_hold(
        self, c: _Compiled, name: str, value: FlagValue, others: list[str], pools: list[list[FlagValue]]
    ) -> bool:
        for combo in itertools.product(*pools):
            env = {**self.fixed, **self.facts, name: value, **dict(zip(others, combo, strict=True))}
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
        """Parameter names in declaration order (flags, then environment variables)."""
        return tuple(self.params)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """The Optuna distribution of each parameter (booleans are categorical [False, True])."""
        dists: dict[str, optuna.distributions.BaseDistribution] = {}
        for name, p in self.params.items():
            if isinstance(p, IntParam):
                dists[name] = optuna.distributions.IntDistribution(p.low, p.high, log=p.log, step=p.step)
            elif isinstance(p, FloatParam):
                dists[name] = optuna.distributions.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
            else:
                assert isinstance(p, CategoricalParam | BoolParam)
                dists[name] = optuna.distributions.CategoricalDistribution(self._choices(name, p))
        return dists

    def suggest(self, trial: optuna.Trial, names: Iterable[str] | None = None) -> dict[str, FlagValue]:
        """Ask the trial for one value per parameter (``names``: only those); enqueued values come back
        as given."""
        flags: dict[str, FlagValue] = {}
        wanted = set(self.params) if names is None else set(names)
        for name, p in self.params.items():
            if name not in wanted:
                continue
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
        """The defaults the space declares (enqueued as the baseline trial's params)."""
        return self.spec.defaults()

    def snap(self, name: str, value: object) -> tuple[FlagValue | None, str]:
        """A value the server reported for parameter ``name``, as the space holds it: ``(value, "")``
        when it is one of the space's values, ``(nearest, why)`` when it lies between them or past an end
        (the nearest value stands for it), ``(None, why)`` when it cannot stand in the space at all."""
        param = self.params[name]
        if isinstance(param, BoolParam):
            if isinstance(value, bool):
                return value, ""
            return None, f"{value!r} is not a boolean"
        if isinstance(param, CategoricalParam):
            for choice in self._choices(name, param):
                if choice == value or str(choice) == str(value):
                    return choice, ""
            if isinstance(value, int | float) and not isinstance(value, bool):
                numbers = [c for c in self._choices(name, param) if isinstance(c, int | float)]
                if numbers:
                    near = min(numbers, key=lambda c: (abs(c - value), c))
                    return near, f"{value} is not a choice {list(param.choices)}: {near} stands for it"
            return None, f"{value!r} is not a choice {list(param.choices)}"
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None, f"{value!r} is not a number"
        low, high = param.low, param.high
        if isinstance(param, IntParam):
            clipped: float = min(max(round(value), low), high)
            clipped = low + round((clipped - low) / param.step) * param.step
            snapped: FlagValue = int(min(clipped, high))
        else:
            clipped = min(max(float(value), low), high)
            if param.step is not None:
                clipped = min(low + round((clipped - low) / param.step) * param.step, high)
            snapped = round(clipped, 10)
        if snapped == value:
            return snapped, ""
        where = "outside" if not low <= value <= high else "between the steps of"
        return snapped, f"{value:g} is {where} [{low:g}, {high:g}]: {snapped:g} stands for it"

    def nominal(self, name: str) -> FlagValue:
        """The value that stands for a parameter nobody declared or reported: the middle of a range
        (geometric for log scales) on its grid, the middle choice, False for a switch."""
        param = self.params[name]
        if isinstance(param, BoolParam):
            return False
        if isinstance(param, CategoricalParam):
            choices = self._choices(name, param)
            return choices[(len(choices) - 1) // 2]
        middle = math.sqrt(param.low * param.high) if param.log else (param.low + param.high) / 2
        value, _ = self.snap(name, middle)
        assert value is not None
        return value

    def violations(self, flags: Mapping[str, FlagValue]) -> tuple[Violation, ...]:
        """Every known constraint the config breaks (empty when it may be launched).

        Raises :class:`SpecError` naming the constraint when it cannot be evaluated for this config
        (a division by zero, or values of types it cannot compare).
        """
        env = {**self.fixed, **self.facts, **flags}
        broken = []
        for c in self._rules():
            try:
                holds = bool(_eval(c.tree, env))
            except KeyError:
                continue  # a parameter the config does not have (a partial baseline)
            except (ArithmeticError, TypeError) as exc:
                index = next((i for i, k in enumerate(self._constraints) if k is c), None)
                field = f"search_space.constraints.{index}.expr" if index is not None else "search_space"
                raise SpecError(
                    field, f"{c.expr!r} cannot be evaluated for {dict(env)}: {type(exc).__name__}: {exc}"
                ) from exc
            if not holds:
                broken.append(Violation(c.expr, c.why))
        return tuple(broken)

    def _is_unset(self, name: str, value: FlagValue) -> bool:
        param = self.params.get(name)
        return param is not None and param.unset is not None and param.unset == value

    def server_flags(self, flags: Mapping[str, FlagValue]) -> dict[str, FlagValue]:
        """Fixed server args then tuned flags as the server gets them (snake-case names): each
        ``json_flag.key`` parameter and fixed arg composed into one flag whose value is its JSON text,
        ``unset`` values and environment parameters left out. :meth:`argv` spells these; an export writes
        them (one rule for what a trial ran and what is deployed)."""
        out: dict[str, FlagValue] = {}
        composed: dict[str, dict[str, FlagValue]] = {}
        dropped: set[str] = set()
        for name, value in {**self.fixed, **flags}.items():
            if name in self.spec.env:
                continue
            flag, dot, key = name.partition(".")
            if self._is_unset(name, value):
                if dot:
                    dropped.add(flag)
                continue
            if dot:
                composed.setdefault(flag, {})[key] = value
            else:
                out[name] = value
        tuned = {n.partition(".")[0] for n in self.spec.params if "." in n}
        given = {n.partition(".")[0] for n in flags if "." in n}
        for flag, keys in composed.items():
            if flag not in dropped and (flag not in tuned or flag in given):  # fixed keys need the tuned
                out[flag] = json.dumps(keys, separators=(",", ":"))
        return out

    def argv(self, flags: Mapping[str, FlagValue]) -> list[str]:
        """Fixed server args then tuned flags, as separate argv items (never a shell string), as
        :meth:`server_flags` composes them."""
        return [item for name, value in self.server_flags(flags).items() for item in flag_argv(name, value)]

    def baseline_argv(self) -> list[str]:
        """The defaults' trial's flags: the fixed server args only (vLLM picks every tuned value)."""
        return self.argv({})

    def env(self, flags: Mapping[str, FlagValue]) -> dict[str, str]:
        """The environment parameters of ``flags`` as the server's variables (``unset`` ones left out)."""
        out: dict[str, str] = {}
        for name in self.spec.env:
            if name not in flags or self._is_unset(name, flags[name]):
                continue
            value = flags[name]
            out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    def launch_key(self, flags: Mapping[str, FlagValue]) -> str:
        """What makes two configs the same launch: the tuned part of the argv and the environment
        (parameters that pass nothing, such as a JSON key of a flag left out, do not count)."""
        return json.dumps({"argv": self.argv(flags), "env": self.env(flags)}, sort_keys=True)
