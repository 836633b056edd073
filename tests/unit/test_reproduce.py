"""The reproduce record: the model's revision and the workload's hash, a record read back (bad input is one
line naming --record), what differs, and whether two figures agree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.errors import SpecError
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.results.reproduce import (
    Recorded,
    agreement,
    differences,
    model_revision,
    read_record,
    workload_hash,
)

SPACE = {"params": {"max_num_seqs": {"type": "categorical", "choices": [64, 256], "default": 256}}}


def loaded_study(tmp_path: Path, **workload: Any) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "rep"},
        "server": {"command": "vllm serve m", "model": "m"},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "workload": workload,
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return load_study(tmp_path / "spec.yaml")


def exported(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "trial": 3,
        "slo_throughput": 1000.0,
        "slo_throughput_interval": [900.0, 1100.0],
        "slo": {"terms": ["ttft:p95<=500ms"], "error_budget": 0.0},
        "reproduce": {"vllm": "0.11.0", "baseline": False, "launched_flags": {"max-num-seqs": 64}},
    }
    data.update(changes)
    return data


def test_a_record_is_read_back_with_its_flags_in_the_spaces_names(tmp_path: Path) -> None:
    loaded = loaded_study(tmp_path)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(exported()))
    got = read_record(path, loaded)
    assert got.flags == {"max_num_seqs": 64} and not got.baseline and got.trial == 3
    assert got.interval == (900.0, 1100.0) and got.slo_throughput == 1000.0


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        (json.dumps({"trial": 1}), "has no reproduce record"),
        (json.dumps(exported(slo_throughput=None)), "no measured slo_throughput"),
        (json.dumps(exported(slo={"terms": ["ttft:p95<=1s"]})), "the figures would not compare"),
        (
            json.dumps(exported(reproduce={"launched_flags": {"block-size": 16}})),
            "sets block-size, which the spec's search space does not tune",
        ),
    ],
)
def test_a_bad_record_is_one_line_naming_the_option(tmp_path: Path, content: str | None, says: str) -> None:
    loaded = loaded_study(tmp_path)
    path = tmp_path / "best.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as info:
        read_record(path, loaded)
    assert info.value.exit_code == 2
    message = str(info.value)
    assert message.startswith("--record: ") and says in message and "\n" not in message


def test_the_workload_hash_follows_the_requests_not_the_spelling(tmp_path: Path) -> None:
    """The same workload hashes alike; another seed, or another dataset file's bytes, does not."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n')
    jsonl = {"dataset": {"kind": "jsonl", "path": "prompts.jsonl"}}
    first = workload_hash(loaded_study(tmp_path, **jsonl))
    assert workload_hash(loaded_study(tmp_path, **jsonl)) == first
    assert workload_hash(loaded_study(tmp_path, **jsonl, seed=1)) != first
    data.write_text('{"prompt": "b"}\n')
    assert workload_hash(loaded_study(tmp_path, **jsonl)) != first


def test_the_model_revision_is_the_cache_snapshot_or_a_config_hash(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert model_revision("acme/tiny", env) == "0123abcd"
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text('{"hidden_size": 8}')
    assert str(model_revision(str(local), env)).startswith("config.json sha256:")
    assert model_revision("acme/absent", env) is None


def test_differences_name_what_changed_and_skip_the_unknown() -> None:
    then = {"vllm": "0.10.1", "gpu": "NVIDIA H100", "gpu_driver": None, "python": "3.11.7"}
    now = {"vllm": "0.11.0", "gpu": "NVIDIA H100", "gpu_driver": "550.54.15", "python": "3.11.7"}
    assert differences(then, now) == ["vllm: 0.10.1 then, 0.11.0 now"]


def test_figures_agree_when_their_intervals_overlap() -> None:
    recorded = Recorded(3, {}, False, 1000.0, (900.0, 1100.0), (), {})
    agrees, text = agreement(recorded, 1150.0, (1050.0, 1250.0))
    assert agrees and text.startswith("measured 1,150 tok/s [1,050-1,250] (+15.0%): agrees with")
    agrees, text = agreement(recorded, 1300.0, (1200.0, 1400.0))
    assert not agrees and text.endswith("beyond both intervals")
    assert agreement(recorded, None, None)[0] is False
