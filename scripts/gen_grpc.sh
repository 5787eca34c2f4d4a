#!/usr/bin/env bash
# Regenerates api/oip_grpc/inference_pb2*.py from inference.proto (needs grpcio-tools; the output is
# committed). The messages go into a descriptor pool of their own: tritonclient registers Triton's
# same-named `inference.*` messages in protobuf's default pool, and one process may load both (the
# tests do, and so does any program that embeds a client beside a server).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. api/oip_grpc/inference.proto
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/POOL = _descriptor_pool.DescriptorPool()  # its own: see scripts\/gen_grpc.sh\nDESCRIPTOR = POOL.AddSerializedFile(/' \
    api/oip_grpc/inference_pb2.py
