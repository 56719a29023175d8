"""The repository stands on its own: no tracked file points at a development machine or outside the clone."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Home and work directories of a development machine. Paths that exist on any Linux host or in the
# images (/tmp, /usr, /etc, /dev, /proc, /var, /opt, /app) are not matched, nor /home/laneserve: the
# images' own user (docker/Dockerfile.*: useradd --home-dir /home/laneserve). The look-behind keeps
# URLs (https://host/work/...) and relative paths (./work, ~/work) out.
ABSOLUTE = re.compile(r"(?<![\w.~-])(/work/|/root/|/Users/\w|/home/(?!laneserve\b)\w|\b[A-Za-z]:\\Users\\)")
# A relative path that climbs (../x). It must land, from the file's own folder, on something in the
# clone (docker/README.md -> ../docs/deploy.md); ../shared/..., ../DESIGN.md and the like do not.
CLIMB = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]+(?:/[\w.-]+)*")


def _climbs_out(path: Path, ref: str) -> bool:
    target = Path(os.path.normpath(path.parent / ref.rstrip(".")))
    return not (target.is_relative_to(REPO) and target.exists())


def offending(path: Path, line: str) -> list[str]:
    found = [m.group(0) for m in ABSOLUTE.finditer(line)]
    return found + [m.group(0) for m in CLIMB.finditer(line) if _climbs_out(path, m.group(0))]


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    return [REPO / n for n in names.decode().split("\0") if n]


def test_no_file_points_at_a_development_machine_or_outside_the_repo():
    me = Path(__file__).resolve()
    hits = []
    for path in tracked_files():
        if path == me or not path.is_file():  # this file's examples; deleted in the work tree, not yet in git
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for no, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if bad := offending(path, line):
                hits.append(f"{path.relative_to(REPO)}:{no}: {', '.join(bad)}: {line.strip()[:160]}")
    assert not hits, "paths of a development machine or outside the repository:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_are_for():
    src = REPO / "loadtest" / "traces.py"
    for bad in ("see /work/.library/device/KINDS.md", "cd /root/src", "/home/alice/x", "/Users/bob/x",
                r"C:\Users\carol\x", "ipc:///work/x.sock", "../shared/traces/a.csv", "Rules (../DESIGN.md).",
                "../../shared/x", "../tests/no_such_file.py"):
        assert offending(src, bad), bad
    for ok in ("ipc:///tmp/laneserve/batcher.sock", "/usr/local/bin/x", "WORKDIR /home/laneserve", "/app/x",
               "./work/x", "~/work/x", "https://example.com/work/x", "see ../tests/test_traces.py.", "a.../b"):
        assert not offending(src, ok), ok
    assert not offending(REPO / "docker" / "README.md", "[docs/deploy.md](../docs/deploy.md)")
    assert offending(REPO / "README.md", "[notes](../docs/deploy.md)")  # from the root that leaves the clone
