"""``python -m atp_router.agent2389 --config agent.toml`` (same as ``atp-agent2389``)."""

import sys

from atp_router.agent2389.cli import main

sys.exit(main())
