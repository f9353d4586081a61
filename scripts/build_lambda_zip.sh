#!/usr/bin/env bash
# Build the gateway Lambda package (HTTP API, direct and SQS handlers, the autoscaling Lambda): the
# batchgate base install, no torch, wheels for the Lambda runtime (python3.11, x86_64 by default).
#   scripts/build_lambda_zip.sh [OUT.zip]      ARCH=aarch64 for arm64 functions
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-$root/dist/batchgate-lambda.zip}")"  # a relative OUT.zip: from where it was run
cd "$root"
arch="${ARCH:-x86_64}"
runtime_python="${LAMBDA_PYTHON:-python3.11}"  # the functions' runtime (terraform: python3.11)
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
python3 -m pip install --quiet --target "$build" --implementation cp --python-version 3.11 \
  --platform "manylinux2014_${arch}" --only-binary=:all: --upgrade .
# what the Lambda runtime already has, or nothing the handlers import
rm -rf "$build"/boto3* "$build"/botocore* "$build"/bin "$build"/*.dist-info/RECORD
# Bytecode the runtime uses as it is. pip's checks the source's modification time, which a zip keeps only to
# 2 s, so most modules read as stale and were compiled again at every cold start (Lambda's code directory is
# read-only: nothing is ever written back), ~550 ms to import the handler instead of ~300. Unchecked-hash
# bytecode is never checked against the source: right for a package nobody edits in place.
find "$build" -name __pycache__ -type d -prune -exec rm -rf {} +
if command -v "$runtime_python" >/dev/null; then
  "$runtime_python" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$build" >/dev/null \
    || echo "note: some modules did not compile (they are compiled when imported, if ever)" >&2
else
  echo "note: no $runtime_python here: the package carries no bytecode (each cold start compiles what it imports)" >&2
fi
mkdir -p "$(dirname "$out")"
rm -f "$out"
(cd "$build" && python3 -m zipfile -c "$out" .)
echo "built $out ($(du -h "$out" | cut -f1))"
