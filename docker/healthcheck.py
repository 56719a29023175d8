#!/usr/bin/env python3
"""Container healthchecks for Compose: `http URL` (the gateway's /health), `zmq ADDRESS` (the batcher) and
`file PATH` (a worker's --liveness-file).

The zmq check speaks the real protocol: it connects a DEALER to the batcher's gateway socket, sends
`Ping(nonce)` and waits for the matching `Pong`, so "healthy" means the batcher's event loop answers,
not merely that a port is open. Exit status 0 = healthy, 1 = not. Stdlib + what the image already has
(pyzmq, msgspec, laneserve.wire.protocol); never imports torch. Copied into the images as
/usr/local/bin/laneserve-healthcheck (a `laneserve ping` sub-command would make this file unnecessary).

    laneserve-healthcheck http http://127.0.0.1:8000/health
    laneserve-healthcheck zmq tcp://127.0.0.1:5555 [--min-workers N]
    laneserve-healthcheck file /tmp/laneserve-worker.alive [--max-age 30]

The file check: healthy while the file's modification time is at most --max-age seconds old (the worker's loop
sets it about every 0.5 s once the model is loaded, between steps and while idle; a hung worker stops).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout: float) -> str | None:
    """None when healthy, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)


def check_file(path: str, max_age: float) -> str | None:
    """None when the file changed within max_age seconds, else why not."""
    import time

    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return None if age <= max_age else f"{path} last set {age:.0f}s ago (> {max_age:.0f}s): the worker's loop is stuck"


def check_zmq(address: str, timeout: float, min_workers: int) -> str | None:
    import zmq

    from laneserve.wire import protocol as P
    from laneserve.wire import transport

    ctx = zmq.Context()
    try:
        sock = transport.connect(ctx, zmq.DEALER, address)
        nonce = int.from_bytes(os.urandom(4), "little")
        sock.send(P.encode(P.Ping(nonce=nonce)))
        decoder = P.decoder(P.BatcherToGateway)
        deadline_ms = int(timeout * 1000)
        # Replies for other nonces cannot arrive (fresh socket identity), but skip anything else defensively.
        while sock.poll(deadline_ms):
            msg = transport.try_decode(decoder, sock.recv(), "batcher")
            if isinstance(msg, P.Pong) and msg.nonce == nonce:
                if msg.protocol_version != P.PROTOCOL_VERSION:
                    return f"protocol version {msg.protocol_version}, this image speaks {P.PROTOCOL_VERSION}"
                if msg.workers_alive < min_workers:
                    return f"{msg.workers_alive} worker(s) alive, want {min_workers}"
                return None
        return f"no Pong from {address} in {timeout}s"
    finally:
        ctx.destroy(linger=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laneserve-healthcheck", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    http = sub.add_parser("http", help="GET URL, healthy on 200")
    http.add_argument("url")
    zmq_ = sub.add_parser("zmq", help="Ping the batcher, healthy on a matching Pong")
    zmq_.add_argument("address")
    zmq_.add_argument("--min-workers", type=int, default=0, help="also require this many registered workers")
    for p in (http, zmq_):
        p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    file_ = sub.add_parser("file", help="a worker's --liveness-file, healthy while recently set")
    file_.add_argument("path")
    file_.add_argument("--max-age", type=float, default=30.0, help="seconds (the batcher's --worker-timeout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "http":
        problem = check_http(args.url, args.timeout)
    elif args.kind == "file":
        problem = check_file(args.path, args.max_age)
    else:
        problem = check_zmq(args.address, args.timeout, args.min_workers)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
