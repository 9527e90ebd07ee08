#!/usr/bin/env bash
# smg, the Shepherd Model Gateway (PyPI smg==1.13.0, pinned in llmserve's `gateway` extra), in front of llmserve
# replicas: OpenAI-compatible HTTP (/v1/chat/completions, /v1/completions, /v1/models) on SMG_PORT, routed over
# vLLM's gRPC engine protocol, which every llmserve replica serves on its gRPC port beside llmserve.v1.
#
#   deploy/smg/launch.sh 10.0.0.1:50051 10.0.0.2:50051 [more smg flags]
#
# cache_aware: a request goes to the replica whose KV cache holds most of its prefix (the replicas' KV events feed
# smg's index; a second turn of a conversation lands where the first was computed). SMG_POLICY=consistent_hashing
# pins each X-SMG-Routing-Key (e.g. a session id) to one replica instead. smg tokenizes with the tokenizer files
# each replica offers (GetModelInfo's tokenizer_path, or GetTokenizer when the gateway runs elsewhere).
set -euo pipefail
workers=()
while [[ $# -gt 0 && $1 != -* ]]; do workers+=("grpc://$1"); shift; done
[[ ${#workers[@]} -gt 0 ]] || { echo "usage: $0 HOST:PORT [HOST:PORT ...] [smg flags]" >&2; exit 2; }
exec "${SMG:-smg}" launch \
    --worker-urls "${workers[@]}" \
    --policy "${SMG_POLICY:-cache_aware}" \
    --host "${SMG_HOST:-0.0.0.0}" --port "${SMG_PORT:-30000}" \
    --prometheus-host "${SMG_HOST:-0.0.0.0}" --prometheus-port "${SMG_METRICS_PORT:-29000}" \
    "$@"
