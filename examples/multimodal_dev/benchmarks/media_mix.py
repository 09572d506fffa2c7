"""Media written on the spot, so the loader benchmark (and the tests) need no download and no
system FFmpeg: videos encoded with PyAV's bundled FFmpeg, JPEG photos-sized images with PIL, and
a conversation JSONL mix of them in the ``messages`` + ``images`` / ``videos`` format.

Every video frame differs from its neighbours (a red level rising with the frame index and a
bright column moving across), so a frame sampled at the wrong index changes the pixels.
"""

from __future__ import annotations

import json
import os

import numpy as np

# extension -> (container format, encoders in order of preference, pixel format)
FORMATS = {
    "mp4": ("mp4", ("libx264", "mpeg4"), "yuv420p"),
    "webm": ("webm", ("libvpx", "libvpx-vp9"), "yuv420p"),
    "mkv": ("matroska", ("libx264", "mpeg4"), "yuv420p"),
    "gif": ("gif", ("gif",), "rgb8"),
}

# The loader benchmark's mix, per conversation: (share, images, videos). Photo-sized images and
# short clips, as instruction-tuning sets hold them; the shares are stated in the README's table.
MIX = ((0.5, 1, 0), (0.25, 2, 0), (0.125, 0, 1), (0.125, 0, 0))
IMAGE_SIDES = ((640, 480), (1024, 768), (1280, 720), (800, 1200))
VIDEO = dict(seconds=4, fps=24, width=640, height=360)


def frame_rgb(index: int, n_frames: int, width: int, height: int) -> np.ndarray:
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[..., 0] = 40 + index * 200 // max(n_frames - 1, 1)
    rgb[..., 1] = (np.arange(height) * 255 // height)[:, None]
    rgb[..., 2] = (np.arange(width) * 255 // width)[None, :]
    rgb[:, (index * 5) % width] = 255
    return rgb


def _encoder(names) -> str:
    import av

    for name in names:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # this FFmpeg build lacks the encoder
            continue
    raise RuntimeError(f"none of the encoders {names} is available in PyAV's FFmpeg")


def write_video(path: str, n_frames: int, width: int, height: int, fps: int = 10, codec: str | None = None) -> str:
    """A video at ``path`` whose container follows the extension (mp4, webm, mkv, gif)."""
    import av

    fmt, encoders, pix_fmt = FORMATS[str(path).rsplit(".", 1)[-1]]
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec or _encoder(encoders), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(frame_rgb(i, n_frames, width, height), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return str(path)


def write_mix(folder: str, conversations: int = 48, seed: int = 0) -> str:
    """``folder/mix.jsonl`` with ``conversations`` conversations drawn from ``MIX`` and their media
    beside it (one video file shared by the video conversations: decoding is what is measured)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "media"), exist_ok=True)
    video = os.path.join("media", "clip.mp4")
    write_video(
        os.path.join(folder, video), VIDEO["seconds"] * VIDEO["fps"], VIDEO["width"], VIDEO["height"], fps=VIDEO["fps"]
    )
    shares = np.array([share for share, _, _ in MIX])
    lines = []
    for c in range(conversations):
        _, n_images, n_videos = MIX[rng.choice(len(MIX), p=shares / shares.sum())]
        images = []
        for i in range(n_images):
            width, height = IMAGE_SIDES[rng.integers(len(IMAGE_SIDES))]
            name = os.path.join("media", f"c{c}_{i}.jpg")
            pixels = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)  # a photo's detail, roughly
            Image.fromarray(pixels).resize((width, height), Image.BILINEAR).save(os.path.join(folder, name), quality=90)
            images.append(name)
        question = "<image>" * n_images + "<video>" * n_videos + f"Describe item {c} in a few words."
        answer = " ".join(["a detailed description"] * int(rng.integers(2, 20)))
        record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        if images:
            record["images"] = images
        if n_videos:
            record["videos"] = [video]
        lines.append(json.dumps(record))
    path = os.path.join(folder, "mix.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    """``python -m examples.multimodal_dev.benchmarks.media_mix OUT_DIR [--conversations N]``: the
    benchmark's mix as a dataset to try ``DATASET=jsonl`` (or ``tools/jsonl_to_energon.py``) on."""
    import argparse

    parser = argparse.ArgumentParser(description="write the loader benchmark's image and video conversation mix")
    parser.add_argument("out_dir")
    parser.add_argument("--conversations", type=int, default=48)
    args = parser.parse_args(argv)
    if args.conversations < 1:
        parser.error(f"--conversations {args.conversations} must be a positive integer")
    if os.path.exists(args.out_dir) and os.listdir(args.out_dir):
        parser.error(f"{args.out_dir} exists and is not empty; give a new folder")
    print(write_mix(args.out_dir, args.conversations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
