"""The deployment files users apply as they are (cluster.yaml, configs/k8s/*.yaml, docker/Dockerfile.*): valid
YAML with the fields the cluster launcher / KubeRay / Kubernetes require, and the images they name built by a
Dockerfile in the repository."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
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
    # no authentication on the server: only this namespace's pods reach it (where NetworkPolicy is enforced)
    pol = docs["NetworkPolicy"]
    assert pol["metadata"]["namespace"] == "healsweep" and pol["spec"]["podSelector"]["matchLabels"] == svc["spec"]["selector"]
    (rule,) = pol["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}] and rule["ports"] == [{"protocol": "TCP", "port": 5000}]


def test_every_pod_can_write_its_volumes():
    """The images run as `ray` (uid 1000, group users = 100); a fresh PVC is root-owned: without fsGroup the MLflow
    server cannot create its database and crash-loops, and the trials cannot write the shared run directory."""
    (job,) = _docs(REPO / "configs" / "k8s" / "kuberay-rayjob.yaml")
    rc = job["spec"]["rayClusterSpec"]
    docs = {d["kind"]: d for d in _docs(REPO / "configs" / "k8s" / "mlflow.yaml")}
    pods = [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"]),
            docs["Deployment"]["spec"]["template"]]
    for t in pods:
        assert t["spec"].get("volumes") and t["spec"]["securityContext"]["fsGroup"] == 100, t
    for df in (REPO / "docker").glob("Dockerfile.*"):
        assert "COPY --chown=ray:users" in df.read_text(), df  # the group fsGroup names


def test_cluster_yaml_documents_tmux_and_the_tracking_server():
    text = (REPO / "cluster.yaml").read_text()
    d = yaml.safe_load(text)
    assert {"cluster_name", "provider", "available_node_types", "head_node_type"} <= set(d)
    assert "ray exec cluster.yaml --tmux" in text
    assert any("MLFLOW_TRACKING_URI=http://" in c for c in d["head_setup_commands"])
    assert "bash ~/healsweep/docker/mlflow-head.sh start" in d["head_setup_commands"]  # tests/e2e/test_mlflow_head.py
    assert "mlflow-head.sh backup' && ray down cluster.yaml" in text


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync not installed")
def test_cluster_yaml_syncs_the_shipped_weights_and_not_what_runs_make(tmp_path):
    """``ray up`` rsyncs this checkout to every node with cluster.yaml's rsync_exclude/rsync_filter, as Ray's command
    runner builds the arguments. A `.gitignore` filter dropped the shipped reference weights (rsync reads its `!`
    exceptions as excludes): the default sweep could not load its models on the nodes."""
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    d = yaml.safe_load((REPO / "cluster.yaml").read_text())
    args = SSHCommandRunner._create_rsync_filter_args(None, {"rsync_exclude": d.get("rsync_exclude"),
                                                              "rsync_filter": d.get("rsync_filter")})
    src = tmp_path / "checkout"  # the repository's files plus what a user's runs leave beside them
    for rel in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    made = ["runs/default/mlflow.db", ".healsweep/store/x.arrow", ".venv/bin/python", "mlflow.db", "store/x",
            ".git/HEAD", "orchestrator/__pycache__/cli.cpython-311.pyc", "healsweep.egg-info/PKG-INFO"]
    for rel in made:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x")
    out = subprocess.run(["rsync", "-a", "-n", "--out-format=%n", *args, f"{src}/", str(tmp_path / "node")],
                         capture_output=True, text=True, check=True).stdout.split()
    synced = {p.rstrip("/") for p in out}
    shipped = {f"tasks/models/weights/{m}.safetensors" for m in ("vit_digits", "resnet_digits")}
    assert shipped <= synced and "tasks/store/core.py" in synced and "configs/default.yaml" in synced
    assert not {rel for rel in made if rel in synced}, sorted(rel for rel in made if rel in synced)


def test_the_documented_sweep_commands_parse_and_put_trials_on_the_gpus():
    """cluster.yaml's header command and the RayJob's entrypoint, through healsweep's own argument parser: flags that
    exist, and (configs/default.yaml runs CPU trials) a GPU share per trial on the GPU workers, which sat idle."""
    import shlex

    from orchestrator.cli import build_parser

    text = (REPO / "cluster.yaml").read_text()
    block = text[text.index("#   ray exec cluster.yaml --tmux"):text.index("cluster_name:")]
    quoted = " ".join(ln.lstrip("# ").rstrip("\\").strip() for ln in block.splitlines()).split("'")[1]
    (job,) = _docs(REPO / "configs" / "k8s" / "kuberay-rayjob.yaml")
    for command in (quoted.split("&&", 1)[1], job["spec"]["entrypoint"]):
        argv = shlex.split(command)
        assert argv[0] == "healsweep", command
        args = build_parser().parse_args(argv[1:])
        res = dict(kv.split("=") for kv in args.resources.split(","))
        assert 0 < float(res["gpu"]) < 1 and args.address == "auto", command


def test_every_ray_node_and_the_driver_run_without_token_auth():
    """Ray 2.60 turns token auth on for `ray start --head` when ~/.ray/auth_token exists (an earlier local ray.init
    on the head writes one): then no worker joins. Every start command and the driver's shell set the mode."""
    d = yaml.safe_load((REPO / "cluster.yaml").read_text())
    for cmd in d["head_start_ray_commands"] + d["worker_start_ray_commands"]:
        if "ray start" in cmd:
            assert cmd.index("export RAY_AUTH_MODE=disabled") < cmd.index("ray start"), cmd
    assert any("export RAY_AUTH_MODE=disabled' >> ~/.bashrc" in c for c in d["head_setup_commands"])
