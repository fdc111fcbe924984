"""Tool-call parse parity: the farm's tool formats against SGLang's function-call detectors (the pinned sglang
0.5.14's `sglang/srt/function_call/*_detector.py`), on a seeded corpus of sampled strings per format: single and
parallel calls, odd whitespace, unicode, nested JSON, content around the calls, and malformed calls.

SGLang cannot be installed here (CUDA wheels); its detectors are pure Python over four small packages, so they run
from the unpacked wheel in a throwaway venv, with two modules stubbed (`sglang.srt.entrypoints.openai.protocol`: the
`Tool` model only; `sglang.srt.environ`: `SGLANG_FORWARD_UNKNOWN_TOOLS` off). The farm parses each string as text
(SGLang reads text: markers by their text on both sides). Agreement, on the well-formed strings: the same calls
(names, and arguments equal as JSON), in order. Malformed strings are counted apart: the farm refuses the turn's calls
(each counted, `malformed`), where SGLang often reads what it can (a call without its closing tag, the good calls
beside a broken one). Writes docs/data/tool_parse_parity.json.

    pip download --no-deps sglang==0.5.14 -d /tmp/sg && unzip -q /tmp/sg/sglang-0.5.14-*.whl 'sglang/*' -d /tmp/sg/x
    python -m venv /tmp/sg/venv && /tmp/sg/venv/bin/pip install pydantic orjson partial_json_parser
    PYTHONPATH=. .venv/bin/python bench/tool_parse_parity.py --sglang /tmp/sg/x --python /tmp/sg/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

from rollout_farm.services.chat.tool_formats import TOOL_FORMATS

OUT = Path(__file__).parent.parent / "docs" / "data" / "tool_parse_parity.json"
DETECTORS = {  # the farm's format -> SGLang's detector (module, class)
    "hermes": ("hermes_detector", "HermesDetector"),
    "qwen3-xml": ("qwen3_coder_detector", "Qwen3CoderDetector"),
    "llama3-json": ("llama32_detector", "Llama32Detector"),
    "mistral": ("mistral_detector", "MistralDetector"),
    "mistral-v11": ("mistral_detector", "MistralDetector"),
    "deepseek-v3": ("deepseekv3_detector", "DeepSeekV3Detector"),
    "deepseek-v3.1": ("deepseekv31_detector", "DeepSeekV31Detector"),
    "harmony": ("gpt_oss_detector", "GptOssDetector"),
}
PARALLEL = {"hermes", "qwen3-xml", "llama3-json", "mistral", "mistral-v11", "deepseek-v3", "deepseek-v3.1"}
NAMES = ["calculator", "get_weather", "search_web", "read-file", "f"]
WORDS = ["naïve", "東京", "Ünïcödé ✓", 'say "hi"', "a\\b", "tab\there", "emoji 🚀", "plain", "x y  z", "{braces}"]

STUBS = {
    "sglang/srt/entrypoints/openai/protocol.py": """
from typing import Any, Optional
from pydantic import BaseModel
class Function(BaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: bool = False
class Tool(BaseModel):
    type: str = "function"
    function: Function
ToolChoice = Any
""",
    "sglang/srt/environ.py": """
class _Off:
    def get(self): return False
class envs:
    SGLANG_FORWARD_UNKNOWN_TOOLS = _Off()
""",
}
RUNNER = """
import importlib, json, sys
from sglang.srt.entrypoints.openai.protocol import Tool
rows = json.load(sys.stdin)
out = []
for row in rows:
    module, cls = row["detector"]
    det = getattr(importlib.import_module("sglang.srt.function_call." + module), cls)()
    tools = [Tool(function={"name": n, "parameters": p}) for n, p in row["tools"].items()]
    try:
        got = det.detect_and_parse(row["text"], tools)
        out.append([[c.name, c.parameters] for c in got.calls])
    except Exception as e:
        out.append("raised " + type(e).__name__)
json.dump(out, sys.stdout)
"""


def value(rng: random.Random, depth: int = 0, kind: str | None = None):
    kind = kind or rng.choice(
        ["str", "str", "int", "float", "bool", "null", "list", "obj"] if depth < 2 else ["str", "int"]
    )
    return {
        "str": lambda: rng.choice(WORDS),
        "int": lambda: rng.randint(-1000, 10**6),
        "float": lambda: round(rng.uniform(-100, 100), 3),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
        "list": lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "obj": lambda: {f"k{i}": value(rng, depth + 1) for i in range(rng.randint(0, 3))},
    }[kind]()


def arguments(rng: random.Random, name: str) -> dict:
    """Three arguments; a parameter's type is the same in every call of the tool (its schema says one type)."""
    keys = [rng.choice(["expression", "city", "query", "path", "opts", "n"]) + str(i) for i in range(3)]
    kinds = ["str", "str", "int", "float", "bool", "list", "obj"]
    return {k: value(rng, 0, random.Random(f"{name}.{k}").choice(kinds)) for k in keys}


def spaced(rng: random.Random, text: str, fmt: str) -> str:
    """Odd whitespace where the format allows it: around a JSON body."""
    if fmt == "hermes":
        return text.replace("<tool_call>\n", "<tool_call>" + rng.choice(["", "\n", "  \n", "\n\n"]))
    if fmt == "mistral":  # SGLang's MistralDetector takes the list after "[TOOL_CALLS] [" (its docstring's form)
        return text.replace("[TOOL_CALLS][", "[TOOL_CALLS] [")
    if fmt == "llama3-json":
        return text.replace("; ", rng.choice([";", "; ", " ;\n"]))
    return text


def broken(rng: random.Random, text: str, fmt) -> str:
    """A malformed call: cut short, its JSON broken, or a bad name."""
    how = rng.choice(["cut", "json", "name"])
    if how == "cut":
        return text[: rng.randint(len(text) // 3, len(text) - 2)]
    if how == "json":
        return text.replace('": ', '" ', 1) if '": ' in text else text.replace("{", "[", 1)
    return text.replace(NAMES[0], "two words", 1)


def corpus(fmt_name: str, n: int, seed: int) -> list[dict]:
    rng, fmt = random.Random(f"{fmt_name}:{seed}"), TOOL_FORMATS.get(fmt_name)()
    rows = []
    for i in range(n):
        count = rng.choice([1, 1, 2, 3]) if fmt_name in PARALLEL else 1
        names = [rng.choice(NAMES) for _ in range(count)]
        calls = [(name, arguments(rng, name)) for name in names]
        if fmt_name == "qwen3-xml":  # no schema for the farm: string values that do not read as JSON
            calls = [(n_, {k: v for k, v in a.items() if not isinstance(v, str) or v in WORDS}) for n_, a in calls]
        text = spaced(rng, fmt.render_calls(calls), fmt_name)
        if fmt_name == "harmony":
            text = "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant" + text
        elif fmt_name != "llama3-json" and rng.random() < 0.3:
            text = rng.choice(["Let me check. ", "Sure!\n", "東京: "]) + text
        malformed = rng.random() < 0.12
        if malformed:
            calls[0] = ("calculator", calls[0][1])
            text = broken(rng, text.replace(calls[0][0], NAMES[0], 1), fmt)
        rows.append({"text": text, "calls": calls, "malformed": malformed})
    return rows


def schema(v) -> dict:
    types = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}
    return {"type": types[type(v)]} if v is not None else {}


def tools(calls: list) -> dict:
    """Each tool's JSON Schema as a caller would declare it: every parameter its calls pass, typed by its value."""
    props = {n: {} for n in NAMES}
    for name, arguments in calls:
        props[name].update({k: schema(v) for k, v in arguments.items()})
    return {n: {"type": "object", "properties": p} for n, p in props.items()}


def reference(rows: list[dict], sglang: str, python: str) -> list:
    with tempfile.TemporaryDirectory() as stubs:
        for path, text in STUBS.items():
            (Path(stubs) / path).parent.mkdir(parents=True, exist_ok=True)
            (Path(stubs) / path).write_text(text)
        env = {"PYTHONPATH": f"{stubs}:{sglang}", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [python, "-c", RUNNER], input=json.dumps(rows), capture_output=True, text=True, env=env, check=False
        )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout)


def same(a, b) -> bool:
    return [(n, json.loads(x) if isinstance(x, str) else x) for n, x in a] == [
        (n, json.loads(x) if isinstance(x, str) else x) for n, x in b
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sglang", required=True, help="the unpacked sglang wheel (holds sglang/srt/function_call)")
    ap.add_argument("--python", required=True, help="a python with pydantic, orjson and partial_json_parser")
    ap.add_argument("-n", type=int, default=1000, help="strings per format")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    report = {"reference": "sglang 0.5.14 sglang/srt/function_call detectors", "n_per_format": args.n, "formats": {}}
    for name, detector in DETECTORS.items():
        rows = corpus(name, args.n, args.seed)
        fmt = TOOL_FORMATS.get(name)()
        farm = [fmt.parse(r["text"], 0) for r in rows]
        asked = [
            {
                "detector": detector,
                "text": r["text"],
                "tools": tools(r["calls"]),
            }
            for r in rows
        ]
        theirs = reference(asked, args.sglang, args.python)
        agree, disagree, bad_read = 0, [], 0
        for r, ours, ref in zip(rows, farm, theirs):
            mine = [(c.name, c.arguments) for c in ours.calls]
            if r["malformed"]:
                bad_read += bool(ref)
                continue
            ok = isinstance(ref, list) and same(mine, ref)
            agree += ok
            if not ok and len(disagree) < 8:
                disagree.append({"text": r["text"], "farm": mine, "farm_malformed": ours.malformed, "sglang": ref})
        clean = [i for i, r in enumerate(rows) if not r["malformed"]]
        report["formats"][name] = {
            "detector": ".".join(detector),
            "n": len(rows),
            "well_formed": len(clean),
            "agree": agree,
            "agreement": round(agree / len(clean), 4),
            "farm_reads_as_generated": sum(
                same([(c.name, c.arguments) for c in farm[i].calls], rows[i]["calls"]) for i in clean
            ),
            "malformed_generated": len(rows) - len(clean),
            "malformed_counted_by_farm": sum(bool(farm[i].malformed) for i in range(len(rows)) if rows[i]["malformed"]),
            "malformed_sglang_read_some_call": bad_read,
            "disagree_examples": disagree,
        }
        print(f"{name}: {agree}/{len(clean)} well-formed agree ({agree / len(clean):.2%})")
    OUT.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
