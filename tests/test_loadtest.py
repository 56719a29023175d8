"""loadtest: the open-loop client, the report math, compare, the CLI, and a replay against the stack.

The client is first run against a small stand-in OpenAI server defined here (loadtest targets
any OpenAI-compatible server; the stand-in lets a test force 429s, hangs and a small context),
then for real against `laneserve serve --model tiny` (the `stack` fixture).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from loadtest import cli, report, sweep, traces
from loadtest.client import PROBE_TEXT, LoadConfig, LoadRunner, RequestRecord, fit_to_context, probe, run_load
from loadtest.traces import DATA_DIR as TRACES
from loadtest.traces import TraceRequest, load_trace, rag

FAIL_429, HANG, MID_ERROR = 13, 17, 19  # max_tokens the stand-in answers with a 429 / never / an error event


class StandIn:
    """A minimal OpenAI-style server on loopback: byte 'tokenizer', streamed completions."""

    def __init__(self, max_model_len: int = 4096, token_delay: float = 0.02):
        self.max_model_len, self.token_delay = max_model_len, token_delay
        self.bodies: list[dict] = []
        self.calls: list[str] = []  # each /detokenize and completion, in arrival order
        self.active = self.max_active = 0
        self.runner: web.AppRunner | None = None
        self.release = asyncio.Event()  # lets hung handlers end at shutdown

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()

    async def models(self, request):
        return web.json_response({"data": [{"id": "standin", "max_model_len": self.max_model_len}]})

    async def tokenize(self, request):
        body = await request.json()
        ids = list(body["prompt"].encode())
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request):
        body = await request.json()
        self.calls.append("detokenize")
        return web.json_response({"prompt": bytes(body["tokens"]).decode(errors="replace")})

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.calls.append("completion")
        n = body["max_tokens"]
        if n == FAIL_429:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if n == HANG:
                await self.release.wait()
                return resp
            if n == MID_ERROR:
                await resp.write(_sse({"choices": [{"index": 0, "text": "x"}]}))
                await resp.write(_sse({"error": {"message": "engine failed", "code": 500}}) + b"data: [DONE]\n\n")
                return resp
            if chat:
                await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
            for i in range(n):
                await asyncio.sleep(self.token_delay)
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                choice["finish_reason"] = "length" if i == n - 1 else None
                await resp.write(_sse({"choices": [choice]}))
            prompt = len(body["prompt"]) if "prompt" in body else len(body["messages"][0]["content"])
            await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n}}))
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.active -= 1
        return resp


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _run(trace, **kw):
    server = StandIn(**{k: kw.pop(k) for k in ("max_model_len", "token_delay") if k in kw})
    url = await server.start()
    try:
        runner = LoadRunner(trace, LoadConfig(url=url, **kw))
        t = time.monotonic()
        meta = await runner.run()
        meta["test_wall_s"] = time.monotonic() - t
    finally:
        await server.stop()
    return server, runner.records, meta


async def test_open_loop_accounts_for_every_request():
    # 30 requests 40 ms apart, each streaming for ~8 x 20 ms: an open loop overlaps them.
    outs = [8] * 30
    outs[5], outs[9], outs[12] = FAIL_429, HANG, MID_ERROR
    trace = [TraceRequest(0.04 * i, 20 + i, o) for i, o in enumerate(outs)]
    server, records, meta = await _run(trace, time_limit=3.0, request_timeout=30.0)
    # The hung request was cut by the 3 s time limit, not the 30 s request timeout (a bound far from both: a loaded
    # 2-core CI machine once took 5.07 s over the whole run, probe included).
    assert meta["test_wall_s"] < 15.0
    s = report.summarize(records, report.parse_slo("ttft=5s"))
    assert s["sent"] == 30 == s["finished"] + s["errored"]
    assert s["finished"] == 27 and s["errors_by_status"] == {"200": 2, "429": 1}
    assert "busy" in records[5].error and "time limit" in records[9].error
    assert records[12].error == "engine failed" and records[12].ttft is not None
    assert server.max_active >= 3
    assert s["dispatch_lag_ms"]["p50"] < 50
    assert all(r.output_tokens == 8 and len(r.itl) == 7 for r in records if r.ok)
    assert s["output_tokens"] == 27 * 8 and s["output_tokens_short"] == 0
    assert s["goodput"] == pytest.approx(27 / 30)
    assert meta["model"] == "standin" and meta["planned"] == 30


async def test_prompts_are_token_ids_from_the_servers_vocab_with_shared_prefixes():
    trace = rag(50.0, 12, num_docs=2, doc_tokens=512, question_tokens=24, output_tokens=3, hit_rate=1.0, seed=1)
    server, records, _ = await _run(trace, token_delay=0.0)
    assert all(r.ok for r in records)
    alphabet = set(PROBE_TEXT.encode())
    by_doc: dict[int, list[list[int]]] = {}
    for body in server.bodies:
        p = body["prompt"]
        assert len(p) == 512 + 24 and set(p) <= alphabet
        assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        by_doc.setdefault(tuple(p[:512]), []).append(p)
    assert len(by_doc) == len({tr.hash_ids for tr in trace}) <= 2
    questions = [tuple(p[512:]) for p in (b["prompt"] for b in server.bodies)]
    assert len(set(questions)) == len(questions)


async def test_context_clamp_and_chat_text_prompts():
    trace = [TraceRequest(0.0, 150, 30), TraceRequest(0.01, 40, 4)]
    server, records, meta = await _run(trace, max_model_len=100, endpoint="chat", token_delay=0.0)
    assert meta["max_model_len"] == 100
    long, short = sorted(records, key=lambda r: -r.trace_input_tokens)
    assert long.clamped and long.input_tokens + long.max_tokens <= 100 and long.max_tokens == 30
    assert not short.clamped and short.ok and short.output_tokens == 4 and len(short.itl) == 3
    assert all("messages" in b and isinstance(b["messages"][0]["content"], str) for b in server.bodies)
    assert report.summarize(records)["clamped"] == 1


async def test_text_prompts_are_made_before_the_clock_starts():
    """--prompt-mode text: every prompt's /detokenize comes before the first completion, so the server under test
    sees the run's completions alone, each with a text prompt of its request's length (a byte per token here)."""
    trace = rag(50.0, 12, num_docs=2, doc_tokens=64, question_tokens=8, output_tokens=2, hit_rate=1.0, seed=1)
    server, records, _ = await _run(trace, token_delay=0.0, prompt_mode="text")
    assert all(r.ok for r in records)
    assert server.calls == ["detokenize"] * 12 + ["completion"] * 12
    assert sorted(len(b["prompt"]) for b in server.bodies) == sorted(r.input_tokens for r in records)


async def test_token_id_bodies_are_encoded_before_the_clock_starts():
    """A review found token-id prompts made and JSON-encoded at send time, on the loop that times every stream."""
    trace = rag(50.0, 6, num_docs=2, doc_tokens=64, question_tokens=8, output_tokens=2, hit_rate=1.0, seed=1)
    server = StandIn()
    url = await server.start()
    try:
        runner = LoadRunner(trace, LoadConfig(url=url))
        async with aiohttp.ClientSession() as session:
            runner.info = await probe(session, runner.cfg)
            made = await runner._prepare(session, [(i, tr, tr, False) for i, tr in enumerate(trace)])
    finally:
        await server.stop()
    assert sorted(made) == list(range(len(trace))) and server.calls == []  # (the ids need no server)
    bodies = [json.loads(made[i][1]) for i in range(len(trace))]
    assert [(len(b["prompt"]), b["max_tokens"]) for b in bodies] == [(tr.input_tokens, 2) for tr in trace]


def test_fit_to_context():
    assert fit_to_context(TraceRequest(0, 10, 10), None) == (TraceRequest(0, 10, 10), False)
    assert fit_to_context(TraceRequest(0, 10, 10), 20)[1] is False
    r, clamped = fit_to_context(TraceRequest(0, 10_000, 5_000, (1, 2)), 4096)
    assert clamped and r.input_tokens + r.output_tokens <= 4096 and r.output_tokens == 2048 and r.hash_ids == (1, 2)


def _rec(i, ttft_ms, e2e_ms, out, status=200, error=None):
    r = RequestRecord(index=i, scheduled=float(i), input_tokens=100, max_tokens=out, trace_input_tokens=100,
                      trace_output_tokens=out, sent=float(i), status=status, error=error)
    if status == 200 and error is None:
        r.ttft, r.e2e, r.output_tokens = ttft_ms / 1e3, e2e_ms / 1e3, out
        r.itl = [(e2e_ms - ttft_ms) / 1e3 / (out - 1)] * (out - 1)
    return r


def test_summary_percentiles_throughput_goodput():
    # 100 ok requests: TTFT 1..100 ms, 11 output tokens, TPOT = 10 ms for the first 50, 40 ms after
    recs = [_rec(i, i + 1, i + 1 + (100 if i < 50 else 400), 11) for i in range(100)]
    recs.append(_rec(100, 0, 0, 11, status=503, error="down"))
    recs.append(_rec(101, 0, 0, 11, status=0, error="ClientConnectorError"))
    s = report.summarize(recs, report.parse_slo("ttft=80ms,tpot=30ms"))
    assert s["sent"] == 102 and s["finished"] == 100 and s["errored"] == 2
    assert s["ttft_ms"]["p50"] == pytest.approx(50.5) and s["ttft_ms"]["p99"] == pytest.approx(99.01)
    assert s["ttft_ms"]["max"] == pytest.approx(100.0) and s["ttft_ms"]["n"] == 100
    assert s["tpot_ms"]["p50"] == pytest.approx(25.0) and s["tpot_ms"]["p90"] == pytest.approx(40.0)
    assert s["itl_ms"]["n"] == 1000 and s["itl_ms"]["mean"] == pytest.approx(25.0)
    duration = (99 + 0.1 + 0.4) - 0  # last ok ends at sent 99 + e2e 0.5 s
    assert s["duration_s"] == pytest.approx(duration)
    assert s["request_throughput"] == pytest.approx(100 / duration)
    assert s["output_tok_s"] == pytest.approx(1100 / duration)
    assert s["total_tok_s"] == pytest.approx((1100 + 100 * 100) / duration)
    assert s["goodput"] == pytest.approx(50 / 102)  # TTFT <= 80 and TPOT <= 30: requests 0..49
    assert s["errors_by_status"] == {"0": 1, "503": 1}
    assert report.summarize([], {})["sent"] == 0


def test_parse_slo():
    assert report.parse_slo("ttft=120ms,tpot=30ms") == {"ttft": pytest.approx(0.12), "tpot": pytest.approx(0.03)}
    assert report.parse_slo("e2e=2s, itl=500") == {"e2e": 2.0, "itl": pytest.approx(0.5)}
    assert report.parse_slo("") == {}
    with pytest.raises(ValueError):
        report.parse_slo("latency=3")


def test_compare_two_reports(tmp_path, capsys):
    a = [_rec(i, 100, 300, 5) for i in range(10)]
    b = [_rec(i, 200, 400, 5) for i in range(10)]
    pa = report.write_report(tmp_path / "a", {"model": "m"}, report.summarize(a), a)
    pb = report.write_report(tmp_path / "b", {"model": "m"}, report.summarize(b), b)
    assert len(report.load_records(tmp_path / "a" / "records.jsonl")) == 10
    rows = {label: (va, vb, ratio) for label, va, vb, ratio in
            report.compare(json.loads(pa.read_text()), json.loads(pb.read_text()))}
    assert rows["TTFT p50 ms"] == (pytest.approx(100), pytest.approx(200), pytest.approx(2.0))
    assert rows["sent"][2] == 1.0
    assert cli.main(["compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 ms" in out and "2.00x" in out


def test_cli_trace_building():
    args = cli.build_parser().parse_args(["--url", "http://127.0.0.1:1", "--out", "x", "--trace",
                                          "burstgpt-3", "--start", "100",
                                          "--duration", "2000", "--max-requests", "10", "--max-input-tokens", "64"])
    reqs = cli.make_trace(args)
    full = load_trace(str(TRACES / "BurstGPT_3_first400.csv"))
    inside = [r for r in full if 100 <= r.arrival < 2100][:10]
    assert len(reqs) == 10 and reqs[0].arrival == 0.0
    assert [r.output_tokens for r in reqs] == [r.output_tokens for r in inside]
    assert all(r.input_tokens == min(64, f.input_tokens) for r, f in zip(reqs, inside))
    args = cli.build_parser().parse_args(["--url", "u", "--out", "x", "--num-requests", "7", "--input-tokens",
                                          "8:16", "--burstiness", "0.5"])
    syn = cli.make_trace(args)
    assert len(syn) == 7 and all(8 <= r.input_tokens <= 16 for r in syn)
    args = cli.build_parser().parse_args(["--url", "u", "--out", "x", "--trace", "burstgpt-33"])
    with pytest.raises(SystemExit, match="shipped traces: azure-code"):
        cli.make_trace(args)


def test_replay_against_the_stack(stack, tmp_path):
    """A short BurstGPT replay (30 requests squeezed into ~4 s, lengths capped for the tiny model)."""
    out = tmp_path / "run"
    rc = cli.main(["--url", stack.base_url, "--trace", str(TRACES / "BurstGPT_3_first400.replay.jsonl"),
                   "--max-requests", "30", "--speedup", "1000", "--max-input-tokens", "48",
                   "--max-output-tokens", "6", "--time-limit", "120", "--slo", "ttft=30s", "--no-progress",
                   "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    s, meta = rep["summary"], rep["meta"]
    assert s["sent"] == 30 == s["finished"] + s["errored"]
    assert s["finished"] == 30, s["error_kinds"]
    assert meta["model"] == "tiny" and meta["tokenizer_probe"] and meta["max_model_len"]
    recs = report.load_records(out / "records.jsonl")
    assert all(r.output_tokens == r.max_tokens and r.prompt_tokens == r.input_tokens for r in recs)
    assert s["ttft_ms"]["n"] == 30 and s["output_tok_s"] > 0
    assert (out / "timeline.png").stat().st_size > 0 and (out / "cdf.png").stat().st_size > 0


def test_a_replay_shared_by_client_processes_sends_the_same_requests(stack, tmp_path):
    """--client-procs 3: the trace dealt round-robin to three processes started together; every request once, with
    the prompt and the send time it has in a one-process run (the prompts: the server counts the same tokens)."""
    runs = {}
    for procs in (1, 3):
        out = tmp_path / f"p{procs}"
        assert cli.main(["--url", stack.base_url, "--trace", "rag", "--rate", "40", "--num-requests", "10",
                         "--num-docs", "2", "--doc-tokens", "64", "--question-tokens", "4:12", "--output-tokens", "3",
                         "--client-procs", str(procs), "--time-limit", "120", "--no-progress", "--no-plots",
                         "--salt", "3", "--out", str(out)]) == 0
        runs[procs] = (report.load_records(out / "records.jsonl"), json.loads((out / "report.json").read_text()))
    (one, _), (three, rep) = runs[1], runs[3]
    assert [r.index for r in three] == list(range(10)) and all(r.ok for r in three)
    assert [r.prompt_tokens for r in three] == [r.prompt_tokens for r in one]
    assert [r.scheduled for r in three] == [r.scheduled for r in one]  # the trace's arrivals, from one start
    assert max(r.sent - r.scheduled for r in three) < 5.0  # (each process started on time: within seconds)
    assert rep["meta"]["client_procs"] == 3 and rep["meta"]["planned"] == 10 and rep["summary"]["finished"] == 10


def test_cli_fails_cleanly_without_a_server(tmp_path, capsys):
    from tests.stack import free_port

    for procs in ("1", "2"):  # (with two processes each finds no server; the run ends at once all the same)
        rc = cli.main(["--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "3", "--no-progress",
                       "--client-procs", procs, "--out", str(tmp_path / "x")])
        assert rc == 2 and "failed before the run" in capsys.readouterr().err


def test_429_and_other_http_errors_are_rejections_and_goodput_misses():
    recs = [_rec(0, 10, 50, 5), _rec(1, 10, 50, 5, status=429, error="busy"), _rec(2, 10, 50, 5, status=503, error="x"),
            _rec(3, 0, 0, 5, status=0, error="ClientConnectorError"), _rec(4, 0, 0, 5, status=200, error="stream")]
    s = report.summarize(recs, report.parse_slo("ttft=1s"))
    assert s["rejected"] == 2 and s["errored"] == 4 and s["goodput"] == pytest.approx(1 / 5)
    assert dict(report._rows(s))["rejected"] == 2


# ----------------------------------------------------------------------------------- bad input, no server

FILE = "<a file>"  # stands for a regular file in tmp_path


@pytest.mark.parametrize("flags, says", [
    (["--slo=ttft=abc"], "--slo: bad term"), (["--slo=ttft=1.2.3ms"], "--slo: bad term"),
    (["--slo=ttft=1ms,ttft=2ms"], "ttft is given twice"), (["--slo=ttft=0"], "finite time > 0"),
    (["--slo=ttft=" + "9" * 400 + "s"], "finite time > 0"),
    (["--max-connections", "0"], "--max-connections"), (["--client-procs", "0"], "--client-procs"),
    (["--client-procs", "65"], "at most 64"), (["--input-tokens", "0:0"], "--input-tokens"),
    (["--output-tokens", "5:3"], "LO <= HI"), (["--max-input-tokens", "0"], "--max-input-tokens"),
    (["--max-requests", "-1"], "--max-requests"), (["--duration", "nan"], "--duration"), (["--start", "-5"], "--start"),
    (["--start", "1e9"], "selects no request"), (["--request-timeout", "0"], "--request-timeout"),
    (["--time-limit", "nan"], "--time-limit"), (["--rate", "1e-300"], "more than 1e+11"),
    (["--speedup", "1e-9"], "more than 7 days"), (["--rate", "1e-320"], "would span inf s"),
    (["--num-docs", "3"], "--num-docs does not apply to --trace synthetic"),
    (["--url", "127.0.0.1:8123"], "must be http(s)://HOST[:PORT]"), (["--url", "http://[::1"], "must be http(s)://"),
    (["--url", "http://127.0.0.1:99999"], "must be http(s)://"), (["--out", FILE], "cannot write files there"),
    (["--out", ""], "--out is empty"),
    (["sweep", "--rates", "5,,6"], "--rates"), (["sweep", "--rates", "inf"], "--rates"),
    (["sweep", "--rates", "5", "--seeds", "1000"], "--seeds"), (["sweep", "--rates", "1e-300"], "more than 1e+11"),
    (["sweep", "--rates", "5", "--warmup-requests", "9"], "more than --num-requests 3"),
    (["sweep", "--rates", "5", "--out", FILE], "cannot write files there"),
])
def test_bad_flags_are_one_line_errors_before_the_run(flags, says, tmp_path, capsys):
    """Each is refused before any request (the URL refuses connections: reaching it would say so instead)."""
    (tmp_path / "f").write_text("x")
    flags = [str(tmp_path / "f") if f == FILE else f for f in flags]
    sub = flags[:1] if flags[0] == "sweep" else []
    argv = [*sub, "--url", "http://127.0.0.1:1", "--no-progress", "--no-plots", "--out", str(tmp_path / "o"),
            "--num-requests", "3", "--input-tokens" if not sub else "--output-tokens", "16", *flags[len(sub):]]
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's usage and error
        rc = exc.code
    assert rc == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_python_m_loadtest_gives_the_same_one_line_error():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "loadtest", "--url", "http://127.0.0.1:1", "--out", "x",
                          "--slo=ttft=abc"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.splitlines() == ["laneserve loadtest: error: --slo: bad term 'ttft=abc'; "
                                                                "expected e.g. ttft=120ms,tpot=30ms"]


@pytest.mark.parametrize("text, says", [
    ("[]", 'no "summary" object'), ('{"summary": 5}', 'no "summary" object'), ('{"summary": {}}', "summary.sent"),
    ('{"kind": "laneserve-sweep"}', '"slo_ms"'), ("<html>", "not JSON"),
])
def test_compare_refuses_files_of_the_wrong_shape(text, says, tmp_path, capsys):
    good = report.write_report(tmp_path / "r", {"model": "m"}, report.summarize([_rec(0, 1, 2, 3)]), [])
    (tmp_path / "bad.json").write_text(text)
    assert cli.main(["compare", str(tmp_path / "bad.json"), str(good)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"laneserve loadtest compare: error: {tmp_path / 'bad.json'}: ")
    assert says in err[0]


class NotOpenAI:
    """A server on loopback that is not quite OpenAI-compatible, one way per first path segment (the --url's path)."""

    MODELS = {"list": [], "noid": {"data": [{"object": "model"}]}, "dictdata": {"data": {"id": "x"}},
              "neglen": {"data": [{"id": "m", "max_model_len": -5}]}}

    async def handle(self, request):
        way, _, rest = request.path.lstrip("/").partition("/")
        if way == "silent":
            await self.release.wait()
        if way == "html404":
            return web.Response(status=404, text="<html>\n<body>\n<p>not here</p>\n</body>\n</html>",
                                content_type="text/html")
        if way == "html200":
            return web.Response(text="<html><body>hello</body></html>", content_type="text/html")
        if rest == "v1/models":
            return web.json_response(self.MODELS.get(way, {"data": [{"id": "m", "max_model_len": 512}]}))
        if rest == "tokenize":
            return web.json_response({"tokens": list(range(100))})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if way == "slow":  # one token after 0.2 s of work, with usage
            await asyncio.sleep(0.2)
            await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n'
                             b'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 4}}\n\n'
                             b"data: [DONE]\n\n")
            return resp
        await resp.write(b"data: [1,2]\n\ndata: [DONE]\n\n")  # way "badchunk"
        return resp

    async def __aenter__(self) -> str:
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        await self.runner.cleanup()


async def test_a_server_that_is_not_openai_compatible_is_a_one_line_error(tmp_path, capsys):
    from loadtest import quote_qa

    flags = ["--no-progress", "--no-plots", "--out", str(tmp_path / "o"), "--num-requests", "3", "--input-tokens",
             "16", "--output-tokens", "4", "--request-timeout", "1"]
    expect = {"silent": "/v1/models: no response within 1 s", "html404": "/v1/models: HTTP 404 Not Found",
              "html200": "/v1/models: the reply is not JSON", "list": "not an OpenAI model list",
              "noid": "not an OpenAI model list", "dictdata": "not an OpenAI model list",
              "neglen": "max_model_len -5, not a whole number >= 1"}
    async with NotOpenAI() as url:
        for way, says in expect.items():
            assert await asyncio.to_thread(cli.main, ["--url", f"{url}/{way}", *flags]) == 2, way
            assert says in capsys.readouterr().err.splitlines()[-1], way
        assert await asyncio.to_thread(cli.main, ["--url", f"{url}/ok", "--model", "other", *flags]) == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"--model other: {url}/ok serves m")
        assert await asyncio.to_thread(cli.main, ["sweep", "--url", f"{url}/silent", "--rates", "5", *flags]) == 2
        assert "no response within 1 s" in capsys.readouterr().err.splitlines()[-1]
        # a chunk that is not an OpenAI one: that request's error, of a named kind
        assert await asyncio.to_thread(cli.main, ["--url", f"{url}/badchunk", *flags]) == 1
        assert json.loads((tmp_path / "o" / "report.json").read_text())["summary"]["error_kinds"] == {
            "ValueError: not an OpenAI stream chunk: [1,2]": 3}
        for way, says in (("silent", "no response within 1 s"), ("html404", "HTTP 404 Not Found")):
            capsys.readouterr()
            assert await asyncio.to_thread(quote_qa.main, ["--url", f"{url}/{way}", "--timeout", "1"]) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and says in err[0], err


async def test_a_request_waiting_for_a_connection_has_the_wait_in_its_ttft_and_the_report_says_so():
    trace = [TraceRequest(0.0, 4, 1)] * 3  # three at once, each served in 0.2 s
    async with NotOpenAI() as url:
        for pool, waited in ((1, 2), (3, 0)):
            cfg = LoadConfig(url=f"{url}/slow", max_connections=pool)
            records, _ = await asyncio.to_thread(run_load, trace, cfg)
            s = report.summarize(records)
            assert s["finished"] == 3 and s["pool_waited"] == waited
            assert sorted(r.pool_wait > 0 for r in records) == [False] * (3 - waited) + [True] * waited
            assert all(r.ttft >= r.pool_wait + 0.2 for r in records)  # (the wait is in the TTFT)
            assert waited == 0 or max(r.pool_wait for r in records) >= 0.4  # the third waited for two


# ------------------------------------------------------------------------- the trace flags, shared

@pytest.mark.parametrize("flags", [
    ["--trace", "rag", "--rate", "9", "--burstiness", "0.4", "--num-requests", "40", "--num-docs", "3",
     "--doc-tokens", "700", "--question-tokens", "5:50", "--output-tokens", "2:9", "--hit-rate", "0.6", "--seed", "5"],
    ["--trace", "synthetic", "--rate", "3", "--num-requests", "25", "--input-tokens", "10:900", "--output-tokens", "7",
     "--seed", "2"],
    ["--trace", "mooncake-synthetic"],
])
def test_simulate_builds_the_trace_loadtest_builds_for_the_same_flags(flags):
    from batcher.sim import cli as sim_cli

    ours = cli.make_trace(cli.build_parser().parse_args(["--url", "u", "--out", "x", *flags]))
    sims = sim_cli.trace_requests(sim_cli.build_parser().parse_args(flags))
    assert [s.row for s in sims] == ours and [s.salt for s in sims] == list(range(len(ours)))
    limited = sim_cli.trace_requests(sim_cli.build_parser().parse_args([*flags, "--limit", "7", "--speedup", "2"]))
    assert [s.row for s in limited] == ours[:7] and [s.arrival for s in limited] == [r.arrival / 2 for r in ours[:7]]
    if flags[1] == "rag":
        assert len({r.hash_ids for r in ours}) < len(ours)  # the pool is shared


def test_trace_flag_errors(tmp_path):
    from batcher.sim import cli as sim_cli

    unmarked = tmp_path / "t.jsonl"
    unmarked.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                        '{"timestamp": 1500, "input_length": 5, "output_length": 2}\n')
    for parse in (lambda f: cli.build_parser().parse_args(["--url", "u", "--out", "x", *f]),
                  lambda f: sim_cli.build_parser().parse_args(f)):
        with pytest.raises(SystemExit, match="--time-unit s or --time-unit ms"):
            cli.trace_from_args(parse(["--trace", str(unmarked)]))
        assert cli.trace_from_args(parse(["--trace", str(unmarked), "--time-unit", "ms"]))[1].arrival == 1.5
        with pytest.raises(SystemExit, match="for trace files"):
            cli.trace_from_args(parse(["--time-unit", "s"]))
        with pytest.raises(SystemExit, match="--rate, --num-requests do not apply to --trace burstgpt-1"):
            cli.trace_from_args(parse(["--trace", "burstgpt-1", "--rate", "5", "--num-requests", "2"]))
        with pytest.raises(SystemExit, match="--input-tokens does not apply to --trace rag"):
            cli.trace_from_args(parse(["--trace", "rag", "--input-tokens", "5"]))
        with pytest.raises(SystemExit):  # argparse's error: --rate must be a finite number > 0
            parse(["--rate", "0"])
    assert sim_cli.main(["--trace", "synthetic", "--limit", "1000"]) == 2  # one line: set its length with ...


# ------------------------------------------------------------------------------------------ sweeps

def _sweep_run(rate, seed, ttft, tpot, goodput, tput, rejected=0):
    return {"rate": rate, "seed": seed, "metrics": {"ttft_p95_ms": ttft, "tpot_p95_ms": tpot, "goodput_pct": goodput,
                                                   "output_tok_s": tput, "rejected": rejected, "sent": 10,
                                                   "finished": 10 - rejected, "errored": rejected}}


def test_sweep_worst_and_median_seed():
    runs = [_sweep_run(10, 0, 50, 9, 100, 300), _sweep_run(10, 1, 90, 7, 96, 280, 1), _sweep_run(10, 2, 70, 8, 98, 310),
            _sweep_run(20, 0, None, None, 0, 0, 10), _sweep_run(20, 1, 60, 30, 99, 500)]
    r10, r20 = sweep.aggregate(runs)
    assert r10["rate"] == 10 and r10["seeds"] == [0, 1, 2]
    assert r10["ttft_p95_ms"] == {"worst": 90, "worst_seed": 1, "median": 70, "median_seed": 2}
    assert r10["tpot_p95_ms"] == {"worst": 9, "worst_seed": 0, "median": 8, "median_seed": 2}
    assert r10["goodput_pct"] == {"worst": 96, "worst_seed": 1, "median": 98, "median_seed": 2}
    assert r10["output_tok_s"] == {"worst": 280, "worst_seed": 1, "median": 300, "median_seed": 0}
    assert r10["rejected"] == {"worst": 1, "worst_seed": 1, "median": 0, "median_seed": 2}  # ties: seed order
    # two seeds: the median is the better one; a p95 with no finished request is the worst
    assert r20["ttft_p95_ms"] == {"worst": None, "worst_seed": 0, "median": 60, "median_seed": 1}
    assert r20["output_tok_s"] == {"worst": 0, "worst_seed": 0, "median": 500, "median_seed": 1}


def test_sweep_marks_saturation_and_slo_capacity():
    slo = {"ttft": 120.0, "tpot": 30.0}
    runs = []
    # rate: (ttft, tpot, goodput, output tok/s) per seed
    table = {10: [(80, 20, 100, 1000), (90, 22, 99, 1010), (85, 21, 100, 990)],  # inside
             20: [(100, 25, 97, 1950), (119, 29, 95, 1960), (110, 28, 96, 1940)],  # inside (95% and p95s at the edge)
             30: [(110, 25, 99, 2000), (125, 26, 99, 1990), (100, 24, 99, 2010)],  # one seed's TTFT p95 over
             40: [(500, 60, 40, 1945), (600, 70, 30, 1950), (550, 65, 35, 1955)]}  # overloaded, tok/s -3%
    for rate, seeds in table.items():
        runs += [_sweep_run(rate, s, *v) for s, v in enumerate(seeds)]
    rows = sweep.aggregate(runs)
    m = sweep.mark(rows, slo)
    # max median tok/s 2000 (rate 30); rate 40's 1950 is within 3% (>= 1940): the highest such rate is 40
    assert m["max_output_tok_s"] == 2000 and m["saturation_rate"] == 40 and m["saturation_reached"]
    assert m["knee_rate"] == 20  # (1950 >= 1940: the curve is flat from 20 req/s on)
    assert "the lowest such rate, the knee: 20 req/s" in sweep.mark_lines({**m, "slo_ms": slo})[0]
    assert [sweep.holds_slo(r, slo) for r in rows] == [True, True, False, False] and m["slo_capacity_rate"] == 20
    # a curve still rising in proportion to the rate at the top: the saturation rate is only a bound
    assert not sweep.mark(rows[:2], slo)["saturation_reached"]  # 10 -> 20 req/s: 1000 -> 1950 tok/s
    assert sweep.mark(rows[1:3], slo)["saturation_reached"]  # 20 -> 30 req/s: 1950 -> 2000 tok/s
    assert any("NOT reached" in line for line in sweep.mark_lines({**sweep.mark(rows[:2], slo), "slo_ms": slo}))
    # the capacity is the highest rate at and below which the SLO holds: not a rate above one that failed
    lucky = [dict(r, metrics=dict(r["metrics"], ttft_p95_ms=100)) if r["rate"] == 40 else r for r in runs]
    lucky = [dict(r, metrics=dict(r["metrics"], tpot_p95_ms=20, goodput_pct=99)) if r["rate"] == 40 else r
             for r in lucky]
    m = sweep.mark(sweep.aggregate(lucky), slo)
    assert m["slo_capacity_rate"] == 20 and m["slo_holds_above_capacity"] == [40]
    # a rate that left requests of its trace unsent (time limit) does not hold the SLO
    cut = [dict(r, metrics=dict(r["metrics"], unsent=1)) if (r["rate"], r["seed"]) == (20, 2) else r for r in runs]
    assert sweep.mark(sweep.aggregate(cut), slo)["slo_capacity_rate"] == 10
    # goodput 94.9% for one seed, or a TPOT p95 just over: no longer inside
    runs[4]["metrics"]["goodput_pct"] = 94.9
    assert sweep.mark(sweep.aggregate(runs), slo)["slo_capacity_rate"] == 10
    runs[4]["metrics"]["goodput_pct"] = 97
    runs[5]["metrics"]["tpot_p95_ms"] = 30.1
    assert sweep.mark(sweep.aggregate(runs), slo)["slo_capacity_rate"] == 10
    # a rejection-heavy seed: goodput counts the 429s as misses
    runs[0]["metrics"].update(goodput_pct=60.0, rejected=4)
    m = sweep.mark(sweep.aggregate(runs), slo)
    assert m["slo_capacity_rate"] is None  # nothing holds the SLO
    assert m["saturation_rate"] == 40
    # only a TTFT term: TPOT is not checked
    assert sweep.mark(sweep.aggregate(runs[3:]), {"ttft": 120.0})["slo_capacity_rate"] == 20
    # no throughput at all: no saturation rate either
    dead = [_sweep_run(r, 0, None, None, 0.0, 0.0, 10) for r in (1, 2)]
    assert sweep.mark(sweep.aggregate(dead), slo) == {"saturation_rate": None, "knee_rate": None,
                                                      "saturation_reached": False,
                                                      "slo_capacity_rate": None, "slo_holds_above_capacity": [],
                                                      "max_output_tok_s": 0.0}


def test_sweep_plan_warms_the_pool_and_keeps_fresh_documents_apart():
    args = cli.build_sweep_parser().parse_args(["--url", "u", "--out", "x", "--rates", "5,2", "--trace", "rag",
                                                "--num-requests", "30", "--num-docs", "3", "--doc-tokens", "512",
                                                "--hit-rate", "0.5", "--seed", "4"])

    def make(rate, seed):
        return cli.trace_from_args(argparse.Namespace(**{**vars(args), "rate": rate, "seed": seed}))

    warmup, runs = sweep.plan(make, args.rates, args.seed, 2, 5, (3, 512))
    assert [(r, s) for r, s, _ in runs] == [(2, 4), (2, 5), (5, 4), (5, 5)]
    assert [w.hash_ids[0] for w in warmup] == [0, 1, 2, 0, 1]
    assert [(w.arrival, w.input_tokens) for w in warmup] == [(r.arrival, r.input_tokens) for r in make(2, 6)[:5]]
    for rate, seed, trace in runs:
        base = make(rate, seed)
        assert [(r.arrival, r.input_tokens, r.output_tokens) for r in trace] == \
            [(r.arrival, r.input_tokens, r.output_tokens) for r in base]
    fresh = [{r.hash_ids for r in t if r.hash_ids[0] >= 3} for _, _, t in runs]
    assert all(fresh) and all(a.isdisjoint(b) for i, a in enumerate(fresh) for b in fresh[i + 1:])
    with pytest.raises(SystemExit):
        cli.build_sweep_parser().parse_args(["--url", "u", "--out", "x", "--rates", "5,5"])


def test_sweep_over_a_trace_file_replays_a_window_per_seed_at_each_rate(capsys):
    """Issue 19's second shape: seed s replays the s-th window of --window-requests requests of the trace, its
    gaps scaled alike to each rate's mean; the warm-up is the window after the last seed's."""
    p = cli.build_sweep_parser()
    flags = ["--url", "u", "--out", "x", "--rates", "8,2", "--trace", "azure-conv", "--seeds", "2"]
    warmup, runs = cli.plan_sweep(p, p.parse_args([*flags, "--window-requests", "50", "--warmup-requests", "10"]))
    full = traces.load_trace("azure-conv")
    assert [(rate, seed) for rate, seed, _ in runs] == [(2, 0), (2, 1), (8, 0), (8, 1)]
    for rate, seed, trace in runs:
        window = full[seed * 50:(seed + 1) * 50]
        assert [(r.input_tokens, r.output_tokens) for r in trace] == [(r.input_tokens, r.output_tokens)
                                                                       for r in window]
        assert trace[0].arrival == 0 and (len(trace) - 1) / trace[-1].arrival == pytest.approx(rate)
        gaps = [(b.arrival - a.arrival, y.arrival - x.arrival) for a, b, x, y in zip(trace, trace[1:], window,
                                                                                       window[1:])]
        scale = trace[-1].arrival / (window[-1].arrival - window[0].arrival)
        assert all(g == pytest.approx(w * scale) for g, w in gaps)  # the trace's own bursts, at the run's rate
    assert [(r.input_tokens, r.output_tokens) for r in warmup] == [(r.input_tokens, r.output_tokens)
                                                                    for r in full[100:110]]
    for extra, says in [(["--window-requests", "10000"], "fewer than the 20032 that --seed 0, --seeds 2"),
                        (["--window-requests", "5"], "--warmup-requests 32 is more than --window-requests 5"),
                        (["--burstiness", "0.5"], "--burstiness does not apply to --trace azure-conv")]:
        with pytest.raises(SystemExit):
            cli.plan_sweep(p, p.parse_args([*flags, *extra]))
        assert says in capsys.readouterr().err, extra
    rag = p.parse_args(["--url", "u", "--out", "x", "--rates", "2", "--trace", "rag", "--window-requests", "50"])
    with pytest.raises(SystemExit):
        cli.plan_sweep(p, rag)
    assert "--window-requests is for a trace file" in capsys.readouterr().err


def test_compare_two_sweeps(tmp_path, capsys):
    slo = {"ttft": 120.0, "tpot": 30.0}
    runs_a = [_sweep_run(r, s, 50 + r, 10, 100, 100 * r) for r in (1, 2) for s in (0, 1)]
    runs_b = [_sweep_run(r, s, 100 + 10 * r, 20, 99, 90 * r) for r in (1, 2, 3) for s in (0, 1)]
    pa, _ = sweep.write(tmp_path / "a", sweep.build({"model": "m", "trace": "rag"}, runs_a, slo))
    pb, md = sweep.write(tmp_path / "b", sweep.build({"model": "m", "trace": "rag"}, runs_b, slo))
    assert "## 3 req/s" in md.read_text() and "SLO capacity: 2 req/s" in md.read_text()
    plot = tmp_path / "ab.png"
    assert cli.main(["compare", str(pa), str(pb), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "a worst" in out and "b median" in out and "3 req/s" in out and "b: SLO capacity: 2 req/s" in out
    assert plot.stat().st_size > 0
    assert cli.main(["compare", str(pa), str(pb), "--plot", str(tmp_path / "ab")]) == 0  # matplotlib adds .png
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'ab.png'}" and (tmp_path / "ab.png").exists()
    for bad in ("x.bogusext", str(plot / "x.png"), str(tmp_path)):  # refused before the tables
        assert cli.main(["compare", str(pa), str(pb), "--plot", bad]) == 2
        assert capsys.readouterr().out == ""
    rep = report.write_report(tmp_path / "r", {"model": "m"}, report.summarize([_rec(0, 1, 2, 3)]), [])
    with pytest.raises(SystemExit):
        cli.main(["compare", str(pa), str(rep)])


def test_sweep_against_the_stack(stack, tmp_path):
    """2 rates x 2 seeds of a small rag trace on the tiny model, after a warm-up; the marks follow
    their definitions on the measured numbers."""
    out = tmp_path / "sweep"
    rc = cli.main(["sweep", "--url", stack.base_url, "--trace", "rag", "--rates", "16,8", "--seeds", "2",
                   "--seed", "11", "--num-requests", "5", "--num-docs", "2", "--doc-tokens", "512",
                   "--question-tokens", "8:16", "--output-tokens", "3", "--warmup-requests", "2",
                   "--slo", "ttft=20s,tpot=5s", "--time-limit", "120", "--no-progress", "--out", str(out)])
    assert rc == 0
    s = json.loads((out / "sweep.json").read_text())
    assert s["kind"] == "laneserve-sweep" and s["meta"]["model"] == "tiny" and s["meta"]["warmup_requests"] == 2
    assert s["meta"]["rates"] == [8, 16] and s["meta"]["seeds"] == [11, 12] and s["slo_ms"] == {"ttft": 20000.0,
                                                                                             "tpot": 5000.0}
    assert [(r["rate"], r["seed"]) for r in s["runs"]] == [(8, 11), (8, 12), (16, 11), (16, 12)]
    for r in s["runs"]:
        m = r["metrics"]
        assert m["sent"] == 5 == m["finished"] and m["rejected"] == 0 and m["output_tok_s"] > 0
        assert json.loads((out / r["dir"] / "report.json").read_text())["summary"]["sent"] == 5
    assert [row["rate"] for row in s["rates"]] == [8, 16]
    for row in s["rates"]:
        mine = [r["metrics"] for r in s["runs"] if r["rate"] == row["rate"]]
        for key, _, higher_is_worse in sweep.METRICS:
            values = [m[key] for m in mine]
            assert row[key]["worst"] == (max if higher_is_worse else min)(values)
            assert row[key]["median"] == (min if higher_is_worse else max)(values)  # two seeds: the better one
        assert row["holds_slo"] == (max(m["ttft_p95_ms"] for m in mine) <= 20000 and
                                    max(m["tpot_p95_ms"] for m in mine) <= 5000 and
                                    min(m["goodput_pct"] for m in mine) >= 95)
    tput = {row["rate"]: row["output_tok_s"]["median"] for row in s["rates"]}
    assert s["saturation_rate"] == max(r for r, v in tput.items() if v >= 0.97 * max(tput.values()))
    inside = [row["rate"] for row in s["rates"] if row["holds_slo"]]
    assert s["slo_capacity_rate"] == (inside[-1] if inside == [8, 16][:len(inside)] and inside else None)
    assert "## 16 req/s" in (out / "sweep.md").read_text() and (out / "sweep.png").stat().st_size > 0
