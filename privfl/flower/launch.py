"""``privfl-flower-run``: Flower's ``flwr run ... --stream`` for a coordinator, exiting non-zero when the run failed.

Flower 1.41's ``flwr run --stream`` exits 0 even when the ServerApp raised (a SuperNode lost mid-round, a refused
configuration): the failure is only in the stream, as Flower's ``Exit Code: <code>`` block. A script or CI job that
starts a federation needs the failure in its exit status, so this launcher runs ``flwr run`` unchanged (its own
arguments pass through), echoes the stream, and exits with

- Flower's exit code when the stream reports an error (``Exit Code: N``, N >= 100; 201: the ServerApp raised);
- ``flwr``'s own status when it fails itself;
- 1 when ``--expect-result PATH`` is given and the ServerApp wrote no result there;
- 0 otherwise.

Usage: ``privfl-flower-run APP_DIR [CONNECTION] [flwr run options...] [--expect-result PATH]`` (or
``python -m privfl.flower.launch ...``). Nothing of Flower is patched: this is a wrapper around its public CLI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

_EXIT = re.compile(r"Exit Code:\s*(\d+)")


def run(argv: list[str], out=None) -> int:
    """Run ``flwr run`` with ``argv`` (``--stream`` added if missing) and return the exit status described in the
    module docstring; the stream goes to ``out`` (default stdout)."""
    out = out or sys.stdout
    argv = list(argv)
    expect = None
    if "--expect-result" in argv:
        at = argv.index("--expect-result")
        if at + 1 >= len(argv):
            print("privfl-flower-run: error: --expect-result needs a path", file=sys.stderr)
            return 2
        expect = argv[at + 1]
        del argv[at:at + 2]
    if not argv:
        print("privfl-flower-run: error: give the app folder (and the SuperLink connection), as to flwr run",
              file=sys.stderr)
        return 2
    if "--stream" not in argv:
        argv.append("--stream")
    flwr = shutil.which("flwr", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if flwr is None:
        print("privfl-flower-run: error: Flower's flwr command is not installed (pip install 'privfl[flower]')",
              file=sys.stderr)
        return 2
    code = 0
    with subprocess.Popen([flwr, "run", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        for line in proc.stdout:
            out.write(line)
            out.flush()
            match = _EXIT.search(line)
            if match and int(match.group(1)) >= 100:
                code = code or int(match.group(1))
    if proc.returncode:
        return proc.returncode
    if code:
        print(f"privfl-flower-run: the run failed (Flower exit code {code})", file=sys.stderr)
        return code if code < 256 else 1
    if expect is not None and not os.path.exists(expect):
        print(f"privfl-flower-run: the ServerApp wrote no result at {expect}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
