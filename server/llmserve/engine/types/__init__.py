"""The types every layer of the engine shares, below all of them and importing none: a request (request.py), what
the core hands back (outputs.py), the errors callers see (errors.py), the protocol the gRPC edge holds (protocol.py).
Torch-free: the edge builds them from protobuf and they cross to an engine process as they are."""
