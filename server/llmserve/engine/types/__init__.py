"""The types every layer of the engine shares, below all of them and importing no other package of llmserve: a
request (request.py), what the core hands back (outputs.py), the errors callers see (errors.py), the protocol the gRPC
edge holds (protocol.py), the stats records (stats.py), the adapters' operations and errors (adapters.py), the KV
cache's events and block count (kv_cache.py), pooling (pooling.py), and the model as the engine knows it: its shape,
its card and its loaded form (model.py). Torch-free when imported: the edge builds them from protobuf and they cross to
an engine process as they are."""
