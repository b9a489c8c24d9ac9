"""Connecting the driver to Ray and sizing Tune for a cluster that may grow.

* :func:`connect` checks ``--address`` before ``ray.init`` (a short TCP probe, then HTTP/2's preface: an unreachable
  GCS, or a port where something else listens, otherwise makes Ray retry for minutes), refuses Ray Client (``ray://``)
  in one line, turns connection and token-auth failures into one line (:class:`ClusterError`, exit 2 in the CLI),
  reports which cluster ``--address auto`` joined, and hands the driver's environment the sweep needs
  (:data:`ENV_PREFIXES`) to every worker through the job's ``runtime_env``: on a real cluster workers are started by
  their node's raylet, not by the driver.
* :func:`tune_concurrency` is the concurrency policy: no cap unless ``resources.max_concurrent`` is set, so trials
  queue and a node that joins later (or an autoscaler that sees the demand) receives them; :func:`pending_limit`
  lets Tune keep the sweep's trials PENDING (not the CPUs present at start).
* :func:`check_store_uri` probes a remote store URI once so an unreachable endpoint or a missing bucket is one
  line, not an AWS traceback from a worker.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
import socket
import sys

from orchestrator.raytune.native_log import held_native_lines
from tasks.errors import first_line

# Environment variables a sweep's workers need from the driver: object-store credentials and endpoint
# (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, ...), Google
# Cloud and Azure credentials for gs:// / abfs:// stores, MLflow (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, ...),
# Hugging Face (HF_TOKEN, HF_HOME, HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, HF_ENDPOINT) and healsweep's own settings.
ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "MLFLOW_", "HF_", "HUGGINGFACE_", "HEALSWEEP_")
ENV_NAMES = ("TORCH_HOME", "XDG_CACHE_HOME", "TRANSFORMERS_OFFLINE")
NODE_LOCAL = ("HEALSWEEP_MODEL_MIRROR",)  # a node's own local paths: never the driver's
PROBE_TIMEOUT_S = 3.0


class ClusterError(Exception):
    """The driver cannot use the Ray cluster or the store it was given (one line, exit 2 in the CLI)."""


# ------------------------------------------------------------------------------------------ environment
def worker_env(environ: dict | None = None) -> dict[str, str]:
    """The driver's variables that every worker gets (names in ENV_PREFIXES / ENV_NAMES), minus those the Ray
    job's own runtime_env already sets (``ray job submit --runtime-env-json``): Ray refuses a conflicting key."""
    environ = os.environ if environ is None else environ
    out = {k: str(v) for k, v in environ.items()
           if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and k not in NODE_LOCAL}
    return {k: v for k, v in out.items() if k not in _job_env_vars(environ)}


def _job_env_vars(environ) -> set[str]:
    raw = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    try:
        return set(((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}))
    except (ValueError, AttributeError):
        return set()


# ------------------------------------------------------------------------------------------ address checks
def parse_address(address: str) -> tuple[str, int] | None:
    """'host:port' -> (host, port); None for 'auto' / 'local'; ClusterError for ray:// and malformed addresses."""
    a = address.strip()
    if a in ("auto", "local"):
        return None
    if a.startswith("ray://"):
        raise ClusterError(
            f"--address {a}: Ray Client (ray://) is not supported: Ray deprecates it and a Tune driver over it "
            "loses its MLflow writer; run healsweep on the head node instead (ray exec --tmux / ray job submit) "
            "with --address auto, or give the GCS address HOST:6379")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"--address {a!r}: expected HOST:PORT of the Ray head's GCS (e.g. 10.0.0.5:6379), "
                           "'auto' or nothing")
    return host.strip("[]"), int(port)


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S, environ=None) -> None:
    """ClusterError in at most ~2 x ``timeout`` seconds when nothing listens at host:port, or when what listens
    there does not answer as a gRPC server does (the GCS is one): otherwise ``ray.init`` retries "Failed to
    connect to GCS" for minutes against, say, a web server or the dashboard's port."""
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
        raise ClusterError(f"cannot reach the Ray cluster at {host}:{port} ({why}): is the head node up and the "
                           "port (GCS, default 6379) open from here?") from None
    with conn:
        if _tls(os.environ if environ is None else environ):
            return  # RAY_USE_TLS: the GCS wants a TLS handshake first; Ray's own errors tell the rest
        answer = _first_frame(conn)
    if not is_http2_settings(answer):
        seen = (f"said nothing in {timeout:g} s" if answer is None else "closed the connection" if not answer
                else f"answered {answer[:16]!r}")
        raise ClusterError(f"{host}:{port} is not a Ray GCS: it {seen} where a gRPC server answers HTTP/2: give "
                           "the head's GCS port (`ray start --head --port`, default 6379), not the dashboard's "
                           "(8265) or another service's")


# HTTP/2's client connection preface (RFC 9113 §3.4) and an empty SETTINGS frame: 9-byte header, length 0, type 4.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def is_http2_settings(frame: bytes | None) -> bool:
    """A server's first HTTP/2 frame is SETTINGS (RFC 9113 §3.4): byte 3 of the 9-byte frame header is type 4,
    byte 4 (flags) has no ACK bit, bytes 5-8 are stream 0."""
    return frame is not None and len(frame) >= 9 and frame[3] == 4 and not frame[4] & 1 and frame[5:9] == bytes(4)


def _first_frame(conn: socket.socket) -> bytes | None:
    """The first 9 bytes a server sends after the HTTP/2 preface (fewer when it closes; None when it says nothing
    before the socket's timeout)."""
    got = b""
    try:
        conn.sendall(HTTP2_PREFACE)
        while len(got) < 9:
            chunk = conn.recv(9 - len(got))
            if not chunk:
                break
            got += chunk
        return got
    except TimeoutError:
        return got or None
    except OSError:  # reset
        return b""


def _tls(environ) -> bool:
    return str(environ.get("RAY_USE_TLS", "")).strip().lower() in ("1", "true")


def check_address(address: str | None) -> None:
    """Fail fast (before any model or store work) on a refused, malformed or unreachable --address."""
    if not address:
        return
    hp = parse_address(address)
    if hp is None and address.strip() == "auto" and os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        parse_address(os.environ["RAY_ADDRESS"])  # RAY_ADDRESS=ray://... would make Ray pick the client
    if hp is None and address.strip() == "auto":
        hp = _auto_address()
    if hp is not None:
        probe(*hp)


def _auto_address() -> tuple[str, int]:
    """The GCS address ``--address auto`` resolves to (RAY_ADDRESS, else the cluster `ray start` recorded)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        addr = canonicalize_bootstrap_address("auto")
    except Exception as e:  # ConnectionError: no running Ray found
        raise ClusterError(_explain(e, "auto")) from None
    if not addr:
        raise ClusterError(_explain(ConnectionError("Could not find any running Ray instance"), "auto"))
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _explain(e: BaseException, address: str) -> str:
    chain, x = [], e
    while x is not None and len(chain) < 10:
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__cause__ or x.__context__
    text = " | ".join(chain)
    if "InvalidAuthToken" in text or "AuthenticationError" in text or "UNAUTHENTICATED" in text:
        return (f"Ray at {address} refused this driver's authentication token: set RAY_AUTH_MODE=token and the "
                "cluster's RAY_AUTH_TOKEN (or ~/.ray/auth_token), or RAY_AUTH_MODE=disabled if the cluster has "
                "token auth off")
    if "Could not find any running Ray instance" in text:
        return ("--address auto: no running Ray cluster found on this machine (set RAY_ADDRESS or give HOST:PORT, "
                "or omit --address for a local Ray)")
    first = first_line(e)
    return f"cannot connect to the Ray cluster at {address}: {first}"


# ------------------------------------------------------------------------------------------ connect
def connect(address: str | None, num_cpus: int | None = None, *, announce=None, verbose: bool = False) -> bool:
    """``ray.init`` for a sweep unless Ray is already initialised (then the caller's setup is kept). Returns True
    when this call started Ray (the caller shuts it down). No address: a fresh local instance, never whatever
    Ray happens to run on the machine."""
    import ray

    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, logging_level=logging.WARNING if verbose else logging.ERROR,
              log_to_driver=verbose, configure_logging=True)
    if not address:
        ray.init(address="local", num_cpus=num_cpus, **kw)
        return True
    check_address(address)
    try:
        with held_native_lines(not verbose):  # Ray's C++ retry lines: the one-line error below says it
            ray.init(address=address.strip(), runtime_env={"env_vars": worker_env()}, **kw)
    except Exception as e:  # ConnectionError, RuntimeError (GCS / auth), ValueError (job env conflict)
        raise ClusterError(_explain(e, address)) from None
    (announce or _announce)(describe())
    return True


def describe() -> str:
    """'Ray cluster 10.0.0.5:6379 (session_..., 3 nodes, 10 CPUs, 2 GPUs)' of the connected cluster."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)
    gcs, sess = getattr(node, "gcs_address", "?"), getattr(node, "session_name", "?")
    res = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return (f"Ray cluster {gcs} ({sess}, {nodes} node{'s' * (nodes != 1)}, {res.get('CPU', 0):g} CPUs, "
            f"{res.get('GPU', 0):g} GPUs)")


def _announce(text: str) -> None:
    print(f"healsweep: joined {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ concurrency
def check_fits(request: dict[str, float], nodes: list[dict], autoscaling: bool) -> None:
    """ClusterError when no alive node can ever place the sweep's largest request (a trial or a dense task):
    Tune would otherwise wait forever with an "insufficient resources" warning every minute. On a cluster that
    may grow (``autoscaling``) a larger node can still join, so only a fixed cluster (a local instance) is refused."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if autoscaling or not alive:
        return
    for name, want in request.items():
        best = max(r.get(name, 0.0) for r in alive)
        if want > best:
            key = "cpus" if name == "CPU" else "gpus"
            raise ClusterError(f"resources: a trial or dense task asks for {want:g} {name} but the largest node has "
                               f"{best:g}; lower resources.{key}_per_trial / {key}_per_dense_task (or --resources) "
                               f"or give Ray more (--num-cpus)")


def present_concurrency(resources, cluster: dict) -> int:
    """Trials the resources present now can run side by side (logged as the parent's ``concurrency``)."""
    if resources.max_concurrent:
        return resources.max_concurrent
    n = int(cluster.get("CPU", 1) // resources.cpus_per_trial)
    if resources.gpus_per_trial > 0:
        n = min(n, int(cluster.get("GPU", 0) // resources.gpus_per_trial))
    return max(1, n)


def tune_concurrency(resources, cluster: dict) -> int | None:
    """Tune's ``max_concurrent_trials``: only the user's cap (``resources.max_concurrent``). Without one, Tune
    queues trials for resources that are not there yet, so nodes that join later run them and an autoscaler sees
    the demand. With a custom searcher Tune keeps only 1 trial PENDING; :func:`pending_limit` raises that."""
    return resources.max_concurrent or None


PENDING_CAP = 200  # Ray Tune's own floor for its variant generator's pending trials ("fast autoscaling")


def pending_trials(resources, trials: int, environ=None) -> int:
    """Trials Tune keeps PENDING (``TUNE_MAX_PENDING_TRIALS_PG``; the user's value wins): the sweep's trials, at
    most ``resources.max_concurrent`` (when set) or :data:`PENDING_CAP`. Never the CPUs present at start: a 1-CPU
    head would let Tune request one actor at a time, so a node joining later gets at most one trial's actor and an
    autoscaler sees demand for one trial. The searcher still hands out only trials it can suggest now (a cell's TPE
    trials wait for its earlier ones), so the limit changes no suggestion."""
    user = (os.environ if environ is None else environ).get("TUNE_MAX_PENDING_TRIALS_PG", "")
    if user.isdigit() and int(user) > 0:
        return int(user)
    return max(1, min(trials, resources.max_concurrent or PENDING_CAP))


@contextlib.contextmanager
def pending_limit(resources, trials: int):
    """``TUNE_MAX_PENDING_TRIALS_PG`` = :func:`pending_trials` while Tune runs (Tune reads it when ``fit`` starts),
    then the user's value (or none) again, so a second sweep in the same process does not take it for the user's."""
    before = os.environ.get("TUNE_MAX_PENDING_TRIALS_PG")
    os.environ["TUNE_MAX_PENDING_TRIALS_PG"] = str(pending_trials(resources, trials))
    try:
        yield int(os.environ["TUNE_MAX_PENDING_TRIALS_PG"])
    finally:
        if before is None:
            os.environ.pop("TUNE_MAX_PENDING_TRIALS_PG", None)
        else:
            os.environ["TUNE_MAX_PENDING_TRIALS_PG"] = before


# ------------------------------------------------------------------------------------------ store URI
def check_store_uri(uri: str | None) -> None:
    """One probe of a remote store URI (s3://, gs://, ...): ClusterError for an unreachable endpoint, refused
    credentials or a bucket that does not exist. Local paths and None pass."""
    if not uri or "://" not in uri or uri.startswith("file://"):
        return
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # ArrowInvalid: unknown query keys, bad scheme
        raise ClusterError(f"store.uri {uri}: {first_line(e)}") from None
    bucket = path.split("/", 1)[0]
    try:
        info = fs.get_file_info(bucket)
    except OSError as e:
        raise ClusterError(f"store.uri {uri}: {_refusal(e)}") from None
    if info.type == pafs.FileType.NotFound:
        raise ClusterError(f"store.uri {uri}: bucket {bucket!r} does not exist at that endpoint (create it first, "
                           "or check the bucket name and endpoint_override)")
    probe = f"{path.rstrip('/')}/.healsweep-write-probe-{uuid.uuid4().hex}"
    need = "a sweep writes and replaces its targets, masks and Tune's storage under it: the credentials need " \
           "PutObject and DeleteObject"
    try:  # read-only credentials passed the HEAD and failed in the dense stage, after Ray started
        with fs.open_output_stream(probe) as f:
            f.write(b"")
    except OSError as e:
        raise ClusterError(f"store.uri {uri}: cannot write there: {_refusal(e)} ({need})") from None
    try:
        fs.delete_file(probe)
    except OSError as e:
        raise ClusterError(f"store.uri {uri}: can write but not delete there ({_refusal(e)}; {need}); the probe "
                           f"object {probe} is left behind") from None


def _refusal(e: OSError) -> str:
    """An S3/GCS client error in a person's words: unreachable, refused credentials, else its first line."""
    msg = str(e)
    if "NETWORK_CONNECTION" in msg or "Could not connect" in msg or "curlCode" in msg:
        return "cannot reach the endpoint (check endpoint_override / AWS_ENDPOINT_URL and the network)"
    if "ACCESS_DENIED" in msg or "SIGNATURE" in msg or "INVALID_ACCESS_KEY" in msg or "403" in msg:
        return "the endpoint refused the credentials (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    return first_line(e)


# ------------------------------------------------------------------------------------------ one storage URI
def is_remote(uri: str | None) -> bool:
    return bool(uri) and "://" in uri and not uri.startswith("file://")


def store_subdir(uri: str, name: str) -> str:
    """'s3://b/store?endpoint_override=h:9000' + 'masks' -> 's3://b/store/masks?endpoint_override=h:9000'."""
    base, q, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}" + (f"?{query}" if q else "")


def mask_root(store_uri: str | None, local_default: str) -> str:
    """Masks follow a remote store URI (``<store.uri>/masks``), so workers without a shared file system read
    them; otherwise the local store root's masks/ directory."""
    return store_subdir(store_uri, "masks") if is_remote(store_uri) else local_default
