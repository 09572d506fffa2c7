"""The text of one answer as its tokens arrive: what may be streamed now, and where OpenAI's ``stop``
strings end it.

The text is always the decode of every token so far (``decode``), never a join of per-token pieces:
byte-level BPE splits a character's UTF-8 bytes across tokens, and a tokenizer's clean-up may change
text around a token. Two tails of that text are held back rather than streamed: a run of U+FFFD (a
character whose last bytes have not come yet) and the longest tail that begins some stop string (the
next token may complete it, and a stop string is never shown). Text already sent cannot be taken
back, so where a decode no longer starts with it, nothing more is sent until ``finish``.

Every delta from ``add`` plus ``finish()`` equals ``text``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decode shows for an incomplete UTF-8 character


class AnswerText:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("an empty stop string would end every answer before its first character")
        self._decode = decode
        self._stop = tuple(stop)
        self.tokens: list[int] = []  # every token added
        self._sent = ""  # what the deltas have given so far
        self._final = ""  # the answer as it would end now: the decode, cut at a stop string
        self._stopped = False
        self._finished = False

    def add(self, token: int) -> str:
        """Append one generated token; return the text that may now be sent (a delta, possibly "")."""
        if self._stopped or self._finished:
            raise RuntimeError("this answer has ended (a stop string, or finish()): no token may follow")
        self.tokens.append(token)
        full = self._decode(self.tokens)
        cut = self._earliest_stop(full)
        if cut is not None:
            self._final = full[:cut]
            self._stopped = True
            return self._extend_sent(self._final)
        self._final = full
        return self._extend_sent(self._held_back(full))

    @property
    def stopped(self) -> bool:
        """A stop string has appeared: the caller ends this row."""
        return self._stopped

    def finish(self) -> str:
        """The rest of the answer's text once no token will come (the held-back part); call once."""
        if self._finished:
            raise RuntimeError("finish() was already called for this answer")
        self._finished = True
        rest = self._final[len(self._sent) :]
        self._sent += rest
        return rest

    @property
    def text(self) -> str:
        """The whole answer so far as it will finally read (sent + held)."""
        return self._sent + self._final[len(self._sent) :]

    def _earliest_stop(self, full: str) -> int | None:
        found = [i for i in (full.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self, full: str) -> str:
        """``full`` less what the next tokens may still change: an unfinished character, the start of a stop."""
        sendable = full.rstrip(REPLACEMENT)
        longest = max((len(s) - 1 for s in self._stop), default=0)
        for size in range(min(longest, len(sendable)), 0, -1):
            tail = sendable[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return sendable[:-size]
        return sendable

    def _extend_sent(self, target: str) -> str:
        """The part of ``target`` past what was sent, where ``target`` continues it; else nothing yet."""
        if not target.startswith(self._sent):
            return ""
        delta = target[len(self._sent) :]
        self._sent = target
        return delta
