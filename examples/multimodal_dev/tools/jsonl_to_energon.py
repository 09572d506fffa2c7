"""Conversations in JSONL -> a Megatron-Energon dataset (WebDataset tar shards plus ``.nv-meta``).

    python -m examples.multimodal_dev.tools.jsonl_to_energon IN.jsonl OUT_DIR \
        [--shard-size 1000] [--media-root DIR] [--allow-media-anywhere] [--valid-fraction 0.01] [--skip-bad]

IN is what ``--data-path`` takes for the jsonl provider (a file, a folder of them, or a comma-
separated list; weights belong in an energon metadataset instead). Every record is read in any
format ``data/conversations.py`` knows; a sample of the shards is one conversation:

    <key>.json        {"messages": [...], "source": "IN.jsonl:LINE"}: the conversation in the
                      transformers "parts" form, an image part's ``image`` (a video part's ``video``)
                      naming the member below; per-media settings kept
    <key>.img<j>.<ext>  the j-th image's bytes, as found (``data/jsonl_media.py`` locates them)
    <key>.vid<j>.<ext>  the j-th video's bytes

Shards are often handed on, so nothing else goes in: a member must decode as the image or video
it claims to be (``bad_image`` / ``bad_video`` otherwise), and paths outside the JSONL's folder
(or ``--media-root``) are refused unless ``--allow-media-anywhere``, as training refuses them.

Shards are ``train-NNNNNN.tar`` and ``val-NNNNNN.tar``; ``--valid-fraction f`` holds out the
last of every 1/f records of each file, the rule of the jsonl provider's ``--valid-fraction``.
energon's prepare step then indexes them and writes ``.nv-meta/split.yaml`` (train / val by
shard name) and ``dataset.yaml`` (``CrudeWebdataset``: ``data/energon.py`` cooks the samples).

A bad record (not JSON, not a conversation, media missing) stops the conversion with one line
naming the file and line, or is left out and counted with ``--skip-bad``. Everything is written
to ``OUT_DIR.partial-<pid>`` first and renamed to OUT_DIR only when complete, so an OUT_DIR
that exists is whole.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from collections import Counter

from examples.multimodal_dev.data.conversations import Media, normalise
from examples.multimodal_dev.data.jsonl_media import MediaAccess, check_decodes, fetch
from examples.multimodal_dev.data.jsonl_source import Records, check_data_path, hold_out, parse_record
from examples.multimodal_dev.data.sample import BadSample, DataError

SPLIT_PATTERNS = {
    "train": "train-[0-9]+[.]tar$",
    "val": "val-[0-9]+[.]tar$",
}  # no backslashes: energon brace-expands them
PROGRESS_EVERY_S = 5.0
_EXT = re.compile(r"^[a-z0-9]{1,8}$")


def stored_record(turns, source: str) -> tuple[dict, dict]:
    """(the record written as ``<key>.json``, member name -> the location of its bytes)."""
    members, counts, messages = {}, Counter(), []
    for turn in turns:
        content = []
        for part in turn.parts:
            if isinstance(part, Media):
                name = f"{'img' if part.kind == 'image' else 'vid'}{counts[part.kind]}.{_extension(part.ref)}"
                counts[part.kind] += 1
                members[name] = part
                content.append({"type": part.kind, part.kind: name, **part.options})
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": turn.role, "content": content})
    return {"messages": messages, "source": source}, members


def _extension(ref: str) -> str:
    if ref.startswith("data:"):
        return "bin"
    ext = os.path.splitext(ref.split("?", 1)[0])[1].lstrip(".").lower()
    return ext if _EXT.match(ext) else "bin"


def read_bytes(media: Media, base_dir: str, access: MediaAccess) -> bytes:
    """The media's bytes, once they decode as the kind the record claims."""
    found = fetch(access.locate(media.ref, base_dir), media.kind)
    if hasattr(found, "read"):
        data = found.read()
    else:
        with open(found, "rb") as f:
            data = f.read()
    check_decodes(data, media.kind, media.ref)
    return data


class ShardWriter:
    """Tar shards ``<prefix>-NNNNNN.tar`` of at most ``shard_size`` samples each."""

    def __init__(self, folder: str, prefix: str, shard_size: int):
        self.folder, self.prefix, self.shard_size = folder, prefix, shard_size
        self.tar, self.in_shard, self.shards, self.samples = None, 0, [], 0

    def add(self, key: str, files: dict[str, bytes]) -> None:
        if self.tar is None or self.in_shard == self.shard_size:
            self.close()
            name = f"{self.prefix}-{len(self.shards):06d}.tar"
            self.shards.append(name)
            self.tar, self.in_shard = tarfile.open(os.path.join(self.folder, name), "w", format=tarfile.USTAR_FORMAT), 0
        for part, data in files.items():
            info = tarfile.TarInfo(f"{key}.{part}")
            info.size, info.mtime, info.mode = (
                len(data),
                0,
                0o644,
            )  # no clock in the bytes: the same input, the same shards
            self.tar.addfile(info, io.BytesIO(data))
        self.in_shard += 1
        self.samples += 1

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None


def convert(
    data_path: str,
    out_dir: str,
    shard_size: int = 1000,
    media_root: str | None = None,
    valid_fraction: float = 0.0,
    skip_bad: bool = False,
    log=print,
    media_anywhere: bool = False,
) -> dict:
    """Write the dataset; returns {"train": n, "val": n, "skipped": {reason: n}}. DataError for a bad
    input (or the first bad record without ``skip_bad``); OUT_DIR is then left as it was."""
    specs = check_data_path(data_path, "IN")
    if any(s.weight is not None for s in specs):
        raise DataError(
            f"IN {data_path!r}: weights are not stored in shards; convert each source on its own and "
            "blend them with an energon metadataset"
        )
    if shard_size < 1:
        raise DataError(f"--shard-size {shard_size}: must be at least 1")
    if not 0 <= valid_fraction < 1:
        raise DataError(f"--valid-fraction {valid_fraction}: must be at least 0 and below 1")
    if media_root and not os.path.isdir(media_root):
        raise DataError(f"--media-root {media_root!r}: no such directory")
    if os.path.exists(out_dir):
        raise DataError(f"OUT_DIR {out_dir!r} exists; give a new folder (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise DataError(f"OUT_DIR {out_dir!r}: its parent folder {parent!r} does not exist")
    partial = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial-{os.getpid()}")
    os.makedirs(partial)
    try:
        access = MediaAccess(media_root, allow_remote=False, anywhere=media_anywhere)
        counts = _write_shards(specs, partial, shard_size, access, valid_fraction, skip_bad, log)
        _prepare(partial, counts)
        os.rename(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return counts


def _write_shards(specs, folder, shard_size, access, valid_fraction, skip_bad, log) -> dict:
    writers = {split: ShardWriter(folder, split, shard_size) for split in SPLIT_PATTERNS}
    skipped, done, started, last = Counter(), 0, time.monotonic(), time.monotonic()
    try:
        for spec in specs:
            records = Records.of(spec.files)
            held = hold_out(len(records), valid_fraction) if valid_fraction else None
            for i in range(len(records)):
                path, line = records.where(i)
                try:
                    files = _sample_files(records.read(i), path, line, access)
                except BadSample as bad:
                    if not skip_bad:
                        raise DataError(
                            f"{path}:{line}: {bad.reason}: {bad.detail} (--skip-bad leaves such records out)"
                        ) from None
                    skipped[bad.reason] += 1
                    continue
                split = "val" if held is not None and held[i] else "train"
                writers[split].add(f"{done:09d}", files)
                done += 1
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    log(
                        f"jsonl_to_energon: {done} conversations in {sum(len(w.shards) for w in writers.values())} "
                        f"shards ({done / (last - started):.0f}/s), at {path}:{line}"
                    )
    finally:
        for writer in writers.values():
            writer.close()
    if not writers["train"].samples:
        raise DataError(
            f"IN {', '.join(s.text for s in specs)}: no conversation to train on "
            f"({sum(skipped.values())} bad, {writers['val'].samples} held out)"
        )
    return {
        "train": writers["train"].samples,
        "val": writers["val"].samples,
        "skipped": dict(skipped),
        "shards": {split: w.shards for split, w in writers.items()},
    }


def _sample_files(line: bytes, path: str, number: int, access: MediaAccess) -> dict[str, bytes]:
    stored, members = stored_record(normalise(parse_record(line)), f"{path}:{number}")
    files = {"json": json.dumps(stored, ensure_ascii=False).encode()}
    for name, media in members.items():
        files[name] = read_bytes(media, os.path.dirname(path), access)
    return files


def _prepare(folder: str, counts: dict) -> None:
    """energon's own prepare step: the shard index, split.yaml by shard name, dataset.yaml."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors import BaseWebdatasetFactory

    tars = [name for split in SPLIT_PATTERNS for name in counts["shards"][split]]
    patterns = [(split, pattern) for split, pattern in SPLIT_PATTERNS.items() if counts["shards"][split]]
    BaseWebdatasetFactory.prepare_dataset(
        EPath(folder), tars, split_parts_patterns=patterns, shuffle_seed=None, workers=1
    )
    with open(os.path.join(folder, ".nv-meta", "dataset.yaml"), "w") as f:
        f.write("__module__: megatron.energon\n__class__: CrudeWebdataset\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.multimodal_dev.tools.jsonl_to_energon", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("data_path", metavar="IN", help="a .jsonl file, a folder of them, or a comma-separated list")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="a new folder for the energon dataset")
    parser.add_argument("--shard-size", type=int, default=1000, help="conversations per tar shard (default 1000)")
    parser.add_argument("--media-root", help="the folder relative media paths start from (default: each JSONL's own)")
    parser.add_argument(
        "--allow-media-anywhere",
        action="store_true",
        help="pack media paths outside each JSONL's folder (or --media-root); refused otherwise",
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="share of the records held out in the val split (the last of every 1/f)",
    )
    parser.add_argument("--skip-bad", action="store_true", help="leave bad records out (counted) instead of stopping")
    args = parser.parse_args(argv)
    try:
        counts = convert(
            args.data_path,
            args.out_dir,
            args.shard_size,
            args.media_root,
            args.valid_fraction,
            args.skip_bad,
            log=lambda line: print(line, file=sys.stderr, flush=True),
            media_anywhere=args.allow_media_anywhere,
        )
    except DataError as err:
        print(f"jsonl_to_energon: {err}", file=sys.stderr)
        return 2
    skipped = sum(counts["skipped"].values())
    print(
        f"jsonl_to_energon: wrote {counts['train']} train and {counts['val']} val conversations in "
        f"{sum(map(len, counts['shards'].values()))} shards to {args.out_dir}"
        + (
            f"; left out {skipped} bad records ({', '.join(f'{k}={v}' for k, v in sorted(counts['skipped'].items()))})"
            if skipped
            else ""
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
