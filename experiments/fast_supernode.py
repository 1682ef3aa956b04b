"""A test and benchmark tool, not part of privfl: Flower's own ``flower-supernode`` with its fixed idle waits shortened.

privfl never patches Flower in what users run: an organisation runs Flower's ``flower-supernode`` as it is (the
README's commands), and ``privfl.flower.local.LocalDeployment`` starts it by default. This launcher lives in
``experiments/`` and is not installed; privfl's own tests and ``experiments/bench_flower.py``'s smoke configuration
start their loopback SuperNodes under it (``LocalDeployment(supernode_command=...)``) only to make rounds of a
second or less affordable in CI, and every timing the README reports that compares privfl with Flower is of stock
binaries.

A flwr 1.41 SuperNode's main loop (``flwr/supernode/start_client_internal.py``) waits a fixed time whenever it has
nothing to do, and those waits sit on the path of every message of every round:

- ``start_client_internal``, ``time.sleep(3)`` after a pull from the SuperLink that brought no message (line 263):
  a message the ServerApp sends reaches the SuperNode up to 3 s after the SuperLink has it;
- ``_push_messages``, ``time.sleep(0.5)`` between two looks for the ClientApp's reply (line 470): the reply leaves
  up to 0.5 s after the ClientApp (a warm worker, :mod:`privfl.flower.warm`) has pushed it;
- ``_push_messages``, ``time.sleep(0.5)`` between two looks for a reply object's content (line 506, inside
  ``yield_object_contents``);
- ``_pull_and_store_message``, ``pull_objects(...)`` with flwr's default backoff (``PULL_INITIAL_BACKOFF`` 1 s,
  doubling to ``PULL_BACKOFF_CAP`` 10 s, flwr/supercore/constant.py:48-49): the SuperLink hands out a message as
  soon as the ServerApp has pushed its metadata, before its objects (flwr/superlink/grid/http_grid.py
  ``_try_push_messages`` pushes them next), so a SuperNode that pulls often finds the objects not there yet and
  waits a whole second before it asks again.

For a federation whose rounds take minutes these are nothing; for short rounds they are most of a round. This
launcher runs Flower's ``flower-supernode`` entry point unchanged (same command line, same parser, same code)
after two patches of the one module ``flwr.supernode.start_client_internal``, made in this process only:

1. its ``time`` global is replaced by :class:`CappedSleep`, which is the ``time`` module except that ``sleep(s)``
   sleeps ``min(s, poll_interval)``: the three sleeps above become ``--poll-interval`` (default 0.05 s). Every wait
   stays a loop around the same condition, so the SuperNode does the same things in the same order, only looks
   more often (a pull from the SuperLink every ``--poll-interval`` seconds while idle, a cheap local check
   otherwise). No other module's sleeps change (the runtime API server's, the heartbeat's, flwr's retries');
2. its ``pull_objects`` global is wrapped so that the first retry of an object the SuperLink does not hold yet
   comes after ``--object-backoff`` seconds (default 0.05) instead of 1 s, still doubling up to flwr's cap and
   within flwr's limits on tries and time (a caller's explicit backoff is kept).

The patches are checked against the module before they are made: flwr must be 1.41.x and the module must hold
exactly the waits listed above; otherwise the launcher warns and runs the SuperNode unpatched (the stock
behaviour), or, with ``--require-patch``, exits with status 2 before starting anything. The launcher's own
options are consumed and removed from the command line; everything else goes to Flower as it was given::

    python experiments/fast_supernode.py --poll-interval 0.05 --insecure --superlink 127.0.0.1:9092 \\
        --isolation process --port 9094 --node-config "partition-id=0 data-path='/data/org0.npz' ..."
"""

from __future__ import annotations

import math
import re
import sys
import time as _time
from typing import Callable

PROG = "fast_supernode"
#: the flwr releases whose SuperNode module layout the patches are written for
FLWR_SERIES = "1.41."
#: the module patched, and the waits it must hold (flwr 1.41.0: lines 263, 470, 506), in source order
MODULE = "flwr.supernode.start_client_internal"
EXPECTED_SLEEPS = ("time.sleep(3)", "time.sleep(0.5)", "time.sleep(0.5)")
#: defaults and accepted ranges (seconds); 3 s is the longest wait the patch caps, so a larger cap changes nothing,
#: and below 0.01 s an idle SuperNode would pull from the SuperLink a hundred times a second
DEFAULT_POLL_INTERVAL = 0.05
POLL_RANGE = (0.01, 3.0)
DEFAULT_OBJECT_BACKOFF = 0.05
OBJECT_BACKOFF_RANGE = (0.01, 10.0)  # 10 s: flwr's PULL_BACKOFF_CAP

_HELP = f"""\
{PROG}: Flower's flower-supernode with its fixed idle waits shortened (experiments/fast_supernode.py).
Options of this launcher (removed before Flower reads the command line; every other option is flower-supernode's):
  --poll-interval SECONDS   cap on the SuperNode's fixed sleeps (3 s between empty pulls from the SuperLink,
                            0.5 s between looks for the ClientApp's reply); default {DEFAULT_POLL_INTERVAL:g},
                            from {POLL_RANGE[0]:g} to {POLL_RANGE[1]:g}
  --object-backoff SECONDS  first retry of a message object the SuperLink does not hold yet (flwr's: 1 s);
                            default {DEFAULT_OBJECT_BACKOFF:g}, from {OBJECT_BACKOFF_RANGE[0]:g} to
                            {OBJECT_BACKOFF_RANGE[1]:g}
  --require-patch           exit with status 2 if the installed flwr cannot be patched (default: warn, run unpatched)
  --log-timestamps          timestamps on Flower's log lines (per-message latencies)
"""


class UsageError(ValueError):
    """A launcher option is malformed (reported as ``PROG: error: ...`` with exit status 2)."""


class CappedSleep:
    """Stands in for the ``time`` module in one module's globals: every attribute is the ``time`` module's, except
    ``sleep(s)``, which sleeps ``min(s, cap)`` (``sleep_fn`` does the sleeping; tests record it instead)."""

    def __init__(self, cap: float, sleep_fn: Callable[[float], None] = _time.sleep) -> None:
        self.cap = cap
        self._sleep = sleep_fn

    def sleep(self, seconds: float) -> None:
        self._sleep(min(seconds, self.cap))

    def __getattr__(self, name: str):
        return getattr(_time, name)

    def __repr__(self) -> str:
        return f"<time module, sleep capped at {self.cap:g} s (experiments/fast_supernode.py)>"


def backing_off_from(first: float, pull_objects: Callable) -> Callable:
    """``pull_objects`` whose first retry of an unavailable object comes after ``first`` seconds unless the caller
    gives ``initial_backoff`` (the doubling, its cap and the limits on tries and time stay flwr's)."""

    def pull_objects_sooner(*args, **kwargs):
        kwargs.setdefault("initial_backoff", first)
        return pull_objects(*args, **kwargs)

    pull_objects_sooner.__wrapped__ = pull_objects
    pull_objects_sooner.__doc__ = pull_objects.__doc__
    return pull_objects_sooner


def _seconds(option: str, raw: str, bounds: tuple[float, float]) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and bounds[0] <= value <= bounds[1]):
        raise UsageError(f"{option} must be a number of seconds from {bounds[0]:g} to {bounds[1]:g}, got {raw!r}")
    return value


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """(this launcher's options, the command line for flower-supernode): the launcher's options are taken out
    wherever they are (``--opt VALUE`` or ``--opt=VALUE``), everything else is kept in its order; after ``--``
    nothing is taken."""
    options = {"poll_interval": DEFAULT_POLL_INTERVAL, "object_backoff": DEFAULT_OBJECT_BACKOFF,
               "require_patch": False, "log_timestamps": False}
    valued = {"--poll-interval": ("poll_interval", POLL_RANGE), "--object-backoff": ("object_backoff",
                                                                                     OBJECT_BACKOFF_RANGE)}
    flags = {"--require-patch": "require_patch", "--log-timestamps": "log_timestamps"}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name, eq, raw = arg.partition("=")
        if name in valued:
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"{name} needs a number of seconds")
                i += 1
                raw = argv[i]
            key, bounds = valued[name]
            options[key] = _seconds(name, raw, bounds)
        elif arg in flags:
            options[flags[arg]] = True
        else:
            rest.append(arg)
        i += 1
    return options, rest


def check_layout(module=None) -> str | None:
    """Why the installed flwr cannot be patched, or None if it can: flwr 1.41.x, and :data:`MODULE` holds the
    ``time`` module, flwr's ``pull_objects`` and exactly the sleeps of :data:`EXPECTED_SLEEPS` in its source."""
    import importlib
    import inspect
    from importlib.metadata import PackageNotFoundError, version

    try:
        flwr_version = version("flwr")
    except PackageNotFoundError:
        return "flwr is not installed"
    if not flwr_version.startswith(FLWR_SERIES):
        return f"flwr {flwr_version} is installed; the patch is written for flwr {FLWR_SERIES}x"
    try:
        module = module or importlib.import_module(MODULE)
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError as exc:
        return f"cannot import {MODULE}: {exc}"
    if getattr(module, "time", None) is not _time:
        return f"{MODULE}.time is not the time module (already patched, or the module changed)"
    if getattr(module, "pull_objects", None) is not inflatable_utils.pull_objects:
        return f"{MODULE}.pull_objects is not flwr's inflatable_utils.pull_objects"
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError) as exc:
        return f"the source of {MODULE} cannot be read ({exc}), so its waits cannot be checked"
    sleeps = tuple(re.findall(r"\b(?:time\.)?sleep\([^)]*\)", source))
    if sleeps != EXPECTED_SLEEPS:
        return f"{MODULE} sleeps {list(sleeps)}, not {list(EXPECTED_SLEEPS)}"
    if len(re.findall(r"\bpull_objects\(", source)) != 1 or "initial_backoff" in source:
        return f"{MODULE} does not call pull_objects exactly once with flwr's default backoff"
    return None


def install(poll_interval: float, object_backoff: float, *, module=None,
            sleep_fn: Callable[[float], None] = _time.sleep) -> Callable[[], None]:
    """Patch :data:`MODULE` (see the module docstring) in this process; returns the function that undoes it.
    Raises RuntimeError, saying why, if :func:`check_layout` finds the module is not the expected one."""
    import importlib

    module = module or importlib.import_module(MODULE)
    problem = check_layout(module)
    if problem:
        raise RuntimeError(problem)
    before = module.time, module.pull_objects
    module.time = CappedSleep(poll_interval, sleep_fn)
    module.pull_objects = backing_off_from(object_backoff, before[1])

    def undo() -> None:
        module.time, module.pull_objects = before

    return undo


def _flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")


def _flower_main():
    """Flower's own ``flower-supernode`` entry point (it reads ``sys.argv``)."""
    from flwr.supernode.cli import flower_supernode

    return flower_supernode()


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options, flower_argv = split_argv(argv)
    except UsageError as exc:
        print(f"usage: {PROG} [--poll-interval SECONDS] [--object-backoff SECONDS] [--require-patch] "
              f"[--log-timestamps] FLOWER-SUPERNODE-OPTIONS...\n{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if {"-h", "--help"} & set(flower_argv[:flower_argv.index("--")] if "--" in flower_argv else flower_argv):
        print(_HELP)  # then Flower's own help
    try:
        install(options["poll_interval"], options["object_backoff"])
    except Exception as exc:  # pylint: disable=broad-except  # whatever it is, the SuperNode can run unpatched
        if options["require_patch"]:
            print(f"{PROG}: error: cannot shorten the SuperNode's waits: {exc} (drop --require-patch to run "
                  f"flower-supernode unpatched)", file=sys.stderr)
            return 2
        print(f"{PROG}: WARNING: running flower-supernode unpatched, with flwr's own waits: {exc}",
              file=sys.stderr, flush=True)
    else:
        print(f"{PROG}: flwr {_flwr_version()}: SuperNode waits capped at {options['poll_interval']:g} s, object "
              f"pulls retried from {options['object_backoff']:g} s ({MODULE} patched)", file=sys.stderr, flush=True)
    if options["log_timestamps"]:
        try:
            from flwr.supercore.logger import update_console_handler
        except ImportError:
            print(f"{PROG}: WARNING: this flwr has no update_console_handler; --log-timestamps ignored",
                  file=sys.stderr, flush=True)
        else:
            update_console_handler(timestamps=True)
    sys.argv = [PROG, *flower_argv]
    return _flower_main()


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CappedSleep", "backing_off_from", "check_layout", "install", "main", "split_argv"]
