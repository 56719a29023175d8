"""ZeroMQ socket factory: addresses, bind/connect, high-water marks, linger; typed send/recv.

Must not know about scheduling: it moves encoded protocol frames, nothing else.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

import msgspec
import zmq

from batcher import protocol

log = logging.getLogger(__name__)


def ipc_path(address: str) -> str | None:
    """The socket file behind an ipc:// address (None for tcp://)."""
    if address.startswith("ipc://"):
        return address[len("ipc://"):]
    return None


def check_address(address: str) -> None:
    """Only ipc:// and tcp:// addresses (tcp:// as host:port); anything else is a config error."""
    parsed = urlparse(address)
    if parsed.scheme == "ipc" and ipc_path(address):
        return
    if parsed.scheme == "tcp" and parsed.hostname and parsed.port:
        return
    raise SystemExit(f"invalid ZeroMQ address {address!r}: use ipc:///path or tcp://host:port")


def bind(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    """Bind a socket; for ipc:// create the directory and replace a stale socket file."""
    check_address(address)
    path = ipc_path(address)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
    sock = ctx.socket(kind)
    _tune(sock)
    if kind == zmq.ROUTER:
        # Fail loudly instead of silently dropping a frame for a peer that went away.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(address)
    return sock


def connect(ctx: zmq.Context, kind: int, address: str, identity: bytes | None = None) -> zmq.Socket:
    check_address(address)
    sock = ctx.socket(kind)
    _tune(sock)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def _tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues here: admission control is the scheduler's job, and a dropped
    # frame would break the one-terminal-event guarantee.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def try_decode(dec: msgspec.msgpack.Decoder, frame: bytes, peer: str):
    """Decode one frame, or log and return None: a malformed frame is never executed."""
    try:
        return dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.error("dropped malformed frame from %s (%d bytes): %s", peer, len(frame), exc)
        return None


encode = protocol.encode
