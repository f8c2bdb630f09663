"""The docs' examples run as printed: every ```bash block of README.md or docs/*.md right after a
``<!-- ci: run -->`` line (``<!-- ci: run, output -->``: the plain ``` block after it is its exact stdout) runs in
bash with ``-euo pipefail``, in a fresh directory, from this checkout's environment; it must exit
0, print no traceback, and print every whole-line ``# `` comment of the block (the expected
output some blocks show inline). A block that uses fixed ports is skipped while one of them is
taken (another run of the same example on this machine). Its processes run in their own session
and are all stopped afterwards, whatever happened."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "<!-- ci: run -->"
RUN_WITH_OUTPUT = "<!-- ci: run, output -->"
BLOCK_TIMEOUT_S = 600  # the A/B and the hand-started fleet take minutes on a busy machine

pytestmark = pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)


def runnable_blocks(text: str, name: str = "README.md") -> list[tuple[int, str, str | None]]:
    """``(line number, bash source, expected stdout or None)`` per marked block of ``text`` (the
    file ``name``); raises ``ValueError`` for a mark not followed by a ```bash block."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() not in (RUN, RUN_WITH_OUTPUT):
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
            raise ValueError(f"{name}:{i + 1}: {line.strip()} is not followed by ```bash")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        expected = None
        if line.strip() == RUN_WITH_OUTPUT:
            if lines[end + 1].strip() != "```":
                raise ValueError(f"{name}:{end + 2}: the expected output block is missing")
            close = next(j for j in range(end + 2, len(lines)) if lines[j].startswith("```"))
            expected = "\n".join(lines[end + 2 : close])
        out.append((i + 2, "\n".join(lines[i + 2 : end]), expected))
    return out


# (file:line, bash source, expected stdout or None) per marked block, README first
BLOCKS = [
    (f"{path.relative_to(ROOT)}:{line}", source, expected)
    for path in DOCS
    for line, source, expected in runnable_blocks(path.read_text(), str(path.relative_to(ROOT)))
]


def fixed_ports(source: str) -> set[int]:
    """Ports a block binds: every 4-digit number from 5000 up, and the next one (the examples
    number replica ``i``'s ports ``N + i``)."""
    numbers = {int(n) for n in re.findall(r"(?<![\w.-])(\d{4})(?![\w.])", source)}
    return {p for n in numbers if n >= 5000 for p in (n, n + 1)}


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_docs_mark_their_examples() -> None:
    assert len(BLOCKS) >= 4  # hashes, the fleet by hand, the audit, the A/B


@pytest.mark.parametrize(
    ("where", "source", "expected"), BLOCKS, ids=[where for where, _, _ in BLOCKS]
)
def test_readme_block_runs_as_printed(
    where: str, source: str, expected: str | None, tmp_path: Path
) -> None:
    taken = sorted(p for p in fixed_ports(source) if port_taken(p))
    if taken:
        pytest.skip(f"ports {taken} in use on this machine")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", source],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {BLOCK_TIMEOUT_S} s"
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the block left running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    report = f"{where}\n--- stdout:\n{out[-3000:]}\n--- stderr:\n{err[-3000:]}"
    assert proc.returncode == 0, report
    assert "Traceback" not in out + err, report
    for comment in (ln[2:] for ln in source.splitlines() if ln.startswith("# ")):
        assert comment in out, f"{comment!r} not printed; {report}"
    if expected is not None:
        assert out.strip() == expected.strip(), report
