#!/usr/bin/env bash
# Build the source directory `gcloud functions deploy` takes for the gateway on Google Cloud Functions: a
# `main.py` at its root that names the entry point (`batchgate`, from gateway/gcf_handler.py), a
# `requirements.txt` (the batchgate base install, no torch) and the packages the handler imports.
#   scripts/build_gcf_source.sh [OUT_DIR]
# then: gcloud functions deploy batchgate --gen2 --runtime python311 --trigger-http --entry-point batchgate \
#         --source OUT_DIR --set-env-vars BATCHGATE_REDIS_URL=...,BATCHGATE_AUTH=api_key,...
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-$root/dist/batchgate-gcf}")"  # a relative OUT_DIR: from where it was run
cd "$root"
rm -rf "$out"
mkdir -p "$out"
cp -r gateway shared "$out"/
find "$out" -name __pycache__ -type d -prune -exec rm -rf {} +
cat > "$out/main.py" <<'PY'
"""Cloud Functions loads main.py: the gateway's entry point, `batchgate`."""

from gateway.gcf_handler import batchgate

__all__ = ["batchgate"]
PY
python3 - "$out/requirements.txt" <<'PY'
import sys, tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
open(sys.argv[1], "w").write("\n".join(deps) + "\n")
PY
echo "built $out (main.py, requirements.txt, gateway/, shared/)"
