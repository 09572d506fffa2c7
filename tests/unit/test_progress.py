"""Progress of long work: plain lines every interval where the output is not a terminal (a log, a pipe),
nothing for work shorter than that, and tqdm's one redrawn line on a terminal."""

import io

from examples.multimodal_dev.progress import GIB, Progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_interval_and_one_at_the_end():
    clock, out = Clock(), io.StringIO()
    with Progress("import", 4, 4 * GIB, stream=out, interval_s=30, clock=clock) as progress:
        for _ in range(4):
            clock.now += 20
            progress.advance(GIB)
    lines = out.getvalue().splitlines()
    # 20 s: quiet; 40 s: a line; 60 s: quiet (20 s since); 80 s: a line; then the closing line
    assert lines[0] == "import: 2/4 tensors, 2.00/4.00 GiB (50%), 51 MiB/s, 40 s left", lines
    assert lines[1].startswith("import: 4/4 tensors, 4.00/4.00 GiB (100%), 51 MiB/s, 0 s left"), lines
    assert lines[2] == "import: 4/4 tensors, 4.00/4.00 GiB (100%), 51 MiB/s, done in 1 min 20 s", lines
    assert len(lines) == 3


def test_work_shorter_than_the_interval_says_nothing():
    clock, out = Clock(), io.StringIO()
    with Progress("export", 3, 3, stream=out, clock=clock) as progress:
        for _ in range(3):
            clock.now += 1
            progress.advance(1)
    assert out.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_redrawn_line():
    out = Terminal()
    with Progress("verify", 2, 2 * GIB, stream=out) as progress:
        progress.advance(GIB)
        progress.advance(GIB)
    text = out.getvalue()  # tqdm's bar, redrawn with carriage returns and cleared at the end: no line left
    assert text.startswith("\rverify:") and "B/s" in text and "\n" not in text, repr(text)
