"""No GPU needed: the device campaigns (`python -m tools.device STEP`) are registered, their command lines parse, the
bootstrap is valid shell, and the GPU test step finds every test file with a GPU test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.device import steps

ROOT = Path(__file__).resolve().parent.parent
# a command line of each step (its required options), as tools/device/README.md gives them
EXAMPLES = {
    "tests": ["tests", "-k", "v3", "--workers", "4"],
    "smoke": ["smoke", "--commit", "abc123"],
    "compile": ["compile", "--formats", "nvfp4", "--heads", "16"],
    "bench": ["bench", "--", "--shapes", "b", "--variants"],
    "forward": ["forward", "--", "--parts", "kld"],
    "prod": ["prod"],
    "memory": ["memory", "--", "--presets", "glm-5"],
    "stream": ["stream", "--", "--steps", "project"],
    "moe": ["moe", "--", "--presets", "glm-5.2", "--tokens", "16384"],
    "fp8": ["fp8", "-k", "weight_maths"],
    "ncu": ["ncu", "--formats", "nvfp4", "--heads", "128", "--context", "2048", "--sparse"],
    "eval": ["eval", "--recipe", "recipes/h200-full.toml"],
    "formats": ["formats"],
    "semantics": ["semantics", "--parts", "default,qp"],
    "long": ["long", "--parts", "grid,kld64"],
    "power": ["power", "--parts", "topk"],
    "train-tok": ["train-tok"],
    "train": ["train", "--seconds", "300"],
    "train-check": ["train-check"],
}


def test_every_step_is_registered_with_an_example():
    assert set(steps.STEPS) == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_step_command_line_parses(name):
    args = steps.parser().parse_args(EXAMPLES[name])
    assert args.step == name and callable(args.runner)


def test_a_missing_required_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        steps.parser().parse_args(["smoke"])
    assert exc.value.code == 2 and "--commit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        steps.parser().parse_args(["no-such-step"])


def test_gpu_test_files_include_every_file_with_a_gpu_test():
    files = steps.gpu_test_files()
    for f in ("tests/test_kernels_v3_gpu.py", "tests/test_gpu_campaigns.py", "tests/test_decode_steps_gpu.py",
              "tests/test_random_models_gpu.py", "tests/test_semantics_gpu.py", "tests/test_long_gpu.py"):
        assert f in files, f
    assert "tests/test_device_steps.py" not in files and "tests/test_codec.py" not in files


def test_the_fp8_step_runs_existing_gpu_test_files():
    for f in steps.FP8_TESTS:
        assert f in steps.gpu_test_files(), f  # the tests step runs them too (DeepGEMM used where it loads)


def test_bootstrap_and_prepare_are_valid_shell():
    for script in ("tools/device/bootstrap.sh", "tools/device/prepare.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
