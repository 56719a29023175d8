"""CURVE key handling for ZeroMQ clients, shared by the gateway and the sidecar's transport
(the gateway may not import batcher.transport). zmq only; torch-free."""

from __future__ import annotations

import zmq
import zmq.auth


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
