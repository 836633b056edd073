"""`autotune export --format helm`: values for the vLLM production stack's chart, read as the chart does.

No `helm` binary can be installed here (none in Debian's or PyPI's archives; the chart needs Helm 3
built from Go), so the check is the chart's own: the values are validated against its
``values.schema.json`` (fixtures/production_stack, upstream commit a6c01db), and the ``vllm serve``
command line is built from ``servingEngineSpec.modelSpec[].vllmConfig`` exactly as its template
``helm/templates/deployment-vllm-multi.yaml`` does, then parsed with vLLM 0.34's own option table
(:mod:`autotune.sim.vllm_options`): every item must be a real spelling with the right number of values,
and each flag must come back with the value the trial ran with.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from autotune.flags import FlagValue, flag_argv
from autotune.results.export import Format, choose, render
from autotune.sim.vllm_options import OPTIONS

from .test_export import make_study, open_, surface

SCHEMA = json.loads(
    (Path(__file__).parent / "fixtures" / "production_stack" / "values.schema.json").read_text()
)


def chart_argv(model_spec: Mapping[str, Any]) -> list[str]:
    """The container command the chart renders for one modelSpec (deployment-vllm-multi.yaml, the
    `vllmConfig` block: its dedicated keys, then each extraArgs item quoted as a string)."""
    argv = ["vllm", "serve", str(model_spec["modelURL"]), "--host", "0.0.0.0", "--port", "8000"]
    config = model_spec.get("vllmConfig")
    if config is None:
        return argv
    if "enableChunkedPrefill" in config:
        argv.append(
            "--enable-chunked-prefill" if config["enableChunkedPrefill"] else "--no-enable-chunked-prefill"
        )
    argv.append(
        "--enable-prefix-caching" if config.get("enablePrefixCaching") else "--no-enable-prefix-caching"
    )
    for key, flag in (
        ("maxModelLen", "--max-model-len"),
        ("dtype", "--dtype"),
        ("tensorParallelSize", "--tensor-parallel-size"),
        ("maxNumSeqs", "--max-num-seqs"),
        ("gpuMemoryUtilization", "--gpu_memory_utilization"),
        ("maxLoras", "--max_loras"),
    ):
        if key in config:
            argv += [flag, str(config[key])]
    argv += [str(item) for item in config.get("extraArgs") or []]
    return argv


def parse_vllm(argv: Sequence[str]) -> dict[str, str | bool]:
    """``vllm serve``'s options as vLLM 0.34's parser would take them (dest → value; a switch → bool);
    an unknown spelling or a missing value fails the test."""
    spellings = {s.replace("_", "-"): o for o in OPTIONS for s in o.spellings}
    out: dict[str, str | bool] = {}
    items = list(argv[3:])  # after `vllm serve MODEL`
    while items:
        word = items.pop(0)
        assert word.startswith("--"), f"{word!r} is not an option"
        option = spellings.get(word.replace("_", "-"))
        assert option is not None, f"{word} is not a `vllm serve` option"
        if option.arity == "0":
            out[option.dest] = word not in option.negative
        else:
            assert items and not items[0].startswith("--"), f"{word} needs a value"
            out[option.dest] = items.pop(0)
    return out


def _as_given(value: str | bool) -> FlagValue:
    if isinstance(value, bool):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def test_helm_values_pass_the_charts_schema_and_become_the_trials_command_line(tmp_path: Path) -> None:
    """Every measured config exports to values the chart's schema accepts, whose rendered command line
    parses with vLLM's own option table back to exactly the flags the trial ran with: integers spelt as
    integers, booleans as --x / --no-x, the fixed max-model-len included, prefix caching left on."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert {t.params["enable_chunked_prefill"] for t in complete} == {True, False}
    for trial in complete:
        choice = choose(study, loaded, trial=trial.number, policy=None)
        text = render(choice, loaded, Format.HELM)
        assert text.startswith(f"# autotune: study 'exp', trial {trial.number}")
        values = yaml.safe_load(text)
        jsonschema.validate(values, SCHEMA)
        (model,) = values["servingEngineSpec"]["modelSpec"]
        assert model["modelURL"] == "my/model"
        assert model["name"] == "model" and model["repository"] and model["tag"]
        assert isinstance(model["requestGPU"], int) and model["requestGPU"] == 1
        extra = model["vllmConfig"]["extraArgs"]
        assert all(isinstance(item, str) for item in extra)
        assert extra == [item for name, value in choice.flags.items() for item in flag_argv(name, value)]
        parsed = parse_vllm(chart_argv(model))
        assert parsed.pop("enable_prefix_caching") is True  # vLLM's default, which the study ran with
        assert parsed.pop("host") == "0.0.0.0" and parsed.pop("port") == "8000"
        assert {dest: _as_given(v) for dest, v in parsed.items()} == choice.flags
        for name, value in choice.flags.items():
            if isinstance(value, int) and not isinstance(value, bool):
                assert parsed[name] == str(value), (name, parsed[name])  # "64", never "64.0"


def test_a_tuned_prefix_caching_flag_goes_to_the_charts_own_key(tmp_path: Path) -> None:
    """The chart always passes --enable-prefix-caching or --no-enable-prefix-caching: a fixed
    enable-prefix-caching: false becomes enablePrefixCaching: false, not a second, contradicting flag."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=None)
    choice = dataclasses.replace(choice, flags={**choice.flags, "enable_prefix_caching": False})
    values = yaml.safe_load(render(choice, loaded, Format.HELM))
    config = values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]
    assert config["enablePrefixCaching"] is False
    assert not any("prefix-caching" in item for item in config["extraArgs"])
    assert (
        parse_vllm(chart_argv(values["servingEngineSpec"]["modelSpec"][0]))["enable_prefix_caching"] is False
    )
