"""deploy/: the Kubernetes manifests validate against the API's schemas, and the Grafana
dashboard queries only metrics that a live router exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from tests.support.cluster import metrics

DEPLOY = Path(__file__).parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_validate(path):
    for document in documents(path):
        kubernetes_validate.validate(document, "1.30.0", strict=True)
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_manifests_hold_the_pieces_a_deployment_needs():
    kinds = {(d["kind"], d["metadata"]["name"]) for p in MANIFESTS for d in documents(p)}
    assert {
        ("Deployment", "pdserve-router"), ("Deployment", "pdserve-prefill"),
        ("Deployment", "pdserve-decode"), ("Service", "pdserve"), ("StatefulSet", "redis"),
        ("HorizontalPodAutoscaler", "pdserve-prefill"), ("ConfigMap", "pdserve"),
        ("HorizontalPodAutoscaler", "pdserve-decode"),
    } <= kinds  # fmt: skip
    config = next(d for p in MANIFESTS for d in documents(p) if d["kind"] == "ConfigMap")
    for d in (d for p in MANIFESTS for d in documents(p) if d["kind"] == "Deployment"):
        container = d["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"] and container["livenessProbe"]
        assert container["resources"]["requests"]
        assert container["envFrom"] == [{"configMapRef": {"name": "pdserve"}}]
    # the router finds the workers through the headless Services the manifests define
    headless = {
        d["metadata"]["name"]: d["spec"]["ports"][0]["port"]
        for p in MANIFESTS
        for d in documents(p)
        if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
    }
    for role in ("prefill", "decode"):
        name = f"pdserve-{role}"
        assert config["data"][f"PDSERVE_{role.upper()}"] == f"dns:{name}:{headless[name]}"


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 8
    return {name for e in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", e)}


def test_dashboard_queries_only_metrics_the_router_exposes(router):
    # one request first: labelled series appear once something is counted
    body = {"prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
    exposed = {name for name, _ in metrics(router.url)}
    queried = dashboard_metric_names()
    assert {
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_generation_tokens_total",
        "pdserve_requests_waiting",
        "pdserve_worker_running",
        "pdserve_prefix_cache_hit_tokens_total",
        "pdserve_kv_store_hit_tokens_total",
    } <= queried  # TTFT, TPOT, throughput, queue depth, per-worker load, hit ratios
    assert queried - exposed == set()
