"""Pure-torch references: the specification of every op in `dropless.ops`.

Written for clarity, not speed: plain loops and autograd through torch ops. Every
fast path (custom autograd Functions, grouped_mm, Triton kernels) is tested against
these, forward and backward, and these pass an fp64 gradcheck at tiny sizes.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs (<= T*K),
# N output features of a grouped GEMM, G expert groups (n_group), V vocabulary

from __future__ import annotations

import torch
import torch.nn.functional as F

from .specs import ActivationConfig, RoutingConfig, as_activation, as_routing


def route_reference(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig | None = None,
    *,
    expert_bias_E: torch.Tensor | None = None,
    **fields,
):
    """Top-k routing. Returns (weights_TK, ids_TK int64, scores_TE), scores and weights in
    fp32 (fp64 for fp64 logits).

    `routing` (or its fields as keywords) says how. Scores are computed in fp32. The
    expert bias only changes which experts are chosen; the weights are the unbiased
    scores of the chosen experts. Group-limited selection (DeepSeek-V3): a group's
    score is the sum of its top-2 biased scores (top-1 when a group holds one expert);
    only the best `topk_group` groups compete.
    """
    routing = as_routing(routing, **fields)
    n_group, topk_group = routing.n_group, routing.topk_group
    T, E = logits_TE.shape
    # at least fp32 whatever the input dtype (fp64 stays fp64, for gradchecks)
    logits = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    if routing.score_func == "softmax":
        scores_TE = logits.softmax(dim=-1)
    else:
        scores_TE = logits.sigmoid()
    choice_TE = (
        scores_TE if expert_bias_E is None else scores_TE + expert_bias_E.to(scores_TE.dtype)
    )
    if n_group is not None and n_group > 1:
        per = E // n_group
        grouped = choice_TE.view(T, n_group, per)
        group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        # scatter_ of a scalar: no host index or host value copied to the device (no sync)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, keep_groups, True)
        mask_TE = mask.unsqueeze(-1).expand(T, n_group, per).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~mask_TE, float("-inf"))
    ids_TK = choice_TE.topk(top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if routing.renormalize:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    weights_TK = weights_TK * routing.scaling_factor
    return weights_TK, ids_TK, scores_TE


def permute_reference(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int):
    """Gather tokens into expert order. Returns (x_SD, token_S, counts_E).

    Pairs are ordered by expert, and within an expert by (token, k): a stable sort of
    the flattened (token, k) pairs.
    """
    T, K = ids_TK.shape
    rows, tokens = [], []
    for e in range(num_experts):
        for t in range(T):
            for k in range(K):
                if int(ids_TK[t, k]) == e:
                    rows.append(x_TD[t])
                    tokens.append(t)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=num_experts)
    token_S = torch.tensor(tokens, dtype=torch.long)
    x_SD = torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    return x_SD, token_S, counts_E


def unpermute_reference(
    y_SN: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    num_experts: int,
):
    """Weighted sum back into token order: out[t] = sum_k w[t,k] * y[slot of (t,k)]."""
    T, K = ids_TK.shape
    slot = 0
    slot_of = {}
    for e in range(num_experts):
        for t in range(T):
            for k in range(K):
                if int(ids_TK[t, k]) == e:
                    slot_of[(t, k)] = slot
                    slot += 1
    out = []
    for t in range(T):
        acc = y_SN.new_zeros(y_SN.shape[1])
        for k in range(K):
            w = 1.0 if weights_TK is None else weights_TK[t, k].to(y_SN.dtype)
            acc = acc + w * y_SN[slot_of[(t, k)]]
        out.append(acc)
    return torch.stack(out)


def grouped_gemm_reference(
    x_SD: torch.Tensor,
    w_END: torch.Tensor,
    counts_E,
    bias_EN: torch.Tensor | None = None,
    *,
    trans_w: bool = True,
):
    """y[s] = x[s] @ w[e(s)]^T (+ bias[e(s)]) for contiguous groups of counts_E rows.

    trans_w=True: w is [E, N, D] (nn.Linear layout); False: w is [E, D, N].
    """
    outs = []
    start = 0
    for e, n in enumerate([int(c) for c in counts_E]):
        w = w_END[e].t() if trans_w else w_END[e]
        y = x_SD[start : start + n] @ w
        if bias_EN is not None:
            y = y + bias_EN[e]
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else x_SD.new_zeros(0, w_END.shape[1 if trans_w else 2])


def swiglu_reference(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
):
    """act(gate, up) (* prob) per row; gate = columns [0, F) and up = [F, 2F), or the
    even and odd columns when `activation.interleaved`; act(h) when not gated. The
    kinds are those of `activation_reference`.
    """
    act = as_activation(activation)
    if act.kind not in ("swiglu", "gpt_oss") or not act.gated:
        from .activations import REGISTERED  # elementwise functions given by the caller

        out = activation_reference(
            h_S2F, act.kind, gated=act.gated, interleaved=act.interleaved, alpha=act.alpha,
            limit=act.limit, fn=REGISTERED.get(act.kind),
        )  # fmt: skip
    else:
        out = activation_reference(
            h_S2F, act.kind, interleaved=act.interleaved, alpha=act.alpha, limit=act.limit
        )
    if prob_S is not None:
        out = out * prob_S.unsqueeze(-1).to(out.dtype)
    return out


def expert_mlp_reference(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2FD: torch.Tensor,
    down_EDF: torch.Tensor,
    down_bias_ED: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
):
    """The routed expert MLP by its definition: a loop over tokens and their experts."""
    T, K = ids_TK.shape
    out = []
    for t in range(T):
        acc = x_TD.new_zeros(down_EDF.shape[1])
        for k in range(K):
            e = int(ids_TK[t, k])
            h = gate_up_E2FD[e] @ x_TD[t]
            a = swiglu_reference(h.unsqueeze(0), None, activation)[0]
            y = down_EDF[e] @ a
            if down_bias_ED is not None:
                y = y + down_bias_ED[e]
            acc = acc + weights_TK[t, k].to(x_TD.dtype) * y
        out.append(acc)
    return torch.stack(out)


def activation_reference(
    h_SN: torch.Tensor,
    kind: str = "swiglu",
    *,
    gated: bool = True,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    fn=None,
):
    """The expert activation by its definition (autograd through torch ops).

    Gated: h = [gate | up] (or gate/up interleaved, gate first) of width 2F -> [S, F];
    non-gated: f(h). Kinds: "swiglu" (silu), "gelu" (exact), "gelu_tanh", "relu2"
    (relu(x)^2), "swiglu_clamp" (silu(min(gate, limit)) * clamp(up, -limit, limit)),
    "gpt_oss" (g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate,
    limit)); any other kind is the elementwise function `fn`.
    """
    if gated:
        if interleaved:
            gate, up = h_SN[..., 0::2], h_SN[..., 1::2]
        else:
            gate, up = h_SN.chunk(2, dim=-1)
    else:
        gate, up = h_SN, None
    if kind == "gpt_oss":
        g = gate.clamp(max=limit)
        return g * torch.sigmoid(g * alpha) * (up.clamp(-limit, limit) + 1)
    if kind == "swiglu_clamp":
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    elementwise = {
        "swiglu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu2": lambda x: F.relu(x).square(),
    }
    f = elementwise[kind](gate) if kind in elementwise else fn(gate)
    return f if up is None else f * up


def linear_cross_entropy_reference(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
):
    """A language-model head and its loss, as Transformers computes them: the logits in
    the input dtype, upcast to fp32 (fp64 stays fp64), then cross-entropy."""
    logits_TV = F.linear(h_TD, weight_VD, bias_V)
    logits_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    return F.cross_entropy(
        logits_TV.reshape(-1, weight_VD.shape[0]),
        labels_T.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    ).reshape(labels_T.shape if reduction == "none" else ())


def rms_norm_reference(
    x: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dim (torch's op); with `residual`, of `x + residual`, returning
    `(normed, x + residual)`."""
    s = x if residual is None else x + residual
    y = F.rms_norm(s, (s.shape[-1],), weight_D, eps)
    return y if residual is None else (y, s)


def lowrank_fold_reference(
    w_E: torch.Tensor, a_ERI: torch.Tensor, b_EOR: torch.Tensor, scale: float, trans_w: bool = True
) -> torch.Tensor:
    """An expert weight with its low-rank (LoRA) update folded in, in its storage layout:
    W + scale * B_e A_e ([E, out, in] when trans_w, else [E, in, out]). Running the plain
    expert MLP on the folded weights is the definition of the low-rank path."""
    delta = torch.einsum("eor,eri->eoi", b_EOR, a_ERI) * scale
    return w_E + (delta if trans_w else delta.transpose(1, 2))
