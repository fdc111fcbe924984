"""The OpenAI-compatible surface: completion and chat requests become rollouts, and rollouts OpenAI's answers."""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING

from pydantic import ValidationError

from services import protocol as P
from services.errors import Invalid
from services.rollout_jobs import Job

if TYPE_CHECKING:
    from services.fanout import Fanout
    from services.replicas import Replicas


class OpenAICompat:
    def __init__(self, fanout: Fanout, replicas: Replicas, model: str):
        self.fanout, self.replicas = fanout, replicas
        self.model_name = os.path.basename(model.rstrip("/"))

    async def completions(self, req: P.CompletionRequest) -> dict:
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        params = sampling(req.max_tokens, req.temperature, req.top_p, req.seed)
        return await self._answer("text_completion", prompts, req.n, params, req.stop, req.logprobs is not None)

    async def chat(self, req: P.ChatCompletionRequest) -> dict:
        text = await self.replicas.call("render_chat", [m.model_dump() for m in req.messages])
        if text is None:
            raise Invalid(
                [{"field": "messages", "message": "no chat template"}],
                "the served model has no chat template: use /v1/completions",
            )
        params = sampling(req.max_completion_tokens or req.max_tokens or 256, req.temperature, req.top_p, req.seed)
        return await self._answer("chat.completion", [text], req.n, params, req.stop, req.logprobs)

    async def _answer(self, kind: str, prompts: list[str], n: int, params: P.SamplingParams, stop, logprobs: bool):
        try:
            rollout = P.RolloutRequest(prompts=[P.Prompt(text=p) for p in prompts], n=n, sampling_params=params)
        except ValidationError as e:
            raise Invalid([{"field": "prompt", "message": err["msg"]} for err in e.errors()]) from None
        result = await self.fanout.produce(Job(len(prompts)), rollout)
        samples = [s.token_ids for g in result.groups for s in g.samples]
        pieces = await self.replicas.call("token_pieces", samples) if logprobs else None
        return response(kind, self.model_name, result.groups, stop, kind == "chat.completion", pieces)


def sampling(max_tokens: int, temperature: float, top_p: float, seed: int | None) -> P.SamplingParams:
    return P.SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces of a sample join to its text. Decoded in a short window of
    context (as vLLM does): a token that ends inside a multi-byte character adds "" and the token that completes
    it adds the character; a lone token would lose a SentencePiece leading space."""
    pieces, prefix, read = [], 0, 0
    for i in range(len(ids)):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        text = tokenizer.decode(ids[prefix : i + 1], skip_special_tokens=True)
        if len(text) > len(before) and (not text.endswith("\ufffd") or i + 1 == len(ids)):
            pieces.append(text[len(before) :])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    return pieces


def cut_at_stop(text: str, stop: str | list[str] | None) -> tuple[str, bool]:
    """text up to the first stop string (excluded), and whether one was found."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def logprobs(pieces: list[str], lps: list[float], text: str, chat: bool) -> dict:
    """The sampled tokens' logprobs in OpenAI's shape, for the tokens inside `text` (which a stop string may have cut).
    Only the sampled token's logprob is known: top_logprobs stay empty."""
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    cut = sum(map(len, pieces)) > len(text)
    keep = [i for i, o in enumerate(offsets) if o < len(text) or not cut]
    if chat:
        return {
            "content": [
                {"token": pieces[i], "logprob": lps[i], "bytes": list(pieces[i].encode()), "top_logprobs": []}
                for i in keep
            ]
        }
    return {
        "tokens": [pieces[i] for i in keep],
        "token_logprobs": [lps[i] for i in keep],
        "top_logprobs": None,
        "text_offset": [offsets[i] for i in keep],
    }


def choices(
    groups: list[P.Group], stop: str | list[str] | None, chat: bool, pieces: list[list[str]] | None
) -> tuple[list[dict], dict]:
    """OpenAI choices (prompt-major, n per prompt) and the usage block; `pieces` (the text of each token) adds
    logprobs."""
    out, prompt_tokens, completion_tokens = [], 0, 0
    for g in groups:
        prompt_tokens += len(g.prompt_token_ids)
        for s in g.samples:
            text, stopped = cut_at_stop(s.text, stop)
            reason = "stop" if stopped or s.finish_reason == "stop" else "length"
            lp = logprobs(pieces[len(out)], s.logprobs, text, chat) if pieces is not None else None
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            out.append({"index": len(out), **body, "logprobs": lp, "finish_reason": reason})
            completion_tokens += len(s.token_ids)
    return out, {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    kind: str, model: str, groups: list[P.Group], stop, chat: bool, pieces: list[list[str]] | None = None
) -> dict:
    picked, usage = choices(groups, stop, chat, pieces)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": picked,
        "usage": usage,
    }
