"""Layout validation without processes: bad sizes give their messages up front."""

import pytest

from dropless.parallel import ParallelConfig, as_parallel_config, resolve_sizes


@pytest.mark.parametrize(
    "kw, world, experts, needle",
    [
        pytest.param(
            dict(dp_replicate=3),
            4,
            8,
            "does not divide the world size 4",
            id="replicate_not_divisor",
        ),
        pytest.param(dict(dp_shard=3), 4, 8, "must equal the world size 4", id="product_not_world"),
        pytest.param(dict(dp_replicate=2, dp_shard=4), 4, 8, "2 x 4 = 8", id="product_too_big"),
        pytest.param(
            dict(ep=3), 6, 8, "not divisible by parallel.ep=3", id="experts_not_divisible"
        ),
        pytest.param(
            dict(ep=4, dp_replicate=2),
            4,
            8,
            "must divide parallel.dp_shard=2",
            id="ep_not_dividing_shard",
        ),
        pytest.param(dict(ep=4), 2, 8, "pick ep from [1, 2]", id="ep_bigger_than_world"),
    ],
)
def test_bad_sizes(kw, world, experts, needle):
    with pytest.raises(ValueError, match=None) as e:
        resolve_sizes(ParallelConfig(**kw), world, experts)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        pytest.param(dict(ep=0), "parallel.ep", id="ep_zero"),
        pytest.param(dict(dp_shard=0), "parallel.dp_shard", id="shard_zero"),
        pytest.param(dict(dp_replicate=-1), "parallel.dp_replicate", id="replicate_negative"),
        pytest.param(dict(dispatcher="nccl"), "parallel.dispatcher", id="unknown_dispatcher"),
        pytest.param(dict(overlap_chunks=0), "parallel.overlap_chunks", id="chunks_zero"),
    ],
)
def test_bad_fields(kw, field):
    with pytest.raises(ValueError) as e:
        ParallelConfig(**kw)
    assert field in str(e.value)


def test_resolve_fills_shard_and_keeps_valid():
    cfg = resolve_sizes(ParallelConfig(dp_replicate=2, ep=2), 8, 16)
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.ep) == (2, 4, 2)


def test_as_parallel_config_accepts_sections():
    class Run:
        class parallel:  # noqa: N801  a config-like object with a .parallel section
            dp_replicate, dp_shard, ep = 1, 4, 2

    assert as_parallel_config(Run()).ep == 2
    assert as_parallel_config({"ep": 2}).ep == 2
    assert as_parallel_config(None).ep == 1


def test_deepep_is_not_a_choice_but_a_clear_error():
    from dropless.parallel.mesh import DISPATCHERS

    assert "deepep" not in DISPATCHERS
    with pytest.raises(ValueError, match=r"dispatcher='deepep' is not implemented \(planned\)"):
        ParallelConfig(dispatcher="deepep")
    with pytest.raises(ValueError, match="allowed: \\('alltoall',\\)"):
        ParallelConfig(dispatcher="nccl")


@pytest.mark.parametrize(
    "recv",
    [
        pytest.param([[2, 0, 1], [1, 3, 0]], id="mixed"),
        pytest.param([[0, 0, 0], [0, 0, 0]], id="nothing_received"),
        pytest.param([[0, 0, 0], [4, 1, 2]], id="one_source"),
        pytest.param([[0, 5], [0, 0], [2, 0]], id="three_sources"),
    ],
)
def test_local_order_groups_rows_by_local_expert(recv):
    """Rows arrive as (source rank, local expert) blocks; the reorder yields (expert,
    source) blocks, and its inverse undoes it (pure-python reference)."""
    import torch

    from dropless.parallel.dispatcher import _local_order

    recv_PL = torch.tensor(recv)
    P, L = recv_PL.shape
    blocks, start = {}, 0
    for p in range(P):
        for e in range(L):
            blocks[p, e] = list(range(start, start + recv[p][e]))
            start += recv[p][e]
    want = [r for e in range(L) for p in range(P) for r in blocks[p, e]]
    perm, inv = _local_order(recv_PL, start)
    assert perm.tolist() == want
    assert perm[inv].tolist() == list(range(start))


def test_one_parallel_config_for_the_library_and_dropless_train():
    """`dropless train`'s [parallel] section is the parallel layer's ParallelConfig, with
    every field and check (timeout_s included)."""
    from dropless.train.config.load import ParallelConfig as TrainParallel
    from dropless.train.config.load import load_config

    assert TrainParallel is ParallelConfig
    cfg = load_config(None, ["parallel.ep=2", "parallel.timeout_s=60"]).parallel
    assert isinstance(cfg, ParallelConfig) and (cfg.ep, cfg.timeout_s) == (2, 60.0)
    resolved = resolve_sizes(cfg, 4, 8)
    assert (resolved.dp_shard, resolved.timeout_s) == (4, 60.0)  # resolving keeps every field
    assert as_parallel_config({"timeout_s": 5}).timeout_s == 5
    for bad, needle in (
        ("parallel.ep=0", "parallel.ep=0 must be an int >= 1"),
        ("parallel.timeout_s=0", "parallel.timeout_s=0.0: must be a number of seconds > 0"),
        ("parallel.dispatcher=deepep", "is not implemented (planned)"),
    ):
        with pytest.raises(ValueError) as e:
            load_config(None, [bad])
        assert needle in str(e.value)
    with pytest.raises(
        ValueError, match=r"parallel.timeout_s=10000000000.0: must be at most 1e\+09 seconds"
    ):
        ParallelConfig(timeout_s=1e10)
