"""LoRA training without a service: the config keys (verl's names), the peft model (only the adapter trains, the
reference is the base under disable_adapter, no second copy), the adapter's pushes and versions against a fake farm
that computes digests as the farm does, and read-your-writes on samples, with negative controls."""

import argparse
import hashlib
import random
import re
import types

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.digest import adapter_digest, base_digest, tensor_checksums
from rollout_farm.services.adapters.peft_format import read_folder
from rollout_farm.services.client import FarmError
from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer import cli, lora
from rollout_farm.trainer.config import ConfigError, Optim, load
from rollout_farm.trainer.run import _adamw
from rollout_farm.trainer.sync import rollouts, staleness_bound
from rollout_farm.trainer.sync.adapter import AdapterSync, PolicyMismatch

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


# the config ---------------------------------------------------------------------------------------------------
def test_lora_is_off_by_default_and_takes_verls_keys():
    m = load().actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (0, 16, "all-linear") and not load().lora
    c = load(None, [*LORA, "actor_rollout_ref.model.target_modules=[q_proj, v_proj]"])
    m = c.actor_rollout_ref.model
    assert c.lora and (m.lora_rank, m.lora_alpha, m.target_modules) == (4, 8.0, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank: Input should be greater than"),
        (["actor_rollout_ref.model.lora_rank=4096"], "actor_rollout_ref.model.lora_rank: Input should be less than"),
        (
            [*LORA, "actor_rollout_ref.model.lora_alpha=0"],
            "actor_rollout_ref.model.lora_alpha: Input should be greater",
        ),
        (
            [*LORA, "actor_rollout_ref.model.target_modules=qproj"],
            "actor_rollout_ref.model.target_modules: Value error",
        ),
        ([*LORA, "actor_rollout_ref.model.target_modules=[]"], "an empty list adapts nothing"),
        ([*LORA, "actor_rollout_ref.model.target_modules=[q proj]"], "are not module names"),
        ([*LORA, "trainer.adapter=my run"], "trainer.adapter: String should match pattern"),
        (["trainer.adapter=mine"], "trainer.adapter: only LoRA training pushes an adapter"),
        (["trainer.adapter_push_dir=/shared"], "trainer.adapter_push_dir: only LoRA training"),
        ([*LORA, "trainer.weight_sync=delta"], "trainer.weight_sync: delta diffs full weight pushes"),
        ([*LORA, "data.env=calculator"], "data.env: LoRA training checks every sample's policy digest"),
    ],
)
def test_bad_lora_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load(None, overrides)
    assert message in str(e.value)


def test_the_adapter_name_is_the_flag_else_the_experiment_name_made_valid_else_the_task_and_seed():
    assert load(None, LORA).adapter_name == "farm-arith-0"
    assert load(None, [*LORA, "trainer.experiment_name='.My run/α 1'"]).adapter_name == "My-run-1"
    parser = argparse.ArgumentParser()
    cli._train_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["train", *LORA, "trainer.experiment_name=x", "--adapter", "team-a.run_2"])
    assert cli.train_config(args).adapter_name == "team-a.run_2"


# the model ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_model):
    """The tiny model as loaded, and a second copy wrapped for LoRA training with a random B (an adapter that changes
    the outputs)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = load(None, [*LORA, f"actor_rollout_ref.model.path={tiny_model}"]).actor_rollout_ref.model
    policy = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), cfg)
    return plain, policy


def randomize_b(policy, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def test_only_the_adapter_trains_and_the_optimizer_holds_only_its_parameters(models):
    _, policy = models
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"} | {
        "down_proj"
    }  # all-linear: every linear layer but the head
    opt = _adamw(policy, Optim())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)


def test_the_reference_is_the_base_under_disable_adapter_with_no_second_copy(models):
    plain, policy = models
    randomize_b(policy, seed=1)
    ref = lora.Reference(policy)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        base = plain(input_ids=ids).logits
        assert torch.allclose(ref(input_ids=ids).logits, base, atol=1e-6)
        assert not torch.allclose(policy(input_ids=ids).logits, base, atol=1e-3)  # the adapter is on again after
    assert ref.model is policy  # one model: the reference's weights are the policy's frozen base


def test_the_base_tensors_are_the_model_folders_under_its_names_without_a_copy(models, tiny_model):
    _, policy = models
    base = lora.base_tensors(policy)
    on_disk = load_file(tiny_model / "model.safetensors")
    assert sorted(base) == sorted(on_disk) == sorted(canonical_state_dict(models[0]))
    assert all(torch.equal(base[n], on_disk[n]) for n in on_disk)
    wrapped = dict(policy.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (
        base[q].data_ptr() == wrapped["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].data_ptr()
    )


def test_target_modules_the_model_lacks_name_the_key(tiny_model):
    from transformers import AutoModelForCausalLM

    cfg = load(None, [*LORA, "actor_rollout_ref.model.target_modules=[nope_proj]"]).actor_rollout_ref.model
    with pytest.raises(ValueError, match="actor_rollout_ref.model.target_modules: .*nope_proj"):
        lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), cfg)


# pushes and read-your-writes ----------------------------------------------------------------------------------
class FakeFarm:
    """The adapter routes of a farm serving `base` (name -> tensor, e.g. the model folder's file): each push answers
    the digest the farm computes from the bytes it loaded (docs/tenants.md), and versions only go up."""

    def __init__(self, base: dict[str, torch.Tensor], owner_elsewhere: bool = False):
        self.base = base_digest(*tensor_checksums(base))
        self.versions: dict[int, str] = {}
        self.pushes: list[tuple[str, int]] = []
        self.owner_elsewhere = owner_elsewhere

    def push_adapter(self, name, folder, version, probe=None):
        self.pushes.append((name, version))
        if self.owner_elsewhere:
            raise FarmError(404, {"error": f"no adapter {name!r}"})
        if self.versions and version <= max(self.versions):
            detail = [{"field": "version", "message": "older than the newest version"}]
            raise FarmError(409, {"error": "versions only go up", "detail": detail})
        config, tensors_file = read_folder(folder)
        digest = adapter_digest(self.base, config.canonical(), *tensor_checksums(load_file(tensors_file)))
        self.versions[version] = digest
        return P.AdapterPushResponse(name=name, version=version, digest=digest, tensors=1, bytes=1, seconds=0.0)

    def adapter(self, name):
        versions = [
            P.AdapterVersion(
                version=v, digest=d, base_version=0, sha256="", bytes=1, r=4, state="resident", pushed_at=0.0
            )
            for v, d in sorted(self.versions.items())
        ]
        return P.AdapterInfo(name=name, versions=versions)


def on_disk(tiny_model, dtype=None):
    t = load_file(tiny_model / "model.safetensors")
    return {n: v.to(dtype) for n, v in t.items()} if dtype else t


def test_each_push_is_the_adapter_alone_its_versions_go_up_and_its_digest_is_the_farms(models, tiny_model):
    _, policy = models
    farm = FakeFarm(on_disk(tiny_model))
    sync = AdapterSync(farm, "run-a", lora.base_tensors(policy))
    assert sync.base_digest == farm.base  # hashed from the trainer's own tensors: the same bytes as the folder's
    assert sync.push(policy, 1) == 1
    randomize_b(policy, seed=2)
    assert sync.push(policy, 1) == 2  # a rollback to step 0 still pushes above the last version
    assert sync.push(policy, 7) == 7  # v<step + 1>
    assert farm.pushes == [("run-a", 1), ("run-a", 2), ("run-a", 7)] and sync.digests == farm.versions
    assert len(set(sync.digests.values())) == 2  # v2 and v7 hold the same adapter: the same digest


def test_a_version_the_farm_refuses_as_used_is_pushed_above_its_newest(models, tiny_model):
    _, policy = models
    farm = FakeFarm(on_disk(tiny_model))
    farm.versions = {1: "xxh3_128:earlier", 5: "xxh3_128:earlier-run"}  # an earlier run under this name
    sync = AdapterSync(farm, "run-b", lora.base_tensors(policy))
    assert sync.push(policy, 1) == 6 and farm.pushes == [("run-b", 1), ("run-b", 6)]


def test_another_tenants_adapter_name_says_to_choose_another(models, tiny_model):
    _, policy = models
    sync = AdapterSync(FakeFarm(on_disk(tiny_model), owner_elsewhere=True), "taken", lora.base_tensors(policy))
    with pytest.raises(RuntimeError, match="another tenant: choose another name .*--adapter NAME"):
        sync.push(policy, 1)


def test_a_farm_serving_other_base_weights_fails_the_push_naming_both_digests(models, tiny_model):
    _, policy = models
    other = {n: t + 1e-3 if t.is_floating_point() else t for n, t in on_disk(tiny_model).items()}
    farm = FakeFarm(other)
    sync = AdapterSync(farm, "run-c", lora.base_tensors(policy))
    with pytest.raises(PolicyMismatch) as e:
        sync.push(policy, 1)
    digests = set(re.findall(r"\w+:[0-9a-f]{32}", str(e.value)))
    assert farm.versions[1] in digests and len(digests) == 2  # the farm's and the trainer's
    assert "the farm serves other base weights" in str(e.value) and not sync.digests


def test_a_farm_serving_the_same_base_in_bfloat16_is_recognised(models, tiny_model):
    _, policy = models
    farm = FakeFarm(on_disk(tiny_model, torch.bfloat16))
    sync = AdapterSync(farm, "run-d", lora.base_tensors(policy))
    assert sync.push(policy, 1) == 1 and sync.served == torch.bfloat16 and sync.digests[1] == farm.versions[1]


def sample(adapter: str | None, version: int | None, digest: str | None, base_version: int = 3) -> P.Sample:
    policy = P.Policy(base_version=base_version, adapter=adapter, adapter_version=version, digest=digest)
    return P.Sample(
        token_ids=[5, 6],
        logprobs=[-1.0, -1.0],
        text="x",
        finish_reason="length",
        weight_version=base_version,
        token_weight_versions=[base_version, base_version],
        policy=policy,
    )


def group(*samples: P.Sample) -> P.Group:
    return P.Group(prompt_token_ids=[1, 2], samples=list(samples), reward_mean=0, reward_std=0, zero_variance=True)


@pytest.fixture
def pushed(models, tiny_model):
    """An AdapterSync that pushed v1 and v2 (another adapter) to a fake farm."""
    _, policy = models
    sync = AdapterSync(FakeFarm(on_disk(tiny_model)), "run-e", lora.base_tensors(policy))
    randomize_b(policy, seed=3)
    sync.push(policy, 1)
    randomize_b(policy, seed=4)
    sync.push(policy, 2)
    assert sync.digests[1] != sync.digests[2]
    return sync


def test_samples_with_the_pushed_digest_train_under_their_adapter_version(pushed):
    g = pushed.verified(group(sample("run-e", 2, pushed.digests[2]), sample("run-e", 1, pushed.digests[1])))
    assert [s.weight_version for s in g.samples] == [2, 1]  # the adapter's versions, not the base's 3
    assert all(s.token_weight_versions is None for s in g.samples)


@pytest.mark.parametrize(
    "bad, words",
    [
        (lambda d: sample("run-e", 2, d[1]), "carries digest"),  # v2 stamped with v1's bytes
        (lambda d: sample("run-e", 2, "xxh3_128:" + "0" * 32), "the farm served other bytes under this version"),
        (lambda d: sample(None, None, "xxh3_128:base"), "the base model (version 3)"),
        (lambda d: sample("someone-else", 2, d[2]), "adapter someone-else@v2"),
        (lambda d: sample("run-e", 2, d[2]).model_copy(update={"policy": None}), "stamps no policy"),
    ],
)
def test_a_sample_of_another_policy_is_refused_and_stops_the_run(pushed, bad, words):
    good = sample("run-e", 2, pushed.digests[2])
    assert pushed.verified(group(good)) is not None  # the control: the same group without the bad sample passes
    with pytest.raises(PolicyMismatch, match=re.escape(words)):
        pushed.verified(group(good, bad(pushed.digests)))


def test_a_version_never_pushed_is_left_to_the_caller(pushed):
    unknown = group(sample("run-e", 9, "xxh3_128:whatever"))
    assert pushed.verified(unknown) is None  # a queue group from an earlier process: refused as stale
    with pytest.raises(PolicyMismatch, match=r"asked for run-e@v2, got samples of version\(s\) \[9\]"):
        pushed.verified_all([unknown], asked=2)


# requests and the queue ---------------------------------------------------------------------------------------
class FakeClient:
    """Rollouts and the queue: records what the trainer asks, answers scripted groups."""

    def __init__(self, groups=(), pulls=()):
        self.groups, self.pulls = list(groups), list(pulls)
        self.requests, self.sources, self.acked, self.fed = [], [], [], []

    def rollouts(self, req):
        self.requests.append(req)
        return P.RolloutResponse(groups=self.groups)

    def queue_pull(self, req):
        return self.pulls.pop(0)

    def queue_ack(self, ids):
        self.acked += ids

    def queue_add_prompts(self, name, prompts, batch_id=None):
        self.fed.append((name, [p.text for p in prompts], batch_id))

    def queue_add_source(self, spec):
        self.sources.append(spec)


def lora_run(sync, client, *overrides):
    cfg = load(
        None,
        [*LORA, f"trainer.adapter={sync.name}", "data.train_batch_size=1", "actor_rollout_ref.rollout.n=1", *overrides],
    )
    task = types.SimpleNamespace(
        train_batch=lambda rng, k: [types.SimpleNamespace(prompt="1+1", answer="2") for _ in range(k)],
        reward="gsm8k",
        max_new_tokens=8,
    )
    return types.SimpleNamespace(
        cfg=cfg,
        client=client,
        adapter=sync,
        version=2,
        base_version=3,
        rng=random.Random(0),
        task=task,
        tok=types.SimpleNamespace(chat_template=None),
        generated_tokens=0,
        pulls=0,
        pull_stats={},
        run_id="r",
        pad_id=0,
    )


def test_a_rollout_names_the_version_just_pushed_and_its_samples_are_checked(pushed):
    client = FakeClient(groups=[group(sample("run-e", 2, pushed.digests[2]))])
    run = lora_run(pushed, client)
    batch = rollouts.pull(run)
    req = client.requests[0]
    assert req.adapter == P.AdapterRef(name="run-e", version=2) and req.min_weight_version == 3  # the base's
    assert batch.weight_versions.tolist() == [2] and batch.token_versions.tolist() == [[2, 2]]
    client.groups = [group(sample("run-e", 2, pushed.digests[1]))]  # the negative control
    with pytest.raises(PolicyMismatch):
        rollouts.pull(run)


def test_the_queue_source_samples_the_adapter_and_stale_or_unknown_groups_are_fed_again(pushed):
    run = lora_run(pushed, FakeClient(), "trainer.rollout_source=queue")
    rollouts.add_queue_source(run, rollouts.source_name(run))
    source = run.client.sources[0]
    assert source.name == "farm-trainer-run-e" and source.adapter == P.AdapterRef(name="run-e", min_version=2)

    def item(item_id, g):
        return P.QueueItem(item_id=item_id, prompt=P.Prompt(text=item_id), group=g, weight_version=3, deliveries=1)

    fresh, old = sample("run-e", 2, pushed.digests[2]), sample("run-e", 1, pushed.digests[1])
    first = [item("old", group(old)), item("unknown", group(sample("run-e", 9, "x"))), item("ok", group(fresh))]
    second = [item("ok2", group(fresh))]
    pulls = [
        P.PullResponse(lease_id=str(i), lease_expires_s=1, current_version=3, items=x)
        for i, x in enumerate([first, second])
    ]
    client = FakeClient(pulls=pulls)
    got = staleness_bound.lease(
        client, "src", 2, version=2, bound=0, lease_s=5, verify=pushed.verified, requeue=lambda i: requeue(client, i)
    )
    assert [i.item_id for i in got.items] == ["ok", "ok2"] and got.refused == 2
    assert [s.weight_version for i in got.items for s in i.group.samples] == [2, 2]
    again = hashlib.sha256(b"old").hexdigest()[:16]
    assert client.acked == ["old", "unknown"] and client.fed == [("src", ["old", "unknown"], f"r:again:{again}")]


def requeue(client, items):
    rollouts.requeue(types.SimpleNamespace(client=client, run_id="r"), "src", items)
