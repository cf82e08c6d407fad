"""Library warnings that say nothing to a megatron_rl user, silenced where they are raised.

megatron-core warns on import that Apex / Transformer Engine are absent and that it falls
back to its local implementations: on CPU (and with the NPU adaptor) that fallback *is* the
configuration, so the warning is noise. Only these exact messages are filtered; anything else
megatron-core or torch says still shows.
"""

from __future__ import annotations

import warnings

# (message regex, module regex) of UserWarnings megatron-core raises at import time.
_NOISE = ((r"(Transformer Engine and )?Apex (is|are) not installed", r"megatron\.core\."),)


def silence_library_noise() -> None:
    """Install the warning filters above (idempotent: ``warnings`` dedupes equal filters)."""
    for message, module in _NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
