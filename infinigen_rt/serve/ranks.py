"""Serving under tensor parallelism: rank 0's runner is driven by the HTTP scheduler; every other rank replays its
calls (`follow`), so each rank's runner makes the same calls in the same order and their collectives meet."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from infinigen_rt.runner import Runner
from infinigen_rt.tp import TP, peer_lost

CONTROL_TIMEOUT = timedelta(days=365)  # a follower waits for the next request as long as the server is up


def control_group():
    """A gloo group for the leader's calls (objects, not tensors), with no practical timeout: an idle server is
    not a dead one. Every rank must create it, in the same order."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class Leader:
    """Rank 0's runner under tensor parallelism: each `add`, `abort` and `step` is sent to the followers before it
    runs here, so every rank's runner makes the same calls in the same order (and its collectives meet). What the
    scheduler reads (running, waiting, stats, blocks...) is the runner's own."""

    def __init__(self, runner, tp: TP, group, params: dict):
        self.runner, self.tp, self.group = runner, tp, group
        self._send(("init", params))

    def _send(self, op: tuple) -> None:
        try:
            dist.broadcast_object_list([op], src=0, group=self.group)
        except RuntimeError as e:  # a server fault, not the request's (the scheduler answers 500 and logs it)
            raise RuntimeError(str(peer_lost(self.tp, e))) from None

    def add(self, req) -> int:
        rid = self.runner.add(req)  # its checks first: a refused request never reaches the followers
        self._send(("add", req))
        return rid

    def abort(self, rid: int):
        self._send(("abort", rid))
        return self.runner.abort(rid)

    def step(self):
        self._send(("step",))
        return self.runner.step()

    def close(self) -> None:
        self._send(("stop",))

    def __getattr__(self, name):
        return getattr(self.runner, name)


def follow(engine, tp: TP, group) -> int:
    """A follower's serve loop: build the runner the leader describes, replay its calls until it stops. Returns
    the steps run."""
    runner, steps = None, 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        op, *args = box[0]
        if op == "stop":
            return steps
        if op == "init":
            runner = Runner(engine, **args[0])
        elif op == "add":
            runner.add(args[0])
        elif op == "abort":
            runner.abort(args[0])
        elif op == "step":
            try:
                runner.step()
            except Exception:  # the leader's step failed the same way: its scheduler answers for it
                pass
            steps += 1
