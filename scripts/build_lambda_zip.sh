#!/usr/bin/env bash
# Build the gateway Lambda package (HTTP API, direct and SQS handlers, the autoscaling Lambda): the
# batchgate base install, no torch, wheels for the Lambda runtime (python3.11, x86_64 by default).
#   scripts/build_lambda_zip.sh [OUT.zip]      ARCH=aarch64 for arm64 functions
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist/batchgate-lambda.zip}")"
arch="${ARCH:-x86_64}"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
python3 -m pip install --quiet --target "$build" --implementation cp --python-version 3.11 \
  --platform "manylinux2014_${arch}" --only-binary=:all: --upgrade .
# what the Lambda runtime already has, or nothing the handlers import
rm -rf "$build"/boto3* "$build"/botocore* "$build"/bin "$build"/*.dist-info/RECORD
mkdir -p "$(dirname "$out")"
rm -f "$out"
(cd "$build" && python3 -m zipfile -c "$out" .)
echo "built $out ($(du -h "$out" | cut -f1))"
