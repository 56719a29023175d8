"""`laneserve` command line: serve | gateway | batcher | worker | simulate | loadtest | bench.

Component sub-commands build their config from flags and LANESERVE_* env vars and
run that one component (what Compose runs); `serve` starts them all. Tool
sub-commands hand their argv to the tool's own main(). Imports stay lazy so the
gateway and the batcher never load torch.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys

from laneserve import gcheap
from laneserve.config import add_arguments, from_args

TOOLS = {
    "simulate": ("batcher.sim.cli", "replay a trace through the scheduler in simulated time"),
    "loadtest": ("loadtest.cli", "open-loop replay of a trace against an OpenAI-compatible URL"),
    "bench": ("workers.tools.bench", "GPU/CPU decode benchmarks (tok/s, roofline, HF baseline)"),
    "calibrate-kv": ("workers.tools.calibrate", "int8 KV cache scales from a corpus"),
}


# vLLM flags with no laneserve setting of the same meaning: why (docs/from-vllm.md); any other unknown flag gets
# the nearest laneserve flag's name
VLLM_ONLY = {
    "--block-size": "KV blocks are 16 tokens, fixed",
    "--enable-chunked-prefill": "prefills are always chunked (--max-num-batched-tokens per step)",
    "--no-enable-chunked-prefill": "prefills are always chunked (--max-num-batched-tokens per step)",
    "--trust-remote-code": "only Llama, Mistral and Qwen2 architectures load, no remote code",
    "--swap-space": "preemption recomputes; there is no CPU swap",
    "--pipeline-parallel-size": "only tensor parallelism (--tensor-parallel-size)",
    "--quantization": "weights load as stored (GGUF quantizations are dequantized); --kv-cache-dtype int8 for KV",
    "--speculative-config": "--speculative ngram (--prompt-lookup-min/max) or draft (--draft-model DIR), with "
                            "--num-speculative-tokens",
    "--data-parallel-size": "--num-workers N: one worker per GPU (or per --tensor-parallel-size GPUs) behind one "
                            "batcher",
    "-tp": "write --tensor-parallel-size (no short form)",
    "-pp": "only tensor parallelism (--tensor-parallel-size)",
    "-dp": "--num-workers N: one worker per GPU (or per --tensor-parallel-size GPUs) behind one batcher",
    "--uvicorn-log-level": "the gateway is aiohttp, without access logs; --log-level sets laneserve's own",
    "--revision": "models load from local dirs and GGUF files, never from the hub",
    "--tokenizer-revision": "models load from local dirs and GGUF files, never from the hub",
}
# vLLM flags taken as given: laneserve already does what they ask
VLLM_NO_OPS = {
    "--enable-auto-tool-choice": "tool_choice auto is on whenever --tool-call-parser is set",
    "--disable-log-requests": "laneserve logs no requests",
    "--disable-log-stats": "laneserve logs no periodic stats (/metrics has them)",
}


def _configs():
    from batcher.config import BatcherConfig
    from gateway.config import GatewayConfig
    from workers.config import WorkerConfig

    return GatewayConfig, BatcherConfig, WorkerConfig


def build_parser() -> argparse.ArgumentParser:
    from laneserve.launcher import LauncherConfig

    gateway_cfg, batcher_cfg, worker_cfg = _configs()
    # allow_abbrev off: a prefix of a flag (vLLM's --disable-log-req, say) is an unknown flag, not that flag
    parser = argparse.ArgumentParser(prog="laneserve", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--log-level", default=os.environ.get("LANESERVE_LOG_LEVEL", "INFO"),
                        help="DEBUG | INFO | WARNING | ERROR [env LANESERVE_LOG_LEVEL]")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run gateway, batcher and workers (one per GPU, or one CPU worker)",
                           allow_abbrev=False)
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it "
                       "(the same as --model)")
    for flag, why in VLLM_NO_OPS.items():
        serve.add_argument(flag, action="store_true", help=f"accepted for vLLM's command line: {why}")
    for cls in (LauncherConfig, gateway_cfg, batcher_cfg, worker_cfg):
        add_arguments(serve, cls, skip=("worker_id",))
    for name, cls, text in (("gateway", gateway_cfg, "run the HTTP gateway"),
                            ("batcher", batcher_cfg, "run the batcher"),
                            ("worker", worker_cfg, "run one model worker")):
        add_arguments(sub.add_parser(name, help=text, allow_abbrev=False), cls)
    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Tools own their argument parsing (after the global --log-level, if given first).
    level, rest = (argv[1], argv[2:]) if argv[:1] == ["--log-level"] and len(argv) > 2 else (None, argv)
    if rest[:1] and rest[0].startswith("--log-level="):
        level, rest = rest[0].split("=", 1)[1], rest[1:]
    if rest and rest[0] in TOOLS:
        import importlib

        if level is not None:
            _check_log_level(level)
            logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from loadtest.cli import one_line_errors  # a bad value or file: one line, not a traceback

        def run(args: list[str]) -> int:
            return importlib.import_module(TOOLS[rest[0]][0]).main(args) or 0
        return one_line_errors(f"laneserve {rest[0]}", run, rest[1:])
    args = parse_args(argv)
    if args.command == "serve" and any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        print("laneserve: --api-key on the command line is visible to every user (/proc/PID/cmdline); use "
              "LANESERVE_API_KEY or --api-key-file (the gateway gets it by environment either way)", file=sys.stderr)
    _check_log_level(args.log_level)
    try:
        gcheap.enabled()
    except ValueError as exc:
        raise SystemExit(f"laneserve: {exc}") from None
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


def _check_log_level(level: str) -> None:
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise SystemExit(f"--log-level {level!r}: choose DEBUG, INFO, WARNING, ERROR or CRITICAL")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """A component sub-command's flags: an unknown one is a clear error (_unknown_flags), and serve's positional
    MODEL is --model."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise SystemExit(_unknown_flags(parser, args.command, unknown))
    if getattr(args, "model_arg", None):
        if args.model is not None and args.model != args.model_arg:
            raise SystemExit(f"laneserve serve: the model is given twice ({args.model_arg!r} and --model "
                             f"{args.model!r})")
        args.model = args.model_arg
    return args


def _unknown_flags(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """An unknown flag's error: why laneserve has no such setting (a vLLM-only flag), or the nearest one it has."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    lines = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag in VLLM_ONLY:
            lines.append(f"{flag} (vLLM's) is not a laneserve flag: {VLLM_ONLY[flag]}")
        elif not flag.startswith("--"):
            lines.append(f"unexpected argument {arg!r}")
        else:
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.5)
            lines.append(f"unknown flag {flag}" + (f"; the nearest laneserve setting is {near[0]}" if near else ""))
    return f"laneserve {command}: " + "; ".join(lines) + " (laneserve {command} --help; docs/from-vllm.md)".format(
        command=command)


if __name__ == "__main__":
    sys.exit(main())
