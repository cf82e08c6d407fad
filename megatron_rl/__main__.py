"""``python -m megatron_rl``: see ``megatron_rl.cli``."""

import sys

from megatron_rl.cli import main

sys.exit(main())
