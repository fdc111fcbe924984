"""The SGLang adapter's calls, checked against the source of the sglang version pinned in pyproject.toml.

The wheel is downloaded (no dependencies, not installed) and read with `ast` by tests/sglang_contract.py, so a
drift in SGLang's API fails here, without a GPU. Bumping the pin re-checks the contract against the new version.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang_contract import Adapter, WheelSource, check

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "rollout_farm" / "services" / "engine" / "sglang_engine.py"
WHEEL_CACHE = Path(os.environ.get("FARM_CACHE", Path.home() / ".cache" / "rollout-farm")) / "wheels"
# Every build of a release holds the same Python source: fetch one fixed build, whatever machine runs the test.
WHEEL_BUILD = ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]


def pinned_sglang_version() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [m for req in extras["sglang"] if (m := re.fullmatch(r"sglang\[srt\]==([\w.]+)", req))]
    named = [req for req in extras["sglang"] if req.startswith("sglang")]
    if len(pins) != 1 or len(named) != 1:
        raise AssertionError(
            f"pyproject.toml's sglang extra is {extras['sglang']}: pin one exact version, like "
            "'sglang[srt]==0.5.14', so that this test checks the adapter against that version's source"
        )
    return pins[0].group(1)


def download_wheel(version: str) -> Path:
    cached = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if cached:
        return cached[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
    command += [*WHEEL_BUILD, "-d", str(WHEEL_CACHE), f"sglang=={version}"]
    try:
        stderr = subprocess.run(command, capture_output=True, text=True, timeout=600).stderr
        error = (stderr.strip().splitlines() or ["no output"])[-1][-500:]  # pip's last line is its error
    except subprocess.TimeoutExpired:
        error = "timed out after 600 s"
    cached = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if cached:
        return cached[0]
    reason = f"could not download the sglang=={version} wheel (`{' '.join(command[2:])}`): {error}"
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{reason}. CI is set, so this fails rather than skips: CI must reach PyPI")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def wheel() -> WheelSource:
    return WheelSource(download_wheel(pinned_sglang_version()))


def test_the_adapter_names_the_pinned_version():
    version = pinned_sglang_version()
    assert f"sglang {version}" in ADAPTER.read_text().split('"""')[1], (
        f"pyproject.toml pins sglang {version}: say so in the docstring of {ADAPTER.name}"
    )


def test_the_adapter_matches_the_pinned_sglang(wheel):
    problems = check(ADAPTER.read_text(), wheel)
    assert not problems, (
        f"{ADAPTER.relative_to(ROOT)} disagrees with sglang {pinned_sglang_version()}'s source:\n  "
        + "\n  ".join(problems)
        + "\nFix the adapter for this version, or pin the version it was written for in pyproject.toml"
    )


def test_the_checker_finds_the_adapters_uses():
    """Against a checker that silently finds nothing: the uses it derives include the ones known today."""
    adapter = Adapter(ADAPTER.read_text())
    chains = {".".join(chain) for _, chain, _ in adapter.engine_uses}
    assert {"async_generate", "update_weights_from_tensor", "tokenizer_manager.abort_request", "loop"} <= chains
    keywords = {
        (".".join(chain), k): v for _, chain, call in adapter.engine_uses if call for k, v in call.keywords.items()
    }
    assert ("tokenizer_manager.abort_request", "abort_all") in keywords  # passed through _LoopThread.call
    sampling = set().union(
        *(
            adapter.dict_keys(call.keywords["sampling_params"])
            for _, chain, call in adapter.engine_uses
            if call and ".".join(chain) == "async_generate"
        )
    )
    assert {"temperature", "max_new_tokens", "sampling_seed", "regex"} <= sampling
    assert {key for _, key in adapter.keys_read_in("_output")} >= {"meta_info", "output_token_logprobs"}
    assert [name for _, name in adapter.environment_variables] == ["SGLANG_RETURN_ORIGINAL_LOGPROB"]


def test_the_adapter_keeps_many_requests_in_flight_without_a_thread_each():
    """The replica awaits agenerate for every rollout at once: it must be a coroutine that submits async_generate to
    the engine's loop and awaits its future, never blocking its event loop on a future or a sleep (SGLang's
    continuous batching needs the requests in flight together). The synchronous generate runs agenerate."""
    tree = ast.parse(ADAPTER.read_text())
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    agenerate, group = methods["agenerate"], methods["_group"]
    assert isinstance(agenerate, ast.AsyncFunctionDef) and isinstance(group, ast.AsyncFunctionDef)
    calls = {ast.unparse(n.func) for n in ast.walk(agenerate) if isinstance(n, ast.Call)}
    assert "self._group" in calls and "self._loop.submit" in calls
    awaited = {ast.unparse(n.value.func) for n in ast.walk(group) if isinstance(n, ast.Await)}
    assert awaited == {"self.llm.async_generate"}
    blocking = {c for c in calls if c.rsplit(".", 1)[-1] in {"result", "run_until_complete"} or c == "time.sleep"}
    assert not blocking, blocking
    assert any(isinstance(n, ast.Await) for n in ast.walk(agenerate))
    generate = {ast.unparse(n) for n in ast.walk(methods["generate"]) if isinstance(n, ast.Call)}
    assert any("self.agenerate(" in c for c in generate), generate


def test_a_group_is_sent_in_the_form_the_pinned_sglang_caches(wheel):
    """SGLang's own n > 1 path prefills each distinct prompt alone (max_new_tokens 0) before the copies, so that they
    find it in the radix cache; the adapter does the same for a call that holds a prompt more than once, with its own
    rids (so abort_request still names them). The SGLang engine needs a GPU: its async_generate is recorded here."""
    manager = wheel.zip.read(wheel.path("sglang.srt.managers.tokenizer_manager")).decode()
    common = manager[manager.index("Cache the common prefix for parallel sampling") :]
    assert "sampling_params.max_new_tokens = 0" in common[: common.index("Expand requests")]
    from rollout_farm.services.engine.sglang_engine import SGLangEngine

    sent = []

    class Recorder:
        async def async_generate(self, input_ids, sampling_params, rid, return_logprob=False):
            sent.append((input_ids, sampling_params["max_new_tokens"], rid))
            return [{"rid": r} for r in rid]

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.llm = Recorder()
    group, other = [1, 2, 3], [4, 5]
    prompts, params = [group] * 3 + [other] * 2, {"max_new_tokens": 8}
    rids = [f"r{i}" for i in range(5)]
    prefixes, results = asyncio.run(engine._group(prompts, [group, other], params, rids, ["p0", "p1"]))
    assert sent == [([group, other], 0, ["p0", "p1"]), (prompts, 8, rids)] and len(results) == 5
    sent.clear()
    asyncio.run(engine._group([group, other], [group, other], params, rids[:2], []))  # no prompt twice: one request
    assert sent == [([group, other], 8, rids[:2])]


def test_a_drift_in_the_real_adapter_is_reported(wheel):
    source = ADAPTER.read_text()
    source = source.replace('"sampling_seed": params.seed', '"seed": params.seed')  # SGLang calls it sampling_seed
    source = source.replace("abort_request, abort_all=True", "abort_request, abort_everything=True")
    problems = check(source, wheel)
    expected = ["SamplingParams has no parameter 'seed'", "abort_request has no parameter 'abort_everything'"]
    assert len(problems) == 2 and all(any(e in p for p in problems) for e in expected), problems


BROKEN_ADAPTER = """
import os
import sglang

class Adapter:
    def __init__(self):
        self.llm = sglang.Engine(model_path="m")

    def generate(self, prompts, rid):
        {line}
"""


def test_the_negative_controls_start_clean(wheel):
    assert check(BROKEN_ADAPTER.format(line="pass"), wheel) == []


@pytest.mark.parametrize(
    "line, problem",
    [
        ("self.llm.async_generat(input_ids=prompts)", "Engine has no attribute 'async_generat'"),
        ("self.llm.async_generate(input_ids=prompts, return_logprobs=True)", "no parameter 'return_logprobs'"),
        ("self.llm.update_weights_from_disk('a', 'b', 'c')", "takes 2 positional arguments, the adapter passes 3"),
        ("self._loop.call(self.llm.tokenizer_manager.abort_request, rid, abort_al=True)", "no parameter 'abort_al'"),
        ("self.llm.tokenizer_manager.abort_requests(rid)", "TokenizerManager has no attribute 'abort_requests'"),
        ("self.llm.server_args.tp_size", "cannot tell the class of sglang.srt.entrypoints.engine.Engine.server_args"),
        ("self.llm.lop = None", "Engine has no attribute 'lop'"),
        ("sglang.Engin()", "sglang.Engin, which sglang/__init__.py lacks"),
        ("sglang.Engine(model_path='m', devise='cuda')", "ServerArgs has no field 'devise'"),
        ("from sglang.srt.no_such_module import x", "imports sglang.srt.no_such_module"),
        ("from sglang.srt.entrypoints.engine import Engin", "imports Engin from sglang.srt.entrypoints.engine"),
        ("self.llm.async_generate(input_ids=prompts, sampling_params={'top_q': 0.9})", "no parameter 'top_q'"),
        (
            "sampling = {}; sampling['max_tokens'] = 8; self.llm.async_generate(sampling_params=sampling)",
            "'max_tokens'",
        ),
        ("def _output(result): return result['meta_info']['output_token_logprob']", "'output_token_logprob'"),
        ("def _prefill(result): return result['meta_info']['cache_tokens']", "'cache_tokens'"),  # a session's reuse
        ("sglang.Engine(model_path='m', disable_radix_cach=False)", "ServerArgs has no field 'disable_radix_cach'"),
        ("os.environ['SGLANG_RETURN_ORIGINAL_LOGPROBS'] = '1'", "$SGLANG_RETURN_ORIGINAL_LOGPROBS"),
    ],
)
def test_the_checker_reports_a_drift(wheel, line, problem):
    problems = check(BROKEN_ADAPTER.format(line=line), wheel)
    assert len(problems) == 1 and problem in problems[0], problems
