"""Record the producer's queue to JSONL, and replay it without any engine (debug modes).

``rollout.record: PATH`` makes the producer write every item it puts on the queue, in order:
each ``BatchStart``, every scored group (prompt and response token ids, behaviour log-probs,
weight versions, rewards, advantages, the dynamic-sampling verdict) and each ``BatchEnd``.
One JSON object a line, ``{"kind": "start" | "group" | "end", ...}``.

``ReplayProducer`` feeds such a file back into the consumer in place of the producer thread:
the trainer sees the very same groups, in the same order, so ``python -m megatron_rl replay
CONFIG PATH`` makes the same update as the live run that recorded it, with no engine, reward
function or data set. A recording is a plain text file: a bug found at step 1000 is
reproduced from the groups of that step alone.
"""

from __future__ import annotations

import base64
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.pipeline.inputs import StepSpan
from megatron_rl.pipeline.records import BatchEnd, BatchStart, QueueItem, Sample, ScoredGroup, put_unless_stopped
from megatron_rl.rollout.types import RoutedExperts


def item_to_json(item: QueueItem) -> dict[str, Any]:
    """A queue item as plain JSON data (exact: floats round-trip through ``repr``)."""
    if isinstance(item, BatchStart):
        return {"kind": "start", **item.__dict__}
    if isinstance(item, BatchEnd):
        return {"kind": "end", **item.__dict__}
    return {
        "kind": "group",
        "step": item.step,
        "prompt_index": item.prompt_index,
        "prompt_id": item.prompt_id,
        "kept": item.kept,
        "rewards": item.rewards.tolist(),
        "advantages": item.advantages.tolist(),
        "samples": [_sample_to_json(s) for s in item.samples],
    }


def _sample_to_json(s: Sample) -> dict[str, Any]:
    """A sample's fields; MoE routes as {"shape", "int16"}: little-endian int16 bytes in base64."""
    data = dict(s.__dict__)
    if s.routed_experts is not None:
        idx = s.routed_experts.indices
        data["routed_experts"] = {
            "shape": list(idx.shape),
            "int16": base64.b64encode(idx.astype("<i2").tobytes()).decode(),
        }
    return data


def _sample_from_json(data: dict[str, Any]) -> Sample:
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    routes = fields.get("routed_experts")
    if routes is not None:
        flat = np.frombuffer(base64.b64decode(routes["int16"]), dtype="<i2")
        fields["routed_experts"] = RoutedExperts(flat.reshape(routes["shape"]))
    return Sample(**fields)


def item_from_json(data: dict[str, Any], where: str = "") -> QueueItem:
    """Inverse of ``item_to_json``; ``ValueError`` naming ``where`` for a malformed record."""
    data = dict(data)
    kind = data.pop("kind", None)
    try:
        if kind == "start":
            return BatchStart(**data)
        if kind == "end":
            data["response_lengths"] = tuple(data["response_lengths"])
            return BatchEnd(**data)
        if kind == "group":
            samples = tuple(_sample_from_json(s) for s in data.pop("samples"))
            return ScoredGroup(
                samples=samples,
                rewards=torch.tensor(data.pop("rewards"), dtype=torch.float32),
                advantages=torch.tensor(data.pop("advantages"), dtype=torch.float32),
                **data,
            )
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"{where}: not a recorded queue item ({type(err).__name__}: {err})") from err
    raise ValueError(f"{where}: unknown record kind {kind!r} (expected start, group or end)")


class QueueRecorder:
    """Appends queue items to a JSONL file (called from the producer thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._lock = threading.Lock()

    def __call__(self, item: QueueItem) -> None:
        with self._lock:
            self._file.write(json.dumps(item_to_json(item)) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_recording(path: str | Path, *, start_step: int = 0) -> Iterator[QueueItem]:
    """The recorded items of steps >= ``start_step``, in order."""
    with Path(path).open() as lines:
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err})") from err
            item = item_from_json(data, where=f"{path}:{n}")
            if item.step >= start_step:
                yield item


@dataclass(frozen=True, kw_only=True)
class ReplayInputs:
    """What a replayed run generates from: a recording (``rollout.record``) instead of engines,
    prompts, a reward function or a controller; ``engine`` only counts versions."""

    path: Path
    engine: NullEngine


class ReplayProducer:
    """Stands in for the producer thread: puts a recording's items of ``steps`` on the queue (same
    contract: never raises, ``error`` holds a failure, ``stop()`` ends it)."""

    def __init__(self, path: str | Path, steps: StepSpan, *, out: queue.Queue[QueueItem], poll_s: float) -> None:
        self._path, self._out, self._poll_s = Path(path), out, poll_s
        self._steps = steps.steps
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatron_rl-producer", daemon=True)

    def _run(self) -> None:
        try:
            seen = set()
            for item in read_recording(self._path, start_step=self._steps.start):
                if item.step not in self._steps:
                    break
                seen.add(item.step)
                if not put_unless_stopped(self._out, item, self._stop, self._poll_s):
                    return
            if missing := [s for s in self._steps if s not in seen]:
                raise ValueError(f"{self._path}: the recording has no step {missing[0]} (steps {missing})")
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()


class NullEngine:
    """The ``RolloutEngine`` of a replay: generates nothing, keeps the version count."""

    def __init__(self, version: int = 0) -> None:
        self.weight_version = version

    def generate(self, requests):
        raise RuntimeError("a replay has no rollout engine")

    def score(self, requests):
        raise RuntimeError("a replay has no rollout engine to score with (the engine probe is off in a replay)")

    def load_weights(self, update, version: int) -> None:
        self.weight_version = version

    def shutdown(self) -> None:
        pass
