"""``privfl-flower-run``: Flower's ``flwr run ... --stream`` for a coordinator, exiting non-zero when the run failed.

Flower 1.41's ``flwr run --stream`` exits 0 even when the ServerApp raised (a SuperNode lost mid-round, a refused
configuration): the failure is only in the stream, as Flower's ``Exit Code: <code>`` block. A script or CI job that
starts a federation needs the failure in its exit status, so this launcher runs ``flwr run`` unchanged (its own
arguments pass through), echoes the stream, and exits with

- Flower's exit code when the stream reports an error (``Exit Code: N``, N >= 100; 201: the ServerApp raised);
- ``flwr``'s own status when it fails itself;
- 1 when ``--expect-result PATH`` is given and the ServerApp wrote no result there, or ``--result PATH`` is given
  and the stream carried no whole result;
- 2 when the arguments are wrong, e.g. ``--result PATH`` is a folder or in a folder that is missing or cannot be
  written (checked before ``flwr run`` starts);
- 0 otherwise.

**The result through Flower.** The ServerApp writes its result (the run's final global state, history, the
organisations' audits: :func:`privfl.flower.app.read_result`'s format) on the SuperLink's host (``result-path``).
A coordinator on another machine gets it through Flower itself: with ``--result PATH`` the launcher asks the run to
put the result into its log stream too (``--run-config result-in-log=true``; base64 lines of
:data:`RESULT_MARK`, with the byte count and SHA-256 of the whole) and writes it to ``PATH`` once the stream carried all
of it, checked. ``privfl-flower-run --from-log RUN_ID [CONNECTION] --result PATH`` gets it later from the run's stored
log (``flwr log RUN_ID CONNECTION --show``), e.g. after a coordinator's connection dropped. Everything in the result
was already the server's (post-processing of the releases and the public audits).

Usage: ``privfl-flower-run APP_DIR [CONNECTION] [flwr run options...] [--expect-result PATH] [--result PATH]`` (or
``python -m privfl.flower.launch ...``). Nothing of Flower is patched: this is a wrapper around its public CLI.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys

_EXIT = re.compile(r"Exit Code:\s*(\d+)")

#: the word that starts every line of a result in a run's log stream
RESULT_MARK = "privfl-result"
#: the run-config key that asks the ServerApp to log its result (``privfl.flower.app``'s app config has it)
LOG_RESULT_KEY = "result-in-log"
#: base64 characters per logged line of a result
RESULT_LINE = 16384
_HEAD = re.compile(RESULT_MARK + r" begin (\d+) bytes sha256 ([0-9a-f]{64}) in (\d+) lines")
_PART = re.compile(RESULT_MARK + r" (\d+)/(\d+) ([A-Za-z0-9+/=]+)")


def result_lines(data: bytes) -> list[str]:
    """The log lines that carry ``data`` (a result's bytes): a head with its size, digest and line count, then its
    base64 in numbered lines."""
    text = base64.b64encode(data).decode("ascii")
    parts = [text[i:i + RESULT_LINE] for i in range(0, len(text), RESULT_LINE)] or [""]
    head = f"{RESULT_MARK} begin {len(data)} bytes sha256 {hashlib.sha256(data).hexdigest()} in {len(parts)} lines"
    return [head, *(f"{RESULT_MARK} {k + 1}/{len(parts)} {part}" for k, part in enumerate(parts))]


class ResultReader:
    """Collects :func:`result_lines` from a log stream (any other text between them is ignored); the last whole,
    checked result wins (a resumed run logs its own)."""

    def __init__(self):
        self.data: bytes | None = None
        self._head = None
        self._parts: dict[int, str] = {}

    def feed(self, line: str) -> None:
        head = _HEAD.search(line)
        if head:
            self._head, self._parts = (int(head.group(1)), head.group(2), int(head.group(3))), {}
            return
        part = _PART.search(line)
        if part is None or self._head is None or int(part.group(2)) != self._head[2]:
            return
        self._parts[int(part.group(1))] = part.group(3)
        size, digest, count = self._head
        if len(self._parts) == count:
            self._head = None
            try:
                data = base64.b64decode("".join(self._parts[k] for k in range(1, count + 1)), validate=True)
            except (KeyError, ValueError):
                return
            if len(data) == size and hashlib.sha256(data).hexdigest() == digest:
                self.data = data

    def write(self, path: str) -> bool:
        """Write the result to ``path`` (whole or not at all); False when the stream carried none."""
        if self.data is None:
            return False
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self.data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.isfile(tmp):
                os.remove(tmp)
            raise
        return True


def check_result_path(path: str) -> str | None:
    """Why ``--result PATH`` cannot be written (checked before the run starts), or None: a folder, a folder that
    does not exist, or one this process cannot write into (a temporary file is created and removed there: the real
    call, not ``os.access``, which says yes to root for a read-only mount)."""
    import tempfile

    if os.path.isdir(path):
        return f"--result {path} is a folder; give a file name inside it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--result {path}: the folder {folder} does not exist; create it or choose another path"
    try:
        fd, probe = tempfile.mkstemp(prefix=".privfl-write-check-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return f"--result {path}: this process cannot write in {folder} ({exc.strerror or exc}); choose another path"
    return None


def _option(argv: list[str], name: str) -> tuple[str | None, str | None]:
    """Remove ``name VALUE`` from ``argv``; (its value, None), or (None, an error) when the value is missing."""
    if name not in argv:
        return None, None
    at = argv.index(name)
    if at + 1 >= len(argv):
        return None, f"{name} needs a value"
    value = argv[at + 1]
    del argv[at:at + 2]
    return value, None


def _flwr() -> str | None:
    """Flower's ``flwr`` command (beside this Python first), or None after saying how to install it."""
    found = shutil.which("flwr", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        print("privfl-flower-run: error: Flower's flwr command is not installed (pip install 'privfl[flower]')",
              file=sys.stderr)
    return found


def _deliver(reader: ResultReader, path: str, out, missing: str) -> int:
    """Write the result ``reader`` collected to ``path``: 0, 1 (saying ``missing``) when it holds none, or 2 when
    ``path`` could not be written after all."""
    try:
        written = reader.write(path)
    except OSError as exc:
        print(f"privfl-flower-run: error: --result {path} could not be written ({exc.strerror or exc}); the run's "
              "stored log still holds the result: privfl-flower-run --from-log RUN_ID [CONNECTION] --result PATH",
              file=sys.stderr)
        return 2
    if not written:
        print(f"privfl-flower-run: {missing}", file=sys.stderr)
        return 1
    print(f"privfl-flower-run: the run's result is at {path}", file=out)
    return 0


def from_log(argv: list[str], result: str, out=None) -> int:
    """``flwr log RUN_ID [CONNECTION] --show`` (``argv``: its arguments), and the result it carries written to
    ``result``: 0, or 1 when the log holds no whole result, or flwr's own status when it fails."""
    out = out or sys.stdout
    flwr = _flwr()
    if flwr is None:
        return 2
    reader = ResultReader()
    proc = subprocess.run([flwr, "log", *argv, "--show"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace")
    for line in proc.stdout.splitlines():
        reader.feed(line)
    if proc.returncode:
        out.write(proc.stdout[-4000:])
        return proc.returncode
    return _deliver(reader, result, out, f"the log of run {argv[0] if argv else '?'} holds no whole result (was the "
                    "run started with --result, or --run-config result-in-log=true?)")


def run(argv: list[str], out=None) -> int:
    """Run ``flwr run`` with ``argv`` (``--stream`` added if missing) and return the exit status described in the
    module docstring; the stream goes to ``out`` (default stdout)."""
    out = out or sys.stdout
    argv = list(argv)
    expect, error = _option(argv, "--expect-result")
    result, error = (None, error) if error else _option(argv, "--result")
    run_id, error = (None, error) if error else _option(argv, "--from-log")
    if not error and result is not None:
        error = check_result_path(result)  # before the run: a result that cannot be written is lost after it
    if error:
        print(f"privfl-flower-run: error: {error}", file=sys.stderr)
        return 2
    if run_id is not None:
        if result is None:
            print("privfl-flower-run: error: --from-log RUN_ID needs --result PATH (where to write the result)",
                  file=sys.stderr)
            return 2
        return from_log([run_id, *argv], result, out)
    if not argv:
        print("privfl-flower-run: error: give the app folder (and the SuperLink connection), as to flwr run",
              file=sys.stderr)
        return 2
    if "--stream" not in argv:
        argv.append("--stream")
    reader = None
    if result is not None:
        reader = ResultReader()
        argv += ["--run-config", f"{LOG_RESULT_KEY}=true"]
    flwr = _flwr()
    if flwr is None:
        return 2
    code = 0
    with subprocess.Popen([flwr, "run", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        for line in proc.stdout:
            if reader is not None and RESULT_MARK in line:
                reader.feed(line)  # the result's base64 is not echoed: it goes to --result
                if _HEAD.search(line) is None:
                    continue
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
    if reader is not None:
        return _deliver(reader, result, out, "the run's log stream carried no whole result")
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
