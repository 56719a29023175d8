"""Monitoring (#24): the shipped Grafana dashboard and Prometheus config against a real CPU stack and the Compose file,
the `baseline` profile against the `gpu` profile, and the vLLM meaning of the request-phase metrics (the queue time
includes the batcher's wait).

The dashboard's metric names are taken from its own PromQL, so a renamed series or a typo in a panel fails here rather
than as an empty panel in Grafana.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
import yaml

from batcher.config import BatcherConfig
from gateway.metrics import watch_loop_lag
from laneserve import cli
from laneserve.config import from_args
from tests.test_compose import DOCKER, SHELL_ENV, build_config, entrypoint, environment, load
from workers.config import WorkerConfig

DASHBOARD = json.loads((DOCKER / "monitoring" / "grafana" / "dashboards" / "laneserve.json").read_text())
PROMETHEUS = yaml.safe_load((DOCKER / "monitoring" / "prometheus.yml").read_text())
NAME = re.compile(r"\blaneserve:[A-Za-z_][A-Za-z0-9_]*")
# What the dashboard must show (the issue's list): one series for each
COVERS = {"time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
          "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket", "request_success_total",
          "request_errors_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "prefix_cache_hits_total", "prefix_cache_queries_total", "request_queue_time_seconds_sum",
          "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum", "prompt_tokens_total",
          "generation_tokens_total", "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total",
          "num_slo_shed_total", "num_slo_paused_decodes_total", "iteration_tokens_total_bucket"}


def dashboard_queries() -> list[str]:
    """Every PromQL string of the dashboard: the panels' targets and the template variables' queries."""
    found: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr":
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(DASHBOARD["panels"])
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            found.append(var["query"]["query"])
    return found


def values(exposition: str) -> dict[str, float]:
    """A Prometheus text exposition as series (name{labels}) -> value."""
    pairs = (line.rsplit(" ", 1) for line in exposition.splitlines() if line and not line.startswith("#"))
    return {series: float(value) for series, value in pairs}


async def _request(s: aiohttp.ClientSession, url: str, body: dict) -> int:
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


# ---------------------------------------------------------------- the dashboard on a real stack
def test_dashboard_queries_filter_on_model_name_and_cover_the_issues_list():
    queries = dashboard_queries()
    names = {n.removeprefix("laneserve:") for q in queries for n in NAME.findall(q)}
    assert COVERS <= names, COVERS - names
    for q in queries:
        assert q.count("(") == q.count(")") and q.count("{") == q.count("}") and q.count("[") == q.count("]"), q
        if q.startswith("label_values("):
            continue
        selectors = re.findall(r"\blaneserve:[A-Za-z0-9_]+(\{[^}]*\})?", q)
        assert selectors and all(sel == '{model_name="$model_name"}' for sel in selectors), q
    panels = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in panels)
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


async def test_every_series_the_dashboard_queries_is_served_with_the_model_name_label(stack):
    async with aiohttp.ClientSession() as s:
        ok = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        assert await _request(s, stack.base_url, ok) == 200
        assert await _request(s, stack.base_url, {**ok, "max_tokens": -1}) == 400  # request_errors_total
        async with s.get(stack.url("/metrics")) as r:
            series = values(await r.text())
    names = {n for q in dashboard_queries() for n in NAME.findall(q)}
    assert len(names) >= len(COVERS)
    for name in sorted(names):
        assert any(s.startswith(name + "{") and 'model_name="tiny"' in s for s in series), name


async def test_eager_steps_report_their_host_launch_time(stack):
    """A prompt's step runs eagerly; the worker reports the host time it took to launch it (on the CPU the forward
    itself), at most the step's own time."""
    async with aiohttp.ClientSession() as s:
        ok = {"model": "tiny", "prompt": "a prompt of its own", "max_tokens": 2, "ignore_eos": True}
        assert await _request(s, stack.base_url, ok) == 200
        async with s.get(stack.url("/metrics")) as r:
            value = values(await r.text())
    steps, launch, measured = (value[f'laneserve:{m}_total{{model_name="tiny"}}']
                               for m in ("eager_steps", "eager_step_launch_ms", "eager_step_time_measured_ms"))
    assert steps >= 1 and 0 < launch <= measured


async def test_the_gateway_reports_its_event_loop_lag(stack):
    async with aiohttp.ClientSession() as s, s.get(stack.url("/metrics")) as r:
        value = values(await r.text())
    name = 'laneserve:gateway_event_loop_lag_seconds_{}{{model_name="tiny"}}'
    assert value[name.format("count")] >= 1 and value[name.format("sum")] >= 0


async def test_the_loop_lag_watch_sees_a_stalled_loop():
    stalls = asyncio.Event()
    seen: list[float] = []

    def observe(lag: float) -> None:
        seen.append(lag)
        if lag >= 0.05:
            stalls.set()

    watch = asyncio.create_task(watch_loop_lag(observe, tick=0.001))
    await asyncio.sleep(0)  # the watch starts its first timer
    time.sleep(0.06)  # the stall it must see: the loop blocked for 60 ms
    await asyncio.wait_for(stalls.wait(), 10)
    watch.cancel()
    assert max(seen) >= 0.05


# ---------------------------------------------------------------- what the request phases mean
async def test_queue_time_includes_the_batchers_wait(make_stack):
    """One sequence at a time: B, sent while A streams, waits in the batcher until A is done. vLLM's queue time (arrival
    to first scheduled) must hold that wait; prefill (scheduled to first token) must not."""
    st = make_stack("--max-num-seqs", "1")
    long = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    short = {"model": "tiny", "prompt": "bye", "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        b = None
        async with s.post(st.url("/v1/completions"), json=long) as r:
            assert r.status == 200
            async for line in r.content:
                if b is None and line.startswith(b"data: {"):  # A runs: B must wait for it
                    sent = time.monotonic()
                    b = asyncio.create_task(_request(s, st.base_url, short))
        a_done = time.monotonic()
        assert await b == 200
        async with s.get(st.url("/metrics")) as r:
            text = await r.text()
    value = values(text)

    def total(metric: str) -> float:
        return value[f'laneserve:{metric}_sum{{model_name="tiny"}}']

    waited = a_done - sent  # B's wait, as the client saw it (A's remaining tokens)
    assert waited > 0.2
    queue, prefill, decode = (total(f"request_{p}_time_seconds") for p in ("queue", "prefill", "decode"))
    # (ms if the wait were not counted; the client's figure also holds B's connect and A's stream relayed late)
    assert queue >= 0.5 * waited and queue > 0.2, (queue, waited)
    assert prefill < 0.5 * queue
    # vLLM's phases add up: queue + prefill + decode = queue + inference = e2e, request by request
    e2e, inference = total("e2e_request_latency_seconds"), total("request_inference_time_seconds")
    assert queue + prefill + decode == pytest.approx(e2e, abs=1e-3)
    assert queue + inference == pytest.approx(e2e, abs=1e-3)
    assert value['laneserve:request_queue_time_seconds_count{model_name="tiny"}'] == 2
    # tokens per step: one request per step here, so a step per token sampled; its tokens are the prompt (the first
    # step) or one (the others). Steps of no tokens (only telling the worker who finished) are not counted.
    generated = long["max_tokens"] + short["max_tokens"]
    steps = value['laneserve:iteration_tokens_total_count{model_name="tiny"}']
    assert steps == generated <= value['laneserve:engine_steps_total{model_name="tiny"}']
    prompt = value['laneserve:prompt_tokens_total{model_name="tiny"}']
    assert value['laneserve:iteration_tokens_total_sum{model_name="tiny"}'] == prompt + generated - 2
    assert value['laneserve:iteration_tokens_total_bucket{le="1.0",model_name="tiny"}'] == generated - 2


# ---------------------------------------------------------------- the monitoring profile
def _mounts(svc: dict) -> dict[str, str]:
    """Container path -> host path (relative to docker/) of a service's bind mounts."""
    out = {}
    for v in svc.get("volumes", []):
        host, container = v.split(":")[:2]
        if host.startswith("./"):
            out[container] = host
    return out


def test_monitoring_profile_scrapes_every_gateway_and_provisions_the_dashboard():
    compose = load("compose.yaml")["services"]
    prom, graf = compose["prometheus"], compose["grafana"]
    assert prom["profiles"] == graf["profiles"] == ["monitoring"]
    for svc in (prom, graf):  # pinned official images
        image, tag = svc["image"].rsplit(":", 1)
        assert image in ("prom/prometheus", "grafana/grafana") and re.fullmatch(r"v?\d+\.\d+\.\d+", tag)
    for container, host in {**_mounts(prom), **_mounts(graf)}.items():
        assert (DOCKER / host).exists(), host
    # Prometheus reads the shipped config and scrapes each gateway replica on the port the gateway listens on
    config = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert _mounts(prom)[config] == "./monitoring/prometheus.yml"
    _, gw = build_config(["gateway"], environment(compose["gateway"]))
    job = next(j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "laneserve")
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["gateway"] and sd["port"] == gw.port and job["metrics_path"] == "/metrics"
    # Grafana: the data source is that Prometheus; the dashboard provider reads the mounted dashboards
    prom_port = int(prom["ports"][0].rsplit(":", 1)[1])
    provisioning = DOCKER / _mounts(graf)["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert ds["url"] == f"http://prometheus:{prom_port}" and ds["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "laneserve.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    assert (DOCKER / _mounts(graf)[folder] / "laneserve.json").is_file()
    home = environment(graf)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{folder}/laneserve.json"


# ---------------------------------------------------------------- the baseline profile
VLLM_ONLY = {"--host", "--port", "--data-parallel-size"}  # vLLM's flags with no laneserve `serve` counterpart


def test_baseline_serves_what_the_gpu_profile_serves():
    """vLLM on the gpu profile's model, GPUs and per-worker limits, on its own port. laneserve takes vLLM's flag
    names, so its own parser reads the baseline's command."""
    env = {**SHELL_ENV, "LANESERVE_MODEL": "/models/m"}
    compose = load("compose.yaml", env=env)["services"]
    vllm = compose["vllm"]
    assert vllm["profiles"] == ["baseline"]
    image, tag = vllm["image"].rsplit(":", 1)
    assert image == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)
    model, *argv = vllm["command"]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert len(flags) * 2 == len(argv)
    ns = cli.parse_args(["serve", model, *[x for k, v in flags.items() if k not in VLLM_ONLY for x in (k, v)]])
    worker, batcher = from_args(WorkerConfig, ns, env={}), from_args(BatcherConfig, ns, env={})
    gpus = []
    for name, svc in compose.items():
        if entrypoint(svc, "compose.yaml") is None:  # a third-party image (this one, Prometheus, ...)
            continue
        command, cfg = build_config(svc["command"], environment(svc))
        if command == "worker" and cfg.device == "cuda":
            gpus += compose[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            assert (cfg.model, cfg.gpu_memory_utilization, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (
                worker.model, worker.gpu_memory_utilization, worker.max_num_seqs, worker.max_num_batched_tokens)
        if command == "batcher":
            assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching) == (
                batcher.max_num_seqs, batcher.max_num_batched_tokens, batcher.enable_prefix_caching)
    assert worker.model == "/models/m" and len(gpus) == 2
    (devices,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert sorted(devices["device_ids"]) == sorted(gpus) and int(flags["--data-parallel-size"]) == len(gpus)
    assert "models:/models:ro" in vllm["volumes"]
    # its own port: the one it listens on, its healthcheck's, published on a host port no other service takes
    (mapping,) = vllm["ports"]
    assert mapping.split(":")[1] == flags["--port"]
    assert f"http://127.0.0.1:{flags['--port']}/health" in " ".join(vllm["healthcheck"]["test"])
    published = [p.split(":")[0] for svc in compose.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)) == 4
