"""A replica's adapter residency within FARM_ADAPTER_BYTES_PER_REPLICA (rollout_farm/services/adapters/residency.py):
the least recently used versions that no call pins are unloaded first, a pinned one never, and a load that cannot fit
is refused rather than served on another policy. LoraLayers.evict unloads only an unpinned version."""

import pytest
import torch
from torch import nn

from rollout_farm.services.adapters.residency import Residency, victims
from rollout_farm.services.engine.torch.lora import LoraLayers

MB = 1 << 20


def test_nothing_is_unloaded_while_it_fits_or_without_a_budget():
    loaded = {"a@v1": (MB, 0), "a@v2": (MB, 0)}
    assert victims(loaded, {}, "b@v1", MB, 3 * MB) == []
    assert victims(loaded, {}, "b@v1", 10 * MB, 0) == []  # 0: unbounded


def test_the_least_recently_used_unpinned_versions_go_first_and_only_as_many_as_needed():
    loaded = {"a@v1": (MB, 0), "a@v2": (MB, 0), "a@v3": (MB, 0)}
    last = {"a@v1": 5, "a@v2": 1, "a@v3": 9}
    assert victims(loaded, last, "b@v1", MB, 3 * MB) == ["a@v2"]
    assert victims(loaded, last, "b@v1", 2 * MB, 3 * MB) == ["a@v2", "a@v1"]
    assert victims(loaded, {"a@v3": 0}, "b@v1", MB, 3 * MB)[0] in {"a@v1", "a@v2"}  # never used: before any used


def test_a_pinned_version_is_never_chosen_and_no_room_is_none():
    loaded = {"a@v1": (MB, 2), "a@v2": (MB, 0), "a@v3": (MB, 1)}
    last = {"a@v1": 0, "a@v2": 7, "a@v3": 1}
    assert victims(loaded, last, "b@v1", MB, 3 * MB) == ["a@v2"]  # the oldest are pinned
    assert victims(loaded, last, "b@v1", 2 * MB, 3 * MB) is None  # only one unpinned: no room, nothing unloaded
    assert victims({"a@v1": (MB, 0)}, {}, "b@v1", 4 * MB, 3 * MB) is None  # larger than the whole budget


def test_the_key_being_loaded_does_not_count_against_itself():
    assert victims({"b@v1": (MB, 0), "a@v1": (MB, 0)}, {}, "b@v1", MB, 2 * MB) == []


def test_residency_keeps_a_use_clock():
    r = Residency(3 * MB)
    for key in ("a@v1", "a@v2", "a@v3", "a@v1"):
        r.used(key)
    loaded = {k: (MB, 0) for k in ("a@v1", "a@v2", "a@v3")}
    assert r.victims(loaded, "b@v1", MB) == ["a@v2"]
    r.forget("a@v2")
    assert r.victims(loaded, "b@v1", MB) == ["a@v2"]  # forgotten: as if never used
    assert r.too_large(4 * MB) and not r.too_large(3 * MB) and not Residency(0).too_large(1 << 40)


@pytest.fixture
def layers():
    model = nn.Sequential(nn.Linear(4, 4))
    lora = LoraLayers(model)
    pair = (torch.ones(2, 4), torch.ones(4, 2))
    for key in ("a@v1", "a@v2"):
        lora.load(key, {"0": pair}, 1.0)
    return lora


def test_evict_unloads_only_an_unpinned_version_and_it_may_load_again(layers):
    layers.pin("a@v1")
    assert layers.evict("a@v1") is False and "a@v1" in layers.resident()
    assert layers.evict("a@v2") is True and "a@v2" not in layers.resident()
    layers.load("a@v2", {"0": (torch.ones(2, 4), torch.ones(4, 2))}, 1.0)  # unlike a retired one: at once
    assert layers.resident()["a@v2"] == (2 * 4 * 4 + 4 * 2 * 4, 0)
    layers.unpin("a@v1")
    assert layers.evict("a@v1") is True


def test_a_retiring_version_is_not_evicted_under_its_calls(layers):
    layers.pin("a@v1")
    assert layers.retire("a@v1") is False
    assert layers.evict("a@v1") is False
    assert "a@v1" in layers.resident(include_retiring=True)
