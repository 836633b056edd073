"""``--gpus``: GPU sets from the command line, and tensor parallelism that must fit a set."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autotune.errors import SpecError
from autotune.fleet import check_parallelism, gpu_sets, label_of
from autotune.loader import load_study


def test_gpu_sets_split_the_list() -> None:
    assert gpu_sets("0,1,2,3", 2, lambda: 0) == [("0", "1"), ("2", "3")]
    assert gpu_sets("all", 1, lambda: 3) == [("0",), ("1",), ("2",)]
    assert gpu_sets(" GPU-a , GPU-b ", 1, lambda: 0) == [("GPU-a",), ("GPU-b",)]
    assert label_of(("2", "3")) == "gpus-2,3"


@pytest.mark.parametrize(
    ("gpus", "per_trial", "field"),
    [
        ("all", 1, "--gpus"),  # NVML sees none
        ("0,,1", 1, "--gpus"),
        ("0,0", 1, "--gpus"),
        ("0,1,2", 2, "--gpus-per-trial"),
        ("0,1", 0, "--gpus-per-trial"),
    ],
)
def test_bad_gpu_sets_name_the_option(gpus: str, per_trial: int, field: str) -> None:
    with pytest.raises(SpecError) as caught:
        gpu_sets(gpus, per_trial, lambda: 0)
    assert caught.value.field == field


def _loaded(tmp_path: Path, tp: dict[str, object] | None, fixed: int | None = None) -> object:
    params: dict[str, object] = {"max_num_seqs": {"type": "int", "low": 8, "high": 64, "default": 32}}
    if tp is not None:
        params["tensor_parallel_size"] = tp
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": params}))
    args = {"max-model-len": 2048, **({"tensor-parallel-size": fixed} if fixed else {})}
    spec = {
        "study": {"name": "fleet"},
        "server": {"command": ["vllm", "serve", "m"], "model": "m", "args": args},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=1s"]},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return load_study(tmp_path / "spec.yaml")


def test_tensor_parallelism_must_fit_each_set(tmp_path: Path) -> None:
    fits = _loaded(tmp_path, {"type": "categorical", "choices": [1, 2], "default": 1})
    check_parallelism(fits, 2)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="more than the 1 GPUs") as caught:
        check_parallelism(fits, 1)  # type: ignore[arg-type]
    assert caught.value.field == "search_space.tensor_parallel_size"
    fixed = _loaded(tmp_path, None, fixed=4)
    with pytest.raises(SpecError) as caught:
        check_parallelism(fixed, 2)  # type: ignore[arg-type]
    assert caught.value.field == "server.args.tensor_parallel_size"
