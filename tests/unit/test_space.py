"""SearchSpace: Optuna distributions, sampling within the spec, the default baseline, constraints, argv."""

from __future__ import annotations

import builtins
import math
from pathlib import Path
from typing import Any, NoReturn

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from autotune.errors import SpecError
from autotune.flags import FlagValue
from autotune.inputs.space import SearchSpace, Violation
from autotune.inputs.spec import SearchSpaceSpec, load_space

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "search_spaces").glob("*.yaml"))

CONSTRAINTS = [
    {"expr": "max_num_batched_tokens >= max_num_seqs", "why": "batched tokens cover every sequence"},
    {
        "expr": "enable_chunked_prefill or max_num_batched_tokens >= max_model_len",
        "why": "without chunked prefill a whole prompt must fit one batch",
    },
]
SPEC: dict[str, Any] = {
    "params": {
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.98, "step": 0.02, "default": 0.9},
        "swap_space": {"type": "float", "low": 0.5, "high": 16.0, "log": True, "default": 4.0},
        "block_size": {"type": "categorical", "choices": [16, 32, 64, 128], "default": 16},
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"], "default": "auto"},
        "max_num_seqs": {"type": "int", "low": 8, "high": 512, "log": True, "default": 256},
        "max_num_batched_tokens": {"type": "int", "low": 512, "high": 8192, "log": True, "default": 2048},
        "max_seq_len_to_capture": {"type": "int", "low": 1024, "high": 8192, "step": 1024, "default": 8192},
        "enable_chunked_prefill": {"type": "bool", "default": True},
    },
    "constraints": CONSTRAINTS,
}
FIXED: dict[str, FlagValue] = {"max_model_len": 4096}


def _space(spec: dict[str, Any] | None = None, fixed: dict[str, FlagValue] | None = None) -> SearchSpace:
    return SearchSpace(SearchSpaceSpec.model_validate(spec or SPEC), FIXED if fixed is None else fixed)


def _study(seed: int = 0) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        storage=optuna.storages.InMemoryStorage(), sampler=optuna.samplers.RandomSampler(seed=seed)
    )


def test_distributions_match_the_spec() -> None:
    """Ints keep log and step, floats keep step or log, categoricals keep choices, bools are [False, True]."""
    dists = _space().distributions()
    assert list(dists) == list(SPEC["params"])
    assert dists["gpu_memory_utilization"] == FloatDistribution(0.8, 0.98, step=0.02)
    assert dists["swap_space"] == FloatDistribution(0.5, 16.0, log=True)
    assert dists["block_size"] == CategoricalDistribution([16, 32, 64, 128])
    assert dists["kv_cache_dtype"] == CategoricalDistribution(["auto", "fp8"])
    assert dists["max_num_seqs"] == IntDistribution(8, 512, log=True)
    assert dists["max_num_batched_tokens"] == IntDistribution(512, 8192, log=True)
    assert dists["max_seq_len_to_capture"] == IntDistribution(1024, 8192, step=1024)
    assert dists["enable_chunked_prefill"] == CategoricalDistribution([False, True])


def test_names_keep_declaration_order() -> None:
    """names lists the parameters in the order the spec declares them."""
    assert _space().names == tuple(SPEC["params"])


def _on_grid(value: float, low: float, step: float) -> bool:
    steps = (value - low) / step
    return math.isclose(steps, round(steps), abs_tol=1e-9)


def test_random_sampling_stays_within_ranges_and_steps() -> None:
    """Over many seeded random trials every value lies in its range, on its step, with the right type."""
    space = _space()
    study = _study(seed=1234)
    seen: dict[str, set[FlagValue]] = {name: set() for name in space.names}
    for _ in range(300):
        trial = study.ask()
        flags = space.suggest(trial)
        assert list(flags) == list(space.names)
        for name, value in flags.items():
            seen[name].add(value)
        gmu = flags["gpu_memory_utilization"]
        assert isinstance(gmu, float)
        assert 0.8 <= gmu <= 0.98
        assert _on_grid(gmu, 0.8, 0.02)
        assert gmu == round(gmu, 10)
        swap = flags["swap_space"]
        assert isinstance(swap, float)
        assert 0.5 <= swap <= 16.0
        for name, low, high in (("max_num_seqs", 8, 512), ("max_num_batched_tokens", 512, 8192)):
            value = flags[name]
            assert type(value) is int
            assert low <= value <= high
        capture = flags["max_seq_len_to_capture"]
        assert type(capture) is int
        assert capture in (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
        assert flags["block_size"] in (16, 32, 64, 128)
        assert flags["kv_cache_dtype"] in ("auto", "fp8")
        assert type(flags["enable_chunked_prefill"]) is bool
        study.tell(trial, 0.0)
    # The sampler explores: every choice and both booleans come up, ranges are spread out.
    assert seen["block_size"] == {16, 32, 64, 128}
    assert seen["kv_cache_dtype"] == {"auto", "fp8"}
    assert seen["enable_chunked_prefill"] == {False, True}
    assert len(seen["gpu_memory_utilization"]) == 10
    seqs = sorted(int(v) for v in seen["max_num_seqs"])
    assert seqs[0] < 16
    assert seqs[-1] > 256


def test_sampled_values_reproduce_with_the_same_seed() -> None:
    """The same sampler seed suggests the same configs."""
    space = _space()
    runs = []
    for _ in range(2):
        study = _study(seed=7)
        configs = []
        for _ in range(20):
            trial = study.ask()
            configs.append(space.suggest(trial))
            study.tell(trial, 0.0)
        runs.append(configs)
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "spec", [SPEC, *(load_space(p).model_dump() for p in SHIPPED)], ids=["test", *(p.stem for p in SHIPPED)]
)
def test_enqueued_defaults_come_back_from_suggest(spec: dict[str, Any]) -> None:
    """Enqueuing defaults() and suggesting on the next trial gives exactly the declared defaults, types
    included (a parameter without a declared default is sampled)."""
    space = _space(spec)
    defaults = space.defaults()
    assert set(defaults) <= set(space.names)
    study = _study()
    study.enqueue_trial(dict(defaults))
    flags = space.suggest(study.ask())
    assert {k: flags[k] for k in defaults} == defaults
    assert {k: type(flags[k]) for k in defaults} == {k: type(v) for k, v in defaults.items()}


def test_defaults_are_each_params_default() -> None:
    """defaults() maps each parameter to the default the spec gives it."""
    assert _space().defaults() == {name: p["default"] for name, p in SPEC["params"].items()}


def _config(**overrides: FlagValue) -> dict[str, FlagValue]:
    return {**_space().defaults(), **overrides}


def test_violations_pass_a_valid_config() -> None:
    """A config within every known rule has no violations (including the defaults)."""
    space = _space()
    assert space.violations(space.defaults()) == ()
    ok = _config(max_num_seqs=512, max_num_batched_tokens=512, enable_chunked_prefill=True)
    assert space.violations(ok) == ()
    no_chunking = _config(enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert space.violations(no_chunking) == ()


def test_violations_catch_batched_tokens_below_max_num_seqs() -> None:
    """max_num_batched_tokens < max_num_seqs breaks the first rule, reported with its reason."""
    (violation,) = _space().violations(_config(max_num_seqs=512, max_num_batched_tokens=511))
    assert violation == Violation(CONSTRAINTS[0]["expr"], CONSTRAINTS[0]["why"])
    assert str(violation) == (
        "max_num_batched_tokens >= max_num_seqs is false (batched tokens cover every sequence)"
    )


def test_violations_catch_the_chunked_prefill_and_max_model_len_rule() -> None:
    """Without chunked prefill, max_num_batched_tokens below the fixed max_model_len is a violation."""
    space = _space()
    (violation,) = space.violations(_config(enable_chunked_prefill=False, max_num_batched_tokens=2048))
    assert violation.expr == CONSTRAINTS[1]["expr"]
    both = space.violations(
        _config(enable_chunked_prefill=False, max_num_batched_tokens=512, max_num_seqs=513)
    )
    assert [v.expr for v in both] == [c["expr"] for c in CONSTRAINTS]


def test_violations_follow_the_fixed_args() -> None:
    """The same flags pass or fail depending on the fixed max_model_len they are bound to."""
    config = _config(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    assert _space(fixed={"max_model_len": 2048}).violations(config) == ()
    assert len(_space(fixed={"max_model_len": 8192}).violations(config)) == 1


@pytest.mark.parametrize(
    ("expr", "holds"),
    [
        ("kv_cache_dtype in ('auto', 'fp8')", True),
        ("kv_cache_dtype not in ['fp8']", True),
        ("not enable_chunked_prefill", False),
        ("512 <= max_num_batched_tokens <= 8192", True),
        ("max_num_batched_tokens // max_num_seqs == 8", True),
        ("max_num_batched_tokens % 1000 == 48 and -block_size < 0", True),
        ("gpu_memory_utilization * 100 - 90 > 0.5 or block_size / 16 != 1", False),
        ("max_model_len + max_num_seqs == 4352", True),
    ],
)
def test_constraint_language_evaluates_without_eval(
    monkeypatch: pytest.MonkeyPatch, expr: str, holds: bool
) -> None:
    """The constraint interpreter handles names, constants, arithmetic, comparisons, in, and/or/not
    with builtins.eval and exec made unusable."""

    def forbidden(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("eval/exec must not be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    spec = {**SPEC, "constraints": [{"expr": expr}]}
    space = _space(spec)
    assert (space.violations(space.defaults()) == ()) is holds


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch pwned')",
        "max_num_seqs.__class__ is int",
        "max_num_seqs.bit_length() > 1",
        "[max_num_seqs for _ in (1,)]",
        "(lambda: True)()",
        "max_num_seqs ** 2 > 1",
        "max_num_seqs if enable_chunked_prefill else 0",
        "{'a': max_num_seqs}",
        "block_size[0]",
        "~max_num_seqs",
    ],
)
def test_forbidden_constructs_are_rejected_when_the_space_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expr: str
) -> None:
    """Calls, attributes, comprehensions, lambdas, powers and friends are refused at load, never run."""
    monkeypatch.chdir(tmp_path)
    spec = SearchSpaceSpec.model_validate({**SPEC, "constraints": [{"expr": expr}]})
    with pytest.raises(SpecError) as info:
        SearchSpace(spec, FIXED)
    assert info.value.field == "search_space.constraints.0.expr"
    assert repr(expr) in info.value.message
    assert not (tmp_path / "pwned").exists()


def test_unknown_name_in_a_constraint_is_rejected() -> None:
    """A constraint naming neither a parameter nor a fixed flag is refused, naming the unknown flag."""
    spec = SearchSpaceSpec.model_validate(SPEC)
    with pytest.raises(SpecError, match="max_model_len") as info:
        SearchSpace(spec, {})
    assert info.value.field == "search_space.constraints.1.expr"


def test_a_constraint_that_cannot_be_evaluated_is_a_spec_error() -> None:
    """A division by zero (or a type clash) names the constraint instead of escaping as a raw exception."""
    spec = {**SPEC, "constraints": [CONSTRAINTS[0], {"expr": "max_num_seqs / (block_size - 16) > 1"}]}
    with pytest.raises(SpecError, match="ZeroDivisionError") as info:
        _space(spec).violations(_config(block_size=16))
    assert info.value.field == "search_space.constraints.1.expr"
    assert "\n" not in str(info.value)


def test_argv_keeps_each_value_as_one_item() -> None:
    """A value with spaces and dashes stays ONE argv item: no shell, no splitting, fixed args first."""
    space = _space(fixed={"max_model_len": 4096, "served_model_name": "16 --trust-remote-code"})
    argv = space.argv(_config(kv_cache_dtype="fp8"))
    assert argv[:4] == ["--max-model-len", "4096", "--served-model-name", "16 --trust-remote-code"]
    assert "--trust-remote-code" not in argv
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert argv[argv.index("--max-num-seqs") + 1] == "256"


def test_argv_renders_booleans_as_flag_and_no_flag() -> None:
    """True is --enable-chunked-prefill, False is --no-enable-chunked-prefill, neither takes a value."""
    space = _space(fixed={"max_model_len": 4096, "enforce_eager": False})
    on = space.argv(_config(enable_chunked_prefill=True))
    off = space.argv(_config(enable_chunked_prefill=False))
    assert on[-1] == "--enable-chunked-prefill"
    assert off[-1] == "--no-enable-chunked-prefill"
    assert "--no-enforce-eager" in on
    assert "True" not in on + off
    assert "False" not in on + off


def test_a_value_no_config_can_take_is_found_and_never_sampled() -> None:
    """With max_model_len 131072 and max_num_batched_tokens at most 32768, chunked prefill off can never
    satisfy the space's own constraint: it is reported, left out of the distribution, never suggested."""
    spec = SearchSpaceSpec.model_validate(
        {
            "params": {
                "max_num_batched_tokens": {
                    "type": "int",
                    "low": 1024,
                    "high": 32768,
                    "log": True,
                    "default": 8192,
                },
                "enable_chunked_prefill": {"type": "bool", "default": True},
                "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"], "default": "auto"},
            },
            "constraints": [{"expr": "enable_chunked_prefill or max_num_batched_tokens >= max_model_len"}],
        }
    )
    long_context = SearchSpace(spec, {"max_model_len": 131072})
    assert [(i.param, i.value) for i in long_context.impossible] == [("enable_chunked_prefill", False)]
    text = str(long_context.impossible[0])
    assert "enable_chunked_prefill=False can never hold" in text and "max_model_len=131072" in text
    assert long_context.distributions()["enable_chunked_prefill"].choices == (True,)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    assert all(long_context.suggest(study.ask())["enable_chunked_prefill"] is True for _ in range(30))
    short_context = SearchSpace(spec, {"max_model_len": 4096})
    assert short_context.impossible == ()  # 4096 <= 32768: chunked prefill off can hold
    assert short_context.distributions()["enable_chunked_prefill"].choices == (False, True)


def test_a_parameter_with_no_possible_value_is_a_spec_error() -> None:
    """A discrete parameter whose every value breaks a constraint: one SpecError naming it."""
    spec = SearchSpaceSpec.model_validate(
        {
            "params": {"block_size": {"type": "categorical", "choices": [16, 32], "default": 16}},
            "constraints": [{"expr": "block_size >= 64", "why": "the backend's minimum"}],
        }
    )
    with pytest.raises(SpecError, match=r"search_space.params.block_size: no value can satisfy"):
        SearchSpace(spec, {})
