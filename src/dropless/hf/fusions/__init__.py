"""Fusions outside the experts that `patch(fused_cross_entropy=..., fused_rmsnorm=...)`
wires into a Transformers model: the loss computed from hidden states (`fused_loss.py`)
and dropless's RMSNorm (`rmsnorm.py`)."""
