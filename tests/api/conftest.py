"""tests/api: the gRPC edge's modules (server/llmserve/api/), each on its own. The service tests' stand-in engine
(tests/service/fake_engine.py) is imported by name, as tests/service imports it."""

from __future__ import annotations

import sys
from pathlib import Path

SERVICE_TESTS = str(Path(__file__).resolve().parents[1] / "service")
if SERVICE_TESTS not in sys.path:
    sys.path.append(SERVICE_TESTS)
