"""deploy/: the Kubernetes manifests validate against the API's schemas, and the Grafana
dashboard queries only metrics that a live router exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from tests.support.cluster import metrics

DEPLOY = Path(__file__).parents[2] / "deploy"
MANIFESTS = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


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
        ("Deployment", "pdserve-router"),
        ("Deployment", "pdserve-prefill"),
        ("Deployment", "pdserve-decode"),
        ("Service", "pdserve"),
        ("StatefulSet", "redis"),
        ("HorizontalPodAutoscaler", "pdserve-prefill"),
        ("ConfigMap", "pdserve"),
        ("HorizontalPodAutoscaler", "pdserve-decode"),
    } <= kinds
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


def merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge, as far as the GPU patches use it: mappings merged key by
    key, lists of named items (containers, env) merged by name, other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in patch.items()} | {
            k: v for k, v in base.items() if k not in patch
        }
    named = isinstance(patch, list) and all(isinstance(x, dict) and "name" in x for x in patch)
    if named and isinstance(base, list):
        by_name = {x["name"]: x for x in patch}
        merged = [merge(x, by_name.pop(x["name"])) if x["name"] in by_name else x for x in base]
        return merged + list(by_name.values())
    return patch


def key(document: dict) -> tuple[str, str]:
    return document["kind"], document["metadata"]["name"]


def kustomize(directory: Path) -> list[dict]:
    """What `kubectl apply -k directory` applies, for the kustomizations here (resources,
    images' new tags, strategic-merge patches)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[dict] = []
    for resource in k["resources"]:
        path = (directory / resource).resolve()
        out += kustomize(path) if path.is_dir() else documents(path)
    for image in k.get("images", []):
        for d in out:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image['name']}:{image['newTag']}"
    for patch in k.get("patches", []):
        for p in documents(directory / patch["path"]):
            i = next(i for i, d in enumerate(out) if key(d) == key(p))
            out[i] = merge(out[i], p)
    return out


def test_the_base_kustomization_lists_every_manifest():
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in MANIFESTS]


def test_the_gpu_overlay_gives_each_worker_pod_a_gpu_and_validates():
    base = {key(d): d for d in kustomize(DEPLOY / "k8s")}
    gpu = {key(d): d for d in kustomize(DEPLOY / "k8s" / "gpu")}
    assert gpu.keys() == base.keys()
    for document in gpu.values():
        kubernetes_validate.validate(document, "1.30.0", strict=True)
    for role in ("prefill", "decode"):
        pod = gpu["Deployment", f"pdserve-{role}"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert container["image"] == "pdserve:cuda"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PDSERVE_DEVICE"] == "cuda" and env["PDSERVE_KV_CACHE_GB"] == ""
        assert env["PDSERVE_PORT"]  # the base's env kept
        base_container = base["Deployment", f"pdserve-{role}"]["spec"]["template"]["spec"]
        probes = ("readinessProbe", "livenessProbe", "startupProbe")
        assert all(container[p] == base_container["containers"][0][p] for p in probes)
    router = gpu["Deployment", "pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in router["resources"]["limits"]
    assert gpu["ConfigMap", "pdserve"] == base["ConfigMap", "pdserve"]


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


def test_the_grid_overlay_makes_each_worker_pod_a_grid_the_router_sees_rank_by_rank():
    grid = {key(d): d for d in kustomize(DEPLOY / "k8s" / "gpu-grid")}
    for document in grid.values():
        kubernetes_validate.validate(document, "1.30.0", strict=True)
    config = grid["ConfigMap", "pdserve"]["data"]
    for role, port in (("prefill", 50051), ("decode", 50052)):
        (container,) = grid["Deployment", f"pdserve-{role}"]["spec"]["template"]["spec"][
            "containers"
        ]
        env = {e["name"]: e.get("value") for e in container["env"]}
        ranks, tensor = int(env["PDSERVE_DATA_PARALLEL"]), int(env["PDSERVE_TENSOR_PARALLEL"])
        assert env["PDSERVE_DEVICE"] == "cuda" and int(env["PDSERVE_PORT"]) == port
        for kind in ("requests", "limits"):  # a GPU for every process of the grid
            assert container["resources"][kind]["nvidia.com/gpu"] == str(ranks * tensor)
        listed = config[f"PDSERVE_{role.upper()}"].split(",")  # every rank's port, by DNS
        assert listed == [f"dns:pdserve-{role}:{port + r}" for r in range(ranks)]
