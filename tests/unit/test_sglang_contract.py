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

from tests.sglang_contract import RESULT_TYPES, Adapter, WheelSource, _is_name, check

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "rollout_farm" / "services" / "engine"
ADAPTER = ENGINE / "sglang_engine.py"
# every file of the adapter that calls `self.llm` (the sglang.Engine): checked as one source, the class first
ADAPTER_FILES = [ADAPTER, ENGINE / "sglang_adapter_verbs.py", ENGINE / "sglang_weights.py"]


def adapter_source() -> str:
    return "\n".join(f.read_text() for f in ADAPTER_FILES)


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
    problems = check(adapter_source(), wheel)
    assert not problems, (
        f"{', '.join(f.name for f in ADAPTER_FILES)} disagree with sglang {pinned_sglang_version()}'s source:\n  "
        + "\n  ".join(problems)
        + "\nFix the adapter for this version, or pin the version it was written for in pyproject.toml"
    )


def test_the_checker_finds_the_adapters_uses():
    """Against a checker that silently finds nothing: the uses it derives include the ones known today."""
    adapter = Adapter(adapter_source())
    chains = {".".join(chain) for _, chain, _ in adapter.engine_uses}
    assert {"async_generate", "update_weights_from_tensor", "tokenizer_manager.abort_request", "loop"} <= chains
    assert {"load_lora_adapter", "async_unload_lora_adapter"} <= chains  # the adapter verbs
    keywords = {
        (".".join(chain), k): v for _, chain, call in adapter.engine_uses if call for k, v in call.keywords.items()
    }
    assert ("tokenizer_manager.abort_request", "abort_all") in keywords  # passed through _LoopThread.call
    assert {("load_lora_adapter", "lora_name"), ("load_lora_adapter", "lora_path")} <= set(keywords)
    assert ("async_unload_lora_adapter", "lora_name") in keywords
    # every request names its adapter, the group's prefill too (SGLang keys the radix cache by adapter)
    generate_calls = [call for _, chain, call in adapter.engine_uses if call and chain == ["async_generate"]]
    assert len(generate_calls) == 2 and all(ast.unparse(c.keywords["lora_path"]) == "adapter" for c in generate_calls)
    engine_call = next(
        n for n in ast.walk(adapter.tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "sglang.Engine"
    )
    assert {"enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch"} <= {
        k.arg for k in engine_call.keywords
    }
    assert "max_loaded_loras" not in {k.arg for k in engine_call.keywords}  # SGLang would unload adapters by itself
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
    tree = ast.parse(adapter_source())
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
        async def async_generate(self, input_ids, sampling_params, rid, return_logprob=False, lora_path=None):
            sent.append((input_ids, sampling_params["max_new_tokens"], rid))
            adapters.append(lora_path)
            return [{"rid": r} for r in rid]

    adapters = []

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
    assert adapters == [None, None, None]  # the base model
    # under an adapter, the prefill names it too: the radix cache key holds the adapter's lora_id
    schedule = wheel.zip.read(wheel.path("sglang.srt.managers.schedule_batch")).decode()
    assert "lora_id is concatenated to the extra key" in schedule
    adapters.clear()
    asyncio.run(engine._group(prompts, [group, other], params, rids, ["p0", "p1"], adapter="a@v3"))
    assert adapters == ["a@v3", "a@v3"]


def test_a_drift_in_the_real_adapter_is_reported(wheel):
    source = adapter_source()
    source = source.replace('"sampling_seed": params.seed', '"seed": params.seed')  # SGLang calls it sampling_seed
    source = source.replace("abort_request, abort_all=True", "abort_request, abort_everything=True")
    problems = check(source, wheel)
    expected = ["SamplingParams has no parameter 'seed'", "abort_request has no parameter 'abort_everything'"]
    assert len(problems) == 2 and all(any(e in p for p in problems) for e in expected), problems


def test_a_lora_drift_in_the_real_adapter_is_reported(wheel):
    """Negative controls on the adapter verbs' calls, made in the real adapter's source."""
    source = adapter_source()
    drifts = [
        ("max_lora_rank=lora.max_rank", "max_lora_ranks=lora.max_rank", "ServerArgs has no field 'max_lora_ranks'"),
        (
            "load_lora_adapter(lora_name=key,",
            "load_lora_adapter(name=key,",
            "load_lora_adapter has no parameter 'name'",
        ),
        ("async_unload_lora_adapter(lora_name=key)", "async_unload_lora_adapter(key, True)", "takes 1 positional"),
        ("rid=rids, lora_path=adapter", "rid=rids, lora_paths=adapter", "async_generate has no parameter 'lora_paths'"),
        (
            "(result.error_message or",
            "(result.error_msg or",
            "LoRAUpdateOutput (what async_unload_lora_adapter returns) has no field 'error_msg'",
        ),
    ]
    for old, new, _ in drifts:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    problems = check(source, wheel)
    assert len(problems) == len(drifts), problems
    assert all(any(expected in p for p in problems) for _, _, expected in drifts), problems


def test_a_lora_verbs_result_is_an_object_the_adapter_reads_by_field(wheel):
    """load_lora_adapter and unload_lora_adapter return LoRAUpdateOutput, an object (success, error_message), not
    the (ok, message) tuple of the weight verbs: the adapter reads its fields and never unpacks it."""
    io_struct = "sglang.srt.managers.io_struct"
    assert {"success", "error_message"} <= wheel.fields(*wheel.find_class(f"{io_struct}.LoRAUpdateOutput"))
    manager = wheel.members(*wheel.find_class("sglang.srt.managers.tokenizer_manager.TokenizerManager"))
    for verb, alias in (
        ("load_lora_adapter", "LoadLoRAAdapterReqOutput"),
        ("unload_lora_adapter", "UnloadLoRAAdapterReqOutput"),
    ):
        assert ast.unparse(manager[verb].returns) == alias, verb
        _, assign = wheel.lookup(io_struct, alias)
        assert isinstance(assign, ast.Assign) and ast.unparse(assign.value) == "LoRAUpdateOutput", alias
    engine = wheel.members(*wheel.lookup("sglang", "Engine"))
    for verb in ("load_lora_adapter", "async_unload_lora_adapter"):
        assert f"tokenizer_manager.{verb.removeprefix('async_')}(" in ast.unparse(engine[verb]), verb
    assert {wheel.find_class(c)[1].name for c in RESULT_TYPES.values()} == {"LoRAUpdateOutput"}
    # the checker's results check (check() above) is not vacuous: it finds both verbs' results, read by field
    adapter = Adapter(adapter_source())
    assert {verb for _, verb, _ in adapter.results} == {"load_lora_adapter", "async_unload_lora_adapter"}
    tree = adapter.tree
    read = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_name(n.value, "result")}
    assert {"result.success", "result.error_message"} <= read


def test_the_request_fields_the_adapter_verbs_name(wheel):
    """The fields behind the keywords: a request's adapter is GenerateReqInput.lora_path, which the Engine passes on;
    a load names lora_name and lora_path (pinned stays False: SGLang may evict unpinned adapters only past
    max_loaded_loras, which the adapter leaves unset), an unload lora_name."""
    io_struct = "sglang.srt.managers.io_struct"
    assert {"lora_path", "lora_id"} <= wheel.fields(*wheel.find_class(f"{io_struct}.GenerateReqInput"))
    assert {"lora_name", "lora_path", "pinned"} <= wheel.fields(
        *wheel.find_class(f"{io_struct}.LoadLoRAAdapterReqInput")
    )
    assert {"lora_name"} <= wheel.fields(*wheel.find_class(f"{io_struct}.UnloadLoRAAdapterReqInput"))
    engine = wheel.members(*wheel.lookup("sglang", "Engine"))
    assert "lora_path=lora_path" in ast.unparse(engine["async_generate"])
    server_args = wheel.fields(*wheel.find_class("sglang.srt.server_args.ServerArgs"))
    assert {
        "enable_lora",
        "max_lora_rank",
        "lora_target_modules",
        "max_loras_per_batch",
        "max_loaded_loras",
    } <= server_args


def test_the_adapter_mirrors_sglangs_lora_tables(wheel):
    """sglang_adapters.py copies SGLang's target-module list, its leaf-name normalisation, its layer regex and the
    default batch of adapters: each copy must still be SGLang's."""
    from rollout_farm.services.engine import sglang_adapters as A

    _, supported = wheel.lookup("sglang.srt.utils.common", "SUPPORTED_LORA_TARGET_MODULES")
    assert tuple(ast.literal_eval(supported.value)) == A.SGLANG_TARGET_MODULES
    _, normalize = wheel.lookup("sglang.srt.lora.utils", "get_normalized_target_modules")
    mapping = next(
        n for n in ast.walk(normalize) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "params_mapping"
    )
    assert A.NORMALIZED.items() <= ast.literal_eval(mapping.value).items()
    _, layer_id = wheel.lookup("sglang.srt.layers.utils.common", "get_layer_id")
    assert repr(A.LAYER.pattern) in ast.unparse(layer_id)
    _, server_args = wheel.find_class("sglang.srt.server_args.ServerArgs")
    default = next(
        n for n in server_args.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "max_loras_per_batch"
    )
    assert ast.literal_eval(default.value) == A.DEFAULT_MAX_LORAS_PER_BATCH


LORA_BEHAVIOURS = [
    # (module, text in its source, what the adapter does because of it)
    (
        "sglang.srt.server_args",
        "you need to specify both --max-lora-rank and --lora-target-modules",
        "an engine with LoRA and no initial adapters passes both max_lora_rank and lora_target_modules",
    ),
    (
        "sglang.srt.lora.lora",
        "self.config.lora_alpha / self.config.r",
        "no rsLoRA in SGLang: the staged config folds sqrt(r) into lora_alpha (fails if SGLang starts honouring it)",
    ),
    ("sglang.srt.lora.lora_config", 'self.hf_config["target_modules"]', "the staged config writes target_modules"),
    ("sglang.srt.lora.lora_config", 'self.hf_config["r"]', "the staged config writes r"),
    ("sglang.srt.lora.lora_config", 'self.hf_config["lora_alpha"]', "the staged config writes lora_alpha"),
    ("sglang.srt.lora.lora", 'self.config.hf_config["peft_type"]', "the staged config writes peft_type"),
    ("sglang.srt.lora.lora_config", "added_tokens.json", "the staged folder holds no other file"),
    (
        "sglang.srt.managers.tokenizer_manager",
        "Reloading evicted adapter",
        "a request naming an unloaded name re-loads it: the adapter stops routing before unloading, deletes the "
        "folder after, and checks its own table before SGLang sees a request",
    ),
    (
        "sglang.srt.managers.tokenizer_manager",
        "Got LoRA adapter that has never been loaded",
        "the adapter's backstop turns this ValueError into AdapterNotResident (NOT_LOADED)",
    ),
    (
        "sglang.srt.lora.lora_registry",
        "requested LoRA adapters are not loaded",
        "the adapter's backstop turns this ValueError into AdapterNotResident (NOT_LOADED)",
    ),
    ("sglang.srt.lora.lora_registry", "does not exist", "an unload of an unknown name is not logged as a failure"),
    ("sglang.srt.managers.tokenizer_control_mixin", "wait_for_unload", "an unload waits for SGLang's requests on it"),
    (
        "sglang.srt.lora.lora_manager",
        "because it is already loaded",
        "a name is refused while loaded: a stage waits for an unload of its key",
    ),
    (
        "sglang.srt.lora.lora",
        "We assume every lora adaptor should contain lora modules for q_proj",
        "k_proj and v_proj are admitted only with q_proj, q_proj only with v_proj",
    ),
    ("sglang.srt.lora.lora", "Orphan up_proj weights", "up_proj is admitted only with gate_proj"),
    (
        "sglang.srt.lora.mem_pool",
        "target_module_names.issubset(self.target_modules)",
        "SGLang's own load check is the config's target_modules only: the adapter checks the tensors' modules",
    ),
]


@pytest.mark.parametrize("module, text, why", LORA_BEHAVIOURS, ids=[t for _, t, _ in LORA_BEHAVIOURS])
def test_the_lora_behaviours_the_adapter_relies_on(wheel, module, text, why):
    source = wheel.zip.read(wheel.path(module)).decode()
    assert text in source, f"{module} no longer says {text!r}, on which the adapter relies: {why}"


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
        # the adapter verbs
        ("self.llm.load_lora_adapter(lora_nam='a', lora_path='p')", "no parameter 'lora_nam'"),
        ("self.llm.load_lora_adapte(lora_name='a', lora_path='p')", "Engine has no attribute 'load_lora_adapte'"),
        ("self.llm.load_lora_adapter('a', 'p', False, True)", "takes 3 positional arguments, the adapter passes 4"),
        ("self.llm.unload_lora_adapter('a', 'b')", "takes 1 positional arguments, the adapter passes 2"),
        ("self.llm.async_unload_lora_adapter(lora_nme='a')", "no parameter 'lora_nme'"),
        ("self.llm.async_generate(input_ids=prompts, lora_paths='a')", "no parameter 'lora_paths'"),
        ("sglang.Engine(model_path='m', max_lora_ranks=8)", "ServerArgs has no field 'max_lora_ranks'"),
        ("sglang.Engine(model_path='m', enable_loras=True)", "ServerArgs has no field 'enable_loras'"),
        ("sglang.Engine(model_path='m', lora_target_module=['q_proj'])", "no field 'lora_target_module'"),
        ("sglang.Engine(model_path='m', max_lora_per_batch=4)", "no field 'max_lora_per_batch'"),
        ("r = self.llm.load_lora_adapter(lora_name='a', lora_path='p'); r.succes", "LoRAUpdateOutput (what"),
        ("r = await self.llm.async_unload_lora_adapter(lora_name='a'); print(r.error)", "has no field 'error'"),
        ("ok, message = self.llm.unload_lora_adapter('a')", "returns LoRAUpdateOutput, an object, which the adapter"),
    ],
)
def test_the_checker_reports_a_drift(wheel, line, problem):
    problems = check(BROKEN_ADAPTER.format(line=line), wheel)
    assert len(problems) == 1 and problem in problems[0], problems
