"""Backend choice: kernels only on the tested architectures, fallbacks said once and recorded,
`kernel` (option or MLA_EVAL_BACKEND) an error where the kernels cannot run, bad names one line."""

import warnings

import pytest
import torch

from mla_eval import cli
from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.formats import get_format

CUDA0 = torch.device("cuda", 0)
SM100_REASON = "kernels are compiled and tested for sm_90 only; this GPU is sm_100"


@pytest.fixture
def gpu(monkeypatch):
    """Pretend cuda:0 is a GPU of a chosen compute capability (CPU tests never launch anything)."""
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    monkeypatch.setattr(dispatch, "_unscoped_fallbacks", set())
    return cap


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)


def _cpu_case():
    spec = get_format("nvfp4")
    cache = torch.zeros(2, 16, spec.record_bytes, dtype=torch.uint8)
    q = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    return spec, cache, q, table, torch.tensor([3], dtype=torch.int32)


def test_auto_takes_the_kernels_only_on_a_tested_architecture(gpu, monkeypatch):
    spec = get_format("nvfp4")
    monkeypatch.setattr(dispatch, "_cutlass_importable", lambda: None)  # as on the H200 image
    assert dispatch.kernel_status(spec, CUDA0) == (True, "kernel")
    for cap, arch in (((10, 0), "sm_100"), ((8, 0), "sm_80"), ((12, 0), "sm_120"), ((9, 1), "sm_91")):
        gpu["value"] = cap
        ok, why = dispatch.kernel_status(spec, CUDA0)
        assert not ok and why == f"kernels are compiled and tested for sm_90 only; this GPU is {arch}"


def test_without_cutlass_the_reason_says_so(gpu):
    ok, why = dispatch.kernel_status(get_format("nvfp4"), CUDA0)
    if dispatch._cutlass_importable() is None:
        pytest.skip("nvidia-cutlass-dsl is installed here")
    assert not ok and "install nvidia-cutlass-dsl" in why


def test_cpu_tensors_are_a_choice_not_a_fallback(no_env):
    spec, cache, q, table, lens = _cpu_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.KernelFallbackWarning)
        with dispatch.use_backend("auto") as log:
            dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1)
    assert log.fallbacks == [] and log.source == "--backend"
    assert log.paths == {"attend nvfp4 on cpu": "reference (cpu tensors: the kernels need a CUDA GPU)"}
    with dispatch.use_backend() as default_log:
        pass
    assert (default_log.backend, default_log.source) == ("auto", "default")


def test_cuda_fallback_warns_once_per_reason_and_is_recorded(gpu, no_env):
    gpu["value"] = (10, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dispatch.use_backend("auto") as log:
            for name in ("nvfp4", "fp8_ds_mla", "nvfp4"):
                assert dispatch._use_kernel(get_format(name), CUDA0, "auto") is False
                assert dispatch._use_kernel(get_format(name), CUDA0, "auto", op="write") is False
    lines = [str(w.message) for w in caught if issubclass(w.category, dispatch.KernelFallbackWarning)]
    assert lines == [f"attention on cuda:0 runs on the torch reference, not the CuTe kernels: {SM100_REASON}"]
    assert log.fallbacks == lines
    assert log.paths["attend nvfp4 on cuda:0"] == f"reference ({SM100_REASON})"
    assert log.paths["write fp8_ds_mla on cuda:0"] == f"reference ({SM100_REASON})"
    assert log.devices() == ["cuda:0"]
    assert log.as_dict()["fallbacks"] == lines

    # a new scope says it again (one line per run), a scope asking for the reference never does
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        with dispatch.use_backend("auto"):
            dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto")
        with dispatch.use_backend("reference") as ref_log:
            dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto")
    assert len(again) == 1 and ref_log.fallbacks == []
    assert ref_log.paths == {"attend nvfp4 on cuda:0": "reference (asked for)"}


def test_fallback_outside_a_scope_warns_once_per_process(gpu, no_env):
    gpu["value"] = (8, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto")
    assert len(caught) == 1 and "this GPU is sm_86" in str(caught[0].message)


def test_argument_blocker_is_a_recorded_fallback(gpu, monkeypatch, no_env):
    monkeypatch.setattr(dispatch, "_cutlass_importable", lambda: None)
    why = "the kernel writer takes bf16, fp16 or fp32 latents, not torch.float64"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dispatch.use_backend() as log:
            assert dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto", op="write", blocker=why) is False
            assert dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto") is True
    assert log.paths == {"write nvfp4 on cuda:0": f"reference ({why})", "attend nvfp4 on cuda:0": "kernel"}
    assert len(caught) == 1 and why in str(caught[0].message)
    with pytest.raises(UserError, match="float64"), dispatch.use_backend("kernel"):
        dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto", op="write", blocker=why)


def test_kernel_backend_on_an_untested_gpu_is_one_line_error(gpu, no_env):
    gpu["value"] = (10, 0)
    with pytest.raises(UserError) as exc, dispatch.use_backend("kernel"):
        dispatch._use_kernel(get_format("nvfp4"), CUDA0, "auto")
    assert str(exc.value) == f"--backend kernel, but the CuTe kernels cannot run here: {SM100_REASON}; use auto or reference"
    with pytest.raises(UserError, match="this GPU is sm_100"):
        dispatch.preflight("kernel", ["cuda:0"])


def test_kernel_backend_on_cpu_is_one_line_error(no_env):
    spec, cache, q, table, lens = _cpu_case()
    want = ("--backend kernel, but the CuTe kernels cannot run here: cpu tensors: the kernels need a CUDA GPU;"
            " use auto or reference")
    with pytest.raises(UserError) as exc, dispatch.use_backend("kernel"):
        dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1)
    assert str(exc.value) == want and "\n" not in want
    with pytest.raises(UserError) as early:
        dispatch.preflight("kernel", [torch.device("cpu")])
    assert str(early.value) == want
    with pytest.raises(UserError, match="--backend kernel"):
        slots = torch.zeros(1, dtype=torch.int64)
        dispatch.write_cache(spec, torch.zeros(1, 512), torch.zeros(1, 64), slots, cache, backend="kernel")


def test_preflight_passes_what_can_run(no_env, monkeypatch):
    assert dispatch.preflight(None, ["cpu"]) == "auto"
    assert dispatch.preflight("reference", ["cpu"]) == "reference"
    assert dispatch.preflight("auto", ["cpu", "cuda:0"]) == "auto"
    with pytest.raises(UserError, match="'gpu' is not a backend"):
        dispatch.preflight("gpu", ["cpu"])


def test_env_bogus_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "bogus")
    spec, cache, q, table, lens = _cpu_case()
    want = "MLA_EVAL_BACKEND 'bogus' is not a backend; choose one of auto, kernel, reference"
    for call in (
        dispatch.default_backend,
        lambda: dispatch.use_backend().__enter__(),
        lambda: dispatch.preflight(None, ["cpu"]),
        lambda: dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1),
    ):
        with pytest.raises(UserError) as exc:
            call()
        assert str(exc.value) == want
    with dispatch.use_backend("reference") as log:  # an explicit backend does not read the variable
        dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1)
    assert log.backend == "reference"


def test_env_kernel_on_a_cpu_tensor_path_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "kernel")
    spec, cache, q, table, lens = _cpu_case()
    want = ("MLA_EVAL_BACKEND=kernel, but the CuTe kernels cannot run here: cpu tensors: the kernels need a CUDA GPU;"
            " use auto or reference")
    with pytest.raises(UserError) as exc:  # no scope: the variable decides
        dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1)
    assert str(exc.value) == want
    with pytest.raises(UserError) as scoped, dispatch.use_backend() as log:
        dispatch.mla_attention_dense(spec, q, cache, block_table=table, seq_lens=lens, softmax_scale=0.1)
    assert str(scoped.value) == want and log.source == dispatch.BACKEND_ENV
    with pytest.raises(UserError) as early:
        dispatch.preflight(None, ["cpu"])
    assert str(early.value) == want


def test_cli_shows_a_library_warning_as_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))

    @cli.app.command("warn-twice-for-test")
    def _warn() -> None:
        warnings.warn("attention on cuda:0 runs on the torch reference: why", dispatch.KernelFallbackWarning, stacklevel=1)

    assert cli.main(["warn-twice-for-test"]) == 0
    err = capsys.readouterr().err
    assert err == "warning: attention on cuda:0 runs on the torch reference: why\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_shared_memory_keeps_hopper_tiles():
    """On the H200: the limits read from the device are Hopper's, so the tiles did not change."""
    from mla_eval_kernels.plan import device_limits
    from mla_eval_kernels.plan.record_plan import plan_for
    from mla_eval_kernels.plan.tuning import tile_config

    dev = torch.device("cuda", 0)
    if device_limits.arch_name(dev) != "sm_90":
        pytest.skip("Hopper only")
    assert device_limits.smem_per_block(dev) == device_limits.HOPPER_SMEM_PER_BLOCK == 232448
    assert device_limits.smem_per_sm(dev) == device_limits.HOPPER_SMEM_PER_SM == 233472
    plan = plan_for(get_format("nvfp4"))  # 64 heads x 64 keys: 216320 bytes, fits 227 KB, not 200 KB
    assert tile_config(plan, 128, device_limits.smem_per_block(dev)) == (64, 4, 2, 64)
    assert tile_config(plan, 128, 200 * 1024) == (64, 4, 2, 32)
    assert dispatch.kernel_status(get_format("nvfp4"), dev) == (True, "kernel")


def test_sglang_fp4_e2m1_goes_to_the_kernels_without_a_fallback_warning(gpu, monkeypatch, no_env):
    """SGLang's KVFP4 record (ties-away E2M1, E8M0 ceiling scales) is in the kernels' scope: auto takes them for
    both the writer and the attention on sm_90, and no fallback is said or recorded."""
    monkeypatch.setattr(dispatch, "_cutlass_importable", lambda: None)
    spec = get_format("sglang_fp4_e2m1")
    assert dispatch.kernel_status(spec, CUDA0) == (True, "kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.KernelFallbackWarning)
        with dispatch.use_backend("auto") as log:
            assert dispatch._use_kernel(spec, CUDA0, "auto", op="write") is True
            assert dispatch._use_kernel(spec, CUDA0, "auto") is True
    assert log.fallbacks == []
    assert log.paths == {"write sglang_fp4_e2m1 on cuda:0": "kernel", "attend sglang_fp4_e2m1 on cuda:0": "kernel"}

