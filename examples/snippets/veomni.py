"""hp_cp inside VeOmni's DeepSeek V4: one training step, 2 gloo ranks, packed documents.

torchrun --nproc-per-node 2 --no-python python -P examples/snippets/veomni.py
(-P: this file is named veomni.py, so its folder must not shadow the veomni package)
"""

import gc

import torch
import torch.distributed as dist
from veomni.distributed.parallel_state import init_parallel_state
from veomni.models.transformers.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from veomni.models.transformers.deepseek_v4.generated import patched_modeling_deepseek_v4_gpu

from hp_cp_core import disable_cp, enable_cp
from hp_cp_torch.cli.parity import TINY_CONFIG
from hp_cp_torch.integrations.veomni import (
    cp_causal_lm_loss,
    cp_sum_gradients,
    cp_veomni_batch,
)

dist.init_process_group("gloo")
init_parallel_state(dp_size=dist.get_world_size(), device_type="cpu")  # VeOmni's CP stays off
torch.manual_seed(0)
config = DeepseekV4Config(**TINY_CONFIG)  # sliding, CSA (r=4) and HCA (r=128) layers
config._attn_implementation = "eager"
model = patched_modeling_deepseek_v4_gpu.DeepseekV4ForCausalLM(config)

handle = enable_cp(model, dist.group.WORLD)  # hp_cp owns every attention layer
ids = torch.randint(0, config.vocab_size, (1, 301), generator=torch.Generator().manual_seed(0))
docs = [0, 120, 301]  # VeOmni's packed row: position_ids restart at each document
position_ids = torch.cat([torch.arange(b - a) for a, b in zip(docs, docs[1:])])[None]
batch = cp_veomni_batch(handle, ids, position_ids=position_ids)
out = model(**batch.model_inputs(), use_cache=False)
loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
loss.backward()
cp_sum_gradients(model.parameters(), dist.group.WORLD)
total = loss.detach().clone()
dist.all_reduce(total)
if dist.get_rank() == 0:
    print(f"loss {float(total):.4f} over {int(batch.n_tokens)} targets, cp {handle.cp_size}")
disable_cp(handle)
dist.barrier()  # every rank done before any tears its process group down
del model, handle, batch, out, loss  # all that holds the process group (CP state, graph),
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
