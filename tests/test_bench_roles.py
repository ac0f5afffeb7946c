"""Kernel roles (h3lab.bench.roles): names the canonical and eager blocks' kernels carry (ours; cuBLAS,
cuDNN and FlashAttention kernels as torch.profiler names them on an H200), each in the role it plays."""

from __future__ import annotations

import pytest

from h3lab.bench.roles import ROLES, by_role, role

NAMES = {
    "attention": [
        "attention_fwd_tma_kernel",
        "attention_bwd_q_tma_kernel",
        "attention_bwd_kv_kernel",
        "attention_delta_kernel",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>",
    ],
    "gemm": [
        "mm_kernel",
        "unit_mm_sm90_kernel",
        "_unit_partial_kernel",
        "chain_kernel",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>",
    ],
    "other": [
        "_rms_modulate_kernel",
        "_qk_norm_rope_kernel",
        "_row_chain_kernel",
        "_elementwise_kernel",
        "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)",
    ],
}


@pytest.mark.parametrize("want", ROLES)
def test_each_kernel_name_has_its_role(want):
    for name in NAMES[want]:
        assert role(name) == want, name


def test_by_role_sums_per_role_and_lists_every_role():
    got = by_role(
        [("mm_kernel", 2.0), ("attention_fwd_tma_kernel", 1.5), ("mm_kernel", 0.5), ("_rms_modulate_kernel", 0.25)]
    )
    assert got == {"attention": 1.5, "gemm": 2.5, "other": 0.25}
    assert by_role([]) == {"attention": 0.0, "gemm": 0.0, "other": 0.0}
