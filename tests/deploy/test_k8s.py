"""docker/k8s: the manifests parse, each object has its required keys, and every name, port,
command and Redis key they refer to exists (in the manifests or in the project)."""

from __future__ import annotations

import ipaddress
import json
import os
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.__main__ import GRACEFUL_SHUTDOWN_S
from gateway.metrics import QueueBacklogs
from gateway.settings import GatewaySettings
from producer_client.schema import QueueStats
from tests.deploy.support import (
    DOCKER,
    known_mili_variables,
    load_yaml_documents,
    parse_dockerfile,
    redis_server_flags,
    worker_commands,
)
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


DEPLOYMENTS = ["mili-worker", "mili-gateway"]


def container_of(deployment: str) -> dict:
    (container,) = the("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def worker_container() -> dict:
    return container_of("mili-worker")


def gateway_container() -> dict:
    return container_of("mili-gateway")


def env_value(container: dict, name: str) -> dict:
    return next(e for e in container["env"] if e["name"] == name)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_has_api_version_kind_and_name(obj):
    assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_deployment_selector_matches_its_pods(deployment):
    spec = the("Deployment", deployment)["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_each_worker_pod_has_a_gpu():
    assert worker_container()["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_probes_run_the_worker_healthcheck_within_their_timeout():
    container = worker_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == HEALTHCHECK, probe
        # Redis that does not answer reads as unhealthy, not as the probe's timeout
        assert container[probe]["timeoutSeconds"] > WorkerSettings.model_fields["healthcheck_timeout_s"].default, probe
    assert "healthcheck" in worker_commands()
    assert set(container["args"]) <= worker_commands()


def test_the_startup_probe_allows_five_minutes_for_loading_the_model():
    probe = worker_container()["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300


def test_the_metrics_port_is_the_settings_default():
    default = WorkerSettings.model_fields["metrics_port"].default
    assert [p["containerPort"] for p in worker_container()["ports"]] == [default]
    annotations = the("Deployment", "mili-worker")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == default


def test_a_draining_worker_gets_its_grace_period():
    pod = the("Deployment", "mili-worker")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > WorkerSettings.model_fields["drain_grace_s"].default


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_pods_run_as_the_image_user(deployment):
    useradd = next(i.args for i in parse_dockerfile(DOCKER / "Dockerfile") if "useradd" in i.args)
    security = the("Deployment", deployment)["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert f"--uid {security['runAsUser']}" in useradd and f"--gid {security['runAsGroup']}" in useradd


def image_environment() -> dict[str, str]:
    """The Dockerfile's ENV: what every container of the image starts with."""
    return {
        k: v
        for i in parse_dockerfile(DOCKER / "Dockerfile")
        if i.keyword == "ENV"
        for k, v in (pair.split("=", 1) for pair in i.args.split())
    }


def test_worker_environment_names_settings_and_objects_that_exist():
    container = worker_container()
    mili = {e["name"] for e in container["env"] if e["name"].startswith("MILI_")}
    assert mili <= known_mili_variables()
    secret_ref = env_value(container, "MILI_REDIS")["valueFrom"]["secretKeyRef"]
    assert secret_ref["key"] in the("Secret", secret_ref["name"])["stringData"]
    # The pod's own name: unique per replica, so each worker has its own consumer name.
    assert env_value(container, "MILI_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_every_variable_the_worker_pod_sets_is_one_the_worker_reads():
    """A variable nothing reads is a setting an operator tunes in vain: REDIS_ADDRESS, for KEDA's
    redis-streams trigger, stayed after the trigger became the prometheus one on the gateway's
    backlog (scaledobject.yaml), its comment still saying KEDA read it."""
    assert {e["name"] for e in worker_container()["env"]} <= known_mili_variables()


def test_the_redis_url_names_the_redis_service():
    service = the("Service", "redis")
    port = service["spec"]["ports"][0]["port"]
    container = worker_container()
    secret_ref = env_value(container, "MILI_REDIS")["valueFrom"]["secretKeyRef"]
    url = urlsplit(the("Secret", secret_ref["name"])["stringData"][secret_ref["key"]])
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", port)


def test_volumes_are_declared_and_claims_exist():
    pod = the("Deployment", "mili-worker")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker_container()["volumeMounts"]}
    assert set(mounts.values()) == set(volumes)
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    the("PersistentVolumeClaim", claim)
    assert image_environment()["MILI_CACHE_DIR"] in mounts


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


def test_keda_scales_the_worker_deployment_on_the_queues_whole_backlog_the_gateway_exports():
    scaled = the("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == the("Deployment", "mili-worker")["metadata"]["name"]
    assert 0 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    queue = WorkerSettings.model_fields["queue"].default
    # The gauge of the waiting jobs over every stream, the one KEDA must see, as the gateway names it.
    stats = QueueStats(queue=queue, depth=3, pending=1, waiting=2, workers=[])
    backlogs = QueueBacklogs()
    backlogs.stats = [stats]
    (waiting,) = [f for f in backlogs.collect() if f.name == "mili_queue_waiting_jobs"]
    assert [(s.labels, s.value) for s in waiting.samples] == [({"queue": queue}, 2)]
    assert meta["query"] == f'max({waiting.name}{{queue="{queue}"}})'
    assert float(meta["threshold"]) > 0 and float(meta["activationThreshold"]) >= 0
    assert meta["ignoreNullValues"] == "false"
    assert urlsplit(meta["serverAddress"]).scheme == "http"


def test_prometheus_scrapes_the_gateways_metrics_where_it_serves_them():
    annotations = the("Deployment", "mili-gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert [p["containerPort"] for p in gateway_container()["ports"]] == [int(annotations["prometheus.io/port"])]


def container_environment(container: dict) -> dict[str, str]:
    """The container's variables as the pod gets them: the image's, then its own, each Secret's
    value read from the Secret of the manifests."""
    env = image_environment()
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            ref = variable["valueFrom"]["secretKeyRef"]
            env[variable["name"]] = the("Secret", ref["name"])["stringData"][ref["key"]]
    return env


def gateway_settings(monkeypatch) -> GatewaySettings:
    for name in [n for n in os.environ if n.startswith("MILI_")]:
        monkeypatch.delenv(name)
    for name, value in container_environment(gateway_container()).items():
        monkeypatch.setenv(name, value)
    return GatewaySettings.load(None)


def test_the_gateway_trusts_forwarded_addresses_from_the_pod_networks_only(monkeypatch):
    """Behind the ingress every connection comes from its pods: with the default (127.0.0.1) every
    client would be one address to the gateway, which counts wrong keys per address."""
    (variable,) = [e for e in gateway_container()["env"] if e["name"] == "MILI_TRUSTED_PROXIES"]
    trusted = gateway_settings(monkeypatch).trusted_proxies
    assert trusted == json.loads(variable["value"]) != GatewaySettings.model_fields["trusted_proxies"].default_factory()
    networks = [ipaddress.ip_network(proxy) for proxy in trusted]  # "*" or a name would raise
    assert networks and all(network.is_private for network in networks)


def test_the_gateway_container_loads_its_settings_and_listens_where_its_port_and_probes_say(monkeypatch):
    container = gateway_container()
    assert container["command"] == ["python", "-m", "gateway"]
    settings = gateway_settings(monkeypatch)
    assert settings.host == "0.0.0.0" and settings.api_keys  # a gateway behind an ingress needs keys
    assert {e["name"] for e in container["env"]} <= {f"MILI_{name.upper()}" for name in GatewaySettings.model_fields}
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port
    annotations = the("Deployment", "mili-gateway")["spec"]["template"]["metadata"]["annotations"]
    assert (int(annotations["prometheus.io/port"]), annotations["prometheus.io/path"]) == (settings.port, "/metrics")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == port["name"], probe
        assert container[probe]["httpGet"]["path"] in ("/health", "/metrics"), probe  # open without a key
        assert container[probe]["timeoutSeconds"] > settings.health_timeout_s, probe
    assert not settings.monitoring_needs_key
    service = the("Service", "mili-gateway")
    labels = the("Deployment", "mili-gateway")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]


def test_a_stopping_gateway_gets_its_grace_period():
    pod = the("Deployment", "mili-gateway")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > GRACEFUL_SHUTDOWN_S
