"""Prometheus and Grafana as docker/compose.yml runs them: Prometheus finds every worker and the
gateway, Grafana finds its datasource and dashboard, and the dashboard asks only for metrics a
running worker or gateway exports (checked against a scrape of a real worker and gateway), among
them the backlogs and served tokens by lane and tenant."""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

import yaml

from tests.deploy.support import DOCKER, exported_names, volume_mounts
from worker.settings import WorkerSettings

GRAFANA = DOCKER / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "mili.json").read_text())
REQUIRED_PANELS = {
    "Queue depth",
    "Requests running / waiting",
    "Time to first token",
    "Time per output token",
    "Tokens per second",
    "Prefix cache hit rate",
    "KV cache usage",
    "Jobs by outcome",
    "Jobs waiting by lane and tenant",
    "Backlog over every stream",
    "Served tokens by lane and tenant",
}
# Every other word a query may use: PromQL's functions and keywords, and label names.
PROMQL_WORDS = {
    "sum",
    "max",
    "rate",
    "histogram_quantile",
    "by",
    "le",
    "outcome",
    "instance",
    "queue",
    "lane",
    "tenant",
}


def expressions() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]


def words(expr: str) -> set[str]:
    """The identifiers of a query, without numbers, durations in [..] and label values in quotes."""
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r'"[^"]*"', " ", expr)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))


def scrape_jobs() -> dict[str, dict]:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_discovers_every_worker_replica_by_dns(compose):
    assert set(scrape_jobs()) == {"mili-worker", "mili-gateway"}
    (sd,) = scrape_jobs()["mili-worker"]["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["type"] == "A"
    assert "worker" in compose["services"]
    assert sd["port"] == WorkerSettings.model_fields["metrics_port"].default
    assert volume_mounts(compose["services"]["prometheus"])["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"


def test_prometheus_scrapes_the_gateways_metrics_where_compose_serves_them(compose):
    job = scrape_jobs()["mili-gateway"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["gateway"] and sd["type"] == "A"
    environment = compose["services"]["gateway"]["environment"]
    assert (environment["MILI_HOST"], str(sd["port"])) == ("0.0.0.0", environment["MILI_PORT"])
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_datasource_points_at_the_compose_prometheus(compose):
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.hostname in compose["services"]
    published = [p.rsplit(":", 1)[1] for p in compose["services"]["prometheus"]["ports"]]
    assert str(url.port) in published  # the container port Prometheus listens on
    scrape_interval = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval


def test_grafana_provisioning_and_dashboard_paths_exist_in_the_container(compose):
    mounts = volume_mounts(compose["services"]["grafana"])
    assert (DOCKER / mounts["/etc/grafana/provisioning"] / "datasources").is_dir()
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/mili.yml").read_text())["providers"]
    dashboards_dir = DOCKER / mounts[provider["options"]["path"]]
    assert (dashboards_dir / "mili.json").is_file()
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    directory, _, file = home.rpartition("/")
    assert (DOCKER / mounts[directory] / file).is_file()


def test_dashboard_has_the_required_panels_on_the_provisioned_datasource():
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    panels = DASHBOARD["panels"]
    assert REQUIRED_PANELS <= {p["title"] for p in panels}
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["targets"], panel["title"]
        for source in [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]:
            assert source == {"type": "prometheus", "uid": datasource["uid"]}


def test_dashboard_queries_use_only_metrics_a_running_worker_or_gateway_exports(scraped):
    exported = exported_names(scraped["worker"]) | exported_names(scraped["gateway"])
    asked = {word for expr in expressions() for word in words(expr) if word.startswith("mili_")}
    assert asked, "the dashboard asks for no mili_ metric"
    assert asked <= exported, f"not exported by the worker or the gateway: {sorted(asked - exported)}"
    others = {word for expr in expressions() for word in words(expr) if not word.startswith("mili_")}
    assert others <= PROMQL_WORDS, f"unknown names in the queries: {sorted(others - PROMQL_WORDS)}"


def test_the_lane_and_tenant_panels_chart_what_the_gateway_and_the_workers_export(scraped):
    panels = {panel["title"]: panel for panel in DASHBOARD["panels"]}

    def asked(title: str) -> set[str]:
        return {w for target in panels[title]["targets"] for w in words(target["expr"]) if w.startswith("mili_")}

    gateway = exported_names(scraped["gateway"])
    assert asked("Jobs waiting by lane and tenant") == {"mili_queue_lane_waiting_jobs"} <= gateway
    assert asked("Backlog over every stream") == {"mili_queue_waiting_jobs", "mili_queue_pending_jobs"} <= gateway
    assert (
        asked("Served tokens by lane and tenant") == {"mili_served_tokens_total"} <= exported_names(scraped["worker"])
    )
