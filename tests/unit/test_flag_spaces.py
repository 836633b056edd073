"""Spaces for the flags teams tune: optional defaults, JSON flags composed from keys, unset values,
environment parameters, facts in constraints, the GPU rule, and the defaults' trial judged against what
the server reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import SpecError
from autotune.hardware.catalog import load_model_arch
from autotune.inputs.space import SearchSpace, model_facts
from autotune.inputs.spec import SearchSpaceSpec, load_space
from autotune.predict.flagcheck import server_version, unknown_flags, version_note
from autotune.server.classify import classify_start_failure
from autotune.server.classify import unknown_flags as refused_flags
from autotune.server.effective import Effective, read_effective
from autotune.study.defaults import check_defaults

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"
FIXTURES = Path(__file__).resolve().parents[1] / "vllm" / "fixtures"


def _space(params: dict[str, object], **extra: object) -> SearchSpaceSpec:
    return SearchSpaceSpec.model_validate({"params": params, **extra})


def test_every_shipped_space_loads_names_its_vllm_versions_and_its_flags_exist_in_vllm_034() -> None:
    """Each file under search_spaces/ validates, says which vLLM versions it was checked against (but
    the legacy one, which spans releases nobody re-checked), and (for the 0.34 ones) passes no flag vLLM
    0.34's parser does not know."""
    arch = load_model_arch("Llama-3.1-8B")
    for path in sorted(SPACES.glob("*.yaml")):
        spec = load_space(path)
        assert spec.vllm_versions or path.name == "vllm-legacy.yaml", path.name
        space = SearchSpace(spec, {"max_model_len": 4096}, {**model_facts(arch), "gpus_per_trial": 8})
        if "0.34" in spec.vllm_versions:
            assert unknown_flags(space, "0.34.0") == [], path.name


def test_a_json_flag_is_composed_from_its_keys_and_left_out_when_its_unset_value_is_chosen() -> None:
    """``speculative_config.method`` and ``.num_speculative_tokens`` make one ``--speculative-config``
    JSON, with a fixed key of server.args; method ``off`` (its unset value) passes no such flag."""
    spec = load_space(SPACES / "vllm-0.34-speculative.yaml")
    space = SearchSpace(spec, {"max_model_len": 4096, "speculative_config.prompt_lookup_min": 2})
    on = {
        "speculative_config.method": "ngram",
        "speculative_config.num_speculative_tokens": 3,
        "speculative_config.prompt_lookup_max": 4,
    }
    argv = space.argv(on)
    flag = argv.index("--speculative-config")
    assert json.loads(argv[flag + 1]) == {
        "prompt_lookup_min": 2,
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    off = {**on, "speculative_config.method": "off"}
    assert "--speculative-config" not in space.argv(off)
    other = {**off, "speculative_config.num_speculative_tokens": 5}
    assert space.launch_key(off) == space.launch_key(other), "an inactive key makes no other launch"
    assert space.baseline_argv() == ["--max-model-len", "4096"]


def test_environment_parameters_go_to_the_environment_never_to_argv() -> None:
    """``env:`` parameters are the server's variables (a boolean as 1/0); ``unset`` passes nothing."""
    spec = load_space(SPACES / "vllm-0.34-kernels.yaml")
    space = SearchSpace(spec, {})
    flags = {"attention_backend": "FLASHINFER", "VLLM_USE_FLASHINFER_SAMPLER": False}
    assert space.argv(flags) == ["--attention-backend", "FLASHINFER"]
    assert space.env(flags) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert space.argv({**flags, "attention_backend": "auto"}) == []
    assert space.launch_key(flags) != space.launch_key({**flags, "VLLM_USE_FLASHINFER_SAMPLER": True})


def test_constraints_use_the_models_head_count_and_the_trials_gpus() -> None:
    """TP must divide the attention heads (a fact of the model), and TP x DP above the trial's GPUs is
    rejected, and never sampled when a value alone exceeds it."""
    spec = load_space(SPACES / "vllm-0.34-parallel.yaml")
    facts = model_facts(load_model_arch("Llama-3.1-8B"))  # 32 heads
    space = SearchSpace(spec, {}, {**facts, "num_attention_heads": 6, "gpus_per_trial": 4})
    assert space.violations({"tensor_parallel_size": 4, "data_parallel_size": 1}) != ()
    assert space.violations({"tensor_parallel_size": 2, "data_parallel_size": 2}) == ()
    assert space.violations({"tensor_parallel_size": 1, "data_parallel_size": 4}) == ()
    broken = space.violations({"tensor_parallel_size": 2, "data_parallel_size": 4})
    assert [v.expr for v in broken] == ["tensor_parallel_size * data_parallel_size <= gpus_per_trial"]
    assert "4 GPUs" in str(broken[0])
    excluded = {(i.param, i.value) for i in space.impossible}
    assert ("tensor_parallel_size", 8) in excluded and ("data_parallel_size", 8) in excluded
    unknown = SearchSpace(spec, {})
    assert unknown.unchecked == ("num_attention_heads % tensor_parallel_size == 0",)
    assert unknown.violations({"tensor_parallel_size": 8, "data_parallel_size": 8}) == ()


def test_bad_space_input_names_the_field_and_the_value() -> None:
    """A default or unset outside the range, a bad version or name: one SpecError naming them."""
    with pytest.raises(ValueError, match=r"unset \(7\) must lie in \[1, 4\]"):
        _space({"x": {"type": "int", "low": 1, "high": 4, "unset": 7}})
    with pytest.raises(ValueError, match="is not a vLLM version"):
        _space({"x": {"type": "bool"}}, vllm_versions=["latest"])
    with pytest.raises(ValueError, match="must be upper case"):
        _space({"x": {"type": "bool"}}, env={"vllm_x": {"type": "bool"}})
    with pytest.raises(ValueError, match="snake-case vLLM flag name"):
        _space({"Bad-Name": {"type": "bool"}})
    spec = _space({"x": {"type": "int", "low": 1, "high": 4}}, constraints=[{"expr": "x < y.z"}])
    with pytest.raises(SpecError, match=r"uses y\.z, which is neither"):
        SearchSpace(spec, {})


def test_the_defaults_trial_takes_reported_values_and_warns_where_the_space_disagrees() -> None:
    """Declared defaults stay the params (a differing report is a warning); undeclared ones take the
    reported value as the space holds it (nearest value, with a note), else the nominal value."""
    spec = _space(
        {
            "gpu_memory_utilization": {
                "type": "float",
                "low": 0.8,
                "high": 1.0,
                "step": 0.02,
                "default": 1.0,
            },
            "block_size": {"type": "categorical", "choices": [16, 32, 64]},
            "max_num_seqs": {"type": "int", "low": 32, "high": 512, "log": True},
            "max_num_batched_tokens": {"type": "int", "low": 1024, "high": 8192, "log": True},
            "speculative_config.method": {"type": "categorical", "choices": ["off", "ngram"], "unset": "off"},
        }
    )
    space = SearchSpace(spec, {})
    reported = Effective(
        {
            "gpu_memory_utilization": 0.92,
            "block_size": 128,
            "max_num_batched_tokens": 2048,
            "speculative_config": None,
        },
        {"gpu_memory_utilization": "vllm:cache_config_info"},
    )
    check = check_defaults(space, space.defaults(), reported)
    assert check.params == {
        "block_size": 64,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 2048,
        "speculative_config.method": "off",
    }
    text = "\n".join(check.warnings)
    assert "gpu_memory_utilization: the space declares 1.0" in text and "reported 0.92" in text
    assert "block_size: the server's default 128 is not a choice [16, 32, 64]: 64 stands for it" in text
    assert "max_num_seqs: no default declared and the server did not report one: 128" in text
    assert "max_num_batched_tokens" not in text
    assert check.contradicted == {"gpu_memory_utilization": 0.92}, "what the trial ran with"


def test_effective_config_is_read_from_real_vllm_lines_and_the_034_utilization_label() -> None:
    """From vLLM 0.32's real start-up log and /metrics: block size from vllm:cache_config_info, prefix
    caching, chunked prefill, TP, DP, KV dtype from the engine line; a 0.34 label of None resolves."""
    log = (FIXTURES / "start_ok.log").read_text()
    metrics = (FIXTURES / "metrics_idle.txt").read_text()
    got = read_effective(log, metrics)
    assert got.version == "0.32.0"
    assert got.values["block_size"] == 128 and got.sources["block_size"] == "vllm:cache_config_info"
    assert got.values["gpu_memory_utilization"] == 0.92
    assert got.values["enable_prefix_caching"] is True and got.values["enable_chunked_prefill"] is True
    assert got.values["tensor_parallel_size"] == 1 and got.values["speculative_config"] is None
    chunked = (FIXTURES / "fail_batched_tokens_lt_seqs.log").read_text()
    assert read_effective(chunked).values["max_num_batched_tokens"] == 64
    label_034 = metrics.replace('gpu_memory_utilization="0.92"', 'gpu_memory_utilization="None"')
    extensible = label_034.replace(
        "cache_config_info{", 'cache_config_info{enable_extensible_kv_cache="True",'
    )
    assert read_effective("", extensible).values["gpu_memory_utilization"] == 1.0
    assert read_effective("", label_034).values["gpu_memory_utilization"] == 0.92


def test_an_unknown_flag_is_invalid_config_naming_the_flag() -> None:
    """vLLM's ``unrecognized arguments`` (exit 2) names the flag in the trial's summary."""
    log = "usage: vllm [-h] [-v]\nvllm: error: unrecognized arguments: --max-num-partial-prefills 2\n"
    diagnosis = classify_start_failure(log, 2, False)
    assert diagnosis.cause == "invalid_config"
    assert "does not know the flag --max-num-partial-prefills" in diagnosis.summary
    assert refused_flags("error: unknown argument: --foo=3") == ("--foo",)


def test_validate_knows_the_simulators_version_and_flags_vllm_034_lacks() -> None:
    """The simulated server is vLLM 0.34.0; a 0.34 space with a flag 0.34 removed is flagged, a space
    checked against another version is noted."""
    assert server_version(["python", "-m", "autotune.sim", "Llama-3.1-8B"]) == "0.34.0"
    assert server_version(["some-launcher"]) is None
    spec = _space(
        {"max_num_partial_prefills": {"type": "int", "low": 1, "high": 4}},
        vllm_versions=["0.34"],
    )
    space = SearchSpace(spec, {"enable_prefix_caching": False})
    assert unknown_flags(space, "0.34.0") == ["--max-num-partial-prefills"]
    assert unknown_flags(space, "0.20.1") is None
    assert version_note(space, "0.34.0") is None
    assert "checked against 0.34" in (version_note(space, "0.32.0+cpu") or "")
