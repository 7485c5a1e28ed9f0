#!/usr/bin/env bash
# Regenerate Python modules (+ .pyi stubs) from the .proto sources.
# Usage (from anywhere): PYTHON=.venv/bin/python proto/generate.sh
# Needs grpcio-tools and mypy-protobuf (protoc-gen-mypy on PATH or beside $PYTHON).
set -euo pipefail

PYTHON="${PYTHON:-python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cd "$root"

# protoc-gen-mypy is installed beside the interpreter (e.g. .venv/bin).
pybin="$(dirname "$(command -v "$PYTHON")")"
export PATH="$pybin:$PATH"

wkt="$("$PYTHON" -c 'import grpc_tools,os;print(os.path.join(os.path.dirname(grpc_tools.__file__),"_proto"))')"

"$PYTHON" -m grpc_tools.protoc -I proto -I "$wkt" \
  --python_out=proto --mypy_out=proto \
  proto/zattera/v1/types.proto proto/zattera/cluster/v1/cluster.proto
