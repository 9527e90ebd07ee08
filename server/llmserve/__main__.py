"""`python -m llmserve`: flags -> config -> serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import Sequence

from llmserve.config import from_args
from llmserve.cpu_features import IsaError
from llmserve.process_settings import configure_process
from llmserve.telemetry.request_log import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    """Serve; the exit status is 0 after a signal, 2 for bad settings, 3 when the engine died (restart me)."""
    # Before torch and transformers are imported anywhere (see llmserve.process_settings).
    try:
        configure_process()
    except IsaError as exc:
        print(f"llmserve: {exc}", file=sys.stderr)
        return 2
    config = from_args(argv)
    configure_logging(config.server.log_level, config.server.log_format)
    from llmserve.app import run
    from llmserve.auth import TokenFileError
    from llmserve.engine.kv_tiers.disk import DiskTierError
    from llmserve.engine.types.adapters import AdapterRefused, LoraUnsupported

    try:
        return asyncio.run(run(config))
    except TokenFileError as exc:
        logging.getLogger("llmserve").error("auth token file: %s", exc)
        return 2
    except DiskTierError as exc:
        logging.getLogger("llmserve").error("KV tiers: %s", exc)
        return 2
    except AdapterRefused as exc:  # a --lora adapter that cannot be served (AdapterNotFound too)
        logging.getLogger("llmserve").error("--lora: %s", exc)
        return 2
    except LoraUnsupported as exc:  # LoRA beside a setting it is not served with (--dtype bfloat16 on the CPU)
        logging.getLogger("llmserve").error("LoRA: %s", exc)
        return 2
    finally:
        # Served and stopped: the interpreter's teardown need not collect what is left. With --engine-in-process
        # (torch and the model in this process) SIGTERM's "stopped" to the exit took 3.4 s without this.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
