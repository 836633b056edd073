"""Pareto selection and export formats: a `vllm serve --config` YAML, a command line, JSON, Helm values
for the vLLM production stack, and a diff against vLLM's defaults.

`vllm serve --config` turns each key into ``--key``; booleans only become ``--no-key`` when the key is
DASHED (``enable_chunked_prefill: false`` is silently ignored, docs/vllm.md), so every key is written
dashed. The model stays positional on the command line.

The Helm values follow the production stack's chart ``vllm-stack`` (deploy/README.md): one
``servingEngineSpec.modelSpec`` entry whose ``vllmConfig.extraArgs`` (a list of strings) holds every flag
as ``vllm serve`` spells it (:func:`autotune.flags.flag_argv`). The chart always passes
``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` (the latter when ``enablePrefixCaching``
is not true), so that key is set to what the study ran.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import ExportError, SpecError
from autotune.flags import FlagValue, dashed_flags, flag_argv
from autotune.formats import Format as Format  # re-exported: `autotune.results.export.Format`
from autotune.formats import Policy as Policy
from autotune.inputs.loader import LoadedStudy
from autotune.results.reproduce import reproduce_record
from autotune.store.record import TrialRecord, full_record
from autotune.study.finalists import Finalist, Gain, Pick, beats_defaults, gain, pick, reruns, verdict
from autotune.study.loop import default_trial
from autotune.units import format_figure, plural, wrap


@dataclass(frozen=True)
class Choice:
    """A selected trial with everything an export needs."""

    trial: FrozenTrial
    tuned: dict[str, FlagValue]
    """The trial's tuned flags (snake-case keys; for the defaults' trial, the values it ran with as the
    server reported them)."""
    flags: dict[str, FlagValue]
    """Fixed server args then tuned flags as the server got them (snake-case keys; JSON keys composed
    into their flag, ``unset`` values and environment parameters left out:
    :meth:`autotune.inputs.space.SearchSpace.server_flags`)."""
    baseline: FrozenTrial | None
    env: dict[str, str] = field(default_factory=dict)
    """The environment parameters the server got (the space's ``env:`` parameters)."""
    launched: dict[str, FlagValue] = field(default_factory=dict)
    """The tuned flags its launch passed: ``tuned``, or none for the defaults' trial (vLLM chose them;
    an export of it passes none either, so that it runs what was measured)."""
    finalist: Finalist | None = None
    """The chosen config's reruns, when it was measured again as a finalist."""
    gain: Gain | None = None
    """Its SLO-constrained throughput over the defaults' (from paired reruns where both were measured
    again), with its interval."""
    verdict: str = ""
    """The study's answer in one sentence (:func:`autotune.study.finalists.verdict`)."""
    beats_defaults: bool = True
    """Whether it beats vLLM's defaults beyond the noise (:func:`autotune.study.finalists.beats_defaults`)."""
    baseline_finalist: Finalist | None = None
    """The defaults' reruns, when they were measured again."""

    @property
    def figure(self) -> Figure:
        """Its SLO-constrained throughput as every output states it."""
        return figure(self.trial, self.finalist)

    @property
    def baseline_figure(self) -> Figure | None:
        """The defaults' figure as every output states it."""
        return None if self.baseline is None else figure(self.baseline, self.baseline_finalist)


@dataclass(frozen=True)
class Figure:
    """A config's SLO-constrained throughput (tok/s) as every output states it: the mean of its reruns when
    it was measured again, else its search's figure."""

    value: float | None
    interval: tuple[float, float] | None
    """``(low, high)``; ``high`` is inf where the search bounded it only from below."""
    source: str
    """``reruns`` or ``search``."""
    runs: int
    """The reruns that met the SLOs (0: the search's)."""
    missed: int
    """The reruns that missed the SLOs."""
    search: float | None
    """The search's own figure (the same as ``value`` when it was not measured again)."""
    search_interval: tuple[float, float] | None


NO_FIGURE = Figure(None, None, "search", 0, 0, None, None)
"""The figure of a config that was not measured."""


def figure(trial: FrozenTrial, finalist: Finalist | None) -> Figure:
    """``trial``'s :class:`Figure` (``finalist``: its reruns, if any)."""
    search = slo_throughput(trial)
    search_interval = TrialRecord.from_trial(trial).slo_throughput_interval if search is not None else None
    if finalist is not None and finalist.throughput is not None:
        return Figure(
            finalist.throughput,
            finalist.interval,
            "reruns",
            len(finalist.met),
            finalist.misses,
            search,
            search_interval,
        )
    missed = finalist.misses if finalist is not None else 0
    return Figure(search, search_interval, "search", 0, missed, search, search_interval)


def trial_flags(trial: FrozenTrial) -> dict[str, FlagValue]:
    """The tuned flags of a trial as the server got them (floats without binary noise)."""
    return dict(TrialRecord.from_trial(trial).flags)


def pareto_front(study: optuna.Study) -> list[FrozenTrial]:
    """Feasible Pareto-optimal COMPLETE trials, by trial number."""
    return sorted(study.best_trials, key=lambda t: t.number)


def _objective_index(loaded: LoadedStudy, policy: Policy) -> int:
    want = "maximize" if policy is Policy.MAX_THROUGHPUT else "minimize"
    for i, objective in enumerate(loaded.spec.objectives):
        if objective.direction == want:
            return i
    raise ExportError(
        f"--policy {policy.value}: the study has no objective to {want} "
        f"({[o.metric for o in loaded.spec.objectives]}): use --trial N"
    )


def choose(
    study: optuna.Study,
    loaded: LoadedStudy,
    *,
    trial: int | None,
    policy: Policy | None,
    table: Mapping[int, Finalist] | None = None,
) -> Choice:
    """Pick the trial to export: ``trial`` if given; else, without a policy, the config the study
    recommends (:func:`autotune.study.finalists.pick`: by its first objective, by the reruns once the
    finalists were measured again); for a policy, the Pareto member best for the first objective it names
    (``max-throughput``: the first maximized, which is the recommendation when it comes first). ``table``:
    the finalists' reruns (:func:`autotune.study.finalists.reruns`) when the caller has read them already."""
    table = reruns(study) if table is None else table
    if trial is not None:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == trial]
        if not matches:
            raise SpecError("--trial", f"no trial {trial} in study {loaded.spec.study.name!r}")
        chosen = matches[0]
        if chosen.state != TrialState.COMPLETE:
            cause = TrialRecord.from_trial(chosen).cause or chosen.state.name.lower()
            raise SpecError("--trial", f"trial {trial} was not measured ({cause}): nothing to export")
    else:
        front = pareto_front(study)
        if not front:
            raise ExportError(
                f"study {loaded.spec.study.name!r} has no complete trial that meets the SLOs yet"
            )
        # No --policy: the study's one rule (what the progress lines, status and the report name).
        index = 0 if policy is None else _objective_index(loaded, policy)
        recommended = pick(study, loaded, table) if index == 0 else None
        if recommended is not None:
            chosen = recommended.trial
        else:
            sign = 1 if loaded.spec.objectives[index].direction == "maximize" else -1
            chosen = max(front, key=lambda t: (sign * t.values[index], -t.number))
    tuned = trial_flags(chosen)
    launched = {} if TrialRecord.from_trial(chosen).baseline else tuned
    flags = loaded.search_space.server_flags(launched)
    baseline = default_trial(study)
    picked = Pick(chosen, chosen.number in table, table.get(chosen.number))
    over = gain(table, chosen, baseline)
    return Choice(
        trial=chosen,
        tuned=tuned,
        flags=flags,
        baseline=baseline,
        env=loaded.search_space.env(launched),
        launched=launched,
        finalist=table.get(chosen.number),
        gain=over,
        verdict=verdict(picked, over, baseline),
        beats_defaults=beats_defaults(picked, over, baseline),
        baseline_finalist=table.get(baseline.number) if baseline is not None else None,
    )


def versus(table: Mapping[int, Finalist], choice: Choice, other: Choice) -> Gain | None:
    """``choice``'s throughput over ``other``'s, paired on the requests both met (``table``: the
    finalists' reruns, :func:`autotune.study.finalists.reruns`); zero for the same trial."""
    return gain(table, choice.trial, other.trial)


def render(
    choice: Choice, loaded: LoadedStudy, fmt: Format, width: int = 0, env: Mapping[str, str] | None = None
) -> str:
    """Render a choice in ``fmt``; the text ends with a newline. The comments that head the YAML formats
    wrap within ``width`` columns (0: not wrapped); what a program reads (the YAML itself, the command
    line, JSON) and the command to copy are never wrapped. ``env`` locates the model's files for the
    JSON's reproduce record (none: the Hugging Face cache's default place)."""
    if fmt is Format.VLLM_YAML:
        return _vllm_yaml(choice, loaded, width)
    if fmt is Format.ARGS:
        return shlex.join([*_env_prefix(choice.env), *_command(choice, loaded)]) + "\n"
    if fmt is Format.HELM:
        return _helm(choice, loaded, width)
    return json.dumps(export_record(choice, loaded, env or {}), indent=2, sort_keys=False) + "\n"


def _env_prefix(env: dict[str, str]) -> list[str]:
    """``env NAME=value ...`` before a command, or nothing."""
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def _env_comments(env: dict[str, str]) -> list[str]:
    """The environment a config needs, as YAML comment lines (a `--config` file cannot set it)."""
    return [f"# environment: {k}={v}\n" for k, v in env.items()]


def defaults_of(loaded: LoadedStudy, baseline: FrozenTrial | None) -> dict[str, FlagValue]:
    """vLLM's defaults of the tuned flags as the study knows them: the space's declared ones, then the
    defaults' trial's values, then what its server reported (``reported_defaults``) wherever it did."""
    out: dict[str, FlagValue] = dict(loaded.search_space.defaults())
    if baseline is None:
        return out
    record = TrialRecord.from_trial(baseline)
    out.update({k: v for k, v in record.flags.items() if k in loaded.search_space.params})
    reported = record.reported_defaults or {}
    for name in loaded.search_space.names:
        flag, dot, key = name.partition(".")
        value = reported.get(flag) if not dot else None
        if dot and isinstance(reported.get(flag), dict):
            value = reported[flag].get(key)
        if isinstance(value, bool | int | float | str):
            out[name] = value
    return out


def diff(choice: Choice, loaded: LoadedStudy, width: int = 0) -> str:
    """The chosen config against vLLM's defaults as a unified diff of their `vllm serve --config` YAML
    (every line shown; the header says which trials and the gain, wrapped within ``width`` columns, 0: not
    wrapped); ends with a newline. The defaults are those the server reported at the defaults' trial
    (:func:`defaults_of`)."""
    known = defaults_of(loaded, choice.baseline)
    space = loaded.search_space
    defaults, defaults_env = space.server_flags(known), space.env(known)
    base = choice.baseline
    before = f"vLLM defaults (trial {base.number})" if base is not None else "vLLM defaults (not measured)"
    after = f"trial {choice.trial.number}"
    old = yaml.safe_dump(dashed_flags(defaults), sort_keys=False).splitlines(keepends=True)
    # the values the trial ran with (for the defaults' trial, those the server reported), on the same
    # footing as the defaults: what differs, not what each command line spelt out
    ran, ran_env = space.server_flags(choice.tuned), space.env(choice.tuned)
    new = yaml.safe_dump(dashed_flags(ran), sort_keys=False).splitlines(keepends=True)
    old += _env_comments(defaults_env)
    new += _env_comments(ran_env)
    header = _comments(
        [
            f"study {loaded.spec.study.name!r}, trial {choice.trial.number} against vLLM's defaults",
            headline(choice),
        ],
        width,
    )
    lines = "".join(difflib.unified_diff(old, new, fromfile=before, tofile=after, n=max(len(old), len(new))))
    return header + (lines or "# no flag differs from vLLM's defaults\n")


def _comments(lines: list[str], width: int, *, use: str | None = None) -> str:
    """The header of an export: ``# autotune: `` and the first line, then each line, as YAML comments
    wrapped within ``width`` (continuation lines indented); ``use``, the command to copy, comes last and
    whole. Ends with a newline."""
    first, *rest = lines
    text = "\n".join(f"# {line}" for line in [f"autotune: {first}", *rest])
    shown = wrap(text, width) + "\n"
    return shown + (f"# use: {use}\n" if use is not None else "")


HELM_CHART = "vllm-stack"
"""The vLLM production stack's chart (github.com/vllm-project/production-stack, ``helm/``)."""

HELM_IMAGE = "vllm/vllm-openai"
"""The chart's usual vLLM image; its tag is the vLLM version the study measured when known."""


def _helm_name(model: str) -> str:
    """A DNS label for ``modelSpec[].name`` (the chart puts it in Deployment and Service names)."""
    label = re.sub(r"[^a-z0-9]+", "-", model.rsplit("/", 1)[-1].lower()).strip("-")
    return label[:40].rstrip("-") or "model"


def _helm_model(loaded: LoadedStudy) -> str:
    """The model the server loads: ``serve``'s positional argument in ``server.command``, else
    ``server.model``."""
    command = list(loaded.spec.server.command)
    if "serve" in command:
        after = command[command.index("serve") + 1 :]
        if after and not after[0].startswith("-"):
            return after[0]
    return loaded.spec.server.model


def _helm_tag(version: str | None) -> str | None:
    match = re.fullmatch(r"v?(\d+\.\d+\.\d+(?:\.\d+)?)", version or "")
    return f"v{match.group(1)}" if match else None


def helm_values(choice: Choice, loaded: LoadedStudy) -> dict[str, Any]:
    """The chart's values for the chosen config: one model, its flags in ``vllmConfig.extraArgs``."""
    flags = dict(choice.flags)
    prefix = flags.pop("enable_prefix_caching", True)
    extra = [item for name, value in flags.items() for item in flag_argv(name, value)]
    tp = int(flags.get("tensor_parallel_size", 1) or 1) * int(flags.get("pipeline_parallel_size", 1) or 1)
    tag = _helm_tag(TrialRecord.from_trial(choice.trial).server_version)
    model = _helm_model(loaded)
    return {
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": _helm_name(model),
                    "repository": HELM_IMAGE,
                    "tag": tag or "latest",
                    "modelURL": model,
                    "replicaCount": 1,
                    "requestCPU": 6,
                    "requestMemory": "16Gi",
                    "requestGPU": tp,
                    "vllmConfig": {"enablePrefixCaching": bool(prefix), "extraArgs": extra},
                    **(
                        {"env": [{"name": k, "value": v} for k, v in choice.env.items()]}
                        if choice.env
                        else {}
                    ),
                }
            ]
        }
    }


def _helm(choice: Choice, loaded: LoadedStudy, width: int) -> str:
    """The Helm values with a header of comments (within ``width``, but for the command to copy)."""
    tag = _helm_tag(TrialRecord.from_trial(choice.trial).server_version)
    prefix = "enable_prefix_caching" in choice.flags
    lines = [
        f"study {loaded.spec.study.name!r}, trial {choice.trial.number}: values for the vLLM production "
        f"stack's Helm chart ({HELM_CHART}, github.com/vllm-project/production-stack).",
        headline(choice),
        "Set requestCPU, requestMemory and the image for your cluster"
        + ("." if tag else "; the tag is 'latest': the study did not record its vLLM version."),
    ]
    if not prefix:
        lines.append(
            "enablePrefixCaching: the chart passes --no-enable-prefix-caching unless it is true; true is "
            "vLLM's default, which the study ran with (the flag was neither tuned nor fixed)."
        )
    header = _comments(lines, width, use=f"helm upgrade --install RELEASE vllm/{HELM_CHART} -f FILE.yaml")
    body = yaml.safe_dump(helm_values(choice, loaded), sort_keys=False, default_flow_style=False)
    return header + body


def _command(choice: Choice, loaded: LoadedStudy) -> list[str]:
    return loaded.server_argv(choice.launched)


def _vllm_yaml(choice: Choice, loaded: LoadedStudy, width: int) -> str:
    """The `vllm serve --config` YAML with a header of comments (within ``width``, but for the command)."""
    body = dashed_flags(choice.flags)
    command = shlex.join([*_env_prefix(choice.env), *loaded.spec.server.command, "--config", "FILE.yaml"])
    lines = [f"study {loaded.spec.study.name!r}, trial {choice.trial.number}", headline(choice)]
    header = _comments(lines, width, use=command) + "".join(_env_comments(choice.env))
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def headline(choice: Choice) -> str:
    """One sentence: the study's verdict, which names the chosen trial (its gain over the defaults, or that
    nothing beat them beyond the noise), then its SLO-constrained throughput with its interval (the mean
    of its reruns when it was measured again)."""
    number = choice.trial.number
    parts = [choice.verdict] if choice.verdict else []
    if not re.search(rf"\btrial {number}\b", choice.verdict):
        parts.insert(0, f"trial {number}")
    shown = choice.figure
    record = TrialRecord.from_trial(choice.trial)
    if shown.source == "reruns" and shown.value is not None:
        bounds = f" [{_span(shown.interval)}]" if shown.interval else ""
        missed = f", {plural(shown.missed, 'rerun')} missed the SLOs" if shown.missed else ""
        parts.append(
            f"SLO-constrained throughput {format_figure(shown.value, 'tok/s')}{bounds} (mean of "
            f"{plural(shown.runs, 'rerun')}{missed})"
        )
    elif record.slo_throughput is not None and choice.trial.state == TrialState.COMPLETE:
        interval = record.slo_throughput_interval
        kind = (record.estimate or {}).get("kind")
        limit = (record.estimate or {}).get("client_limit")
        if kind == "saturation":
            tail = " (search: every request at once met the SLOs)"
        elif interval is not None and math.isinf(interval[1]) and limit:
            tail = f" or more (a lower bound, not the server's limit: {limit})"
        elif interval is not None and math.isinf(interval[1]):
            tail = " or more (search: every probed rate met the SLOs)"
        elif interval is not None:
            tail = f" [{_span(interval)}] (search)"
        else:
            tail = " (search)"
        parts.append(f"SLO-constrained throughput {format_figure(record.slo_throughput, 'tok/s')}{tail}")
    return "; ".join(parts)


def _span(interval: tuple[float, float]) -> str:
    """An interval of figures for people: ``19,512-20,301``."""
    return f"{format_figure(interval[0])}-{format_figure(interval[1])}"


def slo_throughput(trial: FrozenTrial) -> float | None:
    """A trial's SLO-constrained output throughput (tok/s), if it was measured."""
    if trial.state != TrialState.COMPLETE:
        return None
    return TrialRecord.from_trial(trial).slo_throughput


# ----------------------------------------------------------------------------------------------
# The fields every JSON output shares (best --format json, export --format json, status --json):
# one name and one form per fact, documented in docs/reading.md ("The JSON outputs' fields")
# ----------------------------------------------------------------------------------------------


def throughput_fields(shown: Figure) -> dict[str, Any]:
    """``slo_throughput`` (tok/s: the reruns' mean when it was measured again, else the search's), its
    ``slo_throughput_interval`` (``[low, high]``, ``high`` null when the search only bounded it from
    below), ``slo_throughput_from`` (``reruns`` or ``search``), and the search's own figure and interval."""
    return {
        "slo_throughput": shown.value,
        "slo_throughput_interval": _pair(shown.interval),
        "slo_throughput_from": shown.source if shown.value is not None else None,
        "search_slo_throughput": shown.search,
        "search_slo_throughput_interval": _pair(shown.search_interval),
    }


def _pair(interval: tuple[float, float] | None) -> list[float | None] | None:
    """An interval as JSON: ``[low, high]``, ``high`` null when open above."""
    if interval is None:
        return None
    return [interval[0], interval[1] if math.isfinite(interval[1]) else None]


def gain_fields(found: Gain | None) -> dict[str, Any]:
    """The gain over vLLM's defaults: ``gain_over_defaults`` (0.05: 5 % more), its ``gain_interval``, the
    ``gain_paired_reruns`` it rests on and whether it is ``gain_within_noise``."""
    return {
        "gain_over_defaults": None if found is None else found.value,
        "gain_interval": None if found is None else [found.lo, found.hi],
        "gain_paired_reruns": None if found is None else found.rounds,
        "gain_within_noise": None if found is None else found.within_noise,
    }


def reruns_fields(finalist: Finalist | None) -> dict[str, Any] | None:
    """A finalist's reruns (null when it was not measured again)."""
    if finalist is None or not finalist.reruns:
        return None
    return {
        "runs": len(finalist.met),
        "slo_throughput_mean": finalist.throughput,
        "slo_throughput_runs": [r.slo_throughput for r in finalist.reruns],
        "interval": list(finalist.interval) if finalist.interval else None,
        "missed": finalist.misses,
    }


def defaults_fields(choice: Choice | None, baseline: FrozenTrial | None = None) -> dict[str, Any]:
    """vLLM's defaults' trial (``choice.baseline``, else ``baseline``): its number, how it ended, and its
    figure and the search's (:func:`throughput_fields`), the two a gain is paired against."""
    if choice is not None:
        baseline = choice.baseline
    base = TrialRecord.from_trial(baseline) if baseline is not None else None
    shown = (
        choice.baseline_figure if choice is not None else None if baseline is None else figure(baseline, None)
    )
    return {
        "trial": None if baseline is None else baseline.number,
        "outcome": None if base is None else base.outcome,
        "cause": None if base is None or base.cause is None else base.cause.value,
        **throughput_fields(shown or NO_FIGURE),
    }


def export_record(choice: Choice, loaded: LoadedStudy, env: Mapping[str, str]) -> dict[str, Any]:
    """The JSON export: flags, command line, measured metrics, workload and SLOs, and what it was measured
    with (``reproduce``: :func:`autotune.results.reproduce.reproduce_record`, ``env`` locating the model)."""
    trial = choice.trial
    record = full_record(trial, loaded.trial_dir(trial.number))
    spec = loaded.spec
    return {
        "study": spec.study.name,
        "trial": trial.number,
        "model": spec.server.model,
        "flags": dashed_flags(choice.tuned),
        "server_flags": dashed_flags(choice.flags),
        "command": _command(choice, loaded),
        "env": choice.env,
        "objectives": {o.metric: v for o, v in zip(spec.objectives, trial.values or [], strict=False)},
        "highest_passing_probe": record.operating_point,
        "reference_probe": record.reference,
        "probes": list(record.probes) or None,
        "capacity": record.capacity,
        "server_delta": record.server_delta,
        "defaults": defaults_fields(choice),
        "estimate": record.estimate,
        **throughput_fields(choice.figure),
        **gain_fields(choice.gain),
        "verdict": choice.verdict,
        "beats_defaults": choice.beats_defaults,
        "reruns": reruns_fields(choice.finalist),
        "workload": spec.workload.model_dump(mode="json"),
        "slo": {"terms": [str(t) for t in spec.slo.terms], "error_budget": spec.slo.error_budget},
        "reproduce": reproduce_record(trial, choice.launched, loaded, env),
    }
