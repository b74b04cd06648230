"""A reward scored by a vision-language judge behind an OpenAI-compatible chat-completions API (vLLM, SGLang, TGI).

Each (prompt, image) pair becomes one ``POST <url>/chat/completions`` request: the image as a base64 PNG data URL
and the judge's question (its template filled with the prompt), answered at temperature 0. Three judges ship,
each with the template its model was trained or evaluated with (the template text is the model's input, so it is
kept as its authors wrote it; sources below):

- ``"unifiedreward"``: UnifiedReward-2.0's point score, ``Alignment / Coherence / Style Score (1-5)``; the reward
  is the mean of the chosen ``dimensions``.
- ``"qwen-vl-yes-no"``: VQAScore's alignment question to a Qwen-VL instruct model, scored
  ``P(yes) / (P(yes) + P(no))`` from the first answer token's ``top_logprobs`` (as Flow-Factory's
  ``vllm_evaluate`` reward); a server that returns no log-probabilities is scored from the answer text (1 or 0).
- ``"unifiedreward-think-pairwise"``: Pref-GRPO's pairwise preference: every two images of the same prompt are
  compared by UnifiedReward-Think, and each image's reward is its win rate against the others.

A reply without a score, or with one the judge cannot mean (outside the template's range, a dimension scored twice,
a pairwise verdict for both images, unreadable log-probabilities), is a :class:`JudgeReplyError` naming the judge,
the model and quoting the reply, never a 0 or a guess: a silent default would bias the group advantages. The HTTP
side (one deadline per attempt, retries with backoff for connection errors, timeouts, HTTP 429 and 5xx, honouring
``Retry-After``, a bounded answer, the async client) is :class:`~trl_jagg.rewards.remote.RemoteReward`'s; at most
``max_concurrency`` requests are in flight at once. The API key comes from an environment variable, never from a
config file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import re
from collections import defaultdict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.lazy import check_pairs
from trl_jagg.rewards.remote import MAX_RESPONSE_BYTES, RemoteReward, encode_image
from trl_jagg.utils.redaction import check_env_name, check_url_without_credentials

URL_ENV = "TRL_JAGG_JUDGE_URL"
"""Default judge URL (e.g. ``http://localhost:8080/v1``) when none is passed."""
MODEL_ENV = "TRL_JAGG_JUDGE_MODEL"
"""Default served model name when none is passed (else the judge's own default)."""
API_KEY_ENV = "TRL_JAGG_JUDGE_API_KEY"
"""Environment variable read for the API key (sent as ``Authorization: Bearer``); unset means no key."""

logger = logging.getLogger(__name__)

# UnifiedReward-2.0 point score (image generation), CodeGoat24/UnifiedReward
# inference_qwen/UnifiedReward-2.0-inference/point_score_ACS_image_generation.py:29-42 @ff6f520; the same text is
# Pref-GRPO's get_unifiedreward_image_template (fastvideo/rewards/templates.py:251 @3e787f6).
UNIFIEDREWARD_POINT_TEMPLATE = (
    "You are presented with a generated image and its associated text caption. "
    "Your task is to analyze the image across multiple dimensions in relation to the caption. Specifically:\n"
    "Provide overall assessments for the image along the following axes (each rated from 1 to 5):\n"
    "- Alignment Score: How well the image matches the caption in terms of content.\n"
    "- Coherence Score: How logically consistent the image is (absence of visual glitches, object distortions, "
    "etc.).\n"
    "- Style Score: How aesthetically appealing the image looks, regardless of caption accuracy.\n\n"
    "Output your evaluation using the format below:\n\n"
    "Alignment Score (1-5): X\n"
    "Coherence Score (1-5): Y\n"
    "Style Score (1-5): Z\n\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)

# VQAScore's question for Qwen-VL models, linzhiqiu/t2v_metrics
# t2v_metrics/models/vqascore_models/qwen2vl_model.py:173 @6ecb74f.
YES_NO_TEMPLATE = 'Does this figure show "{prompt}"? Please answer Yes or No.'

# UnifiedReward-Think's pairwise image template as Pref-GRPO sends it, CodeGoat24/Pref-GRPO
# fastvideo/rewards/templates.py:172-235 @3e787f6 (the source's code indentation and trailing spaces removed from the lines).
THINK_PAIRWISE_TEMPLATE = """\
You are an objective and precise evaluator for image quality comparison. I will provide you with a text caption \
and two images generated based on this caption. You must analyze the two images carefully and determine which \
image is better.

Evaluation procedure:

1. The caption for the generated images is: 「{prompt}」. You must evaluate the two images across these core \
dimensions:
- Semantic consistency (how closely the image content aligns with the caption)
- Aesthetics (composition, color usage, artistic expression)
- Authenticity (realism and attention to detail)

2. You are also encouraged to add up to two additional evaluation dimensions if they are relevant to the specific \
caption or images (e.g., creativity, spatial layout, fine-grained detail). If no extra dimensions are relevant, \
just keep the three core dimensions.

3. For each evaluation dimension:
- Provide a score between 1–10 for both Image 1 and Image 2
- Provide a short rationale for each score (2–5 short sentences)
- The evaluation must follow exactly this format with line breaks and indentation:
    Dimension name:
        Image 1 (x/10) - rationale;
        Image 2 (y/10) - rationale

4. After evaluating all dimensions, calculate the total score for each image and show the calculation explicitly, \
following this exact format:
    Total score:
    Image 1: x+x+x=total
    Image 2: y+y+y=total

5. Wrap all reasoning and scoring strictly within <think> and </think> tags.

6. After </think>, output the final judgment strictly inside <answer> and </answer> tags, containing only one of:
- Image 1 is better
- Image 2 is better

Constraints:
- You must strictly follow the line breaks, indentation, and formatting shown in the example below.
- Do not merge multiple dimensions into one line. Each dimension must follow the 3-line block format shown below.
- Do not use Markdown formatting, bullet points, bold text, or headings.
- Do not output explanations outside <think> and <answer>.
- The <answer> tag must contain only the final string with no extra words.

Required output format:

<think>
1. Semantic consistency:
    Image 1 (9/10) - ...;
    Image 2 (7/10) - ...
2. Aesthetics:
    Image 1 (8/10) - ...;
    Image 2 (8/10) - ...
3. Authenticity:
    Image 1 (8/10) - ...;
    Image 2 (5/10) - ...
[Additional dimension if any]:
    Image 1 (7/10) - ...;
    Image 2 (8/10) - ...
[Additional dimension if any]:
    Image 1 (6/10) - ...;
    Image 2 (7/10) - ...
Total score:
Image 1: 9+8+8+7+6=38
Image 2: 7+8+5+8+7=35
</think>
<answer>Image 1 is better</answer>

Note: The example above is only to illustrate the exact format (line breaks, indentation, symbols, and style). \
Your actual evaluation must follow this format exactly, but be based on the given caption and images.
"""


@dataclass(frozen=True)
class Judge:
    """How one judge is asked and how its reply becomes a score.

    Attributes:
        template: The question, with ``{prompt}`` where the prompt goes.
        mode: ``"point"`` (scores parsed from the text), ``"yes_no"`` (log-probability of yes) or ``"pairwise"``
            (two images per request, win rates within each prompt's images).
        max_tokens: Tokens the judge may answer with.
        model: Default served model name (vLLM's ``--served-model-name``).
        checkpoint: The Hub checkpoint to serve (for the docs and error messages).
    """

    template: str
    mode: str
    max_tokens: int
    model: str
    checkpoint: str


JUDGES: dict[str, Judge] = {
    "unifiedreward": Judge(
        UNIFIEDREWARD_POINT_TEMPLATE, "point", 256, "UnifiedReward", "CodeGoat24/UnifiedReward-2.0-qwen3vl-8b"
    ),
    "qwen-vl-yes-no": Judge(YES_NO_TEMPLATE, "yes_no", 1, "Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"),
    "unifiedreward-think-pairwise": Judge(
        THINK_PAIRWISE_TEMPLATE, "pairwise", 4096, "UnifiedReward", "CodeGoat24/UnifiedReward-Think-qwen3vl-8b"
    ),
}
"""The judges :func:`vlm_judge` knows by name."""

POINT_DIMENSIONS = ("Alignment", "Coherence", "Style")
POINT_RANGE = (1.0, 5.0)
"""The range UnifiedReward's point-score template declares for each dimension (``Score (1-5)``)."""
# A whole number as written (with an exponent: "1e9" must not read as 1); the template's "X" placeholders never match.
_POINT_SCORE = re.compile(
    r"\b(Alignment|Coherence|Style) Score \(1-5\):\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)"
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FIRST_WORD = re.compile(r"[A-Za-z]+")


class JudgeReplyError(ValueError):
    """A judge's reply holds no score, or one it cannot mean: out of the judge's range, given twice, contradictory,
    or unreadable log-probabilities. Raised from the reward's call, so ``reward_retries`` retries it."""


def point_score(text: str, dimensions: Sequence[str] = POINT_DIMENSIONS) -> float:
    """The mean of the ``dimensions`` scores in a UnifiedReward-2.0 point-score reply.

    Raises:
        JudgeReplyError: when one of ``dimensions`` has no score in ``text``, more than one, or one outside
            :data:`POINT_RANGE`.
    """
    scores: dict[str, list[float]] = defaultdict(list)
    for name, value in _POINT_SCORE.findall(text):
        scores[name].append(float(value))
    missing = [name for name in dimensions if name not in scores]
    if missing:
        raise JudgeReplyError(f"no {', '.join(missing)} score (expected lines like 'Alignment Score (1-5): 3.5')")
    twice = [name for name in dimensions if len(scores[name]) > 1]
    if twice:
        shown = "; ".join(f"{name} {scores[name]}" for name in twice)
        raise JudgeReplyError(f"more than one score for a dimension ({shown}): which one the judge means is unknown")
    low, high = POINT_RANGE
    outside = [f"{name} {scores[name][0]:g}" for name in dimensions if not low <= scores[name][0] <= high]
    if outside:
        raise JudgeReplyError(f"scores outside the template's range {low:g}-{high:g}: {', '.join(outside)}")
    return sum(scores[name][0] for name in dimensions) / len(dimensions)


def yes_probability(choice: dict[str, Any]) -> float | None:
    """``P(yes) / (P(yes) + P(no))`` from the first answer token's ``top_logprobs`` in a chat-completions choice,
    summing the spellings of each word (``"Yes"``, ``" yes"``, ``"YES"``). ``None`` when the choice carries no
    log-probabilities or neither word is among the top tokens.

    Raises:
        JudgeReplyError: a top token that is not ``{"token": str, "logprob": number <= 0}`` (a missing, non-finite
            or positive log-probability would give an overflow, a KeyError or a NaN reward).
    """
    content = (choice.get("logprobs") or {}).get("content") or []
    if not content or not isinstance(content[0], dict):
        return None
    top = content[0].get("top_logprobs") or []
    if not isinstance(top, list):
        raise JudgeReplyError(f"top_logprobs is a {type(top).__name__}, not a list")
    mass = {"yes": 0.0, "no": 0.0}
    for entry in top:
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        # A log-probability is <= 0; a little above is rounding (vLLM sends 0.0 for a certain token, never more).
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str) or isinstance(logprob, bool):
            raise JudgeReplyError(f"a top_logprobs entry is not {{'token': str, 'logprob': number}}: {entry!r}"[:200])
        if not isinstance(logprob, (int, float)) or not -math.inf <= logprob <= 1e-6 or math.isnan(logprob):
            raise JudgeReplyError(f"the log-probability of {entry['token']!r} is {logprob!r}, not a number <= 0")
        word = entry["token"].strip().lower()
        if word in mass:
            mass[word] += math.exp(logprob)
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total > 0 else None


def yes_no_answer(text: str) -> float:
    """1.0 for an answer starting with yes, 0.0 for no (any case, after punctuation and spaces).

    Raises:
        JudgeReplyError: for any other answer.
    """
    word = _FIRST_WORD.search(text)
    answer = word.group(0).lower() if word else ""
    if answer not in ("yes", "no"):
        raise JudgeReplyError("the answer is neither yes nor no")
    return 1.0 if answer == "yes" else 0.0


def pairwise_winner(text: str) -> int:
    """0 when the reply's ``<answer>`` says Image 1 is better, 1 for Image 2.

    Raises:
        JudgeReplyError: without an ``<answer>`` naming one of the two images, or with answers naming both.
    """
    answers = _ANSWER.findall(text)
    first = any("Image 1 is better" in answer for answer in answers)
    second = any("Image 2 is better" in answer for answer in answers)
    if first and second:
        raise JudgeReplyError("answers naming both images: the verdict is contradictory")
    if not first and not second:
        raise JudgeReplyError("no '<answer>Image 1 is better</answer>' or '<answer>Image 2 is better</answer>'")
    return 0 if first else 1


class VLMJudgeReward(RemoteReward):
    """Scores images with a VLM judge served over an OpenAI-compatible chat-completions API; see
    :func:`vlm_judge` for the arguments."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        judge: str = "unifiedreward",
        dimensions: Sequence[str] = POINT_DIMENSIONS,
        max_concurrency: int = 8,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        top_logprobs: int = 20,
        api_key_env: str = API_KEY_ENV,
        name: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if judge not in JUDGES:
            raise ValueError(f"Unknown judge {judge!r}; use one of {sorted(JUDGES)}.")
        unknown = sorted(set(dimensions) - set(POINT_DIMENSIONS))
        if not dimensions or unknown:
            raise ValueError(f"dimensions must be a non-empty subset of {POINT_DIMENSIONS}, got {tuple(dimensions)}.")
        if max_concurrency < 1 or not 1 <= top_logprobs <= 20:
            raise ValueError("max_concurrency must be >= 1 and top_logprobs in 1..20 (the OpenAI API's range).")
        # Keys live in environment variables, never in a URL or a config value (both are saved and logged).
        check_url_without_credentials(
            url, f"vlm-judge {judge!r}", f"export the key as {API_KEY_ENV} (or the variable api_key_env names)."
        )
        check_env_name(
            api_key_env, f"vlm-judge {judge!r}: api_key_env", "Export the key (export MY_JUDGE_KEY=...) and pass "
            f"api_key_env='MY_JUDGE_KEY', or leave the default {API_KEY_ENV}."
        )  # fmt: skip
        if api_key_env != API_KEY_ENV and api_key_env not in os.environ:
            logger.warning("vlm-judge %r: api_key_env=%r is not set, so no API key is sent.", judge, api_key_env)
        endpoint = url.rstrip("/")
        if not endpoint.endswith("/chat/completions"):
            endpoint += "/chat/completions"  # a base URL like http://host:8000/v1, as OpenAI clients take
        # An empty token sends no Authorization header; the reward server's token variable is never read here.
        super().__init__(
            endpoint, timeout=timeout, retries=retries, backoff=backoff, name=name or judge.replace("-", "_"),
            token=os.environ.get(api_key_env, ""), max_response_bytes=max_response_bytes,
        )  # fmt: skip
        self.judge = judge
        self.spec = JUDGES[judge]
        self.model = model or os.environ.get(MODEL_ENV) or self.spec.model
        self.dimensions = tuple(dimensions)
        self.max_concurrency = max_concurrency
        self.top_logprobs = top_logprobs
        # One bound for every call of this reward: overlapped rollout chunks call it at once (all on one event loop).
        self._slots = asyncio.Semaphore(max_concurrency)

    @property
    def per_sample(self) -> bool:  # type: ignore[override]
        """A point or yes/no score depends on its image alone; a win rate on the prompt's other images."""
        return self.spec.mode != "pairwise"

    def _chat_body(self, prompt: str, images: list[Image.Image]) -> bytes:
        """The request asking the judge's question about ``images``: a chat completion at temperature 0."""
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encode_image(image)}"}}
            for image in images
        ]
        content.append({"type": "text", "text": self.spec.template.format(prompt=prompt)})
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.0,
            "max_tokens": self.spec.max_tokens,
        }
        if self.spec.mode == "yes_no":
            payload.update(logprobs=True, top_logprobs=self.top_logprobs)
        return json.dumps(payload).encode("utf-8")

    async def _ask(
        self, client: httpx.AsyncClient, prompt: str, images: list[Image.Image]
    ) -> tuple[str, dict[str, Any]]:
        """One request: the images and the judge's question; returns the reply text and the whole choice."""
        async with self._slots:  # encoded in the slot too: at most max_concurrency request bodies held at once
            body = await asyncio.to_thread(self._chat_body, prompt, images)  # PNG encoding off the event loop
            answer = await self._post(client, body)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(
                f"VLM judge {self.__name__!r} at {self.shown_url} sent a reply that is not a chat completion: "
                f"{repr(answer)[:200]}"
            ) from None
        return text, choice

    async def _score_one(self, client: httpx.AsyncClient, prompt: str, image: Image.Image) -> float:
        text, choice = await self._ask(client, prompt, [image])
        try:
            if self.spec.mode == "point":
                return point_score(text, self.dimensions)
            try:
                probability = yes_probability(choice)
            except JudgeReplyError as error:  # the reply shown is the log-probabilities, which were unreadable
                raise self._reply_error(error, repr(choice.get("logprobs"))) from None
            return probability if probability is not None else yes_no_answer(text)
        except JudgeReplyError as error:
            raise self._reply_error(error, text) from None

    async def _winner(self, client: httpx.AsyncClient, prompt: str, first: Image.Image, second: Image.Image) -> int:
        text, _ = await self._ask(client, prompt, [first, second])
        try:
            return pairwise_winner(text)
        except JudgeReplyError as error:
            raise self._reply_error(error, text) from None

    def _reply_error(self, error: JudgeReplyError, text: str) -> JudgeReplyError:
        return JudgeReplyError(
            f"VLM judge {self.__name__!r} ({self.judge}, model {self.model!r} at {self.shown_url}) sent a reply that gives "
            f"no score: {error}. Reply: {text[:300]!r}. Is the served model the judge's ({self.spec.checkpoint})?"
        )

    async def acall(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float | None]:
        """Score each (prompt, image) pair; in pairwise mode an image's score is its win rate against the other
        images of its prompt, and ``None`` (not applicable) for a prompt with a single image."""
        check_pairs(prompts, images)
        async with self._client() as client:
            if self.spec.mode != "pairwise":
                return await _all([self._score_one(client, *call) for call in zip(prompts, images)])
            by_prompt: dict[str, list[int]] = defaultdict(list)
            for index, prompt in enumerate(prompts):
                by_prompt[prompt].append(index)
            pairs = [pair for indices in by_prompt.values() for pair in itertools.combinations(indices, 2)]
            winners = await _all([self._winner(client, prompts[i], images[i], images[j]) for i, j in pairs])
        wins = [0] * len(images)
        for pair, winner in zip(pairs, winners):
            wins[pair[winner]] += 1
        opponents = {index: len(indices) - 1 for indices in by_prompt.values() for index in indices}
        return [wins[i] / opponents[i] if opponents[i] else None for i in range(len(images))]

    def __repr__(self) -> str:
        return f"VLMJudgeReward(url={self.shown_url!r}, judge={self.judge!r}, model={self.model!r}, name={self.__name__!r})"


async def _all(calls: list[Awaitable[Any]]) -> list[Any]:
    """The results of ``calls``, run concurrently, in call order. The first failure cancels the others (and waits for
    them to stop, so that no request outlives the call's client) and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@register_reward("vlm-judge")
def vlm_judge(
    url: str | None = None,
    model: str | None = None,
    judge: str = "unifiedreward",
    dimensions: Sequence[str] = POINT_DIMENSIONS,
    max_concurrency: int = 8,
    timeout: float = 120.0,
    retries: int = 3,
    backoff: float = 1.0,
    top_logprobs: int = 20,
    api_key_env: str = API_KEY_ENV,
    name: str | None = None,
) -> VLMJudgeReward:
    """A VLM judge served over an OpenAI-compatible chat-completions API (see docs/rewards.md for the servers).

    Args:
        url: The API base (``http://localhost:8080/v1``) or its ``/chat/completions`` endpoint; default the
            ``TRL_JAGG_JUDGE_URL`` environment variable.
        model: The served model name; default ``TRL_JAGG_JUDGE_MODEL``, else the judge's (``"UnifiedReward"`` for
            the UnifiedReward judges, as their vLLM scripts serve them; ``"Qwen2.5-VL-7B-Instruct"``).
        judge: ``"unifiedreward"`` (point score), ``"qwen-vl-yes-no"`` (log-probability of yes) or
            ``"unifiedreward-think-pairwise"`` (win rate within each prompt's images); see :data:`JUDGES`.
        dimensions: The UnifiedReward point-score dimensions averaged into the reward.
        max_concurrency: Requests in flight at once, over every call of this reward (overlapped rollout chunks call
            it at once).
        timeout: Seconds one attempt of one request may take in all (a deadline, as in :func:`remote`).
        retries: Extra attempts after a connection error, timeout, HTTP 429 or 5xx; waits ``backoff * 2**k`` s, or
            the answer's ``Retry-After`` (at most ``timeout``), as in :func:`remote`.
        top_logprobs: Top tokens asked for in ``"qwen-vl-yes-no"`` (vLLM serves at most 20 by default).
        api_key_env: The environment variable holding the API key (unset: no key is sent).
        name: Metric name; default the judge's name with underscores.

    Raises:
        ValueError: without a URL (neither ``url`` nor ``TRL_JAGG_JUDGE_URL``), or for an unknown judge.
    """
    url = url or os.environ.get(URL_ENV)
    spec = JUDGES.get(judge, JUDGES["unifiedreward"])
    if not url:
        raise ValueError(
            f"The vlm-judge reward needs the judge's URL: pass url='http://localhost:8080/v1' (or set {URL_ENV}). "
            f"Serve one with: vllm serve {spec.checkpoint} --served-model-name {spec.model} --port 8080 (see "
            "docs/rewards.md)."
        )
    return VLMJudgeReward(
        url, model=model, judge=judge, dimensions=dimensions, max_concurrency=max_concurrency, timeout=timeout,
        retries=retries, backoff=backoff, top_logprobs=top_logprobs, api_key_env=api_key_env, name=name,
    )  # fmt: skip
