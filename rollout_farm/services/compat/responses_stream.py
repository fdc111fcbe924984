"""OpenAI's Responses streaming answer: server-sent events (`event:` and `data:` lines), each with its
sequence_number.

The turn is sampled whole before the first event (the engines return whole samples), so the stream is the finished
Response told in OpenAI's order: response.created and response.in_progress (no output yet), then per output item
response.output_item.added (the item empty), its text (content_part.added, one output_text.delta, output_text.done,
content_part.done) or its arguments (one function_call_arguments.delta, then .done), response.output_item.done (the
item whole), and response.completed (the Response whole, `farm` included). The SDK's ResponseStream assembles the same
Response.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


def started(item: dict) -> dict:
    """An output item as response.output_item.added gives it: in progress, its text or arguments still empty."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "status": "in_progress"}


def item_events(k: int, item: dict) -> list[dict]:
    """What is told between an item's added and done events."""
    at = {"item_id": item["id"], "output_index": k}
    if item["type"] == "function_call":
        return [
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {
                "type": "response.function_call_arguments.done",
                **at,
                "name": item["name"],
                "arguments": item["arguments"],
            },
        ]
    if item["type"] != "message":
        return []
    part = item["content"][0]
    at["content_index"] = 0
    return [
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []},
        {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **at, "part": part},
    ]


def stream_events(response: dict) -> list[dict]:
    """The events of a finished Response (compat/responses.py `response`), numbered in order."""
    opened = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    opened.pop("completed_at", None)
    out = [{"type": "response.created", "response": opened}, {"type": "response.in_progress", "response": opened}]
    for k, item in enumerate(response["output"]):
        out.append({"type": "response.output_item.added", "output_index": k, "item": started(item)})
        out += item_events(k, item)
        out.append({"type": "response.output_item.done", "output_index": k, "item": item})
    end = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    out.append({"type": end, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(out)]


async def events(response: dict) -> AsyncIterator[str]:
    for event in stream_events(response):
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
