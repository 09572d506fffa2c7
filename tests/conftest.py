import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "examples", "multimodal_dev"), os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest


@pytest.fixture(scope="session")
def mcore():
    """megatron-core initialised for a single CPU process (gloo, world size 1)."""
    from megatron.cpu.single_process import init_single_process

    init_single_process()
