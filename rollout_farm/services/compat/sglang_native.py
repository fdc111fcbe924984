"""SGLang's native surface, translated onto the farm's domain objects: /generate becomes rollouts (Rollouts: checks,
the request table, cancellation), the weight routes WeightPush pushes, pause/continue/abort the replicas' control.

Answers are SGLang's (sglang 0.5.14): {text, output_ids, meta_info} per sample, prompt-major, a list for a batch or
n > 1; logprobs as [logprob, token_id, text|null]; meta_info.weight_version a string, like SGLang's.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.compat.sglang_shapes import (
    aborted,
    answer,
    farm_params,
    model_config,
    per_prompt,
    rids,
    sglang_field,
)
from rollout_farm.services.errors import Invalid, NotFound, RolloutCancelled, pydantic_fields
from rollout_farm.services.protocol import sglang_native as S
from rollout_farm.services.rollout.jobs import owned, shown
from rollout_farm.services.tenants.registry import ANYONE, Principal

if TYPE_CHECKING:
    from rollout_farm.services.compat.openai_api import OpenAICompat
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.replica.handle import Replicas
    from rollout_farm.services.rollout.rollouts import Rollouts
    from rollout_farm.services.weights.push import WeightPush

log = logging.getLogger("farm.service")
SGLANG_VERSION = "0.5.14"  # the SGLang release whose HTTP surface this mirrors
MAX_TOP_LOGPROBS = 20


class SGLangNative:
    def __init__(
        self,
        rollouts: Rollouts,
        weights: WeightPush,
        replicas: Replicas,
        openai: OpenAICompat,
        settings: ServiceSettings,
    ):
        self.rollouts, self.weights, self.replicas, self.openai, self.settings = (
            rollouts,
            weights,
            replicas,
            openai,
            settings,
        )

    # /generate -------------------------------------------------------------------------------------------
    async def generate(self, req: S.GenerateRequest, who: Principal = ANYONE) -> dict | list[dict]:
        """SGLang's answer: one dict for a single prompt with n=1, else a list (prompt-major, n per prompt)."""
        prompts, single = await self.prompts(req)
        loras = [await self.adapter(x, who) for x in per_prompt(req.lora_path, len(prompts), "lora_path", [None])]
        params = per_prompt(req.sampling_params, len(prompts), "sampling_params", [S.SGLangSamplingParams()])
        logprob = per_prompt(req.return_logprob, len(prompts), "return_logprob", [False])
        start = per_prompt(req.logprob_start_len, len(prompts), "logprob_start_len", [-1])
        top = per_prompt(req.top_logprobs_num, len(prompts), "top_logprobs_num", [0])
        if not all(0 <= k <= MAX_TOP_LOGPROBS for k in top):
            raise Invalid([{"field": "top_logprobs_num", "message": f"give 0..{MAX_TOP_LOGPROBS}"}])
        ids = rids(req.rid, len(prompts), single)
        rid = owned(req.rid, who.tenant) if isinstance(req.rid, str) else None  # a tenant's rids are its own
        groups, drew = await self.groups(prompts, params, rid, loras)
        answers = []
        for i, (prompt, group) in enumerate(zip(prompts, groups)):
            for j, s in enumerate(group.samples):
                rid = ids[i] if params[i].n == 1 else f"{ids[i]}_{j}"
                answers.append(answer(rid, prompt, s, params[i]))
                if logprob[i]:
                    answers[-1]["meta_info"] |= await self.logprobs(prompt, s, start[i], top[i], req, drew[i])
        return answers[0] if single and len(answers) == 1 else answers

    @staticmethod
    def samples(req: S.GenerateRequest) -> int:
        """How many samples the request asks for (what counts against a tenant's quota), before any check."""
        given = req.text if req.text is not None else req.input_ids
        single = isinstance(given, str) or bool(given) and isinstance(given[0], int)
        prompts = 1 if single else max(1, len(given or []))
        params = req.sampling_params or [S.SGLangSamplingParams()]
        return prompts * params[0].n if len(params) == 1 else sum(p.n for p in params)

    async def prompts(self, req: S.GenerateRequest) -> tuple[list[list[int]], bool]:
        """Token ids of every prompt (texts encoded as SGLang does), and whether the request was a single one."""
        if (req.text is None) == (req.input_ids is None):
            raise Invalid([{"field": "text", "message": "give exactly one of text or input_ids"}])
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            if not texts or not all(texts):
                raise Invalid([{"field": "text", "message": "an empty prompt: give non-empty text"}])
            return await self.replicas.call("encode_texts", texts), isinstance(req.text, str)
        single = bool(req.input_ids) and isinstance(req.input_ids[0], int)
        ids = [req.input_ids] if single else req.input_ids
        if not ids or not all(ids):
            raise Invalid([{"field": "input_ids", "message": "an empty prompt: give at least one token id"}])
        return ids, single

    async def adapter(self, lora_path: str | None, who: Principal) -> P.AdapterRef | None:
        """The adapter a prompt's lora_path names: 422 for a name that cannot be one, 404 for one the caller may not
        use (SGLang refuses an adapter it has not loaded too)."""
        if lora_path is None:
            return None
        ref = P.AdapterRef.parse(lora_path)
        if ref is None:
            raise Invalid([{"field": "lora_path", "message": f"{lora_path!r} is not 'name' or 'name@vN'"}])
        if await self.openai.fanout.adapters.visible(ref.name, who) is None:
            raise NotFound(
                f"lora_path {lora_path!r} names no adapter you may use: GET /v1/adapters lists them",
                [{"field": "lora_path", "message": "no such adapter"}],
            )
        return ref

    async def groups(
        self,
        prompts: list[list[int]],
        params: list[S.SGLangSamplingParams],
        rid: str | None,
        loras: list[P.AdapterRef | None],
    ) -> tuple[list[P.Group | None], list[tuple[P.AdapterRef, str] | None]]:
        """One rollout per distinct sampling_params and adapter (usually one for the whole batch); each prompt's
        group, and the exact adapter version that drew it. A string rid keys the rollout (so /abort_request can
        cancel it) when the batch makes one rollout (a tenant's kept as its own: rollout/jobs.py owned())."""
        keys = [
            json.dumps([p.model_dump(), lora and lora.model_dump()], sort_keys=True) for p, lora in zip(params, loras)
        ]
        out: list[P.Group | None] = [None] * len(prompts)
        drew: list[tuple[P.AdapterRef, str] | None] = [None] * len(prompts)
        for key in dict.fromkeys(keys):
            idx = [i for i, k in enumerate(keys) if k == key]
            try:
                req = P.RolloutRequest(
                    prompts=[P.Prompt(token_ids=prompts[i]) for i in idx],
                    n=params[idx[0]].n,
                    sampling_params=farm_params(params[idx[0]]),
                    request_id=shown(rid) if rid and len(set(keys)) == 1 else None,  # checked as sent
                    adapter=loras[idx[0]],
                )
                if req.request_id:  # then kept as the caller's own (a tenant's holds a NUL, which nobody may send)
                    req = req.model_copy(update={"request_id": rid})
                groups = (await self.rollouts.answer(req)).groups
            except ValidationError as e:
                raise Invalid([sglang_field(d, idx) for d in pydantic_fields(e.errors())]) from None
            except RolloutCancelled:
                groups = [aborted(prompts[i], req.n, self.weights.committed) for i in idx]
            except Invalid as e:
                raise Invalid([sglang_field(d, idx) for d in e.detail], e.message) from None
            for i, g in zip(idx, groups):
                out[i], drew[i] = g, req._resolved_adapter
        return out, drew

    async def logprobs(
        self,
        prompt: list[int],
        s: P.Sample,
        start: int,
        top: int,
        req: S.GenerateRequest,
        adapter: tuple[P.AdapterRef, str] | None = None,
    ) -> dict:
        """meta_info's logprob keys: the sampled tokens' own logprobs (those of /v1/rollouts); input logprobs from
        `start` and the top alternatives come from one scoring pass over prompt and output, under the policy that
        drew the sample."""
        start = len(prompt) if start < 0 else min(start, len(prompt))
        texts = req.return_text_in_logprobs
        out = {"output_token_logprobs": await self.entries(s.logprobs, s.token_ids, texts)}
        if start == len(prompt) and not top:
            return out | {"input_token_logprobs": []}
        (scored,) = await self.replicas.call("score_ids", [prompt + s.token_ids], top, adapter)
        n = len(prompt)
        out["input_token_logprobs"] = await self.entries(scored["logprobs"][start:n], prompt[start:], texts)
        if top:
            out["input_top_logprobs"] = [await self.tops(t, texts) if t else None for t in scored["top"][start:n]]
            out["output_top_logprobs"] = [await self.tops(t, texts) for t in scored["top"][n:]]
        return out

    async def entries(self, lps: list[float | None], ids: list[int], texts: bool) -> list[list]:
        """[[logprob, token_id, text|null], ...]."""
        words = await self.replicas.call("token_texts", ids) if texts and ids else [None] * len(ids)
        return [[lp, t, w] for lp, t, w in zip(lps, ids, words)]

    async def tops(self, alts: list[list], texts: bool) -> list[list]:
        return await self.entries([lp for _, lp in alts], [t for t, _ in alts], texts)

    # reads -----------------------------------------------------------------------------------------------
    async def model_info(self) -> dict:
        """GET /get_model_info: SGLang's keys; the weight version is the farm's committed one, as a string."""
        s = self.settings
        config = model_config(s.model)
        return {
            "model_path": s.model,
            "tokenizer_path": s.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(await self.weights.refresh()),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
        }

    async def server_info(self) -> dict:
        """GET /get_server_info: the server args SGLang clients read, each replica's state as internal_states."""
        s = self.settings
        states = await self.replicas.states(expected=s.replicas)
        return {
            "model_path": s.model,
            "tokenizer_path": s.model,
            "served_model_name": self.openai.model_name,
            "dp_size": s.replicas,
            "tp_size": 1,
            "context_length": await self.openai.context_length(),
            "max_running_requests": s.engine_max_ongoing_requests * s.replicas,
            "weight_version": str(await self.weights.refresh()),
            "internal_states": [x.model_dump() for x in states.answers] + [{"error": m} for m in states.problems()],
            "version": SGLANG_VERSION,
            "engine": s.engine,
        }

    # control ---------------------------------------------------------------------------------------------
    async def update_from_disk(self, req: S.UpdateWeightsFromDiskRequest) -> dict:
        version = await self.next_version(req.weight_version)
        policy = "abort" if req.abort_all_requests else "finish"
        pushed = await self.weights.from_path(P.WeightsFromPath(path=req.model_path, version=version, policy=policy))
        return {
            "success": True,
            "message": f"weights from {req.model_path} serve as version {pushed.version} on every replica",
            "num_paused_requests": 0,
        }

    async def init_group(self, req: S.InitWeightsUpdateGroupRequest) -> dict:
        await self.weights.init_distributed(P.DistributedGroup(**req.model_dump()))
        return {"success": True, "message": "every replica joined the weight update group"}

    async def update_distributed(self, req: S.UpdateWeightsFromDistributedRequest) -> dict:
        version = await self.next_version(req.weight_version)
        fields = req.model_dump(include={"names", "dtypes", "shapes", "group_name"})
        await self.weights.distributed(P.DistributedUpdate(**fields, version=version))
        return {"success": True, "message": f"version {version} serves on every replica"}

    async def next_version(self, given: str | None) -> int:
        """SGLang's string weight_version as the farm's integer one; none given: the served version + 1."""
        if given is None:
            return max((await self.replicas.versions()).values()) + 1
        if not given.isdigit() or int(given) < 1:
            raise Invalid([{"field": "weight_version", "message": f"{given!r}: the farm's versions are integers >= 1"}])
        return int(given)

    async def pause(self, req: S.PauseGenerationRequest) -> dict:
        """Nothing new is admitted; then what runs ends at its next token with its tokens so far ('abort'), or is
        held by the engine ('in_place', 'retract': rollout_farm/services/engine/torch/hold.py; 501 from an engine that
        cannot)."""
        if req.mode == "abort":
            await self.replicas.control("pause")
            await self.replicas.control("abort")
        else:
            states = await self.replicas.all("pause", req.mode)
            log.info("control", extra={"action": f"pause {req.mode}", "replicas": len(states)})
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def resume(self) -> dict:
        await self.replicas.control("resume")
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def abort(self, req: S.AbortRequest) -> None:
        """abort_all: every replica's running generation ends at its next token. A rid: that /generate's engine calls
        end at their next token, and it answers with their tokens so far, finished 'abort' (as SGLang's do); the cut
        reaches a /generate still on its way to a replica too (rollout_farm/services/replica/cuts.py)."""
        if req.abort_all:
            await self.replicas.control("abort")
        elif req.rid:

            async def cut():
                return await self.replicas.all("cut_rollout", req.rid)

            running, _ = await self.rollouts.jobs.cut(req.rid, cut)
            if not running:
                await cut()
        else:
            raise Invalid([{"field": "rid", "message": "give the rid to abort, or abort_all=true"}])
