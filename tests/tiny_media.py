"""Tiny media for tests (no downloads, no system FFmpeg): the video writer is the benchmarks'
(``benchmarks/media_mix.py``); here, decoding every frame as a reference, and the README examples' media."""

from __future__ import annotations

import numpy as np

from examples.multimodal_dev.benchmarks.media_mix import write_video  # noqa: F401  (the tests import it from here)


def decode_all_tchw(path: str):
    """(all frames as torchvision's removed ``read_video`` returned them: a [T, C, H, W] uint8
    view of stacked [T, H, W, C] RGB frames, the stream's average rate)."""
    import av
    import torch

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2), float(stream.average_rate)


def write_example_media(folder: str) -> None:
    """The pictures and the video the README's example JSONL files name, drawn at their relative
    paths (nothing binary is committed)."""
    import os

    from PIL import Image, ImageDraw

    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    os.makedirs(os.path.join(folder, "videos"), exist_ok=True)
    drawings = {
        "red_circle": lambda d: d.ellipse([16, 16, 80, 80], fill=(220, 20, 20)),
        "blue_square": lambda d: d.rectangle([24, 24, 72, 72], fill=(20, 40, 220)),
        "green_triangle": lambda d: d.polygon([(48, 12), (86, 84), (10, 84)], fill=(20, 180, 40)),
        "stripes": lambda d: [d.rectangle([x, 0, x + 11, 95], fill=(0, 0, 0)) for x in (0, 24, 48, 72)],
    }
    for name, draw in drawings.items():
        image = Image.new("RGB", (96, 96), (255, 255, 255))
        draw(ImageDraw.Draw(image))
        image.save(os.path.join(folder, "images", f"{name}.png"))
    write_video(os.path.join(folder, "videos", "moving_bar.mp4"), 8, 64, 48, fps=4)
