"""docker/k8s: the manifests parse, each object has its required keys, and every name, port,
command and Redis key they refer to exists (in the manifests or in the project)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml

from producer_client.keys import GROUP, Keys
from tests.deploy.support import (
    DOCKER,
    known_mili_variables,
    load_yaml_documents,
    parse_dockerfile,
    redis_server_flags,
    worker_commands,
)
from worker.healthcheck import REDIS_TIMEOUT_S
from worker.settings import WorkerSettings

K8S = DOCKER / "k8s"
HEALTHCHECK = ["python", "-m", "worker", "healthcheck"]


def manifests() -> list[dict]:
    resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return [doc for name in resources for doc in load_yaml_documents(K8S / name)]


OBJECTS = manifests()


def the(kind: str, name: str | None = None) -> dict:
    found = [o for o in OBJECTS if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def worker_container() -> dict:
    (container,) = the("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env_value(container: dict, name: str) -> dict:
    return next(e for e in container["env"] if e["name"] == name)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_has_api_version_kind_and_name(obj):
    assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"]


def test_deployment_selector_matches_its_pods():
    spec = the("Deployment")["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_each_worker_pod_has_a_gpu():
    assert worker_container()["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_probes_run_the_worker_healthcheck_within_their_timeout():
    container = worker_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == HEALTHCHECK, probe
        assert container[probe]["timeoutSeconds"] > REDIS_TIMEOUT_S, probe
    assert "healthcheck" in worker_commands()
    assert set(container["args"]) <= worker_commands()


def test_the_startup_probe_allows_five_minutes_for_loading_the_model():
    probe = worker_container()["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300


def test_the_metrics_port_is_the_settings_default():
    default = WorkerSettings.model_fields["metrics_port"].default
    assert [p["containerPort"] for p in worker_container()["ports"]] == [default]
    annotations = the("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == default


def test_a_draining_worker_gets_its_grace_period():
    pod = the("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > WorkerSettings.model_fields["drain_grace_s"].default


def test_pods_run_as_the_image_user():
    useradd = next(i.args for i in parse_dockerfile(DOCKER / "Dockerfile") if "useradd" in i.args)
    security = the("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert f"--uid {security['runAsUser']}" in useradd and f"--gid {security['runAsGroup']}" in useradd


def test_worker_environment_names_settings_and_objects_that_exist():
    container = worker_container()
    mili = {e["name"] for e in container["env"] if e["name"].startswith("MILI_")}
    assert mili <= known_mili_variables()
    secret_ref = env_value(container, "MILI_REDIS")["valueFrom"]["secretKeyRef"]
    assert secret_ref["key"] in the("Secret", secret_ref["name"])["stringData"]
    # The pod's own name: unique per replica, so each worker has its own consumer name.
    assert env_value(container, "MILI_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_redis_url_and_address_name_the_redis_service():
    service = the("Service", "redis")
    port = service["spec"]["ports"][0]["port"]
    container = worker_container()
    secret_ref = env_value(container, "MILI_REDIS")["valueFrom"]["secretKeyRef"]
    url = urlsplit(the("Secret", secret_ref["name"])["stringData"][secret_ref["key"]])
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", port)
    assert env_value(container, "REDIS_ADDRESS")["value"] == f"redis:{port}"


def test_volumes_are_declared_and_claims_exist():
    pod = the("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker_container()["volumeMounts"]}
    assert set(mounts.values()) == set(volumes)
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    the("PersistentVolumeClaim", claim)
    env = {
        k: v
        for i in parse_dockerfile(DOCKER / "Dockerfile")
        if i.keyword == "ENV"
        for k, v in (pair.split("=", 1) for pair in i.args.split())
    }
    assert env["MILI_CACHE_DIR"] in mounts


def test_redis_keeps_an_append_only_file_and_never_evicts():
    statefulset = the("StatefulSet", "redis")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    flags = redis_server_flags(container["args"])
    assert flags == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    assert container["volumeMounts"][0]["mountPath"] == "/data"
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == container["volumeMounts"][0]["name"]
    service = the("Service", "redis")
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()


def test_keda_scales_the_worker_deployment_on_the_queue_groups_lag():
    scaled = the("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == the("Deployment")["metadata"]["name"]
    assert 0 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    assert meta["stream"] == Keys().queue(WorkerSettings.model_fields["queue"].default)
    assert meta["consumerGroup"] == GROUP
    assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
    # KEDA reads addressFromEnv from the scale target's container.
    assert env_value(worker_container(), meta["addressFromEnv"])
