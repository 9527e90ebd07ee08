"""Display names of the systems, shared by the tables and the plots."""

LABELS = {
    "naive": "naive (generate, 1 at a time)",
    "dynamic": "dynamic batching (8 / 20 ms)",
    "hf_continuous": "transformers continuous batching",
    "llmserve": "llmserve engine (in-process)",
    "llmserve_grpc": "llmserve over gRPC",
    "llmserve_grpc_metrics": "llmserve over gRPC, metrics on",
}
