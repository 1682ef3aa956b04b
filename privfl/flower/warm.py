"""A warm ClientApp executor for a Flower 1.41 SuperNode: one long-lived process that serves every ClientApp task of
its SuperNode, so that Python, torch and privfl are imported once per SuperNode instead of once per message.

With its default ``--isolation subprocess``, a SuperNode starts ``flower-superexec``, which starts a fresh
``flwr-clientapp`` Python process for every message it receives (each one imports torch and privfl, then exits).
With ``--isolation process`` the SuperNode starts nothing and waits for an external process to claim its tasks on
its runtime API. This module is that process. It does what ``flower-superexec`` and ``flwr-clientapp`` do together,
with Flower's own client classes (``RuntimeHttpClient`` and the runtime API's requests), in one loop:

1. claim the oldest pending ClientApp task (``AcquireTask`` for the ``flwr-clientapp`` task type), every
   ``--poll-interval`` seconds while there is none;
2. for the claimed task, with its token: heartbeat while it runs, pull its input (message, ``Context``, run, FAB),
   install the FAB and load its ClientApp -- once per FAB (keyed by the FAB's SHA-256), later tasks of the run reuse
   the loaded app --, call the ClientApp, push the reply message, then push the task output (its status and the
   context, with ``Context.state``) -- exactly the steps and order of ``flwr-clientapp``;
3. go back to 1 instead of exiting.

The context is pulled and pushed with every message, as ``flwr-clientapp`` does, so a client's state between rounds
still lives in ``Context.state`` in the SuperNode, never in this process (privfl keeps its generators and the
algorithm's client state there). Tasks run one at a time, in the order the SuperNode queued them, so a task always
reads the context the previous one pushed. A ClientApp that raises is answered with an error reply (Flower's
``ClientApp`` exception code and reason, as ``flwr-clientapp`` sends it) and a failed task output; the worker goes on.
SIGTERM or SIGINT (or the end of ``--parent-pid``) stop it; a task in flight is then reported failed.

How an organisation runs it (one pair per SuperNode; the SuperNode's runtime API listens on ``--port``, default 9094,
and is reached on loopback only)::

    flower-supernode --superlink SUPERLINK:PORT --root-certificates ca.pem --isolation process --port 9094 \\
        --node-config "partition-id=K data-path='/data/org.npz' ledger-path='/data/ledger.sqlite'"
    privfl-flower-worker --runtime-api-address 127.0.0.1:9094 --insecure
    # same as: python -m privfl.flower.warm --runtime-api-address 127.0.0.1:9094 --insecure

``--insecure`` is about the loopback link between the worker and its own SuperNode only (the SuperNode's link to the
SuperLink keeps its TLS); a SuperNode that serves its runtime API over TLS is reached with ``--root-certificates``
instead, and one started with ``--superexec-auth-secret-file`` is reached with the same file. The worker runs apps
in its own Python environment (privfl must be installed there): it installs no app dependencies at run time.
``--parent-pid PID`` ends the worker when process PID (the SuperNode) ends.

**The app is the coordinator's code.** The ClientApp a SuperNode runs comes from the run's FAB, which the coordinator
builds and ships (``flwr run``): privfl's defences against an active server (the federation file's pinned terms, the
node budget, the identity key) live in privfl's ClientApp, so a coordinator that ships another app module runs its
own code on the organisation's machine, with its data path in reach (a review did: one appended ClientApp replied
with the organisation's records). On a SuperNode that trusts no server (an ``identity-key`` or ``federation`` in its
node config) this worker therefore loads a FAB only if it is privfl's own app (:func:`check_fab`): ``pyproject.toml``
naming privfl's components, the app module exactly as ``write_app`` writes it (:func:`privfl.flower.app.
app_module_source`), and no other file but the algorithm modules whose SHA-256 the organisation listed in its node
config (``trusted-modules='HEX,HEX'``, after reading them); the installed copy is checked against the FAB before it is
imported. A refused FAB gets an error reply and nothing of it runs. Flower's own executor (``--isolation subprocess``,
``flwr-clientapp``) runs whatever the FAB holds: such a SuperNode must run this worker, or check each FAB itself.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

LOG = logging.getLogger("privfl.flower.warm")

#: (first, largest) seconds between two asks for a message object the SuperNode does not hold yet
OBJECT_PULL_BACKOFF = (0.02, 0.25)

#: modules a privfl worker imports when it starts, before it claims a task, so that the first message of a run does
#: not pay for them: privfl's ClientApp and algorithms (torch), and ``torch._dynamo``, which torch imports lazily
#: when the first optimizer is built (about 4 s here, paid by every message of a fresh ClientApp process)
PRELOAD = ("privfl.flower.app", "privfl.algorithms", "privfl.core.plan", "privfl.accounting.ledger", "torch._dynamo")


class WorkerStopped(BaseException):
    """Raised in the worker's main thread by SIGTERM or SIGINT (a BaseException, so that a ClientApp's ``except
    Exception`` does not swallow it)."""


#: node-config key: SHA-256 digests (hex, comma- or space-separated) of the algorithm modules an organisation that
#: trusts no server has read and accepts in a run's FAB (:func:`check_fab`)
TRUSTED_MODULES_KEY = "trusted-modules"
#: the files of a FAB besides its modules: its manifest (Flower's), its project file and privfl's app module
FAB_FILES = (".info/CONTENT", "pyproject.toml", "privfl_flower_app.py")


class UntrustedApp(Exception):
    """A FAB that is not privfl's own app, refused (nothing of it imported) on a SuperNode that trusts no server."""


def trusts_no_server(node_config) -> bool:
    """Whether a SuperNode's node config holds an identity key or a federation file (``privfl.flower.identity``)."""
    from privfl.flower.identity import FEDERATION_KEY, IDENTITY_KEY

    return bool(node_config.get(IDENTITY_KEY) or node_config.get(FEDERATION_KEY))


def trusted_modules(node_config) -> frozenset[str]:
    """The SHA-256 digests of :data:`TRUSTED_MODULES_KEY` in a node config."""
    raw = str(node_config.get(TRUSTED_MODULES_KEY, "") or "")
    digests = frozenset(d.strip().lower() for d in raw.replace(",", " ").split() if d.strip())
    bad = [d for d in digests if len(d) != 64 or any(c not in "0123456789abcdef" for c in d)]
    if bad:
        raise UntrustedApp(f"the node config's {TRUSTED_MODULES_KEY} must list SHA-256 digests (64 hex digits)")
    return digests


def check_fab(run, fab, allowed=frozenset()) -> dict[str, bytes]:
    """Refuse (:class:`UntrustedApp`) a FAB that is not privfl's own app, before anything of it is installed or
    imported: its files must be Flower's manifest, ``pyproject.toml`` and ``privfl_flower_app.py``, plus top-level
    ``<module>.py`` files whose SHA-256 is in ``allowed``; the project file must name privfl's components, the run's
    FAB id and version and no dependency; the app module must be exactly what ``write_app`` writes for those modules
    (:func:`privfl.flower.app.app_module_source`). Returns the files (name -> bytes) the installed app must hold."""
    import io
    import tomllib
    import zipfile

    from privfl.flower.app import APP_MODULE, app_module_source

    try:
        with zipfile.ZipFile(io.BytesIO(fab.content)) as archive:
            files = {info.filename: archive.read(info) for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise UntrustedApp(f"the FAB is not a readable archive ({exc})") from None
    modules = sorted(name for name in files if name not in FAB_FILES)
    for name in modules:
        stem = name[:-3]
        if "/" in name or not name.endswith(".py") or not stem.isidentifier():
            raise UntrustedApp(f"the FAB holds {name!r}, which privfl's app never holds (write_app writes "
                               f"{list(FAB_FILES[1:])} and the run's algorithm modules)")
        if hashlib.sha256(files[name]).hexdigest() not in allowed:
            raise UntrustedApp(f"the FAB brings the module {name!r} (SHA-256 {hashlib.sha256(files[name]).hexdigest()})"
                               f", which this SuperNode's {TRUSTED_MODULES_KEY} does not list: read it, and add its "
                               "digest to the node config to run it")
    if not all(name in files for name in FAB_FILES):
        raise UntrustedApp(f"the FAB lacks one of {list(FAB_FILES)}")
    try:
        project = tomllib.loads(files["pyproject.toml"].decode("utf-8"))
        flwr_app = project["tool"]["flwr"]["app"]
        components = dict(flwr_app["components"])
        fab_id, version = f"{flwr_app['publisher']}/{project['project']['name']}", project["project"]["version"]
        dependencies = project["project"].get("dependencies", [])
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise UntrustedApp(f"the FAB's pyproject.toml is not a privfl app's ({exc})") from None
    expected = {"serverapp": f"{APP_MODULE}:server_app", "clientapp": f"{APP_MODULE}:client_app"}
    if components != expected:
        raise UntrustedApp(f"the FAB's components are {components}; privfl's app has {expected}")
    if (fab_id, version) != (run.fab_id, run.fab_version):
        raise UntrustedApp(f"the FAB is {fab_id} {version}, the run names {run.fab_id} {run.fab_version}")
    if dependencies:
        raise UntrustedApp(f"the FAB declares dependencies {dependencies}; privfl's app declares none")
    source = files[f"{APP_MODULE}.py"].decode("utf-8", errors="replace")
    imported = [line.split()[1] for line in source.splitlines()
                if line.startswith("import ") and line.endswith("# registers its algorithm")]
    if sorted(f"{name}.py" for name in imported) != modules or source != app_module_source(imported):
        raise UntrustedApp(f"the FAB's {APP_MODULE}.py is not the app module privfl's write_app writes: refused, "
                           "nothing of it imported")
    return {name: data for name, data in files.items() if name != ".info/CONTENT"}


def _check_installed(project_dir: Path, files: dict[str, bytes]) -> None:
    """The installed app holds exactly ``files`` (an app folder of the same truncated hash installed earlier, or
    altered since, is refused); Python's byte-code caches in it are removed first, so only these sources run."""
    import shutil

    for cache in [p for p in project_dir.rglob("__pycache__") if p.is_dir()]:
        shutil.rmtree(cache)
    found = {str(p.relative_to(project_dir)): p for p in project_dir.rglob("*") if not p.is_dir()}
    if set(found) != set(files) or any(found[name].read_bytes() != data for name, data in files.items()):
        LOG.error("the installed app in %s is not the FAB that was checked; remove the folder", project_dir)
        raise UntrustedApp("the installed app folder is not the FAB that was checked (its path is in this worker's log)")


class ClientAppCache:
    """ClientApps loaded in this process, one per FAB (by the SHA-256 of its content).

    Loading a FAB's app imports its modules from the FAB's project directory; a later FAB may hold modules of the
    same names (every privfl run ships ``privfl_flower_app``), so before loading another FAB the modules imported
    from earlier project directories are forgotten (the ClientApps already loaded keep working: they hold their
    own module globals). On a SuperNode that trusts no server (``node_config`` with an identity key or a federation
    file) a FAB is loaded only if :func:`check_fab` accepts it (see the module docstring)."""

    def __init__(self) -> None:
        self.apps: dict[str, object] = {}
        self._project_dirs: list[Path] = []

    def get(self, run, fab, node_config=None):
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir

        digest = hashlib.sha256(fab.content).hexdigest()
        if digest != fab.hash_str:
            raise ValueError(f"the FAB's content has SHA-256 {digest}, but the SuperNode says {fab.hash_str}")
        checked = None
        if node_config is not None and trusts_no_server(node_config):
            checked = check_fab(run, fab, trusted_modules(node_config))
        if digest not in self.apps:
            install_from_fab(fab.content, skip_prompt=True)
            project_dir = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str)).resolve()
            if checked is not None:
                _check_installed(project_dir, checked)
            self._forget_earlier_apps()
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            app = load(run.fab_id, run.fab_version, fab.hash_str)
            self._project_dirs.append(project_dir)
            self.apps[digest] = (app, checked is not None)
        app, was_checked = self.apps[digest]
        if checked is not None and not was_checked:
            raise UntrustedApp("this FAB was loaded unchecked earlier in this worker; restart the worker")
        return app

    def _forget_earlier_apps(self) -> None:
        if not self._project_dirs:
            return
        dirs = {str(d) for d in self._project_dirs}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and any(Path(path).resolve().is_relative_to(d) for d in self._project_dirs):
                del sys.modules[name]
        sys.path[:] = [p for p in sys.path if str(Path(p).resolve()) not in dirs]


class Worker:
    """Claims and runs the ClientApp tasks of one SuperNode (see the module docstring)."""

    def __init__(self, runtime_api_address: str, *, insecure: bool, root_certificates: str | None = None,
                 auth_secret: bytes | None = None, poll_interval: float = 0.2) -> None:
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient

        if not 0.01 <= poll_interval <= 60:
            raise ValueError(f"poll_interval must be between 0.01 and 60 seconds, got {poll_interval!r}")
        if insecure == (root_certificates is not None):
            raise ValueError("give either insecure=True or root_certificates (the SuperNode's runtime API CA)")
        self.address = runtime_api_address
        self.insecure = insecure
        self.root_certificates = root_certificates
        self.poll_interval = poll_interval
        self.apps = ClientAppCache()
        self.served = 0
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if auth_secret:
            interceptors.append(SuperExecAuthHttpInterceptor(
                master_secret=auth_secret, protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
        self._acquirer = RuntimeHttpClient.from_server_address(
            server_address=runtime_api_address, insecure=insecure, root_certificates=root_certificates,
            interceptors=interceptors)

    # -- the loop ----------------------------------------------------------------------------------------------------

    def acquire(self):
        """The next ClientApp task and its token, or None (none pending, or the SuperNode not reachable yet)."""
        import httpx
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
        from flwr.supercore.constant import TaskType

        try:
            res = self._acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except httpx.TransportError as exc:
            LOG.debug("runtime API at %s not reachable: %s", self.address, exc)
            return None
        except httpx.HTTPStatusError as exc:  # e.g. a SuperExec auth secret the SuperNode does not share
            LOG.warning("the SuperNode at %s refused to hand out a task: %s", self.address, exc)
            time.sleep(1.0)
            return None
        if res.HasField("task") and res.token:
            return res.task, res.token
        return None

    def serve_forever(self) -> None:
        LOG.info("serving ClientApp tasks of the SuperNode at %s (pid %d)", self.address, os.getpid())
        try:
            while True:
                claimed = self.acquire()
                if claimed is None:
                    time.sleep(self.poll_interval)
                    continue
                try:
                    self.serve(*claimed)
                except Exception:  # pylint: disable=broad-except  # one task's trouble never ends the worker
                    LOG.exception("task %d could not be served", claimed[0].task_id)
        finally:
            self._acquirer.close()

    # -- one task ----------------------------------------------------------------------------------------------------

    def _task_client(self, token: str):
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        retry = make_simple_http_retry_invoker()
        client = RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure, root_certificates=self.root_certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)],
            retry_invoker=retry)
        return client, retry

    def serve(self, task, token: str) -> bool:
        """Run one claimed task as ``flwr-clientapp`` runs it; True if the ClientApp answered without error."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender

        start = time.perf_counter()
        client, retry = self._task_client(token)
        heartbeat = HeartbeatSender(_heartbeat_fn(client, task.task_id))
        message = reply = context = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        kind, stopping = "?", False
        timings = {}
        try:
            heartbeat.start()
            message, context, run, fab = _pull_task_input(client)
            kind = message.metadata.message_type
            timings["pull"] = time.perf_counter() - start
            client_app = self.apps.get(run, fab, context.node_config)
            timings["load"] = time.perf_counter() - start - timings["pull"]
            call = time.perf_counter()
            reply = client_app(message=message, context=context)
            timings["call"] = time.perf_counter() - call
            sub_status, details = SubStatus.COMPLETED, ""
        except WorkerStopped:
            details, stopping = "the privfl warm worker was stopped while the task ran", True
            raise
        except (Exception, SystemExit) as exc:  # pylint: disable=broad-except  # one task's failure, not the worker's
            code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc)}:<'{exc}'>"
            if isinstance(exc, LoadClientAppError):
                code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ("An exception was raised when attempting to "
                                                                     "load `ClientApp`")
            LOG.error("task %d (%s): the ClientApp raised an exception", task.task_id, kind, exc_info=exc)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            if stopping:
                retry.max_tries = 1  # do not hold a stop up on a SuperNode that is going away
            push = time.perf_counter()
            try:
                if reply is not None and context is not None and not stopping:
                    _push_message(client, reply, context)
                _push_task_output(client, context, sub_status, details)
                timings["push"] = time.perf_counter() - push
            except Exception as exc:  # pylint: disable=broad-except
                LOG.error("task %d (%s): could not push its reply or output: %s", task.task_id, kind, exc)
                sub_status = SubStatus.FAILED
            finally:
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()
        self.served += 1
        LOG.info("task %d (%s) %s in %.3f s (pull %.3f, load %.3f, ClientApp %.3f, push %.3f); pid %d has served "
                 "%d tasks", task.task_id, kind, "done" if sub_status == SubStatus.COMPLETED else "FAILED",
                 time.perf_counter() - start, timings.get("pull", 0.0), timings.get("load", 0.0),
                 timings.get("call", 0.0), timings.get("push", 0.0), os.getpid(), self.served)
        return sub_status == SubStatus.COMPLETED


# -- the runtime API steps of a ClientApp task (those of flwr-clientapp) ---------------------------------------------

def _heartbeat_fn(client, task_id: int):
    """A task heartbeat that reports a transport failure (retried) but, unlike flwr-clientapp's, does not stop the
    process when the SuperNode no longer knows the task: it is logged, and the task's pushes then fail."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611

    def beat() -> bool:
        try:
            res = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as err:
            if err.response.status_code in (503, 504):
                return False
            LOG.warning("task %d: heartbeat refused (%s)", task_id, err)
            return True
        if not res.success:
            LOG.warning("task %d: the SuperNode no longer holds this task", task_id)
        return True

    return beat


def _pull_task_input(client):
    """The task's context, run and FAB, then its one message (pulled object by object and confirmed)."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf, make_pull_object_fn_protobuf)
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode's runtime API returned no message for this task")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    # The SuperNode queues the task before it has pulled the message's objects from the SuperLink, and a warm worker
    # claims it at once: an object not there yet is asked for again after 0.02 s, doubling up to 0.25 s (Flower's
    # defaults, 1 s doubling up to 10 s, suit a ClientApp process that took seconds to start; on loopback they
    # cost a warm worker 1 to 3 s per message).
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=OBJECT_PULL_BACKOFF[0], backoff_cap=OBJECT_PULL_BACKOFF[1])
    message.metadata.__dict__["_message_id"] = tree.object_id  # a deflated message does not carry its own id
    return message, context, run, fab


def _push_message(client, message, context) -> None:
    """The reply: its metadata and object tree, then the objects the SuperNode does not hold yet."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PushAppMessagesRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_object import (get_all_nested_objects, get_object_tree,
                                                             no_object_id_recompute)
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import push_objects

    message.metadata.__dict__["_message_id"] = message.object_id
    with no_object_id_recompute():
        tree = get_object_tree(message)
        res = client.PushMessages(PushAppMessagesRequest(
            messages_list=[message_to_proto(remove_content_from_message(message))], message_object_trees=[tree]))
        push_objects(get_all_nested_objects(message),
                     make_push_object_fn_protobuf(client.PushObject, Node(node_id=context.node_id),
                                                  run_id=context.run_id, session_id=res.session_id),
                     object_ids_to_push=set(res.objects_to_push))


def _push_task_output(client, context, sub_status: str, details: str) -> None:
    """The task's end: its status and the context (``Context.state`` included) the SuperNode keeps for the next."""
    from flwr.common.serde import context_to_proto
    from flwr.proto.runtime_pb2 import PushTaskOutputRequest  # pylint: disable=E0611

    client.PushTaskOutput(PushTaskOutputRequest(context=context_to_proto(context) if context else None,
                                                sub_status=sub_status, details=details))


# -- the command ---------------------------------------------------------------------------------------------------

#: ``--log-level``'s choices (logging's level names)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _poll_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.01 <= value <= 60:
        raise argparse.ArgumentTypeError(f"expected seconds between 0.01 and 60, got {text!r}")
    return value


def _pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a process id (an integer >= 1), got {text!r}")
    return value


def _readable_file(text: str) -> str:
    if not os.path.isfile(text):
        what = "is a folder" if os.path.isdir(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; give the PEM file")
    return text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="privfl-flower-worker", description=(
        "Serve the ClientApp tasks of a flower-supernode started with --isolation process, in this one "
        "long-lived process (privfl.flower.warm)."))
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's runtime API, HOST:PORT (its --port)")
    tls = ap.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the SuperNode's runtime API (loopback)")
    tls.add_argument("--root-certificates", type=_readable_file,
                     help="CA certificate (PEM file) of the runtime API's TLS certificate")
    ap.add_argument("--superexec-auth-secret-file", default=None, type=_readable_file,
                    help="the file given to flower-supernode --superexec-auth-secret-file, if any")
    ap.add_argument("--parent-pid", type=_pid, default=None, help="stop when this process (the SuperNode) ends")
    ap.add_argument("--poll-interval", type=_poll_interval, default=0.2,
                    help="seconds between claims while idle, 0.01 to 60 (0.2)")
    ap.add_argument("--preload", default=",".join(PRELOAD),
                    help="comma-separated modules to import before serving (default: privfl's ClientApp, its "
                         "algorithms and torch; '' for none)")
    ap.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    return ap


def preload(modules: list[str]) -> None:
    """Import ``modules`` now (a module that cannot be imported is reported, not fatal: a task will say why)."""
    import importlib

    start = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name.strip())
        except Exception as exc:  # pylint: disable=broad-except
            LOG.warning("could not preload %s: %s", name, exc)
    if modules:
        LOG.info("preloaded %s in %.1f s", ", ".join(modules), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,  # not every HTTP request of httpx
                        format=f"%(asctime)s [privfl-flower-worker pid={os.getpid()}] %(levelname)s %(message)s")
    LOG.setLevel(args.log_level.upper())

    def stop(signum, _frame):
        raise WorkerStopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    secret = None
    if args.superexec_auth_secret_file:
        from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret

        secret = load_superexec_auth_secret(args.superexec_auth_secret_file)
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)  # SIGINT to this process when the parent is gone
    worker = Worker(args.runtime_api_address, insecure=args.insecure, root_certificates=args.root_certificates,
                    auth_secret=secret, poll_interval=args.poll_interval)
    try:
        preload([m for m in args.preload.split(",") if m.strip()])
        worker.serve_forever()
    except WorkerStopped as exc:
        LOG.info("stopped by %s after %d tasks", exc, worker.served)


if __name__ == "__main__":
    main()


__all__ = ["ClientAppCache", "TRUSTED_MODULES_KEY", "UntrustedApp", "Worker", "WorkerStopped", "check_fab", "main"]
