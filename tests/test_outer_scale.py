"""The per-layer outer-scale JSON (schema nvfp4_ds_mla_outer_scale_v1): round trip and bad files."""

import json
import re

import pytest

from mla_eval.errors import UserError
from mla_eval.formats import OuterScales


def good_doc(n=3):
    return {
        "format": "nvfp4_ds_mla_outer_scale_v1", "num_layers": n, "latent_dim": 512, "denominator": 2688,
        "scales": [0.01, 0.02, 0.5][:n],
    }


def test_round_trip_keeps_provenance(tmp_path):
    sc = OuterScales.from_amax([26.88, 0.0, 2688.0], provenance={"model": "m", "tokens": 1000})
    assert sc.scales == (0.01, 1.0, 1.0)
    p = tmp_path / "s.json"
    sc.save(p)
    doc = json.loads(p.read_text())
    assert doc["format"] == "nvfp4_ds_mla_outer_scale_v1" and doc["denominator"] == 2688.0 and doc["num_layers"] == 3
    back = OuterScales.load(p)
    assert back.scales == sc.scales and back.provenance == {"model": "m", "tokens": 1000}
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temp file


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(format="other"), "'format'"),
        (lambda d: d.update(num_layers=5), "'num_layers' is 5"),
        (lambda d: d.update(scales=[]), "non-empty"),
        (lambda d: d["scales"].__setitem__(1, -0.5), "layer 1 is -0.5"),
        (lambda d: d["scales"].__setitem__(0, 0), "layer 0 is 0"),
        (lambda d: d["scales"].__setitem__(2, "x"), "layer 2"),
        (lambda d: d.update(latent_dim=256), "latent_dim"),
        (lambda d: d.update(denominator=448), "denominator"),
    ],
)
def test_malformed_documents(mutate, match):
    doc = good_doc()
    mutate(doc)
    with pytest.raises(UserError, match=match):
        OuterScales.from_json(doc)


def test_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        OuterScales.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        OuterScales.load(bad)


def test_layer_count_check():
    sc = OuterScales.from_json(good_doc())
    sc.check_layers(3)
    with pytest.raises(UserError, match="3 layer scales but the model has 61 layers"):
        sc.check_layers(61)


def test_calibration_refuses_a_latent_no_model_has():
    """A latent profile of 1e30 per layer made `calibrate` write scales of 3.7e26 (issue 44): a calibrated max |c_kv|
    outside fp16's normal range is a one-line error naming the layer, never a scale; a file holding such a scale is
    refused on reading."""
    assert OuterScales.from_amax([0.02, 5.2, 0.0]).scales[2] == 1.0  # an all-zero latent: no scaling, as before
    for amax, words in ((1e30, "layer 1 is 1e+30"), (1e-30, "layer 1 is 1e-30")):
        with pytest.raises(UserError, match=re.escape(f"calibrated max |c_kv| of {words}: a latent's max")):
            OuterScales.from_amax([1.0, amax])
    doc = OuterScales.from_amax([1.0, 2.0]).to_json()
    doc["scales"][1] = 1e30 / 2688
    with pytest.raises(UserError, match="scale of layer 1 is .* outside"):
        OuterScales.from_json(doc)
