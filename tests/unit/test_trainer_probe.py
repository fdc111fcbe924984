"""The trainer's pushes carry a probe by default (rollout_farm/trainer/sync/probe.py), and a farm that refuses one for
it stops the run.

The farm here is a stand-in for the HTTP boundary only: it reads the body the trainer's WeightPusher sends (the
buckets, the probe in the first one's metadata) and scores the probe with the farm's own code
(rollout_farm/services/weights/probe.py score_staged and check) on a served copy of the model. Its broken mode is the
issue's engine: it receives the right bytes but stages one tensor stale."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmError
from rollout_farm.services.errors import Invalid
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.buckets import views
from rollout_farm.services.weights.checks import parse_header, payload_size
from rollout_farm.services.weights.pusher import WeightPusher
from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer import lora
from rollout_farm.trainer.config import ConfigError, load
from rollout_farm.trainer.sync.adapter import AdapterSync
from rollout_farm.trainer.sync.probe import ProbeRefused, PushProbe, probe_refused
from rollout_farm.trainer.sync.weights import push_weights


class ProbingFarm:
    """POST /v1/weights as a farm answers it: the body's buckets staged, the probe scored on them before the
    commit (422 on `probe` on a mismatch); `stale`: a tensor this farm's engine leaves as it was."""

    def __init__(self, served: torch.nn.Module, stale: str | None = None):
        self.served, self.stale, self.version = served, stale, 0
        self.probes: list[probes.Probe | None] = []

    def weights_version(self):
        return P.WeightsVersion(version=self.version, replicas={"r1": self.version})

    def push_pieces(self, pieces, size, version, policy="finish"):
        body = b"".join(bytes(p) for p in pieces())
        assert len(body) == size
        staged, at, probe = {}, 0, None
        while at < len(body):  # safetensors buckets back to back, each saying its own length
            n = int.from_bytes(body[at : at + 8], "little")
            end = at + 8 + n + payload_size(parse_header(body[at + 8 : at + 8 + n])[1])
            tensors, metadata = views(body[at:end])
            probe = probes.parse(metadata.get(probes.META_KEY)) if at == 0 else probe
            staged |= {k: v.clone() for k, v in tensors.items()}
            at = end
        self.probes.append(probe)
        if self.stale:
            staged[self.stale] = canonical_state_dict(self.served)[self.stale].clone()
        if probe is not None:
            try:
                probes.check(probe, probes.score_staged(self.served, staged, probe.sequences), "r1")
            except Invalid as e:
                raise FarmError(422, {"error": e.message, "detail": e.detail}) from None
        with torch.no_grad():
            for name, t in canonical_state_dict(self.served).items():
                t.copy_(staged[name])
        self.version = version
        return P.WeightsPushResponse(version=version, tensors=len(staged), bytes=size, seconds=0.0)


@pytest.fixture
def models(tiny_model):
    def load_model():
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    policy = load_model()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))  # a trained step: other weights than the farm serves
    return policy, load_model(), AutoTokenizer.from_pretrained(tiny_model)


def test_the_trainers_push_carries_a_probe_by_default_and_the_farm_accepts_it(models):
    policy, served, tok = models
    t = load().trainer
    assert (t.push_probe_sequences, t.push_probe_tokens, t.push_probe_tolerance) == (4, 16, 1e-3)
    probe = PushProbe.of_run(t, tok, policy)
    assert probe.sequences == PushProbe.of_run(t, tok, policy).sequences  # deterministic from trainer.seed
    assert len(probe.sequences) == 4 and all(len(s) == 16 and max(s) < len(tok) for s in probe.sequences)
    farm = ProbingFarm(served)
    assert push_weights(WeightPusher(farm), policy, "finish", probe) == 1
    (sent,) = farm.probes
    assert sent is not None and sent.sequences == probe.sequences and sent.tolerance == 1e-3
    assert all(torch.equal(a, b) for a, b in zip(served.parameters(), policy.parameters()))  # committed


def test_a_farm_that_refuses_the_probe_stops_the_run_naming_the_replica(models):
    policy, served, tok = models
    farm = ProbingFarm(served, stale="lm_head.weight")  # the right bytes, a stale tensor in the engine
    before = [p.clone() for p in served.parameters()]
    with pytest.raises(ProbeRefused) as e:
        push_weights(WeightPusher(farm), policy, "finish", PushProbe.of_run(load().trainer, tok, policy))
    said = str(e.value)
    assert "replica r1" in said and "sequence" in said and "trainer.push_probe_sequences=0" in said
    assert isinstance(e.value.__cause__, FarmError) and probe_refused(e.value.__cause__)
    assert farm.version == 0 and all(torch.equal(a, b) for a, b in zip(before, served.parameters()))
    # negative control: without a probe the same broken farm takes the push (what the probe is there to catch)
    off = PushProbe.of_run(load(None, ["trainer.push_probe_sequences=0"]).trainer, tok, policy)
    assert off is None and push_weights(WeightPusher(farm), policy, "finish", off) == 1 and farm.probes[-1] is None


def test_an_adapter_push_carries_the_probe_and_its_refusal_stops_the_run(models):
    policy, _, tok = models
    probe = PushProbe.of_run(load().trainer, tok, policy)

    class AdapterFarm:
        def __init__(self):
            self.sent = []

        def push_adapter(self, name, folder, version, probe=None):
            self.sent.append(probe)
            detail = [{"field": "probe", "message": "replica r2: logprob differs by 3.2 at sequence 1, token 4"}]
            raise FarmError(422, {"error": "the staged policy does not compute the probe's logprobs", "detail": detail})

    farm = AdapterFarm()
    sync = AdapterSync(farm, "run-p", dict(canonical_state_dict(policy)), probe=probe)
    cfg = load(None, ["actor_rollout_ref.model.lora_rank=4"]).actor_rollout_ref.model
    model = lora.wrap(policy, cfg)
    with pytest.raises(ProbeRefused, match="adapter run-p@v1.*replica r2"):
        sync.push(model, 1)
    (sent,) = farm.sent
    assert sent["sequences"] == probe.sequences and len(sent["logprobs"]) == 4 and not sync.digests


def test_a_farm_whose_engine_cannot_score_a_probe_gets_the_runs_pushes_without_one(models, caplog):
    """SGLang scores no staged policy: the farm answers a probed push 501. The run pushes again without a probe, and
    so do its later pushes, with one warning; a 422 on the probe still stops it (the test above)."""
    policy, served, tok = models

    class NoScoringFarm(ProbingFarm):
        def push_pieces(self, pieces, size, version, policy="finish"):
            body = b"".join(bytes(p) for p in pieces())
            n = int.from_bytes(body[:8], "little")
            if probes.META_KEY in views(body[: 8 + n + payload_size(parse_header(body[8 : 8 + n])[1])])[1]:
                self.probes.append("refused")
                raise FarmError(501, {"error": "the SGLangEngine engine has no probes on staged base weights"})
            return super().push_pieces(lambda: [body], size, version, policy)

    farm, probe = NoScoringFarm(served), PushProbe.of_run(load().trainer, tok, policy)
    with caplog.at_level("WARNING", logger="farm.trainer"):
        assert push_weights(WeightPusher(farm), policy, "finish", probe) == 1
        assert push_weights(WeightPusher(farm), policy, "finish", probe) == 2
    assert farm.probes == ["refused", None, None]  # asked once, then never again
    assert [r.message for r in caplog.records].count("push_probe_unsupported") == 1
    assert all(torch.equal(a, b) for a, b in zip(served.parameters(), policy.parameters()))


def test_the_probe_keys_are_checked():
    for override, words in [
        ("trainer.push_probe_sequences=17", "trainer.push_probe_sequences: Input should be less than"),
        ("trainer.push_probe_tokens=1", "trainer.push_probe_tokens: Input should be greater than"),
        ("trainer.push_probe_tolerance=0", "trainer.push_probe_tolerance: Input should be greater than"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load(None, [override])
