"""Where data and processors come from: local paths, or the Hugging Face Hub only when asked.

A value that is not prefixed ``hf://`` is a local path and must exist: a typo fails at once with
"no such file or directory" instead of being retried against the Hub for minutes. ``hf://NAME``
(e.g. ``hf://naver-clova-ix/cord-v2``, ``hf://Qwen/Qwen3.5-0.8B``) asks for the Hub (or its
local cache) explicitly.
"""

from __future__ import annotations

import glob
import os

HUB_PREFIX = "hf://"


def resolve(value: str, flag: str) -> tuple[str, bool]:
    """(local path or Hub name, whether it is a Hub name); ValueError naming ``flag`` for a local
    path (or glob) that matches nothing."""
    if value.startswith(HUB_PREFIX):
        name = value[len(HUB_PREFIX):]
        if not name:
            raise ValueError(f"{flag} {value!r}: no Hub name after {HUB_PREFIX}")
        return name, True
    exists = glob.glob(value) if glob.has_magic(value) else os.path.exists(value)
    if not exists:
        raise ValueError(f"{flag} {value!r}: no such file or directory (a Hugging Face Hub name needs the "
                         f"{HUB_PREFIX} prefix, e.g. {HUB_PREFIX}{value.strip('/')})")
    return value, False
