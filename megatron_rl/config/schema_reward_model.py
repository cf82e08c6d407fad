"""The ``reward`` section's model-scored parts: an LLM judge (``reward.judge``), a
sequence-classification reward model (``reward.model``), and which reward a run uses
(``reward.kind``: one source, or ``combined``: a weighted sum of several, ``reward.weights``).

Imported by ``schema.py`` after its enums (``DType``, ``EngineName``), which this module reuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .schema import DType, EngineName

# reward.kind: the function of reward.fn, the judge, the reward model, or a weighted sum of these
RewardKind = Literal["function", "judge", "model", "combined"]
# reward.weights keys: the components a combined reward may sum
REWARD_COMPONENTS: tuple[str, ...] = ("function", "judge", "model")
# reward.judge.parser names (any other parser is a dotted path "pkg.mod:function" taking the verdict text)
BuiltinParser = Literal["score", "last_number", "yes_no"]
# The placeholders a judge template may hold; {question} and {response} are required.
JUDGE_PLACEHOLDERS: tuple[str, ...] = ("question", "response", "reference", "rubric")

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the task below.\n\nTask:\n{question}\n\nReference answer: {reference}\n\n"
    "Answer to grade:\n{response}\n\nRubric: {rubric}\n\nEnd your reply with one line 'Score: N'."
)


@dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """An LLM judge: each response is put in ``template``, its own engines generate a verdict
    (greedy by default), ``parser`` reads the score from it; a verdict without one scores 0
    (counted as ``unparsed``), so does a batch not answered within reward.timeout_s (``timeout``).
    Its engines are supervised like the rollout engines (rollout.request_timeout_s finds a hung
    worker, rollout.max_restarts)."""

    model: str | None = None  # HF checkpoint dir of the judge (required when the judge is used)
    # The judge's prompt; placeholders {question} (the task), {response} (the answer judged),
    # {reference} (the task's reference answer), {rubric}; other braces are left as written.
    template: str = DEFAULT_JUDGE_TEMPLATE
    rubric: str = "10 if the final answer equals the reference answer, else 0."  # fills {rubric}
    parser: str = "score"  # score ('Score: N', the last one), last_number, yes_no (1 / 0), or "pkg.mod:fn"
    chat_template: bool = True  # wrap the prompt as one user turn with the judge tokenizer's chat template
    engine: EngineName = "hf"  # the judge's engines: vllm or the embedded hf engine
    devices: list[str] = field(default_factory=list)  # one device string per judge engine; [] = one CPU engine
    dtype: DType = "bfloat16"  # the judge's weights and compute dtype
    max_new_tokens: int = 64  # verdict length cap
    temperature: float = 0.0  # 0 = greedy (a deterministic judge)
    batch: int = 64  # the most verdicts requested in one engine call


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A sequence-classification reward model (transformers AutoModelForSequenceClassification, one
    label): the reward is its logit for the prompt and response (chat template when its tokenizer
    has one). Scored in batches by worker processes of its own; a batch running longer than
    reward.timeout_s scores 0 (counted, its worker killed and replaced)."""

    path: str | None = None  # HF checkpoint dir (required when the reward model is used)
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # one worker process per device string
    dtype: DType = "float32"  # weights and compute dtype
    batch: int = 16  # the most responses scored in one forward
