"""The planner's build of EP x FSDP2 (and HSDP) at the target world size, on the meta
device over torch's fake process group (this process is rank 0 of `world`): every
parameter's mesh, placements and local shard shape, checked against the layout
`dropless.parallel.mesh` documents, worked out by hand here."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from dropless.train.config.load import load_config  # noqa: E402
from dropless.train.plan import trace as P  # noqa: E402

E = 32  # experts: ep=16 leaves 2 per rank, FSDP then shards them over dp_shard / ep


def _cfg(ep: int, replicate: int):
    return load_config(
        None,
        [
            "data.tokenizer=bytes", f"parallel.ep={ep}", f"parallel.dp_replicate={replicate}",
            f"model.num_experts={E}", "model.hidden_size=64", "model.num_layers=1",
            "model.moe_intermediate_size=48", "model.head_dim=16", "train.batch_size=512",
        ],
    )  # fmt: skip


def _rank0_rows(n: int, ranks: int) -> int:
    """Rows rank 0 holds of n rows split by Shard(0) over `ranks` (torch.chunk sizes)."""
    return min(math.ceil(n / ranks), n)


LAYOUTS = [(8, 8, 1), (64, 8, 1), (256, 16, 2)]  # (world, ep, dp_replicate): 256 is HSDP


@pytest.mark.parametrize(("world", "ep", "replicate"), LAYOUTS)
def test_every_parameter_placed_and_sharded(world, ep, replicate):
    from torch.distributed.tensor import Replicate, Shard

    cfg = _cfg(ep, replicate)
    hc = P.resolve_hf_config(cfg)
    shard = world // replicate
    with P.fake_world(world):
        model, par, _ = P.build_traced_model(cfg, hc, world, torch.bfloat16)
        assert par.pmesh.world_size == world
        checked = 0
        for name, p in model.named_parameters():
            assert p.device.type == "meta", name  # nothing was allocated
            mesh, places, local = p.device_mesh, p.placements, tuple(p.to_local().shape)
            if ".experts." in name:
                names = ("dp_shard_mod_ep", "ep")
                assert mesh.mesh_dim_names[-2:] == names, name
                assert isinstance(places[-1], Shard) and places[-1].dim == 0, (name, places)
                assert places[-2].dim == 0, (name, places)  # FSDP's strided shard of the EP shard
                rows = _rank0_rows(E // ep, shard // ep)
                assert local == (rows, *p.shape[1:]), (name, local)
            else:
                assert mesh.mesh_dim_names[-1] == "dp_shard", name
                assert places[-1] == Shard(0), (name, places)
                assert local == (_rank0_rows(p.shape[0], shard), *p.shape[1:]), (name, local)
            if replicate > 1:
                assert mesh.mesh_dim_names[0] == "dp_replicate", name
                assert places[0] == Replicate(), (name, places)
            else:
                assert "dp_replicate" not in mesh.mesh_dim_names, name
            checked += 1
        assert checked == len(list(model.parameters())) > 8


def test_traced_plan_at_world_64_counts_the_local_shards():
    """The traced parameters are exactly the local shards' bytes (fp32 build: 4 each) and the
    buffers, the
    optimizer state two fp32 moments of them, and more ranks mean less memory per GPU."""
    cfg = _cfg(8, 1)
    hc = P.resolve_hf_config(cfg)
    with P.fake_world(64):
        model, _, _ = P.build_traced_model(cfg, hc, 64, torch.bfloat16)
        local = sum(p.to_local().numel() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    p64 = P.make_plan(cfg, 64, 80, hf_config=hc, compare_checkpointing=False)
    gib = 2**30
    params = p64.breakdown_gib["parameters"] * gib
    assert params == pytest.approx(4 * local + buffers, abs=2)  # buffers are not sharded
    assert p64.breakdown_gib["optimizer_states"] * gib == pytest.approx(8 * local, abs=64 * 8)
    p8 = P.make_plan(_cfg(8, 1), 8, 80, hf_config=hc, compare_checkpointing=False)
    assert p8.breakdown_gib["parameters"] > 4 * p64.breakdown_gib["parameters"]
