"""``python -m raggedfsdp.train`` == ``python -m raggedfsdp.train.worker`` (one rank; use torchrun for more)."""

import sys

from raggedfsdp.train.worker import main

sys.exit(main())
