"""Anthropic's streaming answer: server-sent events with Anthropic's event types, each with its `event:` line (the
SDK skips an event without one).

The turn is sampled whole before the first event (the engines return whole samples), so the stream is the finished
Message told in Anthropic's order: message_start (the message with no content, stop_reason null, the farm's view
under `farm`), then per block content_block_start (the block empty), one content_block_delta (text_delta,
thinking_delta, or input_json_delta with the whole input) and content_block_stop, then message_delta (stop_reason,
stop_sequence, output tokens) and message_stop. The SDK's MessageStream assembles the same Message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

EMPTY = {
    "text": lambda b: {"type": "text", "text": ""},
    "thinking": lambda b: {"type": "thinking", "thinking": "", "signature": ""},
    "tool_use": lambda b: {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}},
}
DELTA = {
    "text": lambda b: {"type": "text_delta", "text": b["text"]},
    "thinking": lambda b: {"type": "thinking_delta", "thinking": b["thinking"]},
    "tool_use": lambda b: {"type": "input_json_delta", "partial_json": json.dumps(b["input"])},
}


def stream_events(message: dict) -> list[dict]:
    """The events of a finished Message (compat/anthropic.py `message`), in order."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 0}
    out = [{"type": "message_start", "message": start}]
    for i, block in enumerate(message["content"]):
        out += [
            {"type": "content_block_start", "index": i, "content_block": EMPTY[block["type"]](block)},
            {"type": "content_block_delta", "index": i, "delta": DELTA[block["type"]](block)},
            {"type": "content_block_stop", "index": i},
        ]
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    out.append({"type": "message_delta", "delta": delta, "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    return out + [{"type": "message_stop"}]


async def events(message: dict) -> AsyncIterator[str]:
    for event in stream_events(message):
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
