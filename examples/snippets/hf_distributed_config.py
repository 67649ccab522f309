"""CP next to Hugging Face's own parallelism (4 ranks): TP on the experts, FSDP2 by HF, CP on
HF's ``fsdp`` axis. Run: torchrun --standalone --nproc-per-node 4 hf_distributed_config.py"""

import gc
import tempfile

import torch
import torch.distributed as dist
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DistributedConfig

from hp_cp_torch.cli.parity import TINY_CONFIG
from hp_cp_torch.integrations.transformers import cp_layout_from_hf_model

dist.init_process_group("gloo")  # NCCL with one GPU per rank
path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
if dist.get_rank() == 0:  # a tiny random model; use your checkpoint's directory instead
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(DeepseekV4Config(**TINY_CONFIG)).save_pretrained(path[0])
dist.broadcast_object_list(path)

model = DeepseekV4ForCausalLM.from_pretrained(
    path[0],
    attn_implementation="eager",
    distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
)
layout = cp_layout_from_hf_model(model, axis="fsdp")  # never "tp": it shares one batch
handle = layout.enable_cp(model)  # enable_cp(model, layout.cp_mesh); the indexer frozen
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

for step in range(2):
    # this data-parallel replica's sequences (the same on its CP and TP ranks), any length
    seed = 1000 * step + layout.dp_mesh.get_local_rank()
    ids = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(seed))
    batch = handle.batch(ids)  # shifted, padded and sharded for this rank
    out = model(**batch.model_inputs(), use_cache=False)
    # the share of the global mean loss times HF's FSDP divide factor (dp x cp ranks)
    loss = layout.causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = layout.global_loss(loss)  # the global mean loss (a collective)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {total:.4f}")
dist.barrier()  # every rank done before any tears its process group down
del model, handle, layout, optimizer, batch, out, loss  # all that holds the process group,
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
