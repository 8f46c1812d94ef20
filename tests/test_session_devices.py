"""A cache session places each layer's cache on that layer's device (models spread over GPUs)."""

import pytest
import torch

from mla_eval.formats import get_format
from mla_eval.model.session import CacheSession


def _run(session: CacheSession, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for layer in range(session.num_layers):
        lat, rope = torch.randn(2, 5, 512, generator=g), torch.randn(2, 5, 64, generator=g)
        session.write(layer, lat, rope)
        q = torch.randn(2, 5, 4, 576, generator=g)
        outs.append(session.attend(layer, q, 0.05))
    return outs


def test_per_layer_devices_equal_one_device():
    spec = get_format("nvfp4")
    one = CacheSession(spec, 3, 2, 16, "cpu")
    per = CacheSession(spec, 3, 2, 16, ["cpu", torch.device("cpu"), "cpu"])
    assert per.devices == [torch.device("cpu")] * 3
    for a, b in zip(_run(one), _run(per)):
        assert torch.equal(a, b)
    for layer in range(3):
        assert torch.equal(one.caches[layer], per.caches[layer])


def test_cache_and_slots_follow_the_layer_device():
    # "meta" tensors have a device but no data: enough to see where each layer's cache is made
    s = CacheSession(get_format("bf16"), 2, 1, 64, ["cpu", "meta"])
    assert s.caches[0].device.type == "cpu" and s.caches[1].device.type == "meta"
    assert s._slots(1, 0, 4).device.type == "meta" and s._slots(0, 0, 4).device.type == "cpu"


def test_device_list_must_match_the_layers():
    with pytest.raises(ValueError, match="2 devices for 3 layers"):
        CacheSession(get_format("bf16"), 3, 1, 16, ["cpu", "cpu"])
