"""`laneserve` command line: serve | gateway | batcher | worker | simulate | loadtest | bench.

Component sub-commands build their config from flags and LANESERVE_* env vars and
run that one component (what Compose runs); `serve` starts them all. Tool
sub-commands hand their argv to the tool's own main(). Imports stay lazy so the
gateway and the batcher never load torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from laneserve.config import add_arguments, from_args

TOOLS = {
    "simulate": ("batcher.sim.cli", "replay a trace through the scheduler in simulated time"),
    "loadtest": ("loadtest.cli", "open-loop replay of a trace against an OpenAI-compatible URL"),
    "bench": ("workers.tools.bench", "GPU/CPU decode benchmarks (tok/s, roofline, HF baseline)"),
    "calibrate-kv": ("workers.tools.calibrate", "int8 KV cache scales from a corpus"),
}


def _configs():
    from batcher.config import BatcherConfig
    from gateway.config import GatewayConfig
    from workers.config import WorkerConfig

    return GatewayConfig, BatcherConfig, WorkerConfig


def build_parser() -> argparse.ArgumentParser:
    from laneserve.launcher import LauncherConfig

    gateway_cfg, batcher_cfg, worker_cfg = _configs()
    parser = argparse.ArgumentParser(prog="laneserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("LANESERVE_LOG_LEVEL", "INFO"),
                        help="DEBUG | INFO | WARNING | ERROR [env LANESERVE_LOG_LEVEL]")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run gateway, batcher and workers (one per GPU, or one CPU worker)")
    for cls in (LauncherConfig, gateway_cfg, batcher_cfg, worker_cfg):
        add_arguments(serve, cls, skip=("worker_id",))
    for name, cls, text in (("gateway", gateway_cfg, "run the HTTP gateway"),
                            ("batcher", batcher_cfg, "run the batcher"),
                            ("worker", worker_cfg, "run one model worker")):
        add_arguments(sub.add_parser(name, help=text), cls)
    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Tools own their argument parsing.
    if argv and argv[0] in TOOLS:
        import importlib

        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gateway_cfg, batcher_cfg, worker_cfg = _configs()
    if args.command == "serve":
        from laneserve.launcher import LauncherConfig, serve

        return serve(from_args(LauncherConfig, args), from_args(gateway_cfg, args), from_args(batcher_cfg, args),
                     from_args(worker_cfg, args), log_level=args.log_level)
    if args.command == "gateway":
        from gateway.app import run

        run(from_args(gateway_cfg, args))
    elif args.command == "batcher":
        from batcher.core import run

        run(from_args(batcher_cfg, args))
    elif args.command == "worker":
        from workers.main import run

        run(from_args(worker_cfg, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
