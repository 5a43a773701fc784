"""Every experts class of the installed Transformers, found by walking `transformers.models`:
the dropless path equals stock `eager` in float64, forward and backward, with proof it ran.

Run `pytest tests/hf/test_discovery.py -s` to see `families N: ours A, fallback B`."""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import dropless.hf as dh
from dropless.hf import experts as ex
from dropless.hf.patching.discovery import experts_classes, tiny_experts

E, K, T = 5, 2, 7  # E not a power of two
FAMILY_COUNT = {"5.24": 67, "5.17": 54}


def _routings():
    g = torch.Generator().manual_seed(3)
    normal = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    no_zero = torch.stack([torch.randperm(E - 1, generator=g)[:K] + 1 for _ in range(T)])
    skewed = torch.stack(
        [torch.tensor([E - 1, int(torch.randint(0, E - 1, (1,), generator=g))]) for _ in range(T)]
    )
    one_token = normal[:1]
    return {"normal": normal, "expert 0 empty": no_zero, "skewed": skewed, "T=1": one_token}


def _run(module, forward, x_TD, ids_TK, w_TK):
    module.zero_grad(set_to_none=True)
    x = x_TD.clone().requires_grad_(True)
    w = w_TK.clone().requires_grad_(True)
    out = forward(module, x, ids_TK, w)
    g = torch.Generator().manual_seed(5)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    grads = {"out": out.detach(), "x.grad": x.grad, "weights.grad": w.grad}
    grads.update({f"{n}.grad": p.grad for n, p in module.named_parameters()})
    return grads


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(module, eager, D):
    """Mismatch messages of our path against eager over all routings (empty: equal).

    float64 everywhere. Each tensor's tolerance is 1e-9 relative, or 10x the spread
    between stock's own eager and batched_mm for it where a family computes part of
    its gate, norm or sum in float32 (beam, inkling2, muse_spark): as close to eager
    as stock is to itself."""
    from transformers.integrations.moe import batched_mm_experts_forward

    bad = []
    g = torch.Generator().manual_seed(7)
    for case, ids_TK in _routings().items():
        x_TD = torch.randn(ids_TK.shape[0], D, generator=g, dtype=torch.float64)
        w_TK = torch.rand(ids_TK.shape, generator=g, dtype=torch.float64) + 0.1
        ref = _run(module, eager, x_TD, ids_TK, w_TK)
        stock = _run(module, batched_mm_experts_forward, x_TD, ids_TK, w_TK)
        got = _run(module, ex.dropless_experts_forward, x_TD, ids_TK, w_TK)
        for name, r in ref.items():
            o = got[name]
            if r is None:
                if o is not None and o.abs().max() != 0:
                    bad.append(f"{case}: {name} nonzero where eager has none")
                continue
            spread = _rel(stock[name], r)
            assert spread < 1e-4, f"{case}: stock eager and batched_mm differ by {spread:.1e}"
            rtol = max(1e-9, 10 * spread)
            if o is None or _rel(o, r) > rtol:
                err = None if o is None else _rel(o, r)
                bad.append(f"{case}: {name} differs (max rel err {err}, tolerance {rtol:.1e})")
    return bad


def test_every_experts_class_matches_eager_in_float64():
    import transformers

    classes = experts_classes()
    minor = ".".join(transformers.__version__.split(".")[:2])
    # families with a decorated experts class per release (CI pins 5.24): a new release
    # changes this count visibly instead of silently
    found = len({ec.family for ec in classes})
    assert minor in FAMILY_COUNT, f"transformers {minor}: {found} families; add it to FAMILY_COUNT"
    assert found == FAMILY_COUNT[minor]
    paths, problems = {}, []
    for ec in classes:
        try:
            module = tiny_experts(ec.cls, hidden=12, intermediate=8, experts=E)
        except Exception as e:
            problems.append(f"{ec.family}/{ec.name}: could not build: {e}")
            continue
        spec = dh.experts_spec(module)
        path = spec if isinstance(spec, str) else spec.path
        paths[ec] = path
        if isinstance(spec, str):
            problems.append(f"{ec.family}/{ec.name}: fallback: {spec}")
            continue
        w_down = module.down_proj
        D = w_down.shape[2] if module.is_transposed else w_down.shape[1]
        before = ex.PATH_CALLS[(spec.family, path)]
        eager = type(module).forward.__wrapped__
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dh.DroplessGenericGateWarning)
            try:
                bad = _compare(module, eager, D)
            except Exception as e:
                bad = [f"raised {type(e).__name__}: {e}"]
        ran = ex.PATH_CALLS[(spec.family, path)] - before
        if ran != len(_routings()):
            bad.append(f"our {path} path ran {ran} times, expected {len(_routings())}")
        problems += [f"{ec.family}/{ec.name} ({path}): {b}" for b in bad]
    families = {ec.family for ec in classes}
    ours = {ec.family for ec, p in paths.items() if p in ("fused", "generic")}
    counts = collections.Counter(paths.values())
    print(
        f"\nfamilies {len(families)}: ours {len(ours)}, fallback {len(families - ours)} "
        f"(classes {len(classes)}: fused {counts['fused']}, generic gate {counts['generic']})"
    )
    for ec, p in sorted(paths.items(), key=lambda kv: (kv[1], kv[0].family)):
        if p != "fused":
            print(f"  {p}: {ec.family}/{ec.name}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_spec_is_read_from_behaviour_not_name(kind):
    """A module whose config names another family still gets the spec of what it computes."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cls = GptOssExperts if kind == "gpt_oss" else Qwen3MoeExperts
    module = tiny_experts(cls)
    module.config.model_type = "some_future_family"
    spec = dh.experts_spec(module)
    assert spec.path == "fused" and spec.family == "some_future_family"
    assert spec.activation.kind == kind and spec.activation.interleaved == (kind == "gpt_oss")
