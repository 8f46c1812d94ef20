"""The measured rcp.approx.ftz.f32 table: loading, validation, and its use for E4M3 scales."""

import pytest
import torch

from mla_eval.formats import approx


def _bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF


def _e4m3_values() -> list[float]:
    v = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v.tolist()


def _doc(fn) -> dict:
    xs = _e4m3_values() + [6.0, 1.0]
    return {"instruction": "rcp.approx.ftz.f32", "inputs": [_bits(x) for x in xs], "outputs": [_bits(fn(x)) for x in xs]}


def test_lut_reads_a_constructed_table_and_mirrors_negative_codes():
    # a deliberately wrong "instruction" (1/x one ulp up) proves the values come from the table
    def up(x: float) -> float:
        r = torch.tensor([1.0 / x], dtype=torch.float32)
        return float((r.view(torch.int32) + 1).view(torch.float32))

    lut = approx.rcp_approx_e4m3_lut(approx.load_table(_doc(up)))
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    for c in (0x01, 0x38, 0x7E):
        assert lut[c].item() == up(vals[c].item()) and lut[c | 0x80].item() == -up(vals[c].item())
    assert lut[0].item() == 0.0 and lut[0x80].item() == 0.0
    assert approx.rcp_approx_of(6.0, approx.load_table(_doc(up))) == up(6.0)


def test_missing_inputs_and_bad_documents_are_refused():
    doc = _doc(lambda x: 1.0 / x)
    del doc["inputs"][5], doc["outputs"][5]
    with pytest.raises(ValueError, match="lacks E4M3 value"):
        approx.rcp_approx_e4m3_lut(approx.load_table(doc))
    with pytest.raises(ValueError, match="lacks 1000.0"):
        approx.rcp_approx_of(1000.0, approx.load_table(_doc(lambda x: 1.0 / x)))
    with pytest.raises(ValueError, match="for 'rcp.rn.f32'"):
        approx.load_table({**doc, "instruction": "rcp.rn.f32"})
    with pytest.raises(ValueError, match="equally long"):
        approx.load_table({**doc, "outputs": doc["outputs"][:-1]})


def test_committed_h200_table_covers_every_e4m3_value_six_and_one():
    table = approx.measured_table()
    lut = approx.rcp_approx_e4m3_lut(table)
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ok = torch.isfinite(vals) & (vals != 0)
    # the measurement: on these inputs the instruction equals the correctly rounded reciprocal
    assert torch.equal(lut[ok], (1.0 / vals[ok].double()).float())
    assert approx.rcp_approx_of(6.0) == float(torch.tensor(1 / 6, dtype=torch.float32))
    assert approx.rcp_approx_of(1.0) == 1.0
