"""docker/compose.yml and docker/compose.cpu.yml: they parse, each service has what it needs,
workers scale, and every path, port and variable they name exists in the project."""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.settings import GatewaySettings
from tests.deploy.support import (
    DOCKER,
    Tagged,
    known_mili_variables,
    load_compose,
    parse_dockerfile,
    redis_server_flags,
    volume_mounts,
)
from worker.settings import WorkerSettings

REQUIRED = {
    "redis": {"image", "command", "volumes", "healthcheck"},
    "worker": {"build", "image", "environment", "volumes", "deploy", "stop_grace_period"},
    "gateway": {"build", "image", "entrypoint", "environment", "ports", "healthcheck"},
    "prometheus": {"image", "volumes"},
    "grafana": {"image", "volumes"},
}


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def test_every_service_has_its_required_keys(compose):
    assert set(compose["services"]) == set(REQUIRED)
    for name, keys in REQUIRED.items():
        assert keys <= set(compose["services"][name]), f"{name} lacks {keys - set(compose['services'][name])}"


def test_redis_keeps_an_append_only_file_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    flags = redis_server_flags(redis["command"])
    assert flags == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    assert volume_mounts(redis)["/data"] in compose["volumes"]


def test_workers_scale_with_no_fixed_name_or_host_port(compose):
    worker = compose["services"]["worker"]
    assert not {"container_name", "hostname", "ports"} & set(worker)


def test_each_worker_reserves_a_gpu(compose):
    (device,) = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1


def test_the_worker_builds_from_the_dockerfile(compose):
    build = compose["services"]["worker"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert (context / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()


def test_the_worker_reaches_redis_by_its_service_name(compose):
    environment = compose["services"]["worker"]["environment"]
    url = urlsplit(environment["MILI_REDIS"])
    assert url.scheme == "redis" and url.hostname in compose["services"] and url.port == 6379
    assert compose["services"]["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert set(environment) <= known_mili_variables()


def test_worker_volumes_are_declared_and_land_where_the_image_expects_them(compose):
    mounts = volume_mounts(compose["services"]["worker"])
    assert all(source in compose["volumes"] for source in mounts.values())
    image = parse_dockerfile(DOCKER / "Dockerfile")
    env = dict(pair.split("=", 1) for i in image if i.keyword == "ENV" for pair in i.args.split())
    (volume,) = [i.exec_form() for i in image if i.keyword == "VOLUME"]
    assert set(mounts) == {env["MILI_CACHE_DIR"], *volume}


def test_a_draining_worker_gets_its_grace_period_before_sigkill(compose):
    drain_s = WorkerSettings.model_fields["drain_grace_s"].default
    assert seconds(compose["services"]["worker"]["stop_grace_period"]) > drain_s


def test_bind_mounted_files_exist(compose):
    for name, service in compose["services"].items():
        for target, source in volume_mounts(service).items():
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source} (mounted at {target}) does not exist"


def test_the_gateway_runs_the_workers_image_and_reaches_redis_without_a_gpu(compose):
    gateway, worker = compose["services"]["gateway"], compose["services"]["worker"]
    assert (gateway["build"], gateway["image"]) == (worker["build"], worker["image"])
    assert gateway["entrypoint"] == ["python", "-m", "gateway"] and gateway["command"] == []
    assert "deploy" not in gateway
    assert gateway["environment"]["MILI_REDIS"] == worker["environment"]["MILI_REDIS"]
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert set(gateway["environment"]) <= {f"MILI_{name.upper()}" for name in GatewaySettings.model_fields}
    assert gateway["ports"] == [
        f"127.0.0.1:{gateway['environment']['MILI_PORT']}:{gateway['environment']['MILI_PORT']}"
    ]
    assert f":{gateway['environment']['MILI_PORT']}/health" in " ".join(gateway["healthcheck"]["test"])


def test_the_cpu_override_builds_the_cpu_variant_without_a_gpu_reservation(compose):
    override = load_compose(DOCKER / "compose.cpu.yml")
    assert set(override["services"]) == {"worker", "gateway"}
    assert override["services"]["gateway"] == {
        "build": override["services"]["worker"]["build"],
        "image": override["services"]["worker"]["image"],
    }
    worker = override["services"]["worker"]
    args = {i.args.partition("=")[0] for i in parse_dockerfile(DOCKER / "Dockerfile") if i.keyword == "ARG"}
    assert set(worker["build"]["args"]) <= args
    assert worker["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert isinstance(worker["deploy"], Tagged) and worker["deploy"].tag == "!reset"
    assert worker["environment"] == {"MILI_DEVICE": "cpu"}
    assert worker["image"] != compose["services"]["worker"]["image"]  # the CPU image does not overwrite the GPU one
