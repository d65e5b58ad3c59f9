"""nq.ptx: one wrapper per PTX instruction, each with a pure-Python twin (`wrapper.twin`).

Kernels import the wrappers from here; under the CUDA simulator each name is its twin.
See nq/ptx/_asm.py for how a wrapper is built and what its operand kinds mean.

    permute   prmt_b32, lop3_b32 (+ LOP3_A/B/C and the luts the GEMV uses),
              mov_b32_u32_from_f32, mov_b32_f32_from_u32
    memory    ld_global_nc_v4_u32 (+ _na_ and _hint_ variants, createpolicy_evict_first_b64),
              ld_global_nc_v2_u32, ld_global_nc_v2_f32, ld_global_nc_v4_f32, ld_global_nc_u16,
              ld_global_nc_u32, st_global_v4_u32,
              st_global_u16, ld_shared_v4_u32, ld_shared_v4_u32_at, ld_shared_v2_u32_at,
              st_shared_u8_at,
              ld_shared_v4_f32, cvta_to_shared_u32,
              cvta_to_shared_u32_at
    half      fma_rn_f16x2, mul_rn_f16x2, add_rn_f16x2, cvt_f32_f16, cvt_rn_f16_f32,
              pack_f16x2_from_f32, unpack_f16x2_to_f32, cvt_rni_s32_f32
    mbarrier  mbarrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx,
              mbarrier_try_wait_parity, mbarrier_wait_parity
    fence     fence_mbarrier_init, fence_proxy_async_shared
    bulk      cp_async_bulk_g2s, cp_async_bulk_g2s_hint, cp_async_bulk_prefetch_l2
    tensormap cp_async_bulk_tensor_5d_g2s (TMA with a tensor map; `tensormap.encode` makes one)
    async_copy cp_async_cg_shared_global_16 (+ _zfill, _zfill_off), cp_async_commit_group, cp_async_wait_group
    mma       ldmatrix_x4, ldmatrix_x4_trans, mma_sync_m16n8k16_f16_f32,
              mma_sync_m16n8k32_s8_s32
    (nq.ptx.wgmma, sm_90a only, imported from there: wgmma_fence, wgmma_commit_group,
     wgmma_wait_group, the accumulator-carrying wgmma_rs(n) / wgmma_ss(n) / wgmma_fence_acc /
     wgmma_wait_group_acc / wgmma_zero_acc / acc_store_shared factories, the descriptor)
    dp4a      dp4a_s32
    mulhi     mul_hi_u32 (Philox rounds)
    griddep   griddepcontrol_wait, griddepcontrol_launch_dependents (programmatic dependent launch)
    clock     clock64 (the SM's cycle counter)
    gridsync  atom_add_acq_rel_gpu_u32, red_release_gpu_add_u32, red_relaxed_gpu_add_u64,
              ld_acquire_gpu_u32,
              st_release_gpu_u32, fence_acq_rel_gpu, ld_global_cg_v4_u32, nanosleep_u32 (blocks of
              one grid meeting: a grid barrier)
    cluster   cluster_ctarank, barrier_cluster_sync, mapa_shared_cluster_u32, ld_shared_cluster_f32
              (thread block clusters and distributed shared memory)
"""
from nq.ptx._asm import SIMULATOR
from nq.ptx.async_copy import (cp_async_cg_shared_global_16, cp_async_cg_shared_global_16_zfill,
                               cp_async_cg_shared_global_16_zfill_off,
                               cp_async_commit_group, cp_async_wait_group)
from nq.ptx.cluster import (barrier_cluster_sync, cluster_ctarank, ld_shared_cluster_f32,
                            mapa_shared_cluster_u32)
from nq.ptx.bulk import cp_async_bulk_g2s, cp_async_bulk_g2s_hint, cp_async_bulk_prefetch_l2
from nq.ptx.dp4a import dp4a_s32
from nq.ptx.tensormap import cp_async_bulk_tensor_5d_g2s
from nq.ptx.mulhi import mul_hi_u32
from nq.ptx.griddep import griddepcontrol_launch_dependents, griddepcontrol_wait
from nq.ptx.gridsync import (atom_add_acq_rel_gpu_u32, fence_acq_rel_gpu, ld_acquire_gpu_u32,
                             ld_global_cg_v4_u32, nanosleep_u32, red_release_gpu_add_u32,
                             red_relaxed_gpu_add_u64,
                             st_release_gpu_u32)
from nq.ptx.clock import clock64
from nq.ptx.fence import fence_mbarrier_init, fence_proxy_async_shared
from nq.ptx.half import (add_rn_f16x2, cvt_f32_f16, cvt_rn_f16_f32, cvt_rni_s32_f32, fma_rn_f16x2,
                         mul_rn_f16x2, pack_f16x2_from_f32, unpack_f16x2_to_f32)
from nq.ptx.mbarrier import (mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init,
                             mbarrier_try_wait_parity, mbarrier_wait_parity)
from nq.ptx.memory import (createpolicy_evict_first_b64, cvta_to_shared_u32,
                           cvta_to_shared_u32_at, ld_global_nc_hint_v4_u32, ld_global_nc_na_v4_u32,
                           ld_global_nc_u16, ld_global_nc_u32, ld_global_nc_v2_f32,
                           ld_global_nc_v2_u32, ld_global_nc_v4_f32,
                           ld_global_nc_v4_u32, ld_shared_v4_f32, ld_shared_v4_u32,
                           ld_shared_v2_u32_at, ld_shared_v4_u32_at, st_global_u16,
                           st_global_v4_u32, st_shared_u8_at)
from nq.ptx.mma import (ldmatrix_x4, ldmatrix_x4_trans, mma_sync_m16n8k16_f16_f32,
                        mma_sync_m16n8k32_s8_s32)
from nq.ptx.permute import (LOP3_A, LOP3_B, LOP3_C, LUT_AND_OR, LUT_AND_XOR, lop3_b32,
                            mov_b32_f32_from_u32, mov_b32_u32_from_f32, prmt_b32)

__all__ = [
    "clock64",
    "SIMULATOR",
    "prmt_b32", "lop3_b32", "LOP3_A", "LOP3_B", "LOP3_C", "LUT_AND_OR", "LUT_AND_XOR",
    "mov_b32_u32_from_f32", "mov_b32_f32_from_u32",
    "ld_global_nc_v4_u32", "ld_global_nc_na_v4_u32", "ld_global_nc_hint_v4_u32",
    "createpolicy_evict_first_b64", "ld_global_nc_v2_u32", "ld_global_nc_v2_f32",
    "ld_global_nc_v4_f32",
    "ld_global_nc_u16", "ld_global_nc_u32", "st_global_v4_u32", "st_global_u16", "ld_shared_v4_u32",
    "ld_shared_v4_u32_at", "ld_shared_v2_u32_at", "st_shared_u8_at",
    "ld_shared_v4_f32",
    "cvta_to_shared_u32", "cvta_to_shared_u32_at",
    "fma_rn_f16x2", "mul_rn_f16x2", "add_rn_f16x2", "cvt_f32_f16", "cvt_rn_f16_f32",
    "pack_f16x2_from_f32", "unpack_f16x2_to_f32", "cvt_rni_s32_f32",
    "mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx",
    "mbarrier_try_wait_parity", "mbarrier_wait_parity",
    "fence_mbarrier_init", "fence_proxy_async_shared",
    "cp_async_bulk_g2s", "cp_async_bulk_g2s_hint", "cp_async_bulk_prefetch_l2",
    "cp_async_bulk_tensor_5d_g2s",
    "cp_async_cg_shared_global_16", "cp_async_cg_shared_global_16_zfill",
    "cp_async_cg_shared_global_16_zfill_off",
    "cp_async_commit_group", "cp_async_wait_group",
    "ldmatrix_x4", "ldmatrix_x4_trans", "mma_sync_m16n8k16_f16_f32",
    "mma_sync_m16n8k32_s8_s32",
    "dp4a_s32", "mul_hi_u32",
    "griddepcontrol_wait", "griddepcontrol_launch_dependents",
    "atom_add_acq_rel_gpu_u32", "red_release_gpu_add_u32", "red_relaxed_gpu_add_u64", "ld_acquire_gpu_u32", "st_release_gpu_u32", "fence_acq_rel_gpu",
    "ld_global_cg_v4_u32", "nanosleep_u32",
    "cluster_ctarank", "barrier_cluster_sync", "mapa_shared_cluster_u32", "ld_shared_cluster_f32",
]
