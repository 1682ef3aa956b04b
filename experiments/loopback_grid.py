"""An in-process Flower Grid for tests and benchmarks (a test tool, not part of privfl): each message pushed is handed
to the addressed node's ClientApp at once, given a message id of its own as a transport would give it, and its reply
waits to be pulled; a node for which ``silent(node, message)`` holds has died before that message and never answers.
The ServerApp's process identity (``flwr.supercore.task_identity.TaskIdentity``) is the caller's to set, as Flower's
runtime sets it for a ServerApp process.

Used by tests/flower/test_loopback.py (privfl's ServerApp and ClientApp in one process) and by
experiments/bench_secagg.py (Flower's own SecAgg+ workflow)."""

from __future__ import annotations

import copy
import uuid

from flwr.server import Grid


class LoopbackGrid(Grid):
    """``apps``: node id -> (ClientApp, its Context). ``copy_messages``: hand each ClientApp a deep copy (a workflow
    that shares one content between its messages would otherwise see a ClientApp's changes)."""

    def __init__(self, apps: dict, silent=lambda node, message: False, copy_messages: bool = False):
        self.apps, self.silent, self.copy_messages = apps, silent, copy_messages
        self.replies: dict[str, object] = {}

    def set_run(self, run_id):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.apps)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            if self.copy_messages:
                message = copy.deepcopy(message)
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            node = message.metadata.dst_node_id
            if self.silent(node, message):
                continue
            app, context = self.apps[node]
            self.replies[message_id] = app(message, context)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


__all__ = ["LoopbackGrid"]
