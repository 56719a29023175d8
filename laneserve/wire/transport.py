"""ZeroMQ socket factory for all three processes: addresses, bind/connect, high-water marks, linger,
heartbeats, CURVE, the connection monitor; frame decoding that drops malformed frames.

Must not know about scheduling: it moves encoded protocol frames, nothing else.
Security (docs/reliability.md): ipc:// or loopback tcp by default; binding tcp on another
interface without CURVE logs a warning. With CURVE the batcher is the server (its secret
certificate), gateways and workers are clients (the server's public certificate, their own
key pair); an optional directory of client public certificates restricts who may connect.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from urllib.parse import urlparse

import msgspec
import zmq
import zmq.auth

log = logging.getLogger(__name__)
HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 3000
MAX_FRAME_BYTES = 64 << 20  # far above any real frame (a 128k-token prompt is ~400 kB of msgpack)


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


def is_private(address: str) -> bool:
    """ipc://, or tcp:// on a loopback interface: unreachable from other hosts."""
    host = urlparse(address).hostname
    if ipc_path(address) or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or '*': may be any interface
        return False


def bind(ctx: zmq.Context, kind: int, address: str, curve_secret_key: str = "") -> zmq.Socket:
    """Bind a socket; for ipc:// create the directory and replace a stale socket file.

    curve_secret_key: the server certificate's secret file (zmq.auth format) to run CURVE on it.
    """
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
        # A peer reconnecting under the same identity (a restarted worker) replaces the old pipe.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # A peer sending a larger frame is disconnected by libzmq before the frame is buffered.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if curve_secret_key:
        public, secret = zmq.auth.load_certificate(curve_secret_key)
        if secret is None:
            raise SystemExit(f"{curve_secret_key}: not a secret certificate (zmq.auth .key_secret file)")
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
    elif not is_private(address):
        log.warning("binding %s without CURVE: anyone who reaches this port can submit requests or pose as a "
                    "worker; use a private network, or --curve-server-secret-key (docs/reliability.md)", address)
    sock.bind(address)
    return sock


def connect(ctx: zmq.Context, kind: int, address: str, identity: bytes | None = None,
            curve_server_public_key: str = "", curve_client_secret_key: str = "") -> zmq.Socket:
    return connect_monitored(ctx, kind, address, 0, identity, curve_server_public_key, curve_client_secret_key)[0]


def connect_monitored(ctx: zmq.Context, kind: int, address: str, monitor_events: int, identity: bytes | None = None,
                      curve_server_public_key: str = "", curve_client_secret_key: str = ""
                      ) -> tuple[zmq.Socket, zmq.Socket | None]:
    """connect(), plus the socket's monitor (a PAIR socket) for monitor_events, started before connecting so
    no handshake is missed; None when monitor_events is 0."""
    check_address(address)
    sock = ctx.socket(kind)
    _tune(sock)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if curve_server_public_key:
        set_curve_client(sock, curve_server_public_key, curve_client_secret_key)
    monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
    sock.connect(address)
    return sock, monitor


def set_curve_client(sock: zmq.Socket, server_public_key: str, client_secret_key: str = "") -> None:
    """Connect with CURVE: the server's public certificate; our own key pair (fresh if none given)."""
    sock.curve_serverkey = zmq.auth.load_certificate(server_public_key)[0]
    if client_secret_key:
        public, secret = zmq.auth.load_certificate(client_secret_key)
        if secret is None:
            raise SystemExit(f"{client_secret_key}: not a secret certificate (zmq.auth .key_secret file)")
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey = public, secret


def _tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues here: admission control is the scheduler's job, and a dropped
    # frame would break the one-terminal-event guarantee.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # ZMTP heartbeats, answered by libzmq's I/O thread even while the peer's Python is busy in a long
    # step: a peer whose host vanished (no FIN over tcp) is disconnected after the timeout.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def try_decode(dec: msgspec.msgpack.Decoder, frame: bytes, peer: str):
    """Decode one frame, or log and return None: a malformed frame is never executed."""
    try:
        return dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.error("dropped malformed frame from %s (%d bytes): %s", peer, len(frame), exc)
        return None

