"""One rank of ``tests/torch/test_clean_exit.py``: a training script that ends without a barrier.

The reference layer under CP on the world group (``handle.shard``, forward, backward, the
gradients summed over the CP ranks, SGD), the loss all-reduced for logging after every step,
then ``dist.destroy_process_group()``: no ``dist.barrier()``, no ``disable_cp``, nothing
deleted. The model, the handle and the last graph are still alive when the interpreter exits
(Note [Clean exit] in :mod:`hp_cp_torch.distributed.exit`). Started like torchrun starts a script:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment.
"""

import torch
import torch.distributed as dist

from hp_cp_core import DeepSeekV4CPConfig, enable_cp
from hp_cp_torch.reference import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from hp_cp_torch.training import cp_sum_gradients

SEQ = 37  # pads to the layout

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same weights on every rank
config = DeepSeekV4AttentionConfig(
    hidden_size=32, n_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, window_size=16, compress_ratio=4, index_n_heads=2, index_head_dim=16,
    index_topk=3,
)  # fmt: skip
layer = DeepSeekV4Attention(config)
handle = enable_cp(layer, dist.group.WORLD, DeepSeekV4CPConfig(layout="load_balanced"))
optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
mask = handle.shard(torch.ones(2, SEQ), 1, pad_value=0)
for step in range(2):
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(step))
    out = layer(handle.shard(x, 1, pad_value=0.0), loss_mask=mask)
    loss = out.square().sum() / (2 * SEQ)  # this rank's share of the global mean
    loss.backward()
    cp_sum_gradients(layer.parameters(), dist.group.WORLD)
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the logged loss: the last collective before the exit
    if dist.get_rank() == 0:
        print(f"step {step}: loss {float(total):.6f}", flush=True)
dist.destroy_process_group()
