"""llmserve: a gRPC service streaming tokens from a continuous-batching LLM engine."""
