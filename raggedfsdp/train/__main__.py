"""``python -m raggedfsdp.train``: same as ``python -m raggedfsdp.train.worker`` (torchrun for N ranks)."""

import sys

from raggedfsdp.train.worker import main

sys.exit(main())
