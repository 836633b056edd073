"""Choosing a config from the Pareto front and exporting it (vllm-yaml, args, json)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import yaml

from autotune.errors import ExportError, SpecError
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.results.best import best_csv, best_record, best_table
from autotune.results.export import Format, Policy, choose, render
from autotune.results.export import headline as choice_headline
from autotune.results.status import pick_summary
from autotune.study.loop import StudyRunner, open_study

from .fake_trials import FakeTrials, Run

SPACE = {
    "params": {
        "max_num_seqs": {"type": "categorical", "choices": [16, 64, 256], "default": 256},
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.96, "step": 0.08, "default": 0.88},
        "enable_chunked_prefill": {"type": "bool", "default": True},
    }
}


def make_study(
    tmp_path: Path, outcome: Callable[[Mapping[str, FlagValue]], TrialOutcome], again: Run | None = None
) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "exp"},
        "server": {"command": "vllm serve my/model", "model": "my/model", "args": {"max-model-len": 4096}},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "budget": {"trials": 12},
        "sampler": {"name": "random", "seed": 2},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_study(path)
    study = open_study(loaded, create=True)

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return outcome(flags)

    trials = FakeTrials(run, again)
    StudyRunner(loaded, study, trials, on_event=lambda e: None, on_stale=lambda t: None).run()
    return loaded


def surface(flags: Mapping[str, FlagValue]) -> TrialOutcome:
    """Throughput grows with max_num_seqs, so does TTFT; utilization 0.96 OOMs."""
    if float(flags["gpu_memory_utilization"]) > 0.9:
        return TrialOutcome(cause=Cause.OOM, summary="CUDA out of memory")
    seqs = int(flags["max_num_seqs"])
    bonus = 1.1 if flags["enable_chunked_prefill"] is False else 1.0
    tput, ttft = 10.0 * seqs * bonus, 50.0 + seqs
    return TrialOutcome(
        cause=None,
        summary="ok",
        values=(tput, ttft),
        constraints=(-0.5, 0.0),
        attrs={
            "operating_point": {"output_throughput": tput, "p95_ttft_ms": ttft, "request_rate": 2.0},
            "flags": dict(flags),
        },
    )


def open_(loaded: LoadedStudy):  # type: ignore[no-untyped-def]
    return open_study(loaded, create=False, heartbeat=False)


def test_policies_pick_the_ends_of_the_pareto_front(tmp_path: Path) -> None:
    """max-throughput picks the front's highest throughput, min-latency its lowest TTFT."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    fast = choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT)
    quick = choose(study, loaded, trial=None, policy=Policy.MIN_LATENCY)
    front = study.best_trials
    assert fast.trial.values[0] == max(t.values[0] for t in front)
    assert quick.trial.values[1] == min(t.values[1] for t in front)
    assert fast.baseline is not None and fast.baseline.number == 0


def test_vllm_yaml_uses_dashed_keys_and_real_booleans(tmp_path: Path) -> None:
    """The YAML has dashed keys (vLLM ignores `enable_chunked_prefill: false`), fixed args included."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    off = next(
        t for t in study.trials if t.state.name == "COMPLETE" and not t.params["enable_chunked_prefill"]
    )
    text = render(choose(study, loaded, trial=off.number, policy=None), loaded, Format.VLLM_YAML)
    body = yaml.safe_load(text)
    assert body["enable-chunked-prefill"] is False
    assert body["max-model-len"] == 4096
    assert all("_" not in key for key in body)
    assert body["gpu-memory-utilization"] in (0.8, 0.88)
    assert text.startswith("# autotune: study 'exp'")
    assert "# use: vllm serve my/model --config FILE.yaml" in text


def test_args_is_a_ready_command_line(tmp_path: Path) -> None:
    """The args export is the server command plus every flag, shell-quoted; booleans as --x/--no-x."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT)
    argv = shlex.split(render(choice, loaded, Format.ARGS))
    assert argv[:3] == ["vllm", "serve", "my/model"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(choice.flags["max_num_seqs"])
    chunked = (
        "--enable-chunked-prefill"
        if choice.flags["enable_chunked_prefill"]
        else "--no-enable-chunked-prefill"
    )
    assert chunked in argv


def test_json_carries_flags_metrics_workload_slo_and_gain(tmp_path: Path) -> None:
    """The JSON export has what a dashboard needs, including the gain over the vLLM defaults."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT)
    data = json.loads(render(choice, loaded, Format.JSON))
    assert data["flags"]["max-num-seqs"] == choice.flags["max_num_seqs"]
    assert data["server_flags"]["max-model-len"] == 4096 and "max-model-len" not in data["flags"]
    assert data["slo"] == {"terms": ["ttft:p95<=500ms"], "error_budget": 0.0}
    assert data["workload"]["endpoint"] == "completions"
    base = data["defaults"]["slo_throughput"]
    assert data["gain_over_defaults"] == pytest.approx(data["slo_throughput"] / base - 1)
    assert data["highest_passing_probe"]["request_rate"] == 2.0


def test_the_json_outputs_name_each_fact_alike(tmp_path: Path) -> None:
    """best --format json, export --format json and status --json give the pick's trial, tuned flags,
    SLO throughput and interval, gain and reruns under the same names, with the same values; flags are
    keyed as on vLLM's command line in all three; the defaults' trial is named alike."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=None)
    exported = json.loads(render(choice, loaded, Format.JSON))
    best = best_record(study, loaded)
    picked = next(c for c in best["configs"] if c["picked"])
    status = pick_summary(study, loaded)
    assert status is not None
    shared = (
        "trial",
        "flags",
        "slo_throughput",
        "slo_throughput_interval",
        "slo_throughput_from",
        "search_slo_throughput",
        "search_slo_throughput_interval",
        "gain_over_defaults",
        "gain_interval",
        "gain_paired_reruns",
        "gain_within_noise",
        "reruns",
    )
    for key in shared:
        assert exported[key] == picked[key] == status[key], key
    assert exported["flags"] and all("_" not in name for name in exported["flags"])
    for key in (
        "trial",
        "outcome",
        "cause",
        "slo_throughput",
        "slo_throughput_from",
        "search_slo_throughput",
    ):
        assert exported["defaults"][key] == best["defaults"][key], key
    defaults_row = next(c for c in best["configs"] if c["role"] == "defaults")
    assert defaults_row["slo_throughput"] == best["defaults"]["slo_throughput"]


def test_a_config_measured_again_is_stated_by_its_reruns_everywhere(tmp_path: Path) -> None:
    """One figure per config: once the finalists are measured again (here at 80 % of their search's
    figure), the table, the headline, every JSON output and the CSV state the reruns' mean, the defaults'
    too, and the gain is that figure over the defaults' shown one; the search's figure is kept apart."""

    def rerun(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        found = surface(flags)
        tput = found.values[0] * 0.8
        point = {**found.attrs["operating_point"], "output_throughput": tput}
        attrs = {**found.attrs, "operating_point": point}
        return TrialOutcome(None, "ok", (tput, found.values[1]), found.constraints, attrs)

    loaded = make_study(tmp_path, surface, again=rerun)
    study = open_(loaded)
    choice = choose(study, loaded, trial=None, policy=None)
    shown = choice.figure
    assert shown.source == "reruns" and shown.search is not None
    assert shown.value == pytest.approx(shown.search * 0.8)
    base = choice.baseline_figure
    assert base is not None and base.source == "reruns"
    assert choice.gain is not None and choice.gain.value == pytest.approx(shown.value / base.value - 1)
    exported = json.loads(render(choice, loaded, Format.JSON))
    best = best_record(study, loaded)
    status = pick_summary(study, loaded)
    assert status is not None
    picked = next(c for c in best["configs"] if c["picked"])
    for config in best["configs"]:  # paired: on the round both reran, else on the search's stream
        if config["gain_over_defaults"] is None:
            continue
        if config["gain_paired_reruns"] == 1:
            expected = config["slo_throughput"] / best["defaults"]["slo_throughput"] - 1
        else:
            assert config["gain_paired_reruns"] == 0
            expected = config["search_slo_throughput"] / best["defaults"]["search_slo_throughput"] - 1
        assert config["gain_over_defaults"] == pytest.approx(expected), config["trial"]
    assert any(c["slo_throughput_from"] == "search" and c["gain_over_defaults"] for c in best["configs"])
    assert picked["gain_over_pick"] == 0.0
    for config in best["configs"]:  # and each one against the pick, paired alike
        if not config["picked"] and config["gain_over_pick"] is not None:
            assert config["gain_over_pick"] < 0 or config["gain_over_pick_interval"][0] <= 0, config["trial"]
    for data in (exported, picked, status):
        assert data["slo_throughput"] == pytest.approx(shown.value)
        assert data["slo_throughput_from"] == "reruns"
        assert data["search_slo_throughput"] == pytest.approx(shown.search)
    assert exported["defaults"]["slo_throughput"] == best["defaults"]["slo_throughput"] == base.value
    assert f"{shown.value:,.0f} tok/s" in choice_headline(choice)
    table = best_table(study, loaded, 140)
    assert f"{shown.value:.1f}" in table and f"{shown.search:.1f}" not in table
    rows = list(csv.DictReader(io.StringIO(best_csv(study, loaded))))
    row = next(r for r in rows if r["picked"] == "true")
    assert float(row["slo_throughput"]) == pytest.approx(shown.value)
    assert float(row["search_slo_throughput"]) == pytest.approx(shown.search)


def test_exporting_an_unmeasured_or_missing_trial_is_bad_input(tmp_path: Path) -> None:
    """--trial naming a pruned or absent trial is a one-line error naming --trial (exit 2)."""
    loaded = make_study(tmp_path, surface)
    study = open_(loaded)
    pruned = next(t for t in study.trials if t.state.name == "PRUNED")
    with pytest.raises(SpecError, match=r"--trial: trial \d+ was not measured \(oom\)") as info:
        choose(study, loaded, trial=pruned.number, policy=None)
    assert info.value.exit_code == 2
    with pytest.raises(SpecError, match="no trial 999"):
        choose(study, loaded, trial=999, policy=None)


def test_nothing_feasible_yet_is_said_plainly(tmp_path: Path) -> None:
    """A study whose every trial crashed has no front: export says so, best says so."""
    loaded = make_study(tmp_path, lambda flags: TrialOutcome(cause=Cause.OOM, summary="CUDA out of memory"))
    study = open_(loaded)
    with pytest.raises(ExportError, match="no complete trial that meets the SLOs"):
        choose(study, loaded, trial=None, policy=None)
    table = best_table(study, loaded)
    assert "No complete trial meets the SLOs yet." in table
    assert "pruned (oom)" in table


JSON_ENV_SPACE = {
    "params": {
        "max_num_seqs": {"type": "categorical", "choices": [16, 256], "default": 256},
        "attention_backend": {"type": "categorical", "choices": ["auto", "FLASH_ATTN"], "unset": "auto"},
        "speculative_config.method": {"type": "categorical", "choices": ["off", "ngram"], "unset": "off"},
        "speculative_config.num_speculative_tokens": {"type": "categorical", "choices": [2, 3]},
    },
    "env": {"VLLM_USE_FLASHINFER_SAMPLER": {"type": "bool", "default": True}},
}


def _exported(tmp_path: Path, winner: Mapping[str, FlagValue]) -> tuple[LoadedStudy, dict[str, object], str]:
    """A study on JSON_ENV_SPACE where only ``winner``'s values meet the SLOs; its vllm-yaml, args."""
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(JSON_ENV_SPACE))
    spec = {
        "study": {"name": "exp"},
        "server": {"command": "vllm serve my/model", "model": "my/model", "args": {"max-model-len": 4096}},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "budget": {"trials": 16},
        "sampler": {"name": "random", "seed": 3},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_study(tmp_path / "spec.yaml")
    study = open_study(loaded, create=True)

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        tput = 1000.0 if all(flags.get(k) == v for k, v in winner.items()) else 100.0
        return TrialOutcome(
            cause=None,
            summary="ok",
            values=(tput, 60.0),
            constraints=(-0.5, 0.0),
            attrs={"operating_point": {"output_throughput": tput}, "flags": dict(flags)},
        )

    StudyRunner(loaded, study, FakeTrials(run), on_event=lambda e: None, on_stale=lambda t: None).run()
    choice = choose(open_(loaded), loaded, trial=None, policy=None)
    assert all(choice.tuned.get(k) == v for k, v in winner.items()), choice.tuned
    body = yaml.safe_load(render(choice, loaded, Format.VLLM_YAML))
    return loaded, body, render(choice, loaded, Format.ARGS)


def test_exports_write_what_the_trial_ran_json_keys_composed_unset_and_env_left_out(tmp_path: Path) -> None:
    """The export uses the launch's rules: a JSON flag's keys become that flag's JSON text, an ``unset``
    value passes nothing, an environment parameter is the environment, not a flag."""
    winner = {"speculative_config.method": "ngram", "attention_backend": "FLASH_ATTN"}
    _, body, args = _exported(tmp_path, winner)
    assert json.loads(str(body["speculative-config"]))["method"] == "ngram"
    assert not any(k.startswith("speculative-config.") or "VLLM" in k for k in body)
    assert body["attention-backend"] == "FLASH_ATTN"
    command = shlex.split(args)
    assert command[0] == "env" and command[1].startswith("VLLM_USE_FLASHINFER_SAMPLER=")
    served = command[command.index("vllm") :]
    assert served[served.index("--speculative-config") + 1] == body["speculative-config"]


def test_an_unset_value_exports_no_flag(tmp_path: Path) -> None:
    """A config at ``unset`` values (vLLM picks) exports neither the flag nor the JSON flag."""
    _, body, args = _exported(tmp_path, {"speculative_config.method": "off", "attention_backend": "auto"})
    assert "attention-backend" not in body and "speculative-config" not in body
    assert "--attention-backend" not in args and "--speculative-config" not in args


def test_without_a_policy_export_names_the_studys_pick_whatever_its_first_objective(tmp_path: Path) -> None:
    """With a latency objective first, `export` (no --policy) and the study's pick (progress lines,
    status, report) name the same trial; an explicit --policy still picks by its objective."""
    from autotune.study.finalists import pick

    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "exp"},
        "server": {"command": "vllm serve my/model", "model": "my/model"},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "objectives": [
            {"metric": "ttft:p95", "direction": "minimize"},
            {"metric": "slo_throughput", "direction": "maximize"},
        ],
        "budget": {"trials": 10},
        "sampler": {"name": "random", "seed": 2},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_study(tmp_path / "spec.yaml")
    study = open_study(loaded, create=True)

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        out = surface(flags)
        return out if out.values is None else dataclasses.replace(out, values=out.values[::-1])

    StudyRunner(loaded, study, FakeTrials(run), on_event=lambda e: None, on_stale=lambda t: None).run()
    study = open_(loaded)
    recommended = pick(study, loaded)
    assert recommended is not None
    assert choose(study, loaded, trial=None, policy=None).trial.number == recommended.trial.number
    fastest = choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT).trial
    assert fastest.values[1] == max(t.values[1] for t in study.best_trials)


def test_the_defaults_trial_exports_no_tuned_flag(tmp_path: Path) -> None:
    """An export of vLLM's defaults passes none of the tuned flags, as their trial did (the values it
    recorded are what the server reported or the space declared, which need not be what vLLM chose)."""
    loaded = make_study(tmp_path, surface)
    choice = choose(open_(loaded), loaded, trial=0, policy=None)
    assert choice.tuned and not choice.launched
    assert yaml.safe_load(render(choice, loaded, Format.VLLM_YAML)) == {"max-model-len": 4096}
    assert shlex.split(render(choice, loaded, Format.ARGS)) == [
        "vllm",
        "serve",
        "my/model",
        "--max-model-len",
        "4096",
    ]
