#!/usr/bin/env bash
# The MLflow tracking server on a Ray cluster's head node (cluster.yaml's head_setup_commands run `start`), and the
# backup of its SQLite database to the shared file system (`ray down` deletes the head's disk with it).
#
#   bash docker/mlflow-head.sh start    # no database on the head but a backup on the shared file system: restore
#                                       # it; then start the server on 127.0.0.1, unless one already answers there
#   bash docker/mlflow-head.sh backup   # copy the live database to the shared file system (consistent while the
#                                       # server writes: SQLite's backup API); run it before `ray down`
#
# Settings (environment):
#   HEALSWEEP_SHARED    shared file system directory (default /mnt/efs/healsweep): mlartifacts/ (the artifacts) and
#                       mlflow-backup.db. The live database stays on the head's local disk: SQLite on NFS is not safe
#                       under a multi-process server.
#   MLFLOW_DB           the live database (default ~/mlflow.db)
#   MLFLOW_PORT         default 5000
#   MLFLOW_LOG          the server's log (default ~/mlflow.log)
#   MLFLOW_BACKEND_URI  a postgresql+psycopg://USER:PASSWORD@HOST:5432/mlflow URL instead of SQLite (then there is
#                       nothing to restore or back up here: the database outlives the cluster)
set -euo pipefail
shared=${HEALSWEEP_SHARED:-/mnt/efs/healsweep}
port=${MLFLOW_PORT:-5000}
db=${MLFLOW_DB:-$HOME/mlflow.db}
backup="$shared/mlflow-backup.db"
log=${MLFLOW_LOG:-$HOME/mlflow.log}

answers() {  # an MLflow server answers on 127.0.0.1:$port (a process name would match this script's own shell)
  python3 - "$port" <<'PY'
import sys
import urllib.request

try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=3)
except Exception:
    sys.exit(1)
PY
}

copy_db() {  # SRC DEST: SQLite's online backup into DEST.tmp, then a rename (DEST is whole or absent)
  python3 - "$1" "$2" <<'PY'
import os
import sqlite3
import sys

src, dest = sys.argv[1], sys.argv[2]
tmp = f"{dest}.tmp"
if os.path.exists(tmp):
    os.remove(tmp)
with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as s, sqlite3.connect(tmp) as d:
    s.backup(d)
os.replace(tmp, dest)
PY
}

case "${1:-}" in
  start)
    if answers; then
      echo "mlflow-head: a server already answers on 127.0.0.1:$port"
      exit 0
    fi
    if [ -z "${MLFLOW_BACKEND_URI:-}" ] && [ ! -e "$db" ] && [ -e "$backup" ]; then
      mkdir -p "$(dirname "$db")"
      copy_db "$backup" "$db"
      echo "mlflow-head: restored $db from $backup"
    fi
    mkdir -p "$shared/mlartifacts"
    nohup mlflow server --host 127.0.0.1 --port "$port" \
      --backend-store-uri "${MLFLOW_BACKEND_URI:-sqlite:///$db}" \
      --artifacts-destination "$shared/mlartifacts" >"$log" 2>&1 </dev/null &
    pid=$!
    for _ in $(seq 120); do  # a first start creates the schema: ~10-20 s
      if answers; then
        echo "mlflow-head: server pid $pid on 127.0.0.1:$port (log $log)"
        exit 0
      fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    echo "mlflow-head: the server did not start; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
    ;;
  backup)
    if [ -n "${MLFLOW_BACKEND_URI:-}" ]; then
      echo "mlflow-head: MLFLOW_BACKEND_URI is set: that database outlives the cluster, nothing to back up"
      exit 0
    fi
    if [ ! -e "$db" ]; then
      echo "mlflow-head: no database at $db" >&2
      exit 1
    fi
    mkdir -p "$shared"
    copy_db "$db" "$db.backup-tmp"  # on the head's disk: the read lock is short, not held over an NFS write
    [ -e "$backup" ] && cp -p "$backup" "$backup.prev"  # the backup before it (an empty head must not erase it)
    cp "$db.backup-tmp" "$backup.tmp" && mv "$backup.tmp" "$backup" && rm -f "$db.backup-tmp"
    echo "mlflow-head: $db backed up to $backup (the previous one: $backup.prev)"
    ;;
  *)
    echo "usage: bash docker/mlflow-head.sh start|backup (settings: the comment at the top of this file)" >&2
    exit 2
    ;;
esac
