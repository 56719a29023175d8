#!/usr/bin/env python3
"""Print the project's runtime dependencies from pyproject.toml, one per line, minus the excluded ones.

Used by the Dockerfiles so that every image installs exactly what pyproject.toml declares (no second,
drifting list): the gateway image excludes torch (`--exclude torch`), the worker images exclude torch
because their base image or an explicit index already provides the right build. Stdlib only (tomllib),
so it runs in a bare python image before the project is installed.

    python docker/requirements.py [--pyproject PATH] [--exclude NAME ...]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = NAME.match(spec)
    if not match:
        raise ValueError(f"not a requirement: {spec!r}")
    return canonical(match.group(1))


def runtime_requirements(pyproject: str, exclude: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    skip = {canonical(n) for n in exclude}
    unknown = skip - {requirement_name(d) for d in deps}
    if unknown:
        # An exclusion that matches nothing is a typo or a stale Dockerfile: fail the build loudly.
        raise SystemExit(f"--exclude {sorted(unknown)}: not a dependency in {pyproject}")
    return [d for d in deps if requirement_name(d) not in skip]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", default="pyproject.toml")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    print("\n".join(runtime_requirements(args.pyproject, args.exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
