"""Issue 9 at the socket level: the real batcher (batcher.core.Batcher) on real ZeroMQ sockets, the test
playing gateways, workers (batcher.sim.engine.SimWorker executes the steps) and rogue peers. No model, so
fast; tests/test_faults.py runs the whole stack."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from batcher.config import BatcherConfig
from batcher.core import Batcher
from batcher.sim.engine import SimWorker
from gateway.client import BatcherClient, BatcherLost
from gateway.config import GatewayConfig
from laneserve.wire import protocol as P
from laneserve.wire import transport

BS = 16
REPO = Path(__file__).resolve().parents[1]
GW, WK = P.decoder(P.BatcherToGateway), P.decoder(P.BatcherToWorker)


async def recv(sock, dec, timeout: float = 5.0):
    return dec.decode(await asyncio.wait_for(sock.recv(), timeout))


class Side:
    """A running batcher plus helpers to talk to it as a gateway and as workers."""

    def __init__(self, batcher: Batcher, ctx: zmq.asyncio.Context):
        self.b, self.ctx = batcher, ctx
        self.gw = transport.connect(ctx, zmq.DEALER, batcher.cfg.batcher_address, identity=b"gw")

    async def roundtrip(self) -> P.Pong:
        """A Ping answered: every frame sent before it on any socket the loop reads first has been seen
        (the batcher handles a socket's frames in order; the loop is single-threaded)."""
        await self.gw.send(P.encode(P.Ping(nonce=7)))
        while True:
            msg = await recv(self.gw, GW)
            if isinstance(msg, P.Pong) and msg.nonce == 7:
                return msg

    async def worker(self, wid: int, num_blocks: int = 64, ready: bool = True) -> zmq.asyncio.Socket:
        wk = transport.connect(self.ctx, zmq.DEALER, self.b.cfg.worker_address, identity=f"worker-{wid}".encode())
        if ready:
            await wk.send(P.encode(P.WorkerReady(worker_id=wid, num_blocks=num_blocks, block_size=BS,
                                                 max_model_len=1024, protocol_version=P.PROTOCOL_VERSION,
                                                 vocab_size=320)))
            while wid not in self.b.workers:  # the handshake is handled on the batcher's loop
                await self.roundtrip()
        return wk

    async def add(self, rid: str, prompt: list[int] | None = None, **params) -> None:
        await self.gw.send(P.encode(P.AddRequest(request_id=rid, prompt_token_ids=prompt or list(range(20)),
                                                 params=P.SamplingParams(**params), arrival_time=0.0)))

    async def deltas_until_finished(self, rids: set[str], worker_socks: dict | None = None) -> dict:
        """Collect deltas until every id in rids finished; steps arriving at worker_socks are executed."""
        got: dict[str, list[P.TokenDelta]] = {}
        pending = set(rids)
        while pending:
            msg = await recv(self.gw, GW)
            if isinstance(msg, P.Rejected):
                got.setdefault(msg.request_id, []).append(msg)
                pending.discard(msg.request_id)
            elif isinstance(msg, P.TokenBatch):
                for d in msg.deltas:
                    got.setdefault(d.request_id, []).append(d)
                    if d.finish_reason is not None:
                        pending.discard(d.request_id)
        return got

    async def served_until_finished(self, wk, rids: set[str], wid: int = 0) -> dict:
        """deltas_until_finished(rids) while a fresh SimWorker serves every step that reaches the socket wk."""
        stop = asyncio.Event()
        loop = asyncio.create_task(serve_steps(wk, SimWorker(64, BS), stop, wid))
        try:
            return await self.deltas_until_finished(rids)
        finally:
            stop.set()
            await loop


@contextlib.asynccontextmanager
async def batcher(tmp_path, **overrides):
    cfg = BatcherConfig(batcher_address=f"ipc://{tmp_path}/b.sock", worker_address=f"ipc://{tmp_path}/w.sock",
                        **overrides)
    batcher = Batcher(cfg)
    serving = asyncio.create_task(batcher.run())
    ctx = zmq.asyncio.Context()
    side = Side(batcher, ctx)
    try:
        yield side
    finally:
        batcher._stop.set()
        await serving
        ctx.destroy(linger=0)


async def serve_steps(wk, worker: SimWorker, stop: asyncio.Event, wid: int = 0) -> None:
    """A worker loop: execute every StepInput that arrives until stop is set."""
    while not stop.is_set():
        try:
            step = await recv(wk, WK, timeout=0.05)
        except asyncio.TimeoutError:
            continue
        if isinstance(step, P.StepInput):
            await wk.send(P.encode(msgspec.structs.replace(worker.execute(step)[0], worker_id=wid)))


# ---------------------------------------------------------------------------------------------- worker loss
async def test_a_worker_whose_connection_closes_is_lost_at_once_and_a_new_one_serves(tmp_path):
    async with batcher(tmp_path) as side:
        wk = await side.worker(0)
        await side.add("a", max_tokens=50)
        step = await recv(wk, WK)
        assert "a" in step.num_scheduled_tokens
        t0 = time.monotonic()
        wk.close()  # the connection closes, as when the process is SIGKILLed
        got = await side.deltas_until_finished({"a"})
        lost_after = time.monotonic() - t0
        (end,) = got["a"]
        assert end.finish_reason == P.FinishReason.ERROR and "worker 0 lost" in end.error
        assert lost_after < 3.0  # at once: the silence check (--worker-timeout) would take 30 s
        pong = await side.roundtrip()
        assert pong.workers_alive == 0 and pong.stats.steps >= 1  # the lost worker's steps still count
        assert pong.stats.num_running == 0 and pong.stats.kv_blocks_total == 0  # (gauges: live workers only)
        await side.add("b")
        (rej,) = (await side.deltas_until_finished({"b"}))["b"]
        assert isinstance(rej, P.Rejected) and rej.retryable  # no worker: the gateway answers 429/503
        wk2 = await side.worker(0)  # the restarted worker registers and serves
        await side.add("c", max_tokens=5)
        ds = (await side.served_until_finished(wk2, {"c"}))["c"]
        assert sum(len(d.new_token_ids) for d in ds) == 5 and ds[-1].finish_reason == P.FinishReason.LENGTH
        assert (await side.roundtrip()).stats.steps > pong.stats.steps  # counted on from there, not from 0


async def test_a_silent_worker_is_lost_after_worker_timeout(tmp_path):
    async with batcher(tmp_path, worker_timeout=2.0) as side:  # (a stall between registering and the step: not lost)
        t0 = time.monotonic()  # before the worker's last message: the batcher times silence from that message
        wk = await side.worker(0)
        await side.add("a", max_tokens=50)
        await recv(wk, WK)  # it takes the step and never answers (stuck, connection still up)
        (end,) = (await side.deltas_until_finished({"a"}))["a"]
        assert end.finish_reason == P.FinishReason.ERROR and "silent" in end.error
        assert 2.0 <= time.monotonic() - t0 < 10.0  # a bound generous enough for a loaded CI machine
        await wk.send(P.encode(P.Heartbeat(worker_id=0)))  # it comes back: told to register again
        while isinstance(msg := await recv(wk, WK), P.StepInput):  # the second step it had queued
            pass
        assert isinstance(msg, P.Reannounce)


async def test_requeue_recomputes_a_lost_workers_requests_on_another_worker(tmp_path):
    async with batcher(tmp_path, on_worker_loss="requeue") as side:
        wa = await side.worker(0)
        wb = await side.worker(1)
        await side.add("r", prompt=[7] * 20, max_tokens=12)
        steps_a, sim_a = [], SimWorker(64, BS)
        # which worker got it? least load picks 0 (ties go to the lowest id)
        for _ in range(3):  # three steps on worker 0: some tokens reach the gateway
            steps_a.append(await recv(wa, WK))
            await wa.send(P.encode(sim_a.execute(steps_a[-1])[0]))
        first = []
        while sum(len(d.new_token_ids) for d in first) < 3:
            first += (await recv(side.gw, GW)).deltas
        await side.roundtrip()
        wa.close()
        rest = (await side.served_until_finished(wb, {"r"}, wid=1))["r"]
        ds = first + rest
        assert [d.finish_reason for d in ds if d.finish_reason is not None] == [P.FinishReason.LENGTH]
        assert sum(len(d.new_token_ids) for d in ds) == 12  # the client sees no break
        # a second loss of the same request fails it (a request that kills workers must not kill them all)
        assert side.b.requeued == set() and side.b.originals == {}


async def test_requeue_with_no_live_worker_holds_the_requests_until_one_registers(tmp_path):
    """Issue 26 item 7: one worker, lost; its requests wait for the restarted one and finish there with no break
    (an abort meanwhile ends one with a single ABORT)."""
    async with batcher(tmp_path, on_worker_loss="requeue") as side:
        wk, sim = await side.worker(0), SimWorker(64, BS)
        await side.add("a", prompt=[5] * 20, max_tokens=12)
        await side.add("b", prompt=[6] * 20, max_tokens=12)
        for _ in range(3):  # three steps: some tokens reach the gateway
            await wk.send(P.encode(sim.execute(await recv(wk, WK))[0]))
        first = []
        while sum(len(d.new_token_ids) for d in first if d.request_id == "a") < 3:
            first += (await recv(side.gw, GW)).deltas
        wk.close()
        while (await side.roundtrip()).workers_alive:  # the loss is handled on the batcher's loop
            pass
        assert set(side.b.orphans) == {"a", "b"}
        await side.gw.send(P.encode(P.AbortRequests(request_ids=["b"])))
        aborted = (await side.deltas_until_finished({"b"}))["b"]
        wk2 = await side.worker(0)  # the launcher restarted it
        got = await side.served_until_finished(wk2, {"a"})
        ds = [d for d in first if d.request_id == "a"] + got["a"]
        assert [d.finish_reason for d in ds if d.finish_reason is not None] == [P.FinishReason.LENGTH]
        assert sum(len(d.new_token_ids) for d in ds) == 12
        assert [d.finish_reason for d in aborted] == [P.FinishReason.ABORT]
        assert side.b.orphans == {} and side.b.owner == {} and side.b.originals == {}


async def test_a_worker_unknown_to_a_restarted_batcher_is_told_to_reannounce(tmp_path):
    async with batcher(tmp_path) as side:
        wk = await side.worker(0, ready=False)  # registered with a batcher that died: this one never heard of it
        await wk.send(P.encode(P.StepOutput(step=3, worker_id=0)))
        await wk.send(P.encode(P.Heartbeat(worker_id=0)))
        msg = await recv(wk, WK)
        assert isinstance(msg, P.Reannounce)
        with pytest.raises(asyncio.TimeoutError):  # one Reannounce per second, not one per frame
            await recv(wk, WK, timeout=0.3)


# ---------------------------------------------------------------------------------------------- overload
async def test_waiting_requests_over_the_cap_are_rejected_as_retryable(tmp_path):
    async with batcher(tmp_path, max_waiting_requests=2) as side:
        wk = await side.worker(0)
        for rid in "abcd":
            await side.add(rid, max_tokens=50)
        # a runs (two steps in flight, the worker does not answer); b and c wait; d is over the cap
        (rej,) = (await side.deltas_until_finished({"d"}))["d"]
        assert isinstance(rej, P.Rejected) and rej.retryable and "wait" in rej.reason
        pong = await side.roundtrip()
        assert (pong.stats.num_running, pong.stats.num_waiting) == (1, 2)
        wk.close()


# ---------------------------------------------------------------------------------------------- rogue peers
JUNK = [b"", b"\x00", b"\xff" * 100, msgspec.msgpack.encode({"type": "AddRequest"}),
        msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode("hello"),
        msgspec.msgpack.encode({"type": "Shutdown"}), msgspec.msgpack.encode({"type": "NoSuchMessage", "x": 1}),
        # valid-looking messages with wrong field types
        msgspec.msgpack.encode({"type": "AddRequest", "request_id": 5, "prompt_token_ids": "abc",
                                "params": {}, "arrival_time": 0.0}),
        msgspec.msgpack.encode({"type": "AbortRequests", "request_ids": [1, None]}),
        msgspec.msgpack.encode({"type": "WorkerReady", "worker_id": "w", "num_blocks": 1.5, "block_size": 16,
                                "max_model_len": 10, "protocol_version": 1}),
        msgspec.msgpack.encode({"type": "StepOutput", "step": "x", "worker_id": 0}),
        msgspec.msgpack.encode({"type": "Ping", "nonce": "x"})]


def _bad_but_well_typed() -> list[bytes]:
    """Frames that decode, with values that would hurt a worker if executed."""
    sp = P.SamplingParams
    adds = [("neg", [-1, 2], sp()), ("big", [5, 10**6], sp()), ("nan", [5], sp(temperature=math.nan)),
            ("topp", [5], sp(top_p=0.0)), ("lp", [5], sp(logprobs=10**6)), ("mt", [5], sp(max_tokens=-1)),
            ("plp", [5], sp(prompt_logprobs=10**6)), ("stop", [5], sp(stop_token_ids=(10**9,))), ("", [5], sp()),
            ("x" * 300, [5], sp()), ("empty", [], sp()), ("long", [5] * 5000, sp())]
    frames = [P.encode(P.AddRequest(request_id=r, prompt_token_ids=ids, params=p, arrival_time=0.0))
              for r, ids, p in adds]
    frames.append(P.encode(P.WorkerReady(worker_id=9, num_blocks=10**12, block_size=16, max_model_len=10,
                                         protocol_version=P.PROTOCOL_VERSION)))
    frames.append(P.encode(P.WorkerReady(worker_id=9, num_blocks=8, block_size=16, max_model_len=10,
                                         protocol_version=99)))
    return frames


async def test_rogue_frames_on_both_sockets_are_dropped_and_the_batcher_still_serves(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    async with batcher(tmp_path) as side:
        wk = await side.worker(0)
        rogue_front = side.ctx.socket(zmq.DEALER)
        rogue_front.connect(side.b.cfg.batcher_address)
        rogue_back = side.ctx.socket(zmq.DEALER)
        rogue_back.connect(side.b.cfg.worker_address)
        for sock in (rogue_front, rogue_back):
            for frame in JUNK + _bad_but_well_typed():
                await sock.send(frame)
            await sock.send_multipart([b"junk", b"in", b"three frames"])
            await sock.send_multipart([P.encode(P.Ping(nonce=1)), P.encode(P.Ping(nonce=2))])
        # the batcher's answers to the rogue front: Rejected for every bad AddRequest, never a step
        rejected = set()
        while len(rejected) < 12:
            msg = await recv(rogue_front, GW)
            assert isinstance(msg, P.Rejected) and not msg.retryable, msg
            rejected.add(msg.request_id)
        await side.roundtrip()
        assert set(side.b.workers) == {0} and side.b.owner == {}  # no fake worker, nothing admitted
        with pytest.raises(asyncio.TimeoutError):
            await recv(wk, WK, timeout=0.2)  # nothing reached the real worker
        await side.add("ok", max_tokens=4)
        ds = (await side.served_until_finished(wk, {"ok"}))["ok"]
        assert ds[-1].finish_reason == P.FinishReason.LENGTH
        rogue_front.close()
        rogue_back.close()
    assert "dropped malformed frame" in caplog.text and "3-frame message" in caplog.text


async def test_a_request_sent_on_a_closed_batcher_socket_ends_as_batcher_lost_and_leaves_nothing(tmp_path):
    """A review found a send failing at shutdown raised out of the handler with its request's counters and queue
    kept: the drain then never saw zero in flight."""
    client = BatcherClient(GatewayConfig(batcher_address=f"ipc://{tmp_path}/none.sock"))
    client.monitor.close()
    client.sock.close(linger=0)
    try:
        q = client.submit([P.AddRequest(request_id=rid, prompt_token_ids=[1], params=P.SamplingParams(),
                                        arrival_time=0.0) for rid in ("x", "y")])
        item = q.get_nowait()
        assert isinstance(item, BatcherLost) and "closed" in item.reason and client.num_in_flight == 0
    finally:
        client.ctx.term()


async def test_the_gateway_client_drops_junk_from_its_batcher_and_fails_in_flight_when_it_goes(tmp_path):
    """The gateway's side: a fake batcher (a raw ROUTER) answers junk, then a real Pong, then goes away."""
    address = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.asyncio.Context()
    fake = transport.bind(ctx, zmq.ROUTER, address)
    client = BatcherClient(GatewayConfig(batcher_address=address, batcher_timeout=2.0))
    client.start()
    try:
        deadline = time.monotonic() + 5
        while not client.connected:  # the monitor's handshake event, handled on this loop
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        ping = asyncio.create_task(client.ping())
        nonce = 0
        while nonce == 0:  # the client's periodic liveness pings carry nonce 0
            ident, frame = await asyncio.wait_for(fake.recv_multipart(), 5)
            nonce = P.decoder(P.GatewayToBatcher).decode(frame).nonce
        for junk in JUNK:
            await fake.send_multipart([ident, junk])
        await fake.send_multipart([ident, P.encode(P.TokenBatch(step=1, deltas=[P.TokenDelta("nobody", [1])],
                                                                 timestamp=0.0))])
        await fake.send_multipart([ident, P.encode(P.Pong(nonce=nonce, workers_alive=1))])
        assert (await ping).workers_alive == 1
        q = client.submit([P.AddRequest(request_id="x", prompt_token_ids=[1], params=P.SamplingParams(),
                                        arrival_time=0.0)])
        while not isinstance(P.decoder(P.GatewayToBatcher).decode((await asyncio.wait_for(fake.recv_multipart(),
                                                                                          5))[1]), P.AddRequest):
            pass
        t0 = time.monotonic()
        fake.close()  # the batcher dies: the in-flight request ends at once, new ones see it dead
        item = await asyncio.wait_for(q.get(), 5)
        assert isinstance(item, BatcherLost) and time.monotonic() - t0 < 3.0
        assert not await client.alive() and await client.ping() is None
    finally:
        await client.close()
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------------------------- security
def _certs(tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(keys, "server")
    client_pub, client_sec = zmq.auth.create_certificates(keys, "client")
    _, stranger_sec = zmq.auth.create_certificates(keys, "stranger")
    (allowed / "client.key").write_bytes(Path(client_pub).read_bytes())
    return server_pub, server_sec, client_sec, stranger_sec, allowed


@pytest.mark.parametrize("restricted", [False, True])
async def test_curve_over_tcp_serves_a_keyed_client_and_ignores_others(tmp_path, restricted):
    server_pub, server_sec, client_sec, stranger_sec, allowed = _certs(tmp_path)
    port = transport_free_port()
    cfg = BatcherConfig(batcher_address=f"tcp://127.0.0.1:{port}", worker_address=f"ipc://{tmp_path}/w.sock",
                        curve_server_secret_key=str(server_sec),
                        curve_client_keys_dir=str(allowed) if restricted else "")
    batcher = Batcher(cfg)
    serving = asyncio.create_task(batcher.run())
    ctx = zmq.asyncio.Context()

    async def pong(sock, timeout: float = 1.0) -> bool:
        try:  # a refused client's send can block: libzmq drops its pipe after the failed handshake
            await asyncio.wait_for(sock.send(P.encode(P.Ping(nonce=3))), timeout)
            return isinstance(await recv(sock, GW, timeout=timeout), P.Pong)
        except asyncio.TimeoutError:
            return False

    try:
        keyed = transport.connect(ctx, zmq.DEALER, cfg.batcher_address, curve_server_public_key=str(server_pub),
                                  curve_client_secret_key=str(client_sec))
        plain = transport.connect(ctx, zmq.DEALER, cfg.batcher_address)
        stranger = transport.connect(ctx, zmq.DEALER, cfg.batcher_address,
                                     curve_server_public_key=str(server_pub),
                                     curve_client_secret_key=str(stranger_sec))
        assert await pong(keyed, 10.0)  # (a loaded machine: the handshake and the batcher's first turn take time)
        assert not await pong(plain)  # no CURVE: the handshake fails, nothing is ever read
        assert await pong(stranger, 1.0 if restricted else 10.0) is (not restricted)  # knows the server key, not listed
    finally:
        batcher._stop.set()
        await serving
        ctx.destroy(linger=0)


def transport_free_port() -> int:
    from tests.stack import free_port

    return free_port()


def test_binding_tcp_beyond_loopback_without_curve_warns(tmp_path, caplog):
    ctx = zmq.Context()
    try:
        for address, warns in ((f"tcp://127.0.0.1:{transport_free_port()}", False),
                               (f"ipc://{tmp_path}/x.sock", False),
                               (f"tcp://0.0.0.0:{transport_free_port()}", True)):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                transport.bind(ctx, zmq.ROUTER, address).close()
            assert ("without CURVE" in caplog.text) is warns, address
    finally:
        ctx.term()


PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}


def test_no_pickle_anywhere():
    """Nothing is pickled: no pickle-family import, no pyzmq *_pyobj (pickle), no torch.load without
    weights_only=True."""
    found = []
    for package in ("gateway", "batcher", "workers", "laneserve"):
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                found += [f"{path}:{node.lineno} imports {n}" for n in names if n in PICKLERS]
                if isinstance(node, ast.Attribute) and node.attr in ("send_pyobj", "recv_pyobj", "send_serialized",
                                                                      "recv_serialized"):
                    found.append(f"{path}:{node.lineno} uses {node.attr}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                        found.append(f"{path}:{node.lineno} torch.load without weights_only=True")
    assert found == []


async def test_a_request_goes_to_a_worker_that_can_hold_it_and_is_refused_only_if_none_can(tmp_path):
    """The router picked by affinity and load alone, and a request too big for that worker's pool was refused as
    never runnable though another worker's pool held it (a review)."""
    async with batcher(tmp_path) as side:
        small = await side.worker(0, num_blocks=4)  # 64 tokens of KV; the least loaded, lowest id: picked first
        big = await side.worker(1, num_blocks=40)
        await side.add("big", prompt=list(range(300)), max_tokens=3)
        got = await side.served_until_finished(big, {"big"}, wid=1)
        assert got["big"][-1].finish_reason == P.FinishReason.LENGTH
        await side.add("huge", prompt=[i % 300 for i in range(700)], max_tokens=3)  # in the context, in no pool
        (rej,) = (await side.deltas_until_finished({"huge"}))["huge"]
        assert isinstance(rej, P.Rejected) and not rej.retryable and "KV blocks" in rej.reason
        assert (await side.roundtrip()).workers_alive == 2  # (the small worker was there all along)
        small.close()
