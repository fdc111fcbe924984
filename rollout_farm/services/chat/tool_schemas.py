"""Tool definitions as OpenAI sends them, checked before a model sees them: each `{"type": "function", "function":
{"name", "description"?, "parameters"?}}` with a unique name and `parameters` a valid JSON Schema (Draft 2020-12, as
OpenAI's function calling uses), so that a bad definition is a 422 naming the field, never a template error or a
silently ignored tool.
"""

from __future__ import annotations

import re

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def tool_problems(tools: list, field: str = "tools") -> list[dict]:
    """422 detail for every problem of the definitions: [] when they are all usable."""
    problems, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            problems.append({"field": where, "message": 'give {"type": "function", "function": {"name": ...}}'})
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            problems.append({"field": f"{where}.function.name", "message": "1-64 letters, digits, '_' or '-'"})
        elif name in seen:
            problems.append({"field": f"{where}.function.name", "message": f"{name!r} is defined twice"})
        seen.add(name)
        problems += schema_problems(fn.get("parameters", {"type": "object"}), f"{where}.function.parameters")
    return problems


def schema_problems(schema, field: str) -> list[dict]:
    """[] for a JSON Schema of an object's parameters, else what is wrong with it."""
    if not isinstance(schema, dict):
        return [{"field": field, "message": 'a JSON Schema object, e.g. {"type": "object", "properties": {...}}'}]
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.path)
        return [{"field": field, "message": f"not a valid JSON Schema{' at ' + at if at else ''}: {e.message}"}]
    if schema.get("type", "object") != "object":
        return [{"field": field, "message": 'the parameters of a function are an object: {"type": "object", ...}'}]
    return []
