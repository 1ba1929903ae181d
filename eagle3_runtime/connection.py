"""The HTTP/1.1 connection handling of eagle3-serve: uvicorn's h11 protocol with two bounds added.

  * the keep-alive timer also bounds the request head (slowloris), see HeadTimeoutH11;
  * a lingering close: when the server answers before it has read the whole request body (413 on
    Content-Length, or a request that says `Connection: close`), closing at once would make the kernel
    reset the connection while the client is still sending, and a client that sends the whole body
    before it reads (urllib, requests) would see "connection reset" instead of the answer. So the
    server half-closes (FIN after the answer), reads and discards what still comes for at most
    LINGER_SECONDS / LINGER_BYTES, then closes: nginx's lingering_close.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_SECONDS = 2.0
LINGER_BYTES = 64 << 20


class _LingeringTransport:
    """The connection's transport, whose close() lingers while the request body is still arriving."""

    def __init__(self, transport, protocol: "HeadTimeoutH11"):
        self._t, self._p = transport, protocol
        self.lingering = False
        self.drained = 0

    def __getattr__(self, name):
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        if self._p.conn.their_state is not h11.SEND_BODY or not self._t.can_write_eof():
            self._t.close()
            return
        self.lingering = True
        self._t.write_eof()  # (after the answer already buffered)
        self._t.resume_reading()
        self._p.loop.call_later(LINGER_SECONDS, self._t.close)

    def discard(self, n: int) -> None:
        self.drained += n
        if self.drained > LINGER_BYTES:
            self._t.close()


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, with its keep-alive timer also bounding the request head: it starts when
    the connection opens (uvicorn starts it only after a response) and stops once a whole request
    head has arrived (uvicorn stops it at any byte), so an idle connection, or one that dribbles
    its headers (slowloris), is closed after --timeout-keep-alive seconds; and with a lingering close
    (module docstring)."""

    def connection_made(self, transport) -> None:
        super().connection_made(_LingeringTransport(transport, self))
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            self.transport.discard(len(data))
            return
        self.conn.receive_data(data)  # (without uvicorn's unconditional timer stop)
        self.handle_events()

    def eof_received(self):
        if self.transport.lingering:
            self.transport._t.close()
            return False
        return super().eof_received()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a new request's head has arrived: its handler runs untimed
            self._unset_keepalive_if_required()

    def timeout_keep_alive_handler(self) -> None:
        try:
            super().timeout_keep_alive_handler()
        except h11.LocalProtocolError:  # h11 would not send ConnectionClosed in this state: just close
            self.transport.close()

    def shutdown(self) -> None:  # (server shutdown: no lingering)
        if self.transport.lingering:
            self.transport._t.close()
            return
        super().shutdown()
