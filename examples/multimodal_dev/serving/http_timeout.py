"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on receiving each request.

uvicorn closes a keep-alive connection that sits idle between requests, but waits for the rest of a
request without end: a client that opens a connection and sends nothing, or half its headers, or
part of its body, holds a socket, a buffer and (past the headers) an app task until it goes away
(31 of 31 such connections were still open after 20 s). Here every request, its first byte to its
body's last, must arrive within ``timeout_s`` seconds of the connection opening or of the previous
answer; otherwise it is answered 408 where no answer has begun, and the connection is closed. The
app sees a request cut off mid-body as a client that left (``ClientDisconnect``).

Answering is not timed: a long answer streams as long as it takes.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MESSAGE = b"the request did not arrive in full within the server's --request-timeout\n"
# Written as bytes: h11 answers only a request whose headers it has read
ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(MESSAGE), MESSAGE)
)


def timed_h11(timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""

    class TimedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # the first bytes of the next request on this connection
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._disarm()  # received in full (or the connection is done with)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer begun on this request
                self.transport.write(ANSWER)
            self.transport.close()

    return TimedH11Protocol
