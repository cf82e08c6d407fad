"""Rank 0's dispatcher thread (DP > 1): groups reach the other replicas while rank 0 trains its own.

Without it the loop on global rank 0 both cuts the step's micro-batches and trains replica 0's:
while rank 0 runs a forward/backward, groups that complete wait in the pipeline queue, and
replicas 1..n-1 idle although their micro-batches could be cut and sent (periodic mode).

``dispatch_ahead(batch, replica)`` runs ``batch.mini_batches()`` in a thread of its own: a
micro-batch routed to another replica is sent at once (``LeaderReplica.train_micro_batch``:
an asynchronous send), one for replica 0 goes to a local queue that the training thread
drains. What each replica trains, and in which mini-batch, is unchanged (the same
``StepBatch`` cuts it), so periodic == sync and DP = n == DP = 1 hold as before.

Ordering: every message to a replica must keep its order, and mini-batch j + 1 must train on
the weights after optimizer step j. The thread sends mini-batch j's micro-batches, puts an
end marker, and waits until the training thread has asked for mini-batch j + 1 (it does so
only after its ``optimizer_step``, which sends step j to every replica) before it cuts
anything of j + 1. An error in the thread (the pipeline failed, ``parallel.timeout_s``
expired) is raised in the training thread at its next micro-batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from megatron_rl.pipeline import MicroBatch
from megatron_rl.pipeline.batching import StepBatch

_END = object()  # end of one mini-batch's micro-batches for replica 0


def dispatch_ahead(batch: StepBatch, replica) -> Iterator[Iterator[MicroBatch]]:
    """``batch.mini_batches()`` as the training thread of rank 0 iterates it: with a dispatch
    channel (DP > 1), replica 0's micro-batches only, the others sent by ``AheadDispatcher``."""
    if getattr(replica, "dispatch", None) is None:
        return batch.mini_batches()
    return AheadDispatcher(batch, send_remote=replica.train_micro_batch).mini_batches()


class AheadDispatcher:
    """One step's dispatch thread; see the module doc."""

    def __init__(self, batch: StepBatch, *, send_remote: Callable[[MicroBatch], None], join_s: float = 30.0) -> None:
        self._batch, self._send, self._join_s = batch, send_remote, join_s
        self._local: queue.SimpleQueue = queue.SimpleQueue()  # replica 0's micro-batches, _END, or an error
        self._next_mini = threading.Semaphore(0)  # released when the trainer asks for the next mini-batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron_rl-dispatcher", daemon=True)
        self._training = False  # replica 0 has a micro-batch in training (the trainer holds one)
        self.sent_while_training = 0  # remote micro-batches sent meanwhile (what this thread is for)

    def mini_batches(self) -> Iterator[Iterator[MicroBatch]]:
        """The trainer's view: per mini-batch, replica 0's micro-batches."""
        self._thread.start()
        try:
            for _ in range(self._batch.num_mini_batches):
                yield self._local_micro_batches()
                self._next_mini.release()  # optimizer step j was sent: mini-batch j + 1 may go out
        except BaseException:
            self._stop.set()  # the thread ends at its next mini-batch, or when the pipeline is aborted
            self._next_mini.release()
            raise
        self._thread.join(self._join_s)  # done: it has put the last end marker

    def _local_micro_batches(self) -> Iterator[MicroBatch]:
        while (item := self._local.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            self._training = True
            yield item
            self._training = False

    def _run(self) -> None:
        try:
            for j, mini_batch in enumerate(self._batch.mini_batches()):
                if j:
                    self._next_mini.acquire()
                    if self._stop.is_set():
                        return
                for mb in mini_batch:
                    if mb.replica == 0:
                        self._local.put(mb)
                    else:
                        self.sent_while_training += self._training
                        self._send(mb)
                self._local.put(_END)
        except BaseException as err:  # noqa: BLE001 -- re-raised in the training thread
            self._local.put(err)
