# OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 <this file>
import gc

import torch
import torch.distributed as dist
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from hp_cp_core import CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss, cp_sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same weights on every rank
config = GlmMoeDsaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16,
    index_n_heads=4, first_k_dense_replace=1, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    indexer_types=["full", "shared"],  # layer 1 reuses layer 0's top-k
)  # fmt: skip
config._attn_implementation = "eager"
model = GlmMoeDsaForCausalLM(config).float()
ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))  # any S

with torch.no_grad():  # one process, for comparison: HF's own loss on the full sequence
    ref = float(model(input_ids=ids, labels=ids, use_cache=False).loss)

handle = enable_cp(model, dist.group.WORLD, CPConfig(layout="load_balanced"))
batch = handle.batch(ids)  # shifted labels, padding to the layout, this rank's rows
out = model(**batch.model_inputs(), use_cache=False)
loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
loss.backward()
cp_sum_gradients(model.parameters())  # or DDP / FSDP over a mesh that includes cp
total = loss.detach().clone()
dist.all_reduce(total)
print(handle.sharing.describe()[-1])  # which layer owns what
disable_cp(handle)
assert abs(float(total) - ref) <= 1e-5 * abs(ref), (float(total), ref)
if dist.get_rank() == 0:
    print(f"loss under CP {float(total):.6f} == one process {ref:.6f}")
dist.barrier()  # every rank done before any tears its process group down
del model, handle, batch, out, loss  # all that holds the process group (CP state, graph),
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
