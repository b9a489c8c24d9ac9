"""The deployment files users apply as they are (cluster.yaml, configs/k8s/*.yaml, docker/Dockerfile.*): valid
YAML with the fields the cluster launcher / KubeRay / Kubernetes require, and the images they name built by a
Dockerfile in the repository."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = sorted((REPO / "configs" / "k8s").glob("*.yaml"))


def _docs(p: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(p.read_text()) if d is not None]


def _built_images() -> dict[str, str]:
    """{image tag from the `docker build -t` line: ray base image variant (cpu | gpu)}."""
    out = {}
    for df in (REPO / "docker").glob("Dockerfile.*"):
        text = df.read_text()
        tag = re.search(r"docker build -f docker/\S+ -t (\S+) \.", text).group(1)
        assert re.search(r"^FROM rayproject/ray:2\.60\.0-py311-(cpu|gpu)$", text, re.M), df
        extras = set(re.search(r'/opt/healsweep\[([\w,]+)\]', text).group(1).split(","))
        # psycopg for PostgreSQL stores; full mlflow: configs/k8s/mlflow.yaml runs `mlflow server` from the cpu image
        assert {"postgres", "mlflow"} <= extras and "ray[tune]==2.60.0" in text, df
        out[tag] = re.search(r"^FROM rayproject/ray:2\.60\.0-py311-(cpu|gpu)$", text, re.M).group(1)
    return out


def test_every_k8s_manifest_parses_and_has_the_required_fields():
    assert {p.name for p in K8S} >= {"kuberay-rayjob.yaml", "mlflow.yaml"}
    for p in K8S:
        for d in _docs(p):
            assert {"apiVersion", "kind", "metadata"} <= set(d), p
            assert d["metadata"].get("name"), p


def test_rayjob_autoscales_and_its_submitter_can_reach_the_head():
    (job,) = _docs(REPO / "configs" / "k8s" / "kuberay-rayjob.yaml")
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("healsweep run")
    rc = job["spec"]["rayClusterSpec"]
    assert rc["enableInTreeAutoscaling"] is True and rc["rayVersion"] == "2.60.0"
    assert rc["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    for g in rc["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.healsweep.svc.cluster.local:5000"
    images = _built_images()
    pods = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
    for t in pods:
        for c in t["spec"]["containers"]:
            assert c["image"] in images, c["image"]
            if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}):
                assert images[c["image"]] == "gpu"


def test_the_mlflow_service_the_rayjob_logs_to_exists():
    docs = {d["kind"]: d for d in _docs(REPO / "configs" / "k8s" / "mlflow.yaml")}
    svc, dep = docs["Service"], docs["Deployment"]
    assert (svc["metadata"]["name"], svc["metadata"]["namespace"]) == ("mlflow", "healsweep")
    assert svc["spec"]["ports"][0]["port"] == 5000
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] in _built_images()
    assert "mlflow.healsweep.svc.cluster.local:5000" in c["args"][0]  # MLflow 3 checks the Host header


def test_cluster_yaml_filters_rsync_and_documents_tmux():
    text = (REPO / "cluster.yaml").read_text()
    d = yaml.safe_load(text)
    assert {"cluster_name", "provider", "available_node_types", "head_node_type"} <= set(d)
    assert {".venv", "runs", ".healsweep"} <= set(d["rsync_exclude"])
    assert "ray exec cluster.yaml --tmux" in text
    assert any("MLFLOW_TRACKING_URI=http://" in c for c in d["head_setup_commands"])
