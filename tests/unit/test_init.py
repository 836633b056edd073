"""`autotune init`: a complete spec from flags (a catalog model, a local config.json, a cached hub id, a
dataset file), the search space for the server's vLLM with the GPU's batch defaults, and bad input as one
line, exit 2 and no file."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, GPUS, MODELS, GpuProfile
from autotune.inputs.loader import load_study
from autotune.inputs.newspec import (
    SPACES,
    Given,
    Host,
    batch_defaults,
    gather,
    space_for,
    write,
    written_before,
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def init(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``autotune init ARGS -o tmp_path/study.yaml`` with no terminal: (exit code, output)."""
    result = CliRunner().invoke(app, ["init", *args, "-o", str(tmp_path / "study.yaml")], env=env)
    return result.exit_code, result.output


def written(tmp_path: Path) -> dict[str, object]:
    data = yaml.safe_load((tmp_path / "study.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_a_catalog_model_on_a_named_gpu_writes_a_spec_that_loads(tmp_path: Path) -> None:
    """A catalog model for vLLM (no `vllm` here: the newest GPU space) on an H100: `vllm serve MODEL`, the
    model's own max-model-len, chat's SLO and lengths, and the space with the H100's batch defaults."""
    code, output = init(tmp_path, "--model", "Llama-3.1-8B", "--gpu", "H100-80GB")
    assert code == 0, output
    spec = written(tmp_path)
    assert spec["server"] == {
        "command": ["vllm", "serve", "Llama-3.1-8B"],
        "model": "Llama-3.1-8B",
        "args": {"max-model-len": MODELS["Llama-3.1-8B"].max_position_embeddings},
        "port": 0,
        "start_timeout": "15m",
    }
    assert spec["slo"] == {"terms": ["ttft:p95<=500ms", "tpot:p95<=50ms"]}
    assert spec["memory_model"] == {"model": "Llama-3.1-8B", "gpu": "H100-80GB"}
    loaded = load_study(tmp_path / "study.yaml")
    space = loaded.search_space.spec.params
    assert (space["max_num_seqs"].default, space["max_num_batched_tokens"].default) == (1024, 8192)
    assert (
        (tmp_path / "study.space.yaml")
        .read_text()
        .startswith(
            "# Copied by `autotune init` from search_spaces/vllm-0.34.yaml, the batch defaults set for "
            "H100-80GB"
        )
    )
    assert "every key" in (tmp_path / "study.yaml").read_text()  # commented


def test_a_local_config_json_sets_the_model_len_and_the_memory_model(tmp_path: Path) -> None:
    """A local folder with a config.json: its max_position_embeddings and the folder for the memory model;
    on the simulator, the simulator's command and space."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    code, output = init(tmp_path, "--model", str(model), "--gpu", "L40S-48GB", "--simulate", "--budget", "3")
    assert code == 0, output
    spec = written(tmp_path)
    server = spec["server"]
    assert isinstance(server, dict)
    assert server["command"] == ["python", "-m", "autotune.sim", str(model), "--sim-hardware", "L40S-48GB"]
    assert server["args"] == {"max-model-len": 2048}
    assert spec["memory_model"] == {"model": str(model), "gpu": "L40S-48GB"}
    assert spec["budget"] == {"launches": 3}
    assert load_study(tmp_path / "study.yaml").search_space.spec.name == "sim"
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "study.yaml")])
    assert result.exit_code == 0, result.output


def test_a_hub_id_is_read_from_the_hugging_face_cache(tmp_path: Path) -> None:
    """A hub id the catalog does not know, whose config.json is in the cache (read offline)."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    code, output = init(
        tmp_path,
        "--model",
        "acme/tiny-chat",
        "--gpu",
        "A100-80GB",
        env={"HF_HUB_CACHE": str(tmp_path / "hub")},
    )
    assert code == 0, output
    spec = written(tmp_path)
    assert spec["memory_model"] == {"model": str(snapshot), "gpu": "A100-80GB"}
    assert spec["study"] == {"name": "tiny-chat"}
    space = load_study(tmp_path / "study.yaml").search_space.spec.params
    assert (space["max_num_seqs"].default, space["max_num_batched_tokens"].default) == (256, 2048)  # an A100
    simulated = ["--model", "acme/tiny-chat", "--gpu", "A100-80GB", "--simulate", "--force"]
    code, output = init(tmp_path, *simulated, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert code == 0, output
    server = written(tmp_path)["server"]
    assert isinstance(server, dict)
    assert server["command"][3:] == [
        str(snapshot),
        "--sim-hardware",
        "A100-80GB",
        "--served-model-name",
        "acme/tiny-chat",
    ]
    assert server["model"] == "acme/tiny-chat"  # the name requests use, as the simulator serves it


@pytest.mark.parametrize(
    ("lines", "kind", "arrival"),
    [
        ([{"timestamp": 0.0, "input_len": 100, "output_len": 20}], "trace", "trace"),
        ([{"prompt": "hello there", "output_len": 20}], "jsonl", "poisson"),
    ],
)
def test_a_dataset_file_takes_the_place_of_lengths(
    tmp_path: Path, lines: list[dict[str, object]], kind: str, arrival: str
) -> None:
    """A trace (replayed at its own arrivals) or JSONL prompts: the kind told from the file's rows."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in lines * 3))
    code, output = init(tmp_path, "--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--dataset", str(data))
    assert code == 0, output
    workload = written(tmp_path)["workload"]
    assert isinstance(workload, dict)
    assert workload["dataset"]["kind"] == kind
    assert workload["dataset"]["path"] == str(data)
    assert workload["arrival"] == {"process": arrival}
    load_study(tmp_path / "study.yaml")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--model", "acme/unknown-model", "--gpu", "H100-80GB"], "error: --model: 'acme/unknown-model' is"),
        (["--model", "Llama-3.1-8B", "--gpu", "B300-288GB"], "error: --gpu: unknown GPU 'B300-288GB'"),
        (["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--slo", "ttft<=3s"], "error: --slo: invalid SLO"),
        (["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--input-len", "2048-512"], "error: --input-len:"),
        (["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--budget", "soon"], "error: --budget: 'soon'"),
        (["--model", "Llama-3.1-8B"], "error: --gpu: no GPU found through NVML"),
        (["--gpu", "H100-80GB"], "error: --model: required"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path: Path, args: list[str], line: str) -> None:
    """Each bad answer: one line naming the option and the value, exit status 2, nothing written."""
    code, output = init(tmp_path, *args, env={"HF_HUB_CACHE": str(tmp_path / "empty-hub")})
    assert code == 2
    assert output.startswith(line), output
    assert output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_spec_is_kept_without_force(tmp_path: Path) -> None:
    """A second init refuses to overwrite (exit 2, the file unchanged); with --force it rewrites."""
    assert init(tmp_path, "--model", "Llama-3.1-8B", "--gpu", "H100-80GB")[0] == 0
    before = (tmp_path / "study.yaml").read_text()
    code, output = init(tmp_path, "--model", "Qwen2.5-7B", "--gpu", "H100-80GB")
    assert (code, output.split(":")[:2]) == (2, ["error", " --output"])
    assert "pass --force" in output
    assert (tmp_path / "study.yaml").read_text() == before
    assert init(tmp_path, "--model", "Qwen2.5-7B", "--gpu", "H100-80GB", "--force")[0] == 0
    assert "Qwen2.5-7B" in (tmp_path / "study.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.space.yaml", "study.yaml"]


def test_the_gpu_found_through_nvml_is_read_at_run_time() -> None:
    """Without --gpu, the machine's GPU sets the batch defaults and the memory model reads it again at
    run time (`gpu: auto`); a `vllm --version` answer picks the space."""
    found = GpuProfile("NVIDIA H200", 143771 * 2**20, 4800.0, 989.0)
    asked: list[tuple[str, ...]] = []

    def version_of(command: tuple[str, ...]) -> str:
        asked.append(tuple(command))
        return "0.34.1"

    answers = gather(Given(model="Llama-3.1-8B"), None, Host({}, found, version_of))
    assert (answers.gpu, answers.gpu_auto) == (found, True)
    assert asked == [("vllm", "serve", "Llama-3.1-8B")]
    assert answers.space == SPACES / "vllm-0.34.yaml"


@pytest.mark.parametrize(
    ("name", "memory_gib", "defaults"),
    [
        ("H100-80GB", None, (1024, 8192)),
        ("A100-80GB", None, (256, 2048)),  # vLLM leaves the A100 at the small defaults
        ("L40S-48GB", None, (256, 2048)),
        ("RTX-4090-24GB", None, (256, 2048)),
        ("B200", 180, (1024, 16384)),  # from 160 GiB, twice the tokens
    ],
)
def test_batch_defaults_follow_vllm_by_the_gpus_memory(
    name: str, memory_gib: int | None, defaults: tuple[int, int]
) -> None:
    """vLLM 0.34's get_batch_defaults, as docs/vllm.md gives it."""
    gpu = GPUS[name] if memory_gib is None else GpuProfile(name, memory_gib * GIB, 8000.0, 2250.0)
    assert batch_defaults(gpu) == defaults


@pytest.mark.parametrize(
    ("version", "simulated", "space"),
    [
        ("0.34.1", False, "vllm-0.34.yaml"),
        ("0.34.0+cu128", False, "vllm-0.34.yaml"),
        (None, False, "vllm-0.34.yaml"),  # not known: the newest
        ("0.40.0", False, "vllm-0.34.yaml"),  # newer than any space: the newest
        ("0.6.3", False, "vllm-legacy.yaml"),
        ("0.34.0", True, "sim.yaml"),
    ],
)
def test_the_space_matches_the_servers_vllm(version: str | None, simulated: bool, space: str) -> None:
    """The base space of the release the server runs (not a focused one such as vllm-0.34-kernels)."""
    assert space_for(version, simulated=simulated) == SPACES / space


def test_spaces_missing_beside_the_package_name_the_option(tmp_path: Path) -> None:
    """An install without the shipped spaces says to pass --search-space."""
    with pytest.raises(SpecError, match="--search-space: no search spaces at"):
        space_for("0.34.0", simulated=False, spaces=tmp_path / "none")


def test_the_readmes_example_writes_a_spec_that_loads(tmp_path: Path) -> None:
    """The quickstart's `autotune init` line, on a GPU named (no NVML here), with its output moved here."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```bash\n   autotune init ", 1)[1].split("```", 1)[0]
    args = shlex.split(block.replace("\\\n", " "))
    args = args[: args.index("-o")]  # the output goes to tmp_path
    code, output = init(tmp_path, *args, "--gpu", "H100-80GB", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert code == 0, output
    loaded = load_study(tmp_path / "study.yaml")
    assert loaded.spec.server.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert loaded.spec.budget.wall_time == 10 * 3600


def test_the_same_answers_find_the_spec_written_before(tmp_path: Path) -> None:
    """`tune --model ...` run again resumes: the files written hold exactly these answers; other answers
    (another SLO) or an edited spec do not match."""
    host = Host({}, None, lambda command: None)
    given = Given(model="Llama-3.1-8B", gpu="H100-80GB", simulate=True, budget="2")
    answers = gather(given, None, host)
    path = tmp_path / "llama.yaml"
    assert not written_before(answers, path)
    write(answers, path, force=False)
    assert written_before(gather(given, None, host), path)
    assert not written_before(gather(replace(given, slo=("ttft:p95<=1s",)), None, host), path)
    path.write_text(path.read_text() + "# edited\n")
    assert not written_before(answers, path)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["tune", "spec.yaml", "--model", "Llama-3.1-8B"], "error: --model: give a study spec or --model"),
        (["tune"], "error: SPEC: give a study spec, or --model"),
        (
            ["tune", "--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--slo", "ttft<=1s"],
            "error: --slo: invalid",
        ),
    ],
)
def test_tune_with_flags_refuses_bad_input_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], line: str
) -> None:
    """`tune --model ...`: a spec and flags together, neither, or a bad answer: one line, exit 2, no file."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.output.startswith(line), result.output
    assert list(tmp_path.iterdir()) == []


def test_tune_with_other_flags_keeps_the_spec_written_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec of that name with other answers is not overwritten: exit 2, the file unchanged."""
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["init", "--model", "Llama-3.1-8B", "--gpu", "H100-80GB"]).exit_code == 0
    before = (tmp_path / "llama-3.1-8b.yaml").read_text()
    result = CliRunner().invoke(app, ["tune", "--model", "Llama-3.1-8B", "--gpu", "A100-80GB"])
    assert result.exit_code == 2
    assert result.output.startswith("error: --model: llama-3.1-8b.yaml exists with other answers")
    assert (tmp_path / "llama-3.1-8b.yaml").read_text() == before
