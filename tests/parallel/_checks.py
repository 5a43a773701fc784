"""The checks each spawned group runs, by world size (one spawn per world size)."""

from _checks_autocast import (  # noqa: F401
    ep_autocast_bf16_moe,
    fsdp_autocast_casts_fresh_each_step,
    hf_ep_autocast_bf16,
)
from _checks_ckpt import ckpt_async_w2, ckpt_resume_w2, ckpt_save_w4  # noqa: F401
from _checks_collectives import train_collectives  # noqa: F401
from _checks_ep import (  # noqa: F401  (re-exported for the spawned processes)
    bad_mesh_in_group,
    ep_bias_and_shared_expert,
    ep_chunked_no_overlap,
    ep_chunked_overlap,
    ep_last_rank_receives_nothing,
    ep_more_chunks_than_tokens,
    ep_overlap_skewed,
    ep_skewed_one_expert,
    ep_uniform,
)
from _checks_ep_families import (  # noqa: F401
    hf_ep_every_family,
    hf_ep_generic_gate,
    hf_ep_nemotron_h,
    hf_ep_post_norm,
    hf_ep_refusals,
    hf_fsdp_x_ep_nemotron_h,
)
from _checks_fp32_router import (  # noqa: F401
    fsdp_bf16_fp32_router,
    fsdp_frozen_dtypes_stay_one_unit,
    fsdp_refuses_unsplittable_dtypes,
)
from _checks_fsdp import (  # noqa: F401
    fsdp_only,
    fsdp_x_ep,
    fsdp_x_ep_fp64,
    fsdp_x_ep_full,
    fsdp_x_ep_overlap,
    hsdp_only,
    hsdp_x_ep,
)
from _checks_hf import (  # noqa: F401
    hf_ep_equals_single,
    hf_ep_lora_equals_single,
    hf_fsdp_x_ep_train,
)
from _checks_load import hf_sharded_load  # noqa: F401
from _checks_optim import fsdp_fused_adamw  # noqa: F401
from _checks_precision import fsdp_bf16_policy, fsdp_experts_reshard_w4  # noqa: F401
from _checks_quantized import quantized_load_ep, quantized_load_fsdp  # noqa: F401
from _checks_replay import ep_routing_replay, hf_ep_routing_replay  # noqa: F401

CHECKS = {
    2: [
        "ep_uniform",
        "ep_skewed_one_expert",
        "ep_last_rank_receives_nothing",
        "ep_bias_and_shared_expert",
        "ep_chunked_no_overlap",
        "ep_chunked_overlap",
        "ep_overlap_skewed",
        "ep_more_chunks_than_tokens",
        "ep_routing_replay",
        "bad_mesh_in_group",
        "fsdp_only",
        "fsdp_x_ep",
        "fsdp_x_ep_fp64",
        "fsdp_x_ep_overlap",
        "hsdp_only",
        "hf_ep_equals_single",
        "hf_ep_lora_equals_single",
        "hf_ep_routing_replay",
        "hf_fsdp_x_ep_train",
        "hf_sharded_load",
        "ckpt_resume_w2",
        "ckpt_async_w2",
        "train_collectives",
        "fsdp_bf16_policy",
        "fsdp_fused_adamw",
        "ep_autocast_bf16_moe",
        "hf_ep_autocast_bf16",
        "fsdp_autocast_casts_fresh_each_step",
        "hf_ep_nemotron_h",
        "hf_ep_every_family",
        "hf_fsdp_x_ep_nemotron_h",
        "hf_ep_generic_gate",
        "hf_ep_post_norm",
        "hf_ep_refusals",
        "fsdp_bf16_fp32_router",
        "fsdp_refuses_unsplittable_dtypes",
        "fsdp_frozen_dtypes_stay_one_unit",
        "quantized_load_ep",
        "quantized_load_fsdp",
    ],
    4: [
        "ep_uniform",
        "ep_skewed_one_expert",
        "ep_last_rank_receives_nothing",
        "ep_chunked_overlap",
        "fsdp_x_ep",
        "fsdp_x_ep_full",
        "hsdp_x_ep",
        "ckpt_save_w4",
        "fsdp_experts_reshard_w4",
    ],
}
