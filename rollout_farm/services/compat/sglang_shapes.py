"""SGLang 0.5.14's /generate fields and answers, for rollout_farm/services/compat/sglang_native.py: one-or-per-prompt
values, rids, sampling params onto the farm's, error fields under SGLang's names, and each sample in SGLang's shape
({text, output_ids, meta_info}, its finish_reason and weight_versions spans), streamed as SGLang streams."""

from __future__ import annotations

import json
import os
import pathlib
import uuid

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import Invalid, pydantic_fields
from rollout_farm.services.protocol import sglang_native as S


def per_prompt(value, n: int, field: str, default: list) -> list:
    """SGLang's one-or-one-per-prompt fields as one value per prompt."""
    values = default if value is None else (value if isinstance(value, list) else [value])
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise Invalid([{"field": field, "message": f"{len(values)} values for {n} prompts: give one, or one each"}])
    return values


def rids(rid: str | list[str] | None, n: int, single: bool) -> list[str]:
    """meta_info ids, as SGLang's _normalize_rid makes them."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(n)]
    if len(rid) != n or len(set(rid)) != n:
        raise Invalid([{"field": "rid", "message": f"give {n} distinct rids, one per prompt"}])
    return rid


def stops(p: S.SGLangSamplingParams) -> list[str]:
    return [p.stop] if isinstance(p.stop, str) else list(p.stop or [])


def farm_params(p: S.SGLangSamplingParams) -> P.SamplingParams:
    """SGLang's names onto the farm's (a bad value raises pydantic's error, named under sampling_params)."""
    try:
        return P.SamplingParams(
            max_new_tokens=p.max_new_tokens,
            stop=stops(p),
            stop_token_ids=p.stop_token_ids or [],
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            regex=p.regex,
            ignore_eos=p.ignore_eos,
            seed=p.sampling_seed,
        )
    except ValidationError as e:
        raise Invalid(pydantic_fields(e.errors(), "sampling_params")) from None


def sglang_field(detail: dict, idx: list[int]) -> dict:
    """A rollout's 422 detail under SGLang's field names."""
    field = detail.get("field", "")
    parts = field.split(".")
    if field.startswith("prompts.") and len(parts) > 1 and parts[1].isdigit():
        field = f"input_ids.{idx[int(parts[1])]}"
    field = {"sampling_params.seed": "sampling_params.sampling_seed", "request_id": "rid"}.get(field, field)
    return {**detail, "field": field}


def aborted(prompt: list[int], n: int, version: int) -> P.Group:
    """The group of a rollout cancelled outright (one that did not answer a cut in time: RolloutJobs.cut): n empty
    samples finished by 'abort'."""
    sample = P.Sample(token_ids=[], logprobs=[], text="", finish_reason="abort", weight_version=version)
    return P.Group(prompt_token_ids=prompt, samples=[sample] * n, reward_mean=0.0, reward_std=0.0, zero_variance=True)


def first_stop(text: str, params: S.SGLangSamplingParams) -> str | None:
    """The stop string that occurs first in text, if any."""
    found = sorted((text.find(x), x) for x in stops(params) if x in text)
    return found[0][1] if found else None


def finish_reason(s: P.Sample, params: S.SGLangSamplingParams) -> dict:
    """SGLang's finish_reason: the matched stop string, else the stop token; the length; an abort."""
    if s.finish_reason == "stop":
        matched = first_stop(s.text, params)
        return {"type": "stop", "matched": matched if matched is not None else (s.token_ids or [None])[-1]}
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    message = "Aborted" if s.finish_reason == "abort" else "the engine failed on this sample"
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def answer(rid: str, prompt: list[int], s: P.Sample, params: S.SGLangSamplingParams) -> dict:
    """One sample in SGLang's shape; the text ends before the first stop string (SGLang trims it)."""
    matched = first_stop(s.text, params)
    return {
        "text": s.text if matched is None else s.text[: s.text.find(matched)],
        "output_ids": s.token_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason(s, params),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(s.token_ids),
            "cached_tokens": 0,
            "weight_version": str(s.weight_version),
            "weight_versions": version_spans(s),
        },
    }


def version_spans(s: P.Sample) -> list[dict]:
    """meta_info.weight_versions as SGLang (>= 0.5.19) gives it: [{version, start, end}] over the output tokens, one
    span per run of tokens sampled on one weight version (several when a commit landed mid-sample)."""
    versions = s.token_weight_versions or [s.weight_version] * len(s.token_ids)
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def model_config(model: str) -> dict:
    """The model folder's config.json ({} for a hub name or an engine without one)."""
    path = pathlib.Path(model) / "config.json"
    return json.loads(path.read_text()) if os.path.isfile(path) else {}


def sse(answers: dict | list[dict]) -> list[str]:
    """SGLang's stream: `data: {json}` per chunk, then `data: [DONE]`. The farm's engines return whole samples, so
    each answer is one chunk; a batch's chunks carry their `index`, as SGLang's do."""
    if isinstance(answers, dict):
        chunks = [answers]
    else:
        chunks = [{**a, "index": i} for i, a in enumerate(answers)]
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
