"""Study specs and search spaces: each bad input is one SpecError naming field and value; good specs load."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.errors import SpecError
from autotune.inputs.loader import load_study
from autotune.inputs.space import SearchSpace
from autotune.inputs.spec import Objective, SloSection, load_space

REPO = Path(__file__).resolve().parents[2]
DELETE = object()

SPACE: dict[str, Any] = {
    "name": "test",
    "params": {
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.98, "step": 0.02, "default": 0.9},
        "block_size": {"type": "categorical", "choices": [16, 32, 64], "default": 16},
        "max_num_seqs": {"type": "int", "low": 8, "high": 512, "log": True, "default": 256},
        "max_num_batched_tokens": {"type": "int", "low": 512, "high": 8192, "log": True, "default": 2048},
        "enable_chunked_prefill": {"type": "bool", "default": True},
    },
    "constraints": [
        {"expr": "max_num_batched_tokens >= max_num_seqs", "why": "vLLM SchedulerConfig"},
        {"expr": "enable_chunked_prefill or max_num_batched_tokens >= max_model_len"},
    ],
}

SPEC: dict[str, Any] = {
    "study": {"name": "unit"},
    "server": {
        "command": ["python", "-m", "autotune.sim", "tiny"],
        "model": "tiny",
        "args": {"max-model-len": 2048},
        "port": 0,
        "start_timeout": "60s",
    },
    "search_space": "space.yaml",
    "workload": {"dataset": {"kind": "synthetic", "input_len": 128, "output_len": 32}},
    "slo": {"terms": ["ttft:p95<=500ms", "tpot:p95<=50ms"]},
    "objectives": [
        {"metric": "slo_throughput", "direction": "maximize"},
        {"metric": "ttft:p95", "direction": "minimize"},
    ],
}


def _edit(data: dict[str, Any], edits: Mapping[str, object]) -> dict[str, Any]:
    """A deep copy of ``data`` with each dotted path set to its value (or removed for DELETE)."""
    out = copy.deepcopy(data)
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return out


def _write(
    tmp_path: Path,
    spec: Mapping[str, object] | None = None,
    space: Mapping[str, object] | None = None,
    *,
    spec_text: str | None = None,
    space_text: str | None = None,
) -> Path:
    """Write a spec and its search space into ``tmp_path``; return the spec's path."""
    (tmp_path / "space.yaml").write_text(
        space_text if space_text is not None else yaml.safe_dump(dict(space or SPACE)), encoding="utf-8"
    )
    path = tmp_path / "spec.yaml"
    path.write_text(
        spec_text if spec_text is not None else yaml.safe_dump(dict(spec or SPEC)), encoding="utf-8"
    )
    return path


def _spec_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_study(path)
    err = info.value
    text = str(err)
    assert "\n" not in text, text
    assert err.exit_code == 2
    for leak in ("validation error", "For further information", "Traceback", "pydantic"):
        assert leak not in text, text
    return err


# ----------------------------------------------------------------------------------------------
# Bad input: one SpecError naming the field path and the value
# ----------------------------------------------------------------------------------------------

STUDY_CASES: list[Any] = [
    # unknown keys at several depths
    pytest.param({"colour": "red"}, "colour", "'red'", id="unknown-top-level-key"),
    pytest.param({"study.colour": "red"}, "study.colour", "unknown key", id="unknown-study-key"),
    pytest.param({"server.gpus": 8}, "server.gpus", "unknown key", id="unknown-server-key"),
    pytest.param(
        {"workload.dataset.shuffle": True},
        "workload.dataset.shuffle",
        "unknown key",
        id="unknown-dataset-key",
    ),
    # a misspelt key names the closest valid one
    pytest.param({"budgte": {"launches": 3}}, "budgte", "did you mean 'budget'?", id="did-you-mean-top"),
    pytest.param(
        {"budget.lanches": 3}, "budget.lanches", "did you mean 'launches'?", id="did-you-mean-depth"
    ),
    pytest.param({"slo.eror_budget": 0.1}, "slo.eror_budget", "'error_budget'?", id="did-you-mean-slo"),
    pytest.param(
        {"workload.dataset.input_lenn": 5},
        "workload.dataset.input_lenn",
        "'input_len'?",
        id="did-you-mean-deep",
    ),
    # wrong types
    pytest.param({"budget.launches": "many"}, "budget.launches", "'many'", id="string-where-int"),
    pytest.param({"budget.trials": "many"}, "budget.launches", "'many'", id="string-where-int-old-name"),
    pytest.param({"budget": {"trials": 3, "launches": 4}}, "budget", "former name", id="budget-both-names"),
    pytest.param({"server.port": True}, "server.port", "expected a number, got True", id="bool-port"),
    pytest.param({"budget.launches": True}, "budget.launches", "expected a number", id="bool-budget"),
    pytest.param({"faults.pause": "soon"}, "faults.pause", "'soon'", id="bad-fault-pause"),
    pytest.param({"server.port": "eighty"}, "server.port", "'eighty'", id="string-port"),
    pytest.param({"workload": [1, 2]}, "workload", "[1, 2]", id="list-where-mapping"),
    pytest.param({"server.args": ["--x"]}, "server.args", "['--x']", id="list-where-args-mapping"),
    pytest.param({"server.args.tp": [1, 2]}, "server.args.tp", "[1, 2]", id="list-as-flag-value"),
    pytest.param({"server.args.tp": None}, "server.args.tp", "None", id="null-flag-value"),
    pytest.param({"search_space": 5}, "search_space", "5", id="int-where-path"),
    pytest.param({"server.env": {"A": 1}}, "server.env.A", "1", id="int-env-value"),
    # SLO
    pytest.param({"slo.terms": ["foo:p95<=5ms"]}, "slo.terms.0", "'foo'", id="unknown-slo-metric"),
    pytest.param({"slo.terms": ["ttft:p97<=5ms"]}, "slo.terms.0", "'p97'", id="unknown-slo-statistic"),
    pytest.param({"slo.terms": ["ttft p95 < 5"]}, "slo.terms.0", "'ttft p95 < 5'", id="malformed-slo-term"),
    pytest.param(
        {"slo.terms": ["ttft:p95<=5ms", "tpot:p95<=fast"]}, "slo.terms.1", "tpot:p95<=fast", id="second-term"
    ),
    pytest.param({"slo.terms": ["ttft:p95<=0ms"]}, "slo.terms.0", "ttft:p95<=0ms", id="slo-limit-zero"),
    pytest.param({"slo.terms": []}, "slo.terms", "non-empty", id="no-slo-terms"),
    pytest.param(
        {"slo.terms": [{"metric": "foo", "statistic": "bar", "limit_s": -1}]},
        "slo.terms.0",
        "'foo'",
        id="slo-term-as-mapping",
    ),
    pytest.param({"slo.error_budget": 2}, "slo.error_budget", "2", id="error-budget-above-one"),
    # durations
    pytest.param({"server.start_timeout": "-5s"}, "server.start_timeout", "'-5s'", id="negative-duration"),
    pytest.param({"server.start_timeout": -5}, "server.start_timeout", "-5", id="negative-number-duration"),
    pytest.param({"server.start_timeout": "soon"}, "server.start_timeout", "'soon'", id="garbage-duration"),
    pytest.param({"server.stop_timeout": 0}, "server.stop_timeout", "0", id="zero-duration"),
    pytest.param({"server.stop_timeout": True}, "server.stop_timeout", "True", id="bool-duration"),
    pytest.param({"server.start_timeout": float("nan")}, "server.start_timeout", "nan", id="nan-duration"),
    pytest.param(
        {"measurement.probe_duration": 0}, "measurement.probe_duration", "0", id="zero-probe-duration"
    ),
    pytest.param({"budget.wall_time": "1 week"}, "budget.wall_time", "'1 week'", id="garbage-wall-time"),
    pytest.param(
        {"measurement.client_workers": "many"}, "measurement.client_workers", "'many'", id="workers-word"
    ),
    pytest.param({"measurement.client_workers": 0}, "measurement.client_workers", "0", id="zero-workers"),
    # files
    pytest.param({"search_space": "missing.yaml"}, "search_space", "missing.yaml", id="missing-space-file"),
    pytest.param(
        {"workload.dataset": {"kind": "sharegpt", "path": "missing.json"}},
        "workload.dataset.path",
        "missing.json",
        id="missing-dataset-file",
    ),
    pytest.param(
        {"workload.dataset": {"kind": "jsonl"}}, "workload.dataset", "'jsonl'", id="dataset-without-path"
    ),
    pytest.param(
        {"workload.tokenizer": "nowhere/tokenizer.json"},
        "workload.tokenizer",
        "nowhere/tokenizer.json",
        id="missing-tokenizer-file",
    ),
    # server args that collide with the search space or the server section
    pytest.param(
        {"server.args.max-num-seqs": 64},
        "server.args.max_num_seqs",
        "search-space parameter",
        id="fixed-param",
    ),
    pytest.param(
        {"server.args.--enable-chunked-prefill": True},
        "server.args.enable_chunked_prefill",
        "search-space parameter",
        id="fixed-param-dashed",
    ),
    pytest.param({"server.args.host": "0.0.0.0"}, "server.args.host", "server.host", id="host-in-args"),
    pytest.param({"server.args.--port": 8080}, "server.args.port", "server.port", id="port-in-args"),
    pytest.param(
        {"server.args": {"max-model-len": 2048, "max_model_len": 4096}},
        "server.args",
        "'max_model_len'",
        id="flag-given-twice",
    ),
    # objectives
    pytest.param(
        {"objectives": [{"metric": "speed", "direction": "maximize"}]},
        "objectives.0.metric",
        "'speed'",
        id="unknown-objective",
    ),
    pytest.param(
        {"objectives": [{"metric": "ttft:p97", "direction": "minimize"}]},
        "objectives.0.metric",
        "'ttft:p97'",
        id="unknown-objective-statistic",
    ),
    pytest.param(
        {"objectives": [{"metric": "slo_throughput", "direction": "up"}]},
        "objectives.0.direction",
        "'up'",
        id="unknown-direction",
    ),
    pytest.param(
        {
            "objectives": [
                {"metric": "slo_throughput", "direction": "maximize"},
                {"metric": "slo_throughput", "direction": "maximize"},
            ]
        },
        "objectives",
        "slo_throughput",
        id="duplicate-objective",
    ),
    pytest.param(
        {
            "objectives": [
                {"metric": "ttft:median", "direction": "minimize"},
                {"metric": "ttft:p50", "direction": "minimize"},
            ]
        },
        "objectives",
        "ttft:p50",
        id="duplicate-objective-by-alias",
    ),
    pytest.param({"objectives": []}, "objectives", "at least one", id="no-objectives"),
    # server section
    pytest.param({"server.port": 70000}, "server.port", "70000", id="port-too-high"),
    pytest.param({"server.port": -1}, "server.port", "-1", id="port-negative"),
    pytest.param({"server.command": []}, "server.command", "must not be empty", id="empty-command"),
    pytest.param(
        {"server.command": [""]}, "server.command", "the program (argv item 0) is empty", id="blank-program"
    ),
    pytest.param(
        {"server.command": ["  ", "serve"]}, "server.command", "is only whitespace", id="space-program"
    ),
    pytest.param({"server.model": DELETE}, "server.model", "required", id="missing-model"),
    # study identity
    pytest.param({"study.name": "../escape"}, "study.name", "'../escape'", id="name-with-path"),
    pytest.param({"study.name": "my study"}, "study.name", "'my study'", id="name-with-space"),
    pytest.param({"study.name": ""}, "study.name", "''", id="empty-name"),
    pytest.param({"study": DELETE}, "study", "required", id="missing-study-section"),
    # shared-prefix groups
    pytest.param(
        {"workload.dataset.prefix": {"groups": 3}},
        "workload.dataset.prefix",
        "exactly one",
        id="prefix-no-length",
    ),
    pytest.param(
        {"workload.dataset.prefix": {"groups": 2, "hit_rate": 0.5, "len": 100}},
        "workload.dataset.prefix",
        "exactly one",
        id="prefix-both-lengths",
    ),
    pytest.param(
        {"workload.dataset.prefix": {"groups": 2, "hit_rate": 1.5}},
        "workload.dataset.prefix.hit_rate",
        "1.5",
        id="prefix-hit-rate-above-one",
    ),
    pytest.param(
        {"workload.dataset.prefix": {"groups": 0, "hit_rate": 0.5}},
        "workload.dataset.prefix.groups",
        "0",
        id="prefix-no-groups",
    ),
    pytest.param(
        {"workload.dataset.prefix": {"groups": 3, "hit_rate": 0.5, "weights": [1, 2]}},
        "workload.dataset.prefix.weights",
        "[1.0, 2.0]",
        id="prefix-weights-per-group",
    ),
    pytest.param(
        {"workload.dataset.prefix": {"groups": 2, "hit_rate": 0.5, "weights": [1, -2]}},
        "workload.dataset.prefix.weights",
        "-2.0",
        id="prefix-negative-weight",
    ),
    pytest.param(
        {"workload.dataset": {"kind": "jsonl", "path": "x.jsonl", "prefix": {"hit_rate": 0.5}}},
        "workload.dataset.prefix",
        "'jsonl'",
        id="prefix-on-text-prompts",
    ),
    pytest.param(
        {"workload.dataset.prefix_len": 100, "workload.dataset.prefix": {"hit_rate": 0.5}},
        "workload.dataset.prefix",
        "prefix_len (100)",
        id="prefix-and-prefix-len",
    ),
    # trace time scale
    pytest.param(
        {"workload.dataset.time_scale": 2}, "workload.dataset.time_scale", "'synthetic'", id="scale-no-trace"
    ),
    pytest.param(
        {"workload.dataset": {"kind": "trace", "path": "t.jsonl", "time_scale": 0}},
        "workload.dataset.time_scale",
        "0",
        id="scale-zero",
    ),
    # multi-turn conversations
    pytest.param(
        {"workload.conversation": {}}, "workload.conversation.turns", "required", id="conversation-no-turns"
    ),
    pytest.param(
        {"workload.conversation": {"turns": 0}},
        "workload.conversation.turns",
        "value >= 1, got 0",
        id="zero-turns",
    ),
    pytest.param(
        {"workload.conversation": {"turns": 2, "think_time": "soon"}},
        "workload.conversation.think_time.value",
        "'soon'",
        id="think-time-garbage",
    ),
    pytest.param(
        {"workload.conversation": {"turns": 2, "think_time": {"dist": "exponential"}}},
        "workload.conversation.think_time",
        "mean > 0",
        id="think-time-no-mean",
    ),
    pytest.param(
        {"workload.conversation": {"turns": 2, "think_time": {"dist": "uniform", "low": "2s", "high": "1s"}}},
        "workload.conversation.think_time",
        "low (2.0) must be <= high (1.0)",
        id="think-time-inverted",
    ),
    pytest.param(
        {"workload.arrival": {"process": "concurrency"}, "workload.conversation": {"turns": 2}},
        "workload.conversation",
        "'concurrency'",
        id="conversation-concurrency",
    ),
    pytest.param(
        {"workload.dataset": {"kind": "trace", "path": "t.jsonl"}, "workload.conversation": {"turns": 2}},
        "workload.conversation",
        "'trace'",
        id="conversation-on-trace",
    ),
    pytest.param(
        {"workload.prompt_format": "token_ids", "workload.conversation": {"turns": 2}},
        "workload.conversation",
        "prompt_format 'text'",
        id="conversation-token-ids",
    ),
    # notify: an argv item that says nothing (the command would fail at every notification)
    pytest.param(
        {"notify.command": [""]}, "notify.command", "item 0 is empty ('')", id="notify-empty-argv-item"
    ),
    pytest.param(
        {"notify.command": ["notify-send", "  "]},
        "notify.command",
        "item 1 is only whitespace ('  ') in ['notify-send', '  ']",
        id="notify-blank-argv-item",
    ),
    pytest.param(
        {"notify.command": []}, "notify.command", "must not be empty, got []", id="notify-empty-argv"
    ),
]


@pytest.mark.parametrize(("edits", "field", "value"), STUDY_CASES)
def test_bad_study_spec_is_one_spec_error_naming_field_and_value(
    tmp_path: Path, edits: dict[str, object], field: str, value: str
) -> None:
    """A bad study spec raises SpecError whose field is the offending path and whose text shows the value."""
    err = _spec_error(_write(tmp_path, _edit(SPEC, edits)))
    assert err.field == field
    assert value in err.message
    assert str(err).startswith(f"{field}: ")


P = "search_space.params"
SPACE_CASES: list[Any] = [
    pytest.param({"colour": 1}, "search_space.colour", "unknown key", id="unknown-space-key"),
    pytest.param({"parms": {}}, "search_space.parms", "did you mean 'params'?", id="did-you-mean-space"),
    pytest.param(
        {"params.max_num_seqs.choice": [1]},
        "search_space.params.max_num_seqs.choice",
        "unknown key (value",
        id="no-key-of-another-param-type",
    ),
    pytest.param(
        {"params.max_num_seqs.colour": 1}, f"{P}.max_num_seqs.colour", "unknown key", id="unknown-param-key"
    ),
    pytest.param({"params": [1, 2]}, P, "[1, 2]", id="params-list-where-mapping"),
    pytest.param({"params": {}}, P, "at least one", id="no-params"),
    pytest.param({"params.max_num_seqs": 5}, f"{P}.max_num_seqs", "5", id="param-not-mapping"),
    pytest.param(
        {"params.max_num_seqs.low": "eight"}, f"{P}.max_num_seqs.low", "'eight'", id="string-where-int"
    ),
    pytest.param({"params.max_num_seqs.low": 8.5}, f"{P}.max_num_seqs.low", "8.5", id="fraction-where-int"),
    pytest.param(
        {"params.max_num_seqs": {"type": "int", "low": 512, "high": 256, "default": 300}},
        f"{P}.max_num_seqs",
        "low (512) must be <= high (256)",
        id="int-low-above-high",
    ),
    pytest.param(
        {"params.gpu_memory_utilization.low": 0.99},
        f"{P}.gpu_memory_utilization",
        "low (0.99) must be <= high (0.98)",
        id="float-low-above-high",
    ),
    pytest.param(
        {
            "params.gpu_memory_utilization": {
                "type": "float",
                "low": 0.0,
                "high": 1.0,
                "log": True,
                "default": 1,
            }
        },
        f"{P}.gpu_memory_utilization",
        "low (0.0)",
        id="float-log-low-zero",
    ),
    pytest.param(
        {"params.max_num_seqs.low": 0, "params.max_num_seqs.default": 4},
        f"{P}.max_num_seqs",
        "low (0)",
        id="int-log-low-zero",
    ),
    pytest.param(
        {"params.max_num_seqs.default": 1000}, f"{P}.max_num_seqs", "default (1000)", id="int-default-outside"
    ),
    pytest.param(
        {"params.gpu_memory_utilization.default": 0.5},
        f"{P}.gpu_memory_utilization",
        "default (0.5)",
        id="float-default-outside",
    ),
    pytest.param(
        {"params.gpu_memory_utilization.default": 0.91},
        f"{P}.gpu_memory_utilization",
        "default (0.91)",
        id="float-default-off-step",
    ),
    pytest.param(
        {"params.gpu_memory_utilization.step": 0.05},
        f"{P}.gpu_memory_utilization",
        "step",
        id="float-range-not-whole-steps",
    ),
    pytest.param(
        {"params.max_num_seqs": {"type": "int", "low": 8, "high": 100, "step": 7, "default": 15}},
        f"{P}.max_num_seqs",
        "(7)",
        id="int-range-not-whole-steps",
    ),
    pytest.param(
        {"params.max_num_seqs": {"type": "int", "low": 8, "high": 100, "step": 4, "default": 9}},
        f"{P}.max_num_seqs",
        "default (9)",
        id="int-default-off-step",
    ),
    pytest.param(
        {"params.max_num_seqs": {"type": "int", "low": 8, "high": 64, "step": 0, "default": 8}},
        f"{P}.max_num_seqs",
        "step (0)",
        id="int-step-zero",
    ),
    pytest.param({"params.block_size.default": 17}, f"{P}.block_size", "default (17)", id="choice-default"),
    pytest.param({"params.block_size.choices": []}, f"{P}.block_size", "empty", id="empty-choices"),
    pytest.param(
        {"params.block_size.choices": [16, 32, 16]}, f"{P}.block_size", "[16, 32, 16]", id="duplicate-choices"
    ),
    pytest.param(
        {"params.max_num_seqs.type": "integer"}, f"{P}.max_num_seqs", "'integer'", id="unknown-param-type"
    ),
    pytest.param({"params.max_num_seqs.type": DELETE}, f"{P}.max_num_seqs", "type", id="missing-param-type"),
    pytest.param(
        {"params.enable_chunked_prefill.default": 2},
        f"{P}.enable_chunked_prefill.default",
        "2",
        id="bool-default-int",
    ),
    pytest.param({"params.max-num-seqs": SPACE["params"]["max_num_seqs"]}, P, "'max-num-seqs'", id="dashed"),
    # constraints: malformed, unknown names, forbidden constructs
    pytest.param(
        {"constraints": [{"expr": "max_num_seqs >="}]},
        "search_space.constraints.0.expr",
        "'max_num_seqs >='",
        id="malformed-constraint",
    ),
    pytest.param(
        {"constraints": [{"expr": "max_num_seqs <= max_seq_len_to_capture"}]},
        "search_space.constraints.0.expr",
        "max_seq_len_to_capture",
        id="constraint-unknown-name",
    ),
    pytest.param(
        {"constraints": [{"expr": "__import__('os').system('true')"}]},
        "search_space.constraints.0.expr",
        "__import__('os')",
        id="constraint-import",
    ),
    pytest.param(
        {"constraints": [{"expr": "max_num_seqs.bit_length() > 1"}]},
        "search_space.constraints.0.expr",
        "max_num_seqs.bit_length()",
        id="constraint-attribute",
    ),
    pytest.param(
        {"constraints": [{"expr": "abs(max_num_seqs) > 1"}]},
        "search_space.constraints.0.expr",
        "abs(max_num_seqs)",
        id="constraint-call",
    ),
    pytest.param(
        {"constraints": [{"expr": "max_num_seqs ** 99999 > 1"}]},
        "search_space.constraints.0.expr",
        "**",
        id="constraint-power",
    ),
    pytest.param(
        {"constraints": [{"expr": "[x for x in (1, 2)]"}]},
        "search_space.constraints.0.expr",
        "[x for x in (1, 2)]",
        id="constraint-comprehension",
    ),
    pytest.param(
        {"constraints": [{"expr": 5}]}, "search_space.constraints.0.expr", "5", id="constraint-not-string"
    ),
]


@pytest.mark.parametrize(("edits", "field", "value"), SPACE_CASES)
def test_bad_search_space_is_one_spec_error_naming_field_and_value(
    tmp_path: Path, edits: dict[str, object], field: str, value: str
) -> None:
    """A bad search space (loaded through the study) raises SpecError naming the param path and the value."""
    err = _spec_error(_write(tmp_path, SPEC, _edit(SPACE, edits)))
    assert err.field == field
    assert value in err.message


def test_inverted_range_message_matches_the_documented_form(tmp_path: Path) -> None:
    """The design's example error comes out word for word: path, then 'low (512) must be <= high (256)'."""
    space = _edit(SPACE, {"params.max_num_seqs": {"type": "int", "low": 512, "high": 256, "default": 300}})
    err = _spec_error(_write(tmp_path, SPEC, space))
    assert str(err) == "search_space.params.max_num_seqs: low (512) must be <= high (256)"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param("study:\n  name: x\nserver: [\n", 4, id="unclosed-list"),
        pytest.param("study:\n  name: x\n bad indent: 1\n", 3, id="bad-indent"),
        pytest.param("study: {name: x\n", 2, id="unclosed-mapping"),
    ],
)
def test_malformed_yaml_names_the_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    """Malformed YAML is a SpecError naming the file and the line, not a yaml traceback."""
    path = _write(tmp_path, spec_text=text)
    err = _spec_error(path)
    assert err.field == "spec"
    assert "malformed YAML" in err.message
    assert str(path) in err.message
    assert f"line {line}" in err.message


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys silently; autotune refuses the file, naming the key and line."""
    text = "study:\n  name: x\nserver:\n  port: 8000\n  port: 9000\n"
    err = _spec_error(_write(tmp_path, spec_text=text))
    assert err.field == "spec"
    assert "duplicate key 'port'" in err.message and "line 5" in err.message
    space = "params:\n  x: {type: bool, default: true}\n  x: {type: bool, default: false}\n"
    err = _spec_error(_write(tmp_path, SPEC, space_text=space))
    assert err.field == "search_space" and "duplicate key 'x'" in err.message


def test_a_boolean_is_not_a_number_in_the_search_space(tmp_path: Path) -> None:
    """An int parameter's default given as true is refused, not read as 1."""
    space = _edit(SPACE, {"params.max_num_seqs": {"type": "int", "low": 1, "high": 8, "default": True}})
    err = _spec_error(_write(tmp_path, SPEC, space))
    assert err.field == "search_space.params.max_num_seqs.default"
    assert "expected a number, got True" in err.message


def test_malformed_search_space_yaml_names_the_search_space_field(tmp_path: Path) -> None:
    """Malformed YAML in the search-space file is reported against the search_space field."""
    err = _spec_error(_write(tmp_path, SPEC, space_text="params:\n  x: [\n"))
    assert err.field == "search_space"
    assert "malformed YAML" in err.message
    assert "line 3" in err.message


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        pytest.param("- a\n- b\n", "list", id="list"),
        pytest.param("just text\n", "str", id="scalar"),
        pytest.param("42\n", "int", id="number"),
        pytest.param("", "NoneType", id="empty-file"),
    ],
)
def test_non_mapping_top_level_is_rejected(tmp_path: Path, text: str, kind: str) -> None:
    """A spec file that is not a YAML mapping is a SpecError naming the file and what it holds."""
    path = _write(tmp_path, spec_text=text)
    err = _spec_error(path)
    assert err.field == "spec"
    assert str(path) in err.message
    assert kind in err.message


def test_missing_spec_file_is_a_spec_error(tmp_path: Path) -> None:
    """A spec path that does not exist is a SpecError naming the path."""
    err = _spec_error(tmp_path / "absent.yaml")
    assert "absent.yaml" in err.message


def test_load_space_alone_reports_its_field_prefix(tmp_path: Path) -> None:
    """load_space prefixes errors with the field it is given and names the bad value."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(_edit(SPACE, {"params.block_size.choices": []})), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_space(path, field="spaces.0")
    assert info.value.field == "spaces.0.params.block_size"


def test_load_study_writes_nothing(tmp_path: Path) -> None:
    """Loading a good or a bad spec creates no workdir, storage or any other file next to the spec."""
    good = _write(tmp_path)
    load_study(good)
    (tmp_path / "bad").mkdir()
    _spec_error(_write(tmp_path / "bad", _edit(SPEC, {"study.colour": 1})))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "bad",
        "bad/space.yaml",
        "bad/spec.yaml",
        "space.yaml",
        "spec.yaml",
    ]


# ----------------------------------------------------------------------------------------------
# Good input
# ----------------------------------------------------------------------------------------------


def test_demo_study_loads() -> None:
    """studies/demo.yaml loads with its search space, SLO and objectives."""
    loaded = load_study(REPO / "studies" / "demo.yaml")
    assert loaded.spec.study.name == "demo"
    assert loaded.space_path == (REPO / "search_spaces" / "sim.yaml").resolve()
    assert [t.key for t in loaded.spec.slo.terms] == ["ttft:p95", "tpot:p95"]
    assert loaded.spec.server.args == {"max_model_len": 4096}
    assert loaded.spec.server.start_timeout == 60.0
    assert loaded.spec.measurement.probe_duration == 6.0
    assert [o.metric for o in loaded.spec.objectives] == ["slo_throughput", "ttft:p95"]


@pytest.mark.parametrize("path", sorted((REPO / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_each_shipped_search_space_loads_and_binds(path: Path) -> None:
    """Each search_spaces/*.yaml validates and binds with max_model_len fixed, as their comments require."""
    space = load_space(path)
    assert space.params
    bound = SearchSpace(space, {"max_model_len": 4096})
    declared = {n for n, p in {**space.params, **space.env}.items() if p.default is not None}
    assert set(bound.defaults()) == declared  # a default is optional: trial 0 reads the server's


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        ("500ms", 0.5),
        ("2s", 2.0),
        ("10m", 600.0),
        ("1.5h", 5400.0),
        ("250us", 250e-6),
        (" 3 s ", 3.0),
        (30, 30.0),
        (0.25, 0.25),
    ],
)
def test_durations_parse_to_seconds(tmp_path: Path, given: object, seconds: float) -> None:
    """Durations are numbers of seconds or strings with us/ms/s/m/h units."""
    loaded = load_study(_write(tmp_path, _edit(SPEC, {"server.start_timeout": given})))
    assert loaded.spec.server.start_timeout == pytest.approx(seconds)


def test_relative_paths_resolve_against_the_spec_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """search_space, dataset path and workdir are resolved against the spec file's directory, not the cwd."""
    spec_dir = tmp_path / "studies"
    (tmp_path / "spaces").mkdir()
    (spec_dir / "data").mkdir(parents=True)
    (tmp_path / "spaces" / "s.yaml").write_text(yaml.safe_dump(SPACE), encoding="utf-8")
    (spec_dir / "data" / "prompts.jsonl").write_text('{"prompt": "hi"}\n', encoding="utf-8")
    spec = _edit(
        SPEC,
        {
            "search_space": "../spaces/s.yaml",
            "workload.dataset": {"kind": "jsonl", "path": "data/prompts.jsonl"},
            "study.workdir": "runs/here",
        },
    )
    (spec_dir / "spec.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_study(Path("..") / "studies" / "spec.yaml")
    assert loaded.spec_path == (spec_dir / "spec.yaml").resolve()
    assert loaded.base_dir == spec_dir.resolve()
    assert loaded.space_path == (tmp_path / "spaces" / "s.yaml").resolve()
    assert loaded.workdir == (spec_dir / "runs" / "here").resolve()
    assert loaded.storage_url == f"sqlite:///{(spec_dir / 'runs' / 'here' / 'study.db').resolve()}"
    assert loaded.trial_dir(3) == loaded.workdir / "trials" / "3"


def test_default_workdir_and_storage_follow_the_study_name(tmp_path: Path) -> None:
    """Without workdir/storage, storage is sqlite:///<spec dir>/<study name>/study.db."""
    loaded = load_study(_write(tmp_path, _edit(SPEC, {"study.name": "llama-8b.v2"})))
    assert loaded.workdir == (tmp_path / "llama-8b.v2").resolve()
    assert loaded.storage_url == f"sqlite:///{(tmp_path / 'llama-8b.v2' / 'study.db').resolve()}"


def test_explicit_storage_is_kept_verbatim(tmp_path: Path) -> None:
    """An explicit storage URL is used as given."""
    url = "postgresql://tuner@db/autotune"
    loaded = load_study(_write(tmp_path, _edit(SPEC, {"study.storage": url})))
    assert loaded.storage_url == url


@pytest.mark.parametrize(
    ("text", "metric", "statistic", "limit_s"),
    [
        ("ttft:p95<=500ms", "ttft", "p95", 0.5),
        ("tpot:median<=50ms", "tpot", "p50", 0.05),
        ("e2el:p99<=2s", "e2el", "p99", 2.0),
        ("itl:max<=200us", "itl", "max", 200e-6),
        ("ttft:mean<=250", "ttft", "mean", 0.25),
        (" ttft : p90 <= 1.5 s ", "ttft", "p90", 1.5),
    ],
)
def test_slo_terms_parse_with_units_and_median_alias(
    text: str, metric: str, statistic: str, limit_s: float
) -> None:
    """SLO terms parse metric, statistic (median → p50) and a limit in us/ms/s (ms when no unit)."""
    (term,) = SloSection.model_validate({"terms": [text]}).terms
    assert (term.metric, term.statistic) == (metric, statistic)
    assert term.limit_s == pytest.approx(limit_s)


def test_a_single_slo_term_string_is_accepted() -> None:
    """terms may be one string instead of a list."""
    slo = SloSection.model_validate({"terms": "ttft:p99<=1s", "error_budget": 0.01})
    assert [t.key for t in slo.terms] == ["ttft:p99"]
    assert slo.error_budget == 0.01


def test_objective_latency_metric_is_canonical() -> None:
    """An objective such as 'ttft:median' is stored as its canonical key 'ttft:p50'."""
    assert Objective(metric="ttft:median", direction="minimize").metric == "ttft:p50"
    assert Objective(metric="goodput", direction="maximize").metric == "goodput"


def test_server_args_are_normalised_and_command_string_split(tmp_path: Path) -> None:
    """Flag names in server.args become snake case; a command string is shlex-split."""
    spec = _edit(
        SPEC,
        {
            "server.command": "vllm serve 'my model'",
            "server.args": {"--max-model-len": 4096, "trust-remote-code": True, "served_model_name": "a b"},
        },
    )
    loaded = load_study(_write(tmp_path, spec))
    assert loaded.spec.server.command == ("vllm", "serve", "my model")
    assert loaded.spec.server.args == {
        "max_model_len": 4096,
        "trust_remote_code": True,
        "served_model_name": "a b",
    }


def test_specs_are_immutable(tmp_path: Path) -> None:
    """Loaded spec objects are frozen."""
    loaded = load_study(_write(tmp_path))
    with pytest.raises(ValueError, match="frozen"):
        loaded.spec.study.name = "other"  # type: ignore[misc]


def _one_param_study(tmp_path: Path, server: str, workload: str = "") -> Path:
    """A minimal spec (the given ``server`` and ``workload`` YAML lines) with a one-parameter space."""
    (tmp_path / "space.yaml").write_text(
        "params:\n  max_num_seqs: {type: int, low: 8, high: 64, default: 16}\n"
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "study: {name: s}\n"
        f"server: {server}\n"
        "search_space: space.yaml\n"
        + (f"workload: {workload}\n" if workload else "")
        + "slo: {terms: ['ttft:p95<=1s']}\n"
    )
    return spec


def test_flag_in_command_that_is_tuned_is_rejected(tmp_path: Path) -> None:
    """A tuned flag already in server.command would override every trial's value: refused, field named."""
    spec = _one_param_study(tmp_path, "{command: [vllm, serve, m, --max-num-seqs, '32'], model: m}")
    with pytest.raises(SpecError) as info:
        load_study(spec)
    assert info.value.field == "server.command.3"
    assert "--max-num-seqs" in str(info.value)


def test_null_env_value_is_accepted_to_unset_a_variable(tmp_path: Path) -> None:
    """server.env accepts null, which the launcher treats as 'unset this variable'."""
    spec = _one_param_study(
        tmp_path, "{command: [vllm, serve, m], model: m, env: {VLLM_CPU_KVCACHE_SPACE: null, A: '1'}}"
    )
    loaded = load_study(spec)
    assert loaded.spec.server.env == {"VLLM_CPU_KVCACHE_SPACE": None, "A": "1"}


def test_token_id_prompts_need_the_completions_endpoint(tmp_path: Path) -> None:
    """Chat requests carry text: token-id prompts with the chat endpoint are refused at load."""
    spec = _one_param_study(
        tmp_path, "{command: [vllm, serve, m], model: m}", "{endpoint: chat, prompt_format: token_ids}"
    )
    with pytest.raises(SpecError) as info:
        load_study(spec)
    assert info.value.field == "workload"
    assert "token_ids" in str(info.value)


@pytest.mark.parametrize("header", ["Authorization", "authorization", "AUTHORIZATION"])
def test_an_authorization_header_beside_an_api_key_is_refused(tmp_path: Path, header: str) -> None:
    """server.api_key_env sends its own Authorization header on every request: a workload header of that
    name (in any case) would be silently replaced, so the pair is refused, naming the header."""
    spec = _one_param_study(
        tmp_path,
        "{command: [vllm, serve, m], model: m, api_key_env: VLLM_KEY}",
        f"{{headers: {{{header}: 'Bearer ${{GATEWAY}}'}}}}",
    )
    err = _spec_error(spec)
    assert err.field == f"workload.headers.{header}"
    assert "server.api_key_env ('VLLM_KEY')" in str(err)
    alone = _one_param_study(
        tmp_path, "{command: [vllm, serve, m], model: m}", f"{{headers: {{{header}: x}}}}"
    )
    assert dict(load_study(alone).spec.workload.headers) == {header: "x"}


def test_latency_objectives_are_the_statistics_the_client_judges_beside_the_slo(tmp_path: Path) -> None:
    """An objective that is a latency statistic is one the study reads from its probes (so the client's
    self-check judges its bound); throughputs are not, and ``median`` reads as ``p50``."""
    edits = {
        "objectives": [
            {"metric": "slo_throughput", "direction": "maximize"},
            {"metric": "itl:median", "direction": "minimize"},
            {"metric": "goodput", "direction": "maximize"},
        ]
    }
    spec = load_study(_write(tmp_path, _edit(SPEC, edits))).spec
    assert [k.key for k in spec.latency_objectives] == ["itl:p50"]


def test_client_workers_take_a_count_or_auto(tmp_path: Path) -> None:
    """``measurement.client_workers`` is ``auto`` unless given; a count is taken as it is, and ``auto``."""
    assert load_study(_write(tmp_path)).spec.measurement.client_workers == "auto"
    for given in (1, 4, "auto"):
        edited = _edit(SPEC, {"measurement.client_workers": given})
        assert load_study(_write(tmp_path, edited)).spec.measurement.client_workers == given
