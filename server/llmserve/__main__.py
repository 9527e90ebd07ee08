"""`python -m llmserve`: flags -> config -> serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from llmserve.config import from_args
from llmserve.process import configure_process


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch and transformers are imported anywhere (see llmserve.process).
    configure_process()
    config = from_args(argv)
    logging.basicConfig(
        level=config.server.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from llmserve.app import run

    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
