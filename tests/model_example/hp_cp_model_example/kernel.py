"""A third party's attention kernel, registered by the entry point ``example_dense`` (group
``hp_cp.torch_kernels``): each chunk's columns as one dense, masked softmax with the sink."""

from __future__ import annotations

import torch

from hp_cp_torch.kernels.registry import AttentionRequest


class DenseMaskKernel:
    def problem(self, device: torch.device) -> str | None:
        return None  # runs wherever torch does

    def __call__(self, request: AttentionRequest) -> torch.Tensor:
        pool = request.pool()  # [B, P, D]: the window's rows, then the compressed slots
        outs = []
        for lo, hi, idx in request.column_chunks():  # idx [B, l, K] pool rows, -1 = none
            logits = torch.einsum("blhd,bpd->blhp", request.q[:, lo:hi].float(), pool.float())
            keep = idx.new_zeros((idx.shape[0], hi - lo, pool.shape[1] + 1), dtype=torch.bool)
            keep.scatter_(-1, torch.where(idx >= 0, idx, pool.shape[1]), True)
            keep = keep[..., :-1, None].transpose(-1, -2)  # [B, l, 1, P]
            logits = (logits * request.scale).masked_fill(~keep, float("-inf"))
            sink = request.sink.float().view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
            outs.append(torch.einsum("blhp,bpd->blhd", probs, pool.float()))
        return torch.cat(outs, dim=1).to(request.q.dtype)
