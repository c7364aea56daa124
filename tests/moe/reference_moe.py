"""Reference MoE forward written as plain per-token, per-expert loops (for tests only).

Reads the weights of a ``MoELayer`` through its global-expert state_dict, so it does not share
code with the layer's permutation, dispatch or grouped GEMMs.
"""

import torch
import torch.nn.functional as F


def expert_weights(layer):
    """{global expert: {"fc1.weight": ..., ...}} from a (full, EP=1) layer's state_dict, with grad."""
    sd = layer.state_dict(keep_vars=True)
    out = {}
    for key, value in sd.items():
        if key.startswith("experts."):
            _, g, name = key.split(".", 2)
            out.setdefault(int(g), {})[name] = value
    return out


def reference_moe(x_TH, router_weight, experts, top_k, *, probs_position="expert", activation="swiglu"):
    logits = x_TH.to(router_weight.dtype) @ router_weight.t()
    top, idx = logits.topk(top_k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    rows = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros(x_TH.shape[1], dtype=torch.float64)
        for k in range(top_k):
            w = experts[int(idx[t, k])]
            h = x_TH[t] @ w["fc1.weight"].t()
            if "fc1.bias" in w:
                h = h + w["fc1.bias"]
            if activation == "swiglu":
                gate, up = h.chunk(2)
                a = F.silu(gate) * up
            else:
                a = F.gelu(h) if activation == "gelu" else F.relu(h)
            p = probs[t, k].to(a.dtype)
            if probs_position == "expert":
                a = a * p
            y = a @ w["fc2.weight"].t()
            if "fc2.bias" in w:
                y = y + w["fc2.bias"]
            if probs_position == "combine":
                y = y * p
            acc = acc + y.double()
        rows.append(acc.to(x_TH.dtype))
    return torch.stack(rows) if rows else x_TH.new_zeros(0, x_TH.shape[1])
