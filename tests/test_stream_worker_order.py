"""A streaming worker runs a weight load or a scoring call only with its engine idle
(``rollout.stream_worker``, issue 30's mutation audit).

The module's rule: Receive and Score commands run only when no request is decoding; one that
arrives mid-batch waits until the batch has drained. The pool never sends one mid-batch, so
nothing exercised the rule and a worker that loaded weights under running requests passed
the suite. Here ``serve_stream`` runs in this process on a pipe whose commands arrive at given
engine steps, over a backend that logs every submit, step, finish, load and score. Its tokens
are its current weights, so a load mid-batch would also show in the responses: each request's
tokens must all come from the weights its result is stamped with.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.stream_worker import serve_stream
from megatron_rl.rollout.types import GenerationResult
from megatron_rl.rollout.worker import Done, Generate, Loaded, Receive, Result, Score
from tests.rollout_reference import request

OLD, NEW = 10, 20  # the token every step emits under version 0's and version 1's weights


class _Pipe:
    """The worker's end of its pipe: ``inbox`` is what has arrived; a blocking ``recv`` on an
    empty inbox takes the next batch of ``when_idle`` (EOF once none is left)."""

    def __init__(self, first: list, when_idle: list[list]) -> None:
        self.inbox, self.when_idle, self.sent = deque(first), deque(when_idle), []

    def poll(self) -> bool:
        return bool(self.inbox)

    def recv(self):
        if not self.inbox:
            if not self.when_idle:
                raise EOFError
            self.inbox.extend(self.when_idle.popleft())
        return self.inbox.popleft()

    def send(self, message) -> None:
        self.sent.append(message)


class _LoggingDecoder:
    """A ``StreamingBackend`` without a model: one token (its weights' value) per request per
    step; after step n, the commands ``arrivals[n]`` reach the pipe (while requests decode)."""

    streams_requests = True
    device = "cpu"

    def __init__(self, pipe: _Pipe, arrivals: dict[int, list]) -> None:
        self.pipe, self.arrivals = pipe, arrivals
        self.weights, self.steps, self.log = OLD, 0, []
        self._running: dict[str, list] = {}  # request id -> [request, tokens, version]

    def submit(self, requests, weight_version: int) -> None:
        for r in requests:
            self._running[r.request_id] = [r, [], weight_version]
        self.log.append(("submit", tuple(r.request_id for r in requests)))

    def step(self) -> list[GenerationResult]:
        self.steps += 1
        self.log.append(("step", tuple(self._running)))
        done = []
        for rid, (r, tokens, version) in list(self._running.items()):
            tokens.append(self.weights)
            if len(tokens) == r.sampling.max_new_tokens:
                del self._running[rid]
                self.log.append(("finish", rid))
                done.append(
                    GenerationResult(
                        request_id=rid,
                        prompt_ids=r.prompt_ids,
                        response_ids=tuple(tokens),
                        logprobs=(0.0,) * len(tokens),
                        finish_reason="length",
                        weight_version=version,
                    )
                )
        self.pipe.inbox.extend(self.arrivals.pop(self.steps, ()))
        return done

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def abort_all(self) -> None:
        self._running.clear()

    def load_tensors(self, named_tensors) -> None:
        self.log.append(("load", tuple(self._running)))
        for _, value in named_tensors:
            self.weights = value

    def score(self, requests, weight_version: int):
        self.log.append(("score", tuple(self._running)))
        for r in requests:
            yield ScoreResult(
                request_id=r.request_id,
                logprobs=(float(self.weights),) * len(r.response_ids),
                weight_version=weight_version,
            )

    def generate(self, requests, weight_version: int):
        raise AssertionError("a streaming worker submits and steps; it never calls generate")


class _Receiver:
    """A transport's receiver that hands the backend the version-1 weights."""

    def receive(self, load, backend) -> None:
        backend.load_tensors([("w", NEW)])


def _serve(first: list, arrivals: dict[int, list], when_idle: list[list]):
    pipe = _Pipe(first, when_idle)
    backend = _LoggingDecoder(pipe, arrivals)
    serve_stream(backend, pipe, 0, {"fake": _Receiver()})
    assert not arrivals, "a scripted arrival never came: the batch ended before its step"
    return backend, pipe.sent


def _gen(*specs: tuple[str, int]) -> Generate:
    return Generate(tuple(request(rid, (1, 2), max_new=n) for rid, n in specs))


def _receive() -> Receive:
    return Receive(SimpleNamespace(transport="fake", loads=True), 1)


def _check_ran_idle(log: list, kind: str) -> None:
    """``kind`` ran once, with nothing running, after every request submitted before it finished."""
    at = [i for i, (what, _) in enumerate(log) if what == kind]
    assert len(at) == 1, log
    assert log[at[0]][1] == (), f"{kind} ran while {log[at[0]][1]} were decoding: {log}"
    submitted = {rid for what, ids in log[: at[0]] if what == "submit" for rid in ids}
    finished = {rid for what, rid in log[: at[0]] if what == "finish"}
    assert submitted == finished, (submitted - finished, log)


def _results(sent: list) -> dict[str, GenerationResult]:
    return {m.result.request_id: m.result for m in sent if isinstance(m, Result)}


def test_a_weight_load_sent_mid_batch_waits_until_every_request_finished():
    # a, b, c decode; e joins after step 1; the load arrives after step 2 (b, c, e still running);
    # d is sent once the worker is idle again and must run on the new weights
    backend, sent = _serve(
        [_gen(("a", 2), ("b", 4), ("c", 6))], {1: [_gen(("e", 3))], 2: [_receive()]}, [[_gen(("d", 3))]]
    )
    _check_ran_idle(backend.log, "load")
    results = _results(sent)
    for rid, n in (("a", 2), ("b", 4), ("c", 6), ("e", 3)):
        assert (results[rid].response_ids, results[rid].weight_version) == ((OLD,) * n, 0), results[rid]
    assert (results["d"].response_ids, results["d"].weight_version) == ((NEW,) * 3, 1)
    kinds = [type(m).__name__ for m in sent]
    loaded = sent.index(Loaded(1))
    assert sent.index(Done(("a", "b", "c"))) < loaded < sent.index(Result(results["d"]))
    assert kinds.count("Result") == 5 and kinds.count("Done") == 3 and kinds.count("Failed") == 0


def test_a_scoring_call_sent_mid_batch_waits_until_every_request_finished():
    # the score, then a load, arrive after step 1 (b still decoding): both wait, then run in the
    # order sent, so the score sees the weights the batch decoded with
    score = Score(
        (
            ScoreRequest(request_id="s0", prompt_ids=(1, 2), response_ids=(3, 4, 5)),
            ScoreRequest(request_id="s1", prompt_ids=(6,), response_ids=(7,)),
        )
    )
    backend, sent = _serve([_gen(("a", 1), ("b", 5))], {1: [score, _receive()]}, [])
    _check_ran_idle(backend.log, "score")
    _check_ran_idle(backend.log, "load")
    assert [what for what, _ in backend.log if what in ("score", "load")] == ["score", "load"]
    results = _results(sent)
    assert results["a"].response_ids == (OLD,) and results["b"].response_ids == (OLD,) * 5
    assert (results["s0"].logprobs, results["s0"].weight_version) == ((float(OLD),) * 3, 0)
    assert results["s1"].logprobs == (float(OLD),)
    assert sent.index(Done(("a", "b"))) < sent.index(Result(results["s0"]))
    assert sent[-2:] == [Done(("s0", "s1")), Loaded(1)]
