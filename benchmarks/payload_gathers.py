"""GPU time of the dispatch's two row gathers, plain and through the token + probability payload.

    python benchmarks/payload_gathers.py          # one H200

The dispatcher (te_dist.moe.payload) writes the expand gather straight into a payload's strided
view [S, H + 16 bytes] and reads the chunk sort straight out of one; this times both against the
plain contiguous gathers they replace (CUDA events, 50 calls after 5 warm-up calls), for the
Mixtral-like (H 4096, top-2) and DeepSeek-like (H 7168, top-8) layers at 1024 and 8192 tokens.
"""
import torch

from te_dist.moe.payload import payload_columns


def t(fn, n=50):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3


dev = torch.device("cuda", 0)
for name, H, K in (("mixtral", 4096, 2), ("deepseek", 7168, 8)):
    for T in (1024, 8192):
        S = T * K
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        tok = torch.randint(0, T, (S,), device=dev)
        idx = torch.randperm(S, device=dev)
        pay = torch.empty(S, payload_columns(H, x.dtype), device=dev, dtype=x.dtype)
        xs = x.index_select(0, tok)
        a = t(lambda: x.index_select(0, tok))
        b = t(lambda: torch.index_select(x, 0, tok, out=pay[:, :H]))
        c = t(lambda: xs.index_select(0, idx))
        d = t(lambda: pay[:, :H].index_select(0, idx))
        gb = S * H * 2 * 2 / 1e3
        print(f"| {name} T={T} S={S} | expand {a:.1f} | expand into payload {b:.1f} | sort {c:.1f} | sort from payload {d:.1f} | "
              f"GB/s plain {gb / a:.0f} payload {gb / b:.0f} |", flush=True)
