"""The OpenAI-compatible surface: completion and chat requests become rollouts, and rollouts OpenAI's answers."""

from __future__ import annotations

import functools
import itertools
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.renderer import ChatRenderer
from rollout_farm.services.errors import Invalid, NotFound, pydantic_fields
from rollout_farm.services.rollout.jobs import Job
from rollout_farm.services.tenants.registry import ANYONE, Principal

if TYPE_CHECKING:
    from rollout_farm.services.replica.handle import Replicas
    from rollout_farm.services.rollout.fanout import Fanout
    from rollout_farm.services.rollout.request_checks import RequestChecks


@dataclass
class Generated:
    groups: list[P.Group]
    adapter: tuple[P.AdapterRef, str] | None  # the exact adapter version that drew them, and its digest


class OpenAICompat:
    def __init__(self, fanout: Fanout, replicas: Replicas, checks: RequestChecks, model: str, committed):
        self.fanout, self.replicas, self.checks, self.committed = fanout, replicas, checks, committed
        self.model_name = os.path.basename(model.rstrip("/"))
        # chats rendered here, with the tokenizer one replica hands over once
        self.renderer = ChatRenderer(functools.partial(replicas.read, "chat_tokenizer"))

    async def models(self, who: Principal = ANYONE) -> dict:
        """GET /v1/models: the base policy, with the committed weight version and the context length, then each
        resident version of the adapters `who` may use, as "name@vN" (its digest under `meta`)."""
        context = await self.context_length()
        meta = {"weight_version": await self.committed(), "context_length": context}
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout-farm", "meta": meta}
        cards = [card | ({"max_model_len": context} if context else {})]  # vLLM's name: renderers reads it
        for info in await self.fanout.adapters.all():
            if not who.may_use(info.owner):
                continue
            for v in info.versions:
                if v.state == "resident":
                    meta = {"digest": v.digest, "base_version": v.base_version}
                    card = {"id": f"{info.name}@v{v.version}", "object": "model", "created": int(v.pushed_at)}
                    cards.append({**card, "owned_by": info.owner or "rollout-farm", "meta": meta})
        return {"object": "list", "data": cards}

    async def context_length(self) -> int | None:
        return await self.checks.context_length()

    async def policy(self, model: str | None, who: Principal) -> P.AdapterRef | None:
        """The adapter `model` names: "name@vN" (that version) or "name" (its newest resident version) of an adapter
        `who` may use; None for any other name (the base model, as before adapters). "name@vN" of no adapter the
        caller may use is a 404 naming `model`."""
        ref = P.AdapterRef.parse(model) if model else None
        if ref is None:
            return None
        if await self.fanout.adapters.visible(ref.name, who) is None:
            if ref.version is None:
                return None
            raise NotFound(
                f"model {model!r} names no adapter you may use: GET /v1/adapters lists them",
                [{"field": "model", "message": "no such adapter"}],
            )
        return ref

    async def completions(self, req: P.CompletionRequest, who: Principal = ANYONE) -> dict:
        if req.max_tokens == 0 and not req.echo:
            raise Invalid([{"field": "max_tokens", "message": "0 generates nothing: set echo=true to score"}])
        adapter = await self.policy(req.model, who)
        prompts = await self.prompts(req.prompt, req.max_tokens)
        top_k = req.logprobs or 0
        rollout = await self.generate(prompts, req.n, sampling(max(1, req.max_tokens), req, req.stop), adapter)
        groups = rollout.groups
        if req.max_tokens == 0:  # echo alone: the prompt, scored (lm-eval's loglikelihood); the one token is dropped
            groups = [g.model_copy(update={"samples": [nothing(s) for s in g.samples]}) for g in groups]
        scored = await self.scored(groups, top_k, req.echo, rollout.adapter) if req.echo or top_k else None
        pieces = await self.pieces(groups) if req.logprobs is not None and scored is None else None
        model = self.served_as(rollout.adapter)
        return response("text_completion", model, groups, req.stop, False, pieces, scored, req.echo)

    async def chat(self, req: P.ChatCompletionRequest, who: Principal = ANYONE) -> dict:
        adapter = await self.policy(req.model, who)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        text = await self.renderer.render(messages)
        if text is None:
            raise Invalid(
                [{"field": "messages", "message": "no chat template"}],
                "the served model has no chat template: use /v1/completions",
            )
        if not text:  # e.g. the built-in models' template renders one empty message to nothing
            raise Invalid(
                [{"field": "messages", "message": "the messages render to an empty prompt: give some text"}],
                "the messages render to an empty prompt through the model's chat template",
            )
        if req.top_logprobs and not req.logprobs:
            raise Invalid([{"field": "top_logprobs", "message": "needs logprobs=true"}])
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        if await self.checks.context_length() is not None:  # counted here: no Ray call to a replica
            counted = P.Prompt(token_ids=await self.renderer.prompt_ids(text))
            await self.checks.fits([counted], max_tokens, "max_completion_tokens", "messages")
        rollout = await self.generate([P.Prompt(text=text)], req.n, sampling(max_tokens, req, req.stop), adapter)
        groups = rollout.groups
        top_k = req.top_logprobs or 0
        scored = await self.scored(groups, top_k, False, rollout.adapter) if req.logprobs and top_k else None
        pieces = await self.pieces(groups) if req.logprobs and scored is None else None
        out = response("chat.completion", self.served_as(rollout.adapter), groups, req.stop, True, pieces, scored)
        return with_token_ids(out, groups) if req.return_token_ids else out

    async def prompts(self, prompt, max_tokens: int) -> list[P.Prompt]:
        """OpenAI's four prompt shapes as rollout prompts; token ids checked against the vocabulary, and every
        prompt's length plus max_tokens against the context."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise Invalid([{"field": "prompt", "message": "no prompt: give a text, texts or token ids"}])
        try:
            out = [P.Prompt(text=p) if isinstance(p, str) else P.Prompt(token_ids=p) for p in prompt]
        except ValidationError as e:
            raise Invalid([{"field": "prompt", "message": err["msg"]} for err in e.errors()]) from None
        try:
            await self.checks.tokens(out)
        except Invalid as e:
            raise Invalid([{**d, "field": d["field"].replace("prompts.", "prompt.")} for d in e.detail]) from None
        await self.checks.fits(out, max_tokens, "max_tokens", "prompt")
        return out

    async def generate(
        self, prompts: list[P.Prompt], n: int, params: P.SamplingParams, adapter: P.AdapterRef | None = None
    ) -> Generated:
        rollout = P.RolloutRequest(prompts=prompts, n=n, sampling_params=params, adapter=adapter)
        groups = (await self.fanout.produce(Job(len(prompts)), rollout)).groups
        return Generated(groups, rollout._resolved_adapter)

    def served_as(self, adapter: tuple[P.AdapterRef, str] | None) -> str:
        """The answer's `model`: the policy that drew it, "name@vN" for an adapter, else the served model's name."""
        return adapter[0].key() if adapter else self.model_name

    async def pieces(self, groups: list[P.Group]) -> list[list[str]]:
        return await self.renderer.token_pieces([s.token_ids for g in groups for s in g.samples])

    async def scored(
        self, groups: list[P.Group], top_k: int, echo: bool, adapter: tuple[P.AdapterRef, str] | None = None
    ) -> list[dict]:
        """Each choice's tokens scored in one pass over prompt and completion (under the adapter that drew them):
        logprobs and the top_k alternatives of every token, the prompt's kept only with echo."""
        seqs = [g.prompt_token_ids + s.token_ids for g in groups for s in g.samples]
        starts = [0 if echo else len(g.prompt_token_ids) for g in groups for _ in g.samples]
        scores = await self.replicas.call("score", seqs, top_k, adapter)
        return [{k: v[start:] for k, v in sc.items()} for sc, start in zip(scores, starts)]


def nothing(s: P.Sample) -> P.Sample:
    """The sample with no tokens (max_tokens 0)."""
    return s.model_copy(update={"token_ids": [], "logprobs": [], "text": "", "finish_reason": "length"})


def sampling(max_tokens: int, req, stop: str | list[str] | None) -> P.SamplingParams:
    """The rollout's sampling params; what only they check (an empty or 17th stop string) is a 422 on `stop`."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    try:
        return P.SamplingParams(
            max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=stops
        )
    except ValidationError as e:
        raise Invalid(pydantic_fields(e.errors())) from None


def cut_at_stop(text: str, stop: str | list[str] | None) -> tuple[str, bool]:
    """text up to the first stop string (excluded), and whether one was found."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def logprobs(pieces: list[str], lps: list[float | None], text: str, chat: bool, tops: list[dict] | None) -> dict:
    """Logprobs in OpenAI's shape for the tokens inside `text` (a stop string may have cut it): each token's piece
    and logprob and, with `tops`, its position's alternatives ({piece: logprob})."""
    offsets = [0, *itertools.accumulate(map(len, pieces))]  # each piece's start (once: 4096 pieces summed in O(n))
    cut = offsets.pop() > len(text)
    keep = [i for i, o in enumerate(offsets) if o < len(text) or not cut]
    if chat:
        return {
            "content": [
                {
                    "token": pieces[i],
                    "logprob": lps[i],
                    "bytes": list(pieces[i].encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())}
                        for t, lp in (tops[i] if tops else {}).items()
                    ],
                }
                for i in keep
            ]
        }
    return {
        "tokens": [pieces[i] for i in keep],
        "token_logprobs": [lps[i] for i in keep],
        "top_logprobs": [tops[i] or None for i in keep] if tops else None,
        "text_offset": [offsets[i] for i in keep],
    }


def choice_logprobs(scored: dict | None, pieces: list[str] | None, s: P.Sample, text: str, chat: bool) -> dict | None:
    """A choice's logprobs: from the scoring pass (with alternatives, and the prompt's with echo), or the sampled
    tokens' own."""
    if scored is not None:
        return logprobs(scored["pieces"], scored["logprobs"], text, chat, scored["top"])
    if pieces is not None:
        return logprobs(pieces, s.logprobs, text, chat, None)
    return None


def choices(
    groups: list[P.Group],
    stop: str | list[str] | None,
    chat: bool,
    pieces: list[list[str]] | None,
    scored: list[dict] | None = None,
    echo: bool = False,
) -> tuple[list[dict], dict]:
    """OpenAI choices (prompt-major, n per prompt) and the usage block."""
    out, prompt_tokens, completion_tokens = [], 0, 0
    for g in groups:
        prompt_tokens += len(g.prompt_token_ids)
        for s in g.samples:
            i = len(out)
            text, stopped = cut_at_stop(s.text, stop)
            if echo:  # scored from the prompt's first token: its pieces give the prompt's text
                text = "".join(scored[i]["pieces"][: len(g.prompt_token_ids)]) + text
            reason = "stop" if stopped or s.finish_reason == "stop" else "length"
            lp = choice_logprobs(scored[i] if scored else None, pieces[i] if pieces else None, s, text, chat)
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            out.append({"index": i, **body, "logprobs": lp, "finish_reason": reason})
            completion_tokens += len(s.token_ids)
    return out, {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    kind: str,
    model: str,
    groups: list[P.Group],
    stop,
    chat: bool,
    pieces: list[list[str]] | None = None,
    scored: list[dict] | None = None,
    echo: bool = False,
) -> dict:
    picked, usage = choices(groups, stop, chat, pieces, scored, echo)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": picked,
        "usage": usage,
    }


def with_token_ids(out: dict, groups: list[P.Group]) -> dict:
    """A chat answer with vLLM's return_token_ids fields: the prompt's ids, and each choice's sampled ids."""
    for choice, s in zip(out["choices"], (s for g in groups for s in g.samples)):
        choice["token_ids"] = s.token_ids
    return {"prompt_token_ids": groups[0].prompt_token_ids, **out}
