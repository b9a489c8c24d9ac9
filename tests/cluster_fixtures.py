"""Real components for the cluster e2e tests (tests/e2e/test_cluster_*.py), imported by tests/conftest.py:
a multi-node Ray cluster on this machine (ray.cluster_utils) whose nodes do NOT inherit the test's credentials,
an S3 endpoint with enforced auth (moto_server), PostgreSQL (Debian's package) and an MLflow server on it."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tests.ray_nodes import free_port

# A cluster_utils node's workers inherit os.environ as it is when the node starts: strip what only the driver
# may have, or "workers don't get the driver's environment" could never fail.
DRIVER_ONLY = ("AWS_", "MLFLOW_", "HF_", "HEALSWEEP_")
NODE_ARGS = dict(include_dashboard=False, object_store_memory=80 * 1024 * 1024, num_gpus=0)


def start_scrubbed(fn, *a, **kw):
    saved = {k: v for k, v in os.environ.items() if k.startswith(DRIVER_ONLY)}
    for k in saved:
        del os.environ[k]
    try:
        return fn(*a, **kw)
    finally:
        os.environ.update(saved)


def make_cluster(monkeypatch, head_cpus: int):
    """A cluster_utils cluster with a ``head_cpus``-CPU head; yields it and shuts it down."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("TUNE_MAX_PENDING_TRIALS_PG", raising=False)
    cluster = start_scrubbed(Cluster, initialize_head=True, head_node_args={"num_cpus": head_cpus, **NODE_ARGS})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_node(cluster, **node_args):
    """Must run in the main thread (Ray's Node installs a SIGTERM handler)."""
    return start_scrubbed(cluster.add_node, **{**NODE_ARGS, **node_args})


# ------------------------------------------------------------------------------------------ S3 (moto)
def _wait_http(url: str, timeout: float, proc=None, log: str | None = None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited rc={proc.returncode}\n" + (open(log).read()[-3000:] if log else ""))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def moto_s3():
    """moto_server with auth ENFORCED (after 6 free calls spent on two IAM users, their keys and policies: s3:*, and
    a read-only one, every request must be signed). Yields endpoint, host, bucket, key, secret, region, ro_key,
    ro_secret."""
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "6"})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint + "/moto-api/", 30, proc)
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bootstrap",
                           aws_secret_access_key="bootstrap")
        iam.create_user(UserName="ci")
        k = iam.create_access_key(UserName="ci")["AccessKey"]
        iam.put_user_policy(UserName="ci", PolicyName="s3-all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key, secret = k["AccessKeyId"], k["SecretAccessKey"]
        iam.create_user(UserName="reader")
        ro = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.put_user_policy(UserName="reader", PolicyName="s3-read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Resource": "*",
                                                     "Action": ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"]}]}))
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                     region_name="us-east-1").create_bucket(Bucket="hs-test")
        yield {"endpoint": endpoint, "host": f"127.0.0.1:{port}", "bucket": "hs-test", "key": key,
               "secret": secret, "region": "us-east-1",
               "ro_key": ro["AccessKeyId"], "ro_secret": ro["SecretAccessKey"]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


@pytest.fixture
def aws_env(moto_s3, monkeypatch):
    """Credentials only in this (the driver's) environment; a developer's ~/.aws kept out."""
    for k, v in {"AWS_ACCESS_KEY_ID": moto_s3["key"], "AWS_SECRET_ACCESS_KEY": moto_s3["secret"],
                 "AWS_DEFAULT_REGION": moto_s3["region"], "AWS_EC2_METADATA_DISABLED": "true",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return moto_s3


# ------------------------------------------------------------------------------------------ PostgreSQL + MLflow
def _pg_bindir() -> str | None:
    # Debian keeps initdb/pg_ctl in /usr/lib/postgresql/<major>/bin, not on PATH
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if cands:
        return os.path.dirname(cands[-1])
    w = shutil.which("initdb")
    return os.path.dirname(w) if w else None


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL cluster on 127.0.0.1; yields postgresql+psycopg://postgres@127.0.0.1:P/mlflow."""
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    root = tempfile.mkdtemp(prefix="hs-pg-")  # not tmp_path: the postgres user cannot enter /tmp/pytest-of-root
    run_as = []
    if os.geteuid() == 0:  # initdb/postgres refuse to run as root
        shutil.chown(root, "postgres", "postgres")
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), free_port()
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
    subprocess.run(run_as + [f"{bindir}/initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                             "--no-sync"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(run_as + [f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(root, "server.log"), "-w", "-t", "60",
                             "-o", f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c full_page_writes=off",
                             "start"], check=True, env=env, stdout=subprocess.DEVNULL)
    try:
        subprocess.run([f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow"],
                       check=True, env=env)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(run_as + [f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                       env=env, stdout=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server(postgres_url):
    """`mlflow server` on the PostgreSQL backend (artifacts proxied); yields its http:// tracking URI."""
    root = tempfile.mkdtemp(prefix="hs-mlflow-")
    art, log, port = os.path.join(root, "artifacts"), os.path.join(root, "server.log"), free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres_url,
             "--artifacts-destination", art, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_http(uri + "/health", 180, proc, log)
        yield uri
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
