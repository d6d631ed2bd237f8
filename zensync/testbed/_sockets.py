"""Stdlib TCP tools run inside host namespaces: a one-shot transfer and a ring-allreduce traffic pattern.

``python -m zensync.testbed._sockets recv --bind IP --port P --nbytes N``: accept one connection,
read N bytes, print JSON {"bytes", "seconds"} (seconds from first byte to last).
``python -m zensync.testbed._sockets send --host IP --port P --nbytes N``: connect (retrying until the
peer listens), send N bytes, print JSON.
``python -m zensync.testbed._sockets ring --rank R --ips IP0,IP1,.. --port P --nbytes B --iters K``:
(host r listens on P + r)
move exactly the bytes of a ring allreduce of B bytes: 2(n-1) steps, each sending a B/n chunk to the
next host while receiving one from the previous. Prints JSON with per-iteration seconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

__all__ = ["main"]

_CHUNK = 1 << 20
_CONNECT_TIMEOUT_S = 30.0


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _send_all(sock: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytes(_CHUNK))
    left = nbytes
    while left:
        left -= sock.send(buf[: min(left, _CHUNK)])


def _recv_exact(sock: socket.socket, nbytes: int) -> None:
    buf = bytearray(_CHUNK)
    left = nbytes
    while left:
        got = sock.recv_into(buf, min(left, _CHUNK))
        if not got:
            raise ConnectionError(f"peer closed with {left} bytes still expected")
        left -= got


def _recv(args: argparse.Namespace) -> dict[str, float]:
    with socket.create_server((args.bind, args.port)) as server:
        conn, _ = server.accept()
        with conn:
            conn.recv_into(bytearray(1), 1)
            start = time.monotonic()
            _recv_exact(conn, args.nbytes - 1)
            seconds = time.monotonic() - start
            conn.sendall(b"k")  # tell the sender everything arrived
    return {"bytes": args.nbytes, "seconds": seconds}


def _send(args: argparse.Namespace) -> dict[str, float]:
    with _connect(args.host, args.port) as sock:
        start = time.monotonic()
        _send_all(sock, args.nbytes)
        sock.recv(1)
        return {"bytes": args.nbytes, "seconds": time.monotonic() - start}


def _ring(args: argparse.Namespace) -> dict[str, object]:
    ips = args.ips.split(",")
    n, rank = len(ips), args.rank
    chunk = args.nbytes // n
    with socket.create_server((ips[rank], args.port + rank)) as server:  # port + rank: loopback hosts share an IP
        out = _connect(ips[(rank + 1) % n], args.port + (rank + 1) % n)
        inc, _ = server.accept()
    times = []
    with out, inc:
        for _ in range(args.iters):
            start = time.monotonic()
            for _step in range(2 * (n - 1)):
                sender = threading.Thread(target=_send_all, args=(out, chunk))
                sender.start()
                _recv_exact(inc, chunk)
                sender.join()
            times.append(time.monotonic() - start)
        out.sendall(b"d")  # drain: the peer's last recv completes only after our data is read
        inc.recv(1)
    return {"rank": rank, "chunk_bytes": chunk, "steps": 2 * (n - 1), "seconds": times}


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m zensync.testbed._sockets")
    sub = parser.add_subparsers(dest="cmd", required=True)
    recv = sub.add_parser("recv")
    recv.add_argument("--bind", required=True)
    send = sub.add_parser("send")
    send.add_argument("--host", required=True)
    ring = sub.add_parser("ring")
    ring.add_argument("--rank", type=int, required=True)
    ring.add_argument("--ips", required=True)
    ring.add_argument("--iters", type=int, default=1)
    for p in (recv, send, ring):
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--nbytes", type=int, required=True)
    args = parser.parse_args(argv)
    result = {"recv": _recv, "send": _send, "ring": _ring}[args.cmd](args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
