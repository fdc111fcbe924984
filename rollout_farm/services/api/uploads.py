"""Reading a streamed prompt upload (POST /v1/queue/sources/{name}/prompts), with its own FARM_ limit: the body, and
its prompts from JSON or JSONL. Weight uploads stream through rollout_farm/services/weights/stream.py instead."""

from __future__ import annotations

import hashlib

from fastapi import Request
from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import Invalid, TooLarge, pydantic_fields


async def read_body(request: Request, limit: int, setting: str, what: str, fix: str) -> tuple[bytes, str]:
    """The whole body and its hex SHA-256; 413 (naming the setting) once it passes `limit` bytes, declared or
    counted."""
    too_large = TooLarge(f"{what} larger than {setting}={limit}: {fix}")
    if int(request.headers.get("content-length") or 0) > limit:
        raise too_large
    data, digest = bytearray(), hashlib.sha256()
    async for chunk in request.stream():
        data += chunk
        digest.update(chunk)
        if len(data) > limit:
            raise too_large
    return bytes(data), digest.hexdigest()


def prompts_from_body(body: bytes, content_type: str | None) -> list[P.Prompt]:
    """A JSON QueuePrompts body, or JSONL with one Prompt per line; 422 naming `line N.<field>` for bad lines."""
    if (content_type or "application/json").split(";")[0].strip() == "application/json":
        try:
            return P.QueuePrompts.model_validate_json(body).prompts
        except ValidationError as e:
            raise Invalid(pydantic_fields(e.errors())) from None
    prompts, errors = [], []
    for i, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
        if line.strip():
            try:
                prompts.append(P.Prompt.model_validate_json(line))
            except ValidationError as e:
                errors += pydantic_fields(e.errors(), f"line {i}")
    if not prompts and not errors:
        errors = [{"field": "body", "message": "no prompts: send one JSON Prompt per line"}]
    if errors:
        raise Invalid(errors)
    return prompts
