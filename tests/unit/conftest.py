import os
import shutil

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "multimodal_dev", "data", "examples")


@pytest.fixture(scope="session")
def example_data(tmp_path_factory):
    """(folder of docs/data.md's example JSONL files with their media drawn here, those files converted
    to an energon dataset (4 conversations a shard), the converter's counts, a Qwen3.5-style processor)."""
    from tiny_media import write_example_media
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

    from examples.multimodal_dev.tools import jsonl_to_energon

    root = tmp_path_factory.mktemp("energon")
    data = root / "data"
    shutil.copytree(EXAMPLES, data)
    write_example_media(str(data))
    out = root / "shards"
    counts = jsonl_to_energon.convert(str(data), str(out), shard_size=4, log=lambda line: None)
    processor = build_processor(str(root / "processor"), chat_template=QWEN35_CHAT_TEMPLATE)
    return data, out, counts, processor
