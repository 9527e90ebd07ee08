"""The gRPC edge of llmserve.v1.GenerateService, one module per role. Follow a Generate call in this order:

- `servicer.py`: the handlers; one Generate call's flow: admit, build the prompt, convert, stream, record.
- `admission.py`: streams in flight (draining, the server's and each identity's caps, duplicate request ids)
  and the scoping of request and session ids to the caller's identity.
- `limits.py`: the sizes a caller may send (each a flag), checked before any tokenizer or engine work.
- `prompts.py`: a request's input as token ids (tokenizer, chat template), and append mode over the
  session history store.
- `convert.py`: protobuf to engine types and back (GenerateRequest -> GenerationRequest, Delta ->
  GenerateResponse). Field values are validated once, by the engine's request types, which name each field
  by its path in GenerateRequest; the edge renames nothing.
- `errors.py`: the edge's own refusals and the google.rpc.Status each known error maps to (app.py's
  interceptor sends it).

The package imports no tensor library; the engine behind it is reached through `engine.types.protocol.Engine`.
"""
