"""The Kubernetes manifests under deploy/: valid against the API's models, and wired as the tuner needs.

Each YAML document is read into the ``kubernetes`` client's model class for its kind and written back:
a field the API does not know (or a misspelt one) is dropped on the way, so the two differ.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from autotune.inputs.loader import load_study

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMMAND = ["autotune", "tune", "/etc/autotune/spec.yaml", "--gpus", "all"]


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every non-empty YAML document under deploy/, with where it came from."""
    found = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        for number, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                found.append((f"{path.relative_to(REPO)}#{number}", doc))
    return found


def model_name(doc: dict[str, Any]) -> str:
    """The client's model class for a document: apiVersion batch/v1, kind Job → V1Job."""
    version = str(doc["apiVersion"]).rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + str(doc["kind"])


class _Response:
    """What ApiClient.deserialize reads in older clients: a response with the body in ``data``."""

    def __init__(self, body: str) -> None:
        self.data = body


def round_trip(doc: dict[str, Any]) -> Any:
    """The document read into its model class and serialized back, as the client would send it."""
    api = client.ApiClient()
    body = json.dumps(doc)
    try:
        if "content_type" in inspect.signature(api.deserialize).parameters:  # newer clients: the text itself
            model = api.deserialize(body, model_name(doc), "application/json")
        else:
            model = api.deserialize(_Response(body), model_name(doc))
        return api.sanitize_for_serialization(model)
    finally:
        api.close()


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def test_there_are_manifests() -> None:
    """deploy/ holds a Job, a ConfigMap and an example Secret."""
    assert sorted(doc["kind"] for _, doc in documents()) == ["ConfigMap", "Job", "Secret"]


@pytest.mark.parametrize(("where", "doc"), documents(), ids=[where for where, _ in documents()])
def test_document_matches_the_api_schema(where: str, doc: dict[str, Any]) -> None:
    """Reading a document into its Kubernetes model and writing it back changes nothing (no unknown field)."""
    assert hasattr(client, model_name(doc)), f"{where}: no model {model_name(doc)} for this apiVersion/kind"
    assert round_trip(doc) == doc


def test_job_runs_one_indexed_pod_per_gpu_node() -> None:
    """Indexed, as many pods at once as completions, never two on one node, each asking for GPUs."""
    (job,) = by_kind("Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] >= 1
    pod = spec["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = spec["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_job_retries_a_crashed_pod_but_not_bad_input() -> None:
    """A failed pod is replaced (backoffLimit > 0); exit status 2 (bad input) fails the Job at once."""
    (job,) = by_kind("Job")
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert spec["backoffLimit"] >= 1
    fail_job = [rule for rule in spec["podFailurePolicy"]["rules"] if rule["action"] == "FailJob"]
    assert fail_job[0]["onExitCodes"] == {"containerName": "autotune", "operator": "In", "values": [2]}


def test_job_command_and_storage_secret() -> None:
    """The container runs `autotune tune` on the mounted spec, with AUTOTUNE_STORAGE from the Secret."""
    (job,) = by_kind("Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == COMMAND
    assert "args" not in container
    (storage,) = [env for env in container["env"] if env["name"] == "AUTOTUNE_STORAGE"]
    assert set(storage) == {"name", "valueFrom"}
    ref = storage["valueFrom"]["secretKeyRef"]
    (secret,) = by_kind("Secret")
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert not ref.get("optional", False)


def test_configmap_is_mounted_where_the_command_reads_it() -> None:
    """The ConfigMap holding spec.yaml is the volume mounted at /etc/autotune."""
    (job,) = by_kind("Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/autotune"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (configmap,) = by_kind("ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert "spec.yaml" in configmap["data"]


def test_configmap_spec_is_a_valid_study(tmp_path: Path) -> None:
    """The ConfigMap's files, laid out as mounted, load as a study whose workdir is a mounted volume."""
    (configmap,) = by_kind("ConfigMap")
    for name, text in configmap["data"].items():
        (tmp_path / name).write_text(text)
    loaded = load_study(tmp_path / "spec.yaml")
    assert loaded.spec.study.storage is None  # the storage comes from the Secret
    (job,) = by_kind("Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(loaded.workdir.is_relative_to(mount) for mount in mounts)


def test_configmap_search_space_is_the_shipped_one() -> None:
    """The ConfigMap's search space is search_spaces/vllm-0.34.yaml, unchanged (no drifting copy)."""
    (configmap,) = by_kind("ConfigMap")
    assert configmap["data"]["search-space.yaml"] == (REPO / "search_spaces" / "vllm-0.34.yaml").read_text()
