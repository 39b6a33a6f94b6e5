"""benchmarks/gpu.py on CPU (its --smoke shapes): the learner row and the --profile table that GPU
leases read, the kernel-name classification those tables use, and the refusal of bad flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64>>", "attention"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)>", "copy/cast"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "reduce"),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedOptimizerTensorListMetadata<4>>", "optimizer"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_2", "elementwise/other"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float>>", "elementwise/other"),
    ("void at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copy/cast"),
    ("void at::native::scatter_gather_elementwise_kernel<128, 8>", "elementwise/other"),
    ("triton_poi_fused__to_copy_1", "copy/cast"),
    ("aten::mm", "matmul"),
])
def test_kernel_kind(name, kind):
    assert gpu.kernel_kind(name) == kind


def test_smoke_learner_row_and_profile(tmp_path, capsys):
    assert gpu.main(["--smoke", "--parts", "learner", "--profile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["part"] == "learner" and rows[0]["step_s"] > 0 and rows[0]["tokens_per_step"] == 16 * 24
    (profile,) = tmp_path.glob("profile-smoke-sdpa-mb256tok.txt")
    summary = json.loads(profile.read_text().splitlines()[0])
    assert 0 < summary["busy_s"] and summary["by_kind_s"]["matmul"] > 0 and "optimizer" in summary["by_kind_s"]
    assert "aten::mm" in profile.read_text()
    assert "Optimizer.step#AdamW.step" not in profile.read_text().split("\n\n")[1]  # a span, not a kernel
    assert rows[0]["lora_rank"] == 0 and rows[0]["trainable"] == rows[0]["params"]


def test_smoke_learner_row_with_lora_trains_only_the_adapters(tmp_path):
    assert gpu.main(["--smoke", "--parts", "learner", "--lora-rank", "4", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    # smoke: hidden 64, 2 layers, 4 heads of 16, 2 kv heads, intermediate 128: r x (in + out) per adapted linear
    per_layer = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64))
    assert row["lora_rank"] == 4 and row["trainable"] == 2 * per_layer and row["step_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--parts", "learner,decode"], "unknown"),
    (["--parts", "e2e", "--e2e-schemes", "pipeline_rl"], "name:k"),
    (["--parts", "e2e", "--e2e-weight-sync", "nccl"], "valid: gloo, ipc"),
])
def test_bad_flags_are_refused_before_any_work(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        gpu.main(["--smoke", "--out", str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()
