"""What autotune relies on in Optuna's private names (autotune/store/optuna_private.py), pinned: an Optuna
upgrade that changes any of it fails here first, with the function that needs mending named in the message."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from autotune.store import optuna_private

# autotune beats the heartbeat itself (recovery.heartbeat), outside Study.optimize, as these tests ask.
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")

UPGRADE = "Optuna changed what autotune/store/optuna_private.py.{} relies on"


@pytest.fixture
def study(tmp_path: Path) -> optuna.Study:
    with warnings.catch_warnings():  # the heartbeat is experimental in Optuna
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'pin.db'}", heartbeat_interval=60)
    return optuna.create_study(storage=storage, study_name="pin")


def test_the_storage_and_its_connections(study: optuna.Study) -> None:
    found = optuna_private.storage(study)
    assert isinstance(found, optuna.storages.BaseStorage), UPGRADE.format("storage")
    assert found.get_study_id_from_name("pin") == study._study_id, UPGRADE.format("storage")
    inner = optuna_private.connections(study)
    assert isinstance(inner, optuna.storages.RDBStorage), UPGRADE.format("connections")
    memory = optuna.create_study()
    assert optuna_private.connections(memory) is optuna_private.storage(memory), UPGRADE.format("connections")


def test_a_queued_trials_params_are_what_its_suggestions_return(study: optuna.Study) -> None:
    """``enqueue_trial`` stores FIXED_PARAMS; ``queue`` does the same with the params visible; both are
    what ``ask`` then suggests; ``fix_params`` adds values the next suggestion returns."""
    study.enqueue_trial({"x": 3})
    waiting = study.get_trials(states=(TrialState.WAITING,))[0]
    assert optuna_private.queued_params(waiting) == {"x": 3}, UPGRADE.format("FIXED_PARAMS")
    trial = study.ask()
    assert trial.suggest_int("x", 0, 9) == 3, UPGRADE.format("FIXED_PARAMS")
    stored = study.get_trials()[trial.number]
    again = optuna_private.fix_params(study, trial, stored, {"y": "b"})
    assert again.number == trial.number, UPGRADE.format("fix_params")
    assert again.suggest_categorical("y", ["a", "b", "c"]) == "b", UPGRADE.format("fix_params")
    study.tell(trial, 1.0)

    distributions = {"x": IntDistribution(0, 9), "y": CategoricalDistribution(["a", "b", "c"])}
    optuna_private.queue(study, {"x": 5, "y": "c"}, distributions, {"why": "retry"})
    waiting = study.get_trials(states=(TrialState.WAITING,))[0]
    assert waiting.params == {"x": 5, "y": "c"} and waiting.user_attrs == {"why": "retry"}, UPGRADE.format(
        "queue"
    )
    trial = study.ask()
    assert trial.number == waiting.number, UPGRADE.format("queue")
    assert (trial.suggest_int("x", 0, 9), trial.suggest_categorical("y", ["a", "b", "c"])) == (5, "c"), (
        UPGRADE.format("queue")
    )


def test_another_process_trial_is_written_and_failed_once(study: optuna.Study) -> None:
    """A trial this process holds no object for (as another worker's) takes user attrs and is failed
    through the storage, atomically: the second attempt reports that it lost."""
    study.ask()
    frozen = study.get_trials(states=(TrialState.RUNNING,))[0]
    assert optuna_private.trial_id(frozen) == frozen._trial_id, UPGRADE.format("trial_id")
    optuna_private.set_user_attrs(study, frozen, {"failed_because": "given back"})
    assert optuna_private.fail(study, frozen) is True, UPGRADE.format("fail")
    stored = study.get_trials()[frozen.number]
    assert stored.state == TrialState.FAIL and stored.user_attrs == {"failed_because": "given back"}
    with pytest.raises(UpdateFinishedTrialError):
        optuna_private.fail(study, frozen)


def test_the_heartbeat_and_system_attrs_of_a_live_trial(study: optuna.Study) -> None:
    assert optuna_private.heartbeat_interval(study) == 60, UPGRADE.format("heartbeat_interval")
    assert optuna_private.heartbeat_interval(optuna.create_study()) is None, UPGRADE.format(
        "heartbeat_interval"
    )
    trial = study.ask()
    optuna_private.beat(study, trial)  # the storage's record_heartbeat takes the trial's storage id
    assert study.get_trials()[trial.number].state == TrialState.RUNNING, UPGRADE.format("beat")
    optuna_private.set_system_attr(trial, "constraints", [-1.0, 0.5])
    assert study.get_trials()[trial.number].system_attrs["constraints"] == [-1.0, 0.5], UPGRADE.format(
        "set_system_attr"
    )


def test_no_other_module_touches_optunas_private_names() -> None:
    """Optuna's private attributes and modules are named in autotune/store/optuna_private.py only."""
    import re

    private = re.compile(
        r"\._(storage|trial_id|study_id|backend)\b|\boptuna(\.\w+)*\._\w+|[\"']fixed_params[\"']"
    )
    root = Path(optuna_private.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "optuna_private.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if private.search(line)
    ]
    assert not found, "Optuna's private names outside autotune/store/optuna_private.py:\n" + "\n".join(found)
