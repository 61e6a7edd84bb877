"""A TCP proxy that puts a far-away link in front of a local server: every byte arrives half a
round trip late in each direction, and a new connection costs one round trip before its first
byte gets through (the TCP handshake a real link charges).

A request answered by the server behind it then costs one round trip (its bytes go out half
a trip late, the answer comes back half a trip late), as over a real network, however many
requests share a connection, and whatever the client does with its connections: a client that
opens one connection per request pays for each. The delay is a pipeline, not a pause per
chunk: bytes sent back to back arrive back to back, one round trip later, so bandwidth is not
limited, only latency added.

Used by tests (in front of moto's S3 server, the `s3_server` fixture's `latency`) and by
`bench/remote_latency.py` (the test Hub and moto at 50 ms). One event loop in one daemon thread
serves every connection; `LatencyProxy.connections` counts the connections clients opened.

    proxy = LatencyProxy("127.0.0.1", server_port, rtt=0.05).start()
    ... point clients at proxy.url ...
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class LatencyProxy:
    """Forwards `127.0.0.1:<port>` to `target_host:target_port`, `rtt` seconds per round trip.

    Attributes:
        url: `http://127.0.0.1:<port>` (the proxy's own port).
        port: the port it listens on.
        rtt: the round trip added, in seconds (may be changed while it runs).
        connections: client connections accepted so far.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, target_host: str, target_port: int, rtt: float = 0.05) -> None:
        self.target = (target_host, target_port)
        self.rtt = rtt
        self.connections = 0
        self.port = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="latency-proxy")

    def start(self) -> LatencyProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0, backlog=512)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        # the handshake: the client's first bytes leave one round trip after it connected
        opened = self._loop.time() + self.rtt
        pipes = asyncio.gather(
            self._pipe(client_r, server_w, opened),
            self._pipe(server_r, client_w, 0.0),
            return_exceptions=True,
        )
        try:
            await pipes
        except asyncio.CancelledError:
            pipes.cancel()
            with contextlib.suppress(BaseException):
                await pipes

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: float
    ) -> None:
        """Copy `reader` to `writer`, each chunk written half a round trip after it was read
        (or after `opened`, when the connection is not open yet)."""
        loop = self._loop
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(data)
                with contextlib.suppress(OSError, ConnectionError):
                    await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                try:
                    data = await reader.read(1 << 16)
                except (OSError, ConnectionError):
                    data = b""
                queue.put_nowait((max(loop.time(), opened) + self.rtt / 2, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(Exception):
                writer.close()


def proxied(server_url: str, rtt: float) -> LatencyProxy:
    """A started proxy in front of the server at `http://host:port`."""
    from urllib.parse import urlsplit

    parts = urlsplit(server_url)
    assert parts.hostname is not None and parts.port is not None
    return LatencyProxy(parts.hostname, parts.port, rtt).start()


__all__ = ["LatencyProxy", "proxied"]
