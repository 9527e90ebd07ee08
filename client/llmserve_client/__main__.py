"""`python -m llmserve_client`: the client CLI."""

import sys

from llmserve_client.cli import main

sys.exit(main())
