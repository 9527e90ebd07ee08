"""Telemetry of the gRPC edge: one record per Generate call (`call.CallRecord`) feeds the request log line
(`request_log`), the Prometheus metrics (`metrics`) and the OpenTelemetry span (`tracing`). None of it sees
a request's content (except the log's opt-in prompt), only its sizes, times and outcome."""
