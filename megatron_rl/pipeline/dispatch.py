"""Data parallelism: which model replica trains which group of a step.

One dispatcher for all replicas, not one producer per replica. The producer thread and the
engine pool live on global rank 0 (the leader of DP replica 0); as each group of a step
completes, ``StepBatch`` gives it to the replica with the fewest packed tokens so far this
step (``TokenRouter``), packs that replica's micro-batches, and rank 0 sends each micro-batch
to its replica's leader (``trainer.data_parallel``). Why one dispatcher:

- Balance. Response lengths are heavy-tailed and unknown until a group completes. A fixed
  share of the prompts per replica (one producer each) leaves a replica that drew the long
  groups training while the others wait at the gradient all-reduce; routing completed groups
  by tokens evens the work whatever the lengths (``train/dp_imbalance`` = max / mean tokens
  per replica: 1.0 is perfect).
- One batch, one state. The prompt stream, the group-size controller (SAGC sees the whole
  batch's lengths), the per-request sampling seeds and the policy-version bookkeeping stay
  single, so a DP = n run generates exactly the DP = 1 run's batch and checkpoints one
  controller and one stream; the update is the DP = 1 update (global loss normalisation,
  ``trainer.policy_step``), the tests' reference.
- One engine owner. The engines receive weights from one rank once per batch after every
  replica's optimizer step, so ``periodic`` stays exactly on-policy at DP > 1.

The cost is that rank 0 ships micro-batches (token ids, advantages, behaviour log-probs: a few
MB per step, asynchronously) to the other replicas; it never ships weights or activations.
"""

from __future__ import annotations


class TokenRouter:
    """Least-loaded assignment of groups to ``replicas`` by packed tokens, for one step."""

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"the number of data-parallel replicas must be >= 1, got {replicas}")
        self.loads = [0] * replicas  # packed tokens given to each replica this step

    @property
    def replicas(self) -> int:
        return len(self.loads)

    def assign(self, tokens: int) -> int:
        """The replica with the fewest tokens so far (lowest index on ties); it gets ``tokens``."""
        replica = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
        self.loads[replica] += tokens
        return replica

    def imbalance(self) -> float:
        """max / mean tokens per replica (1.0 when balanced or when nothing was routed)."""
        total = sum(self.loads)
        return 1.0 if total == 0 else max(self.loads) * len(self.loads) / total
