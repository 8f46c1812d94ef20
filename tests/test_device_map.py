"""--device-map auto with --max-memory (accelerate's per-GPU cap): parsing, what reaches accelerate, the
refusal of an offload to CPU under a cap, what the result records, and that kld builds each layer's cache
on that layer's device. A real split over several GPUs needs them: tests/test_multigpu_gpu.py."""

import json

import pytest
import torch
from tiny_models import tiny_checkpoint, tiny_model

from mla_eval.cli import main
from mla_eval.errors import UserError
from mla_eval.model import loader

TEXT = " ".join(f"The river {w} flows past the old mill near the {w} bridge." for w in ["north", "south"] * 40)


@pytest.mark.parametrize(
    ("text", "bytes_"),
    [("40GiB", 40 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("4096", 4096)],
)
def test_memory_sizes(text, bytes_):
    assert loader.parse_memory(text) == bytes_


@pytest.mark.parametrize("bad", ["", "0GiB", "-4GiB", "40 parsecs", "GiB", "4e9"])
def test_bad_memory_sizes_are_one_line(bad):
    with pytest.raises(UserError, match="--max-memory .*: give a positive size such as 40GiB"):
        loader.parse_memory(bad)


def test_the_cap_needs_device_map_auto():
    with pytest.raises(UserError, match="--max-memory caps what --device-map auto plans per GPU"):
        loader.check_max_memory("40GiB", "none")
    assert loader.check_max_memory(None, "none") is None
    assert loader.check_max_memory("2GiB", "auto") == 2 * 2**30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _fake_gpus(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_the_cap_reaches_accelerate_for_every_gpu(ckpt, monkeypatch):
    """from_pretrained gets device_map='auto' and max_memory = the cap on each of the visible GPUs."""
    from transformers import AutoModelForCausalLM

    seen = {}

    class Stop(Exception):
        pass

    def capture(path, **kwargs):
        seen.update(kwargs)
        raise Stop

    _fake_gpus(monkeypatch, 4)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", capture)
    monkeypatch.setattr(loader, "resolve_device", lambda device: torch.device("cpu"))
    with pytest.raises(Stop):
        loader.load_model(ckpt, device_map="auto", max_memory="40GiB")
    assert seen["device_map"] == "auto"
    assert seen["max_memory"] == {0: 40 * 2**30, 1: 40 * 2**30, 2: 40 * 2**30, 3: 40 * 2**30}


def test_layers_pushed_to_cpu_by_the_cap_are_refused(ckpt, monkeypatch):
    from transformers import AutoModelForCausalLM

    def spread(path, **kwargs):
        model = tiny_model("deepseek_v3", vocab_size=12288, max_position_embeddings=256)
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": "cpu"}
        return model

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spread)
    monkeypatch.setattr(loader, "resolve_device", lambda device: torch.device("cpu"))
    with pytest.raises(UserError, match="offloaded layers to cpu: .* under --max-memory 0.5 GiB per GPU; raise the cap"):
        loader.load_model(ckpt, device_map="auto", max_memory="512MiB")


def test_a_gpu_cap_on_a_machine_without_gpus_is_one_line(ckpt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--max-memory caps each GPU, but no CUDA GPU is visible"):
        loader.load_model(ckpt, device_map="auto", max_memory="8GiB")


def test_kld_records_the_placement(ckpt, tmp_path, capsys):
    pytest.importorskip("accelerate")
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "k.json"
    args = ["kld", "--model", str(ckpt), "--text", str(tmp_path / "t.txt"), "--ctx", "64", "--stride", "32",
            "--formats", "nvfp4", "--scales", "none", "--no-layer-stats", "--device-map", "auto", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "warning: --device-map auto found no GPU: every layer runs on the CPU" in err  # said, not silent
    settings = json.loads(out.read_text())["settings"]
    assert settings["device_map"] == "auto" and settings["max_memory_per_gpu"] is None
    assert settings["layer_devices"] == ["cpu"] * 3  # no GPU here: accelerate keeps every layer on the CPU


def test_kld_builds_each_layers_cache_on_that_layers_device(monkeypatch):
    """The session of every scored forward gets the model's per-layer devices (a mixed map is patched in here: no
    second device on a CPU machine), and CacheSession puts each cache there (tests/test_session_devices.py). A layer
    on the meta device (a streamed layer between its turns) runs on the model's device."""
    from mla_eval.evals import kld
    from mla_eval.evals.variants import parse_variants
    from mla_eval.model.adapter import MlaAdapter

    model = tiny_model("deepseek_v3")
    adapter = MlaAdapter(model)
    adapter.modules[1].kv_a_proj_with_mqa.to("meta")
    lm = loader.LoadedModel(model=model, tokenizer=None, adapter=adapter, path=loader.Path("tiny"), name="tiny",
                            device=torch.device("cpu"), is_default=False)
    assert lm.layer_devices == [torch.device("cpu")] * 3
    mixed = [torch.device("cpu"), torch.device("meta"), torch.device("cpu")]
    monkeypatch.setattr(loader.LoadedModel, "layer_devices", property(lambda self: mixed))
    seen = []

    class Stop(Exception):
        pass

    def record(spec, layers, batch, tokens, devices, **kw):
        seen.append(list(devices))
        raise Stop

    monkeypatch.setattr(kld, "CacheSession", record)
    (variant,) = parse_variants("nvfp4")
    protocol = kld.KldProtocol((variant,), variant, ctx=16, stride=8, min_context=8)
    with pytest.raises(Stop):
        kld._forward_hidden(lm, variant, torch.zeros(1, 16, dtype=torch.long), 8, protocol, None)
    assert seen == [mixed]
