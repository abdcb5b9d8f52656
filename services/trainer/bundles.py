"""The bundle an epoch of the trainer service trains under: its rollback request (`rollback_request`) and, in
overlap mode, the wait for it on the event loop while the training thread polls between iterations
(`BundleWaiter`).

Imports: asyncio, `shared.knobs`; `TrainerWorker` for types only (the waiter calls its `_wait_bundle` and
`_roll_back`).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from shared.knobs import Knobs

if TYPE_CHECKING:
    from services.trainer.worker import TrainerWorker


class BundleWaiter:
    """Overlap mode: waits on the event loop for bundle `epoch` (`TrainerWorker._wait_bundle`, bounded by the
    timeout) while the training thread polls it between iterations (`poll`, handed to `train_epoch`)."""

    def __init__(self, worker: "TrainerWorker", epoch: int):
        self.epoch = epoch
        self.applied: dict | None = None         # {"epoch", "iteration", "at"} once applied
        self.rollback: dict = {}                 # the record of the bundle's rollback, done where it was applied
        self._worker = worker
        self._result: tuple[dict | None, bool] | None = None
        self._task = asyncio.get_running_loop().create_task(worker._wait_bundle(epoch))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            bundle, timed_out, _ = task.result()
            self._result = (bundle, timed_out)   # one assignment: the training thread reads it atomically

    @property
    def bundle(self) -> dict | None:
        """The bundle, once stored (None before, or after a timeout)."""
        return None if self._result is None else self._result[0]

    def poll(self, iteration: int) -> Knobs | None:
        """Training thread, before each iteration: the bundle's knobs the first time it is seen (after its
        rollback, when it asks for one), else None."""
        r = self._result
        if self.applied is not None or r is None or r[0] is None:
            return None
        self.applied = {"epoch": self.epoch, "iteration": iteration, "at": time.time()}
        req = rollback_request(r[0])
        if req:
            self.rollback = {**req, **self._worker._roll_back(req), "rollback_iteration": iteration}
        return Knobs.from_dict(r[0]["knobs"])

    async def result_async(self) -> tuple[dict | None, bool]:
        """(bundle or None, timed out), waiting for it when it is not in yet."""
        bundle, timed_out, _ = await self._task
        return bundle, timed_out

    def cancel(self) -> None:
        self._task.cancel()


def rollback_request(bundle: dict | None) -> dict:
    """{"rollback_to_epoch", "rollback_checkpoint_sha256", "rollback_keep", "rollback_restart"} of a bundle that asks
    for a rollback, else {}."""
    if bundle and bundle.get("rollback") and bundle.get("rollback_to_epoch") is not None:
        return {"rollback_to_epoch": int(bundle["rollback_to_epoch"]),
                "rollback_checkpoint_sha256": str(bundle.get("rollback_checkpoint_sha256") or ""),
                "rollback_keep": float(bundle.get("rollback_keep") or 0.0),
                "rollback_restart": bool(bundle.get("rollback_restart"))}
    return {}
