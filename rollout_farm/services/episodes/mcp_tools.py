"""MCP tools as the model sees them, for both MCP environments: the `mcp` environment (rollout_farm/services/episodes/
mcp_env.py, an MCP server over stdio or streamable HTTP) and openenv's MCP actions (rollout_farm/services/episodes/
openenv_remote.py, `action: "mcp"`).

A tool of `tools/list` ({name, description, inputSchema}) becomes an OpenAI function tool ({name, description,
parameters}); a tool call's arguments become `tools/call`'s; a `tools/call` result ({content, structuredContent,
isError}) becomes the tool message's text: the text blocks, else the structured content as compact JSON, a
placeholder for what is not text (an image's type and size), `error: ` before a result the tool marked as an error,
and at most MAX_RESULT_CHARS characters with a note of what was cut. The result arrives as a dict: the SDK's model
dumped by alias (camelCase) or openenv's JSON (snake_case); both spellings are read.
"""

from __future__ import annotations

import json

from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.chat.tool_schemas import NAME, schema_problems

MAX_RESULT_CHARS = 16_000  # of one tool result shown to the model; the rest is cut, with a note
MAX_TOOLS = 128  # tools shown to the model; a server that lists more is an env_error naming the count


class ToolRefused(ValueError):
    """A call the model wrote that no tool takes: the model reads why, the episode goes on."""


def openai_tools(listed: list[dict]) -> list[dict]:
    """The OpenAI tools of a `tools/list` answer's tools; ValueError naming the tool whose name or schema no OpenAI
    tool can have (the model would be shown a tool it cannot call)."""
    if len(listed) > MAX_TOOLS:
        raise ValueError(f"the server lists {len(listed)} tools, more than {MAX_TOOLS}")
    tools = []
    for tool in listed:
        name, schema = tool.get("name"), tool.get("inputSchema", tool.get("input_schema")) or {"type": "object"}
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"its tool {name!r} has no OpenAI function name (1-64 letters, digits, '_' or '-')")
        if problems := schema_problems(schema, f"{name}.inputSchema"):
            raise ValueError(f"its tool {name!r} has an inputSchema no function takes: {problems[0]['message']}")
        what = tool.get("description") or tool.get("title") or ""
        tools.append({"type": "function", "function": {"name": name, "description": what, "parameters": schema}})
    return tools


def call_arguments(call: ToolCall, tools: list[dict]) -> dict:
    """The call's arguments for `tools/call`; ToolRefused when the tool is not listed or the arguments are no object."""
    names = [t["function"]["name"] for t in tools]
    if call.name not in names:
        raise ToolRefused(f"no tool {call.name!r}; the tools are {', '.join(names)}")
    args = json.loads(call.arguments or "{}")  # the tool format wrote it as JSON
    if not isinstance(args, dict):
        raise ToolRefused(f"the arguments of {call.name} are a JSON object of its parameters")
    return args


def result_text(result: dict) -> str:
    """What the model reads of a `tools/call` result, cut to MAX_RESULT_CHARS."""
    texts = [block_text(block) for block in result.get("content") or []]
    structured = result.get("structuredContent", result.get("structured_content"))
    if not any(block.get("type") == "text" for block in result.get("content") or []) and structured is not None:
        texts.append(json.dumps(structured, ensure_ascii=False, separators=(",", ":")))
    text = "\n".join(texts)
    if result.get("isError", result.get("is_error")):
        text = f"error: {text}"
    return truncated(text)


def block_text(block: dict) -> str:
    """One content block as text: a text block's text, an embedded text resource's, else a placeholder."""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "resource":
        resource = block.get("resource") or {}
        if "text" in resource:
            return str(resource["text"])
        return f"[resource {resource.get('uri')}: {mime(resource)}, not text]"
    if kind == "resource_link":
        return f"[resource link {block.get('uri')}]"
    if kind in ("image", "audio"):
        return f"[{kind} {mime(block)}, {len(block.get('data') or '') * 3 // 4} bytes, not shown]"
    return f"[{kind} content, not shown]"


def mime(block: dict) -> str:
    return block.get("mimeType", block.get("mime_type")) or "unknown type"


def truncated(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return f"{text[:MAX_RESULT_CHARS]}\n[truncated: the first {MAX_RESULT_CHARS} of {len(text)} characters]"
