# PYTHONSAFEPATH=1 TORCHDYNAMO_DISABLE=1 torchrun --nproc-per-node 2 <this file>
import gc

import torch
import torch.distributed as dist
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from hp_cp_core import enable_cp
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_nemo_batch,
    cp_sum_gradients,
)

dist.init_process_group("gloo")
config = DeepseekV4Config(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
    o_groups=2, n_routed_experts=4, num_experts_per_tok=2, compress_ratios=[0, 4, 128],
    num_hash_layers=0, hc_mult=2, index_head_dim=8, index_n_heads=4, index_topk=8,
    num_nextn_predict_layers=0, torch_dtype="float32",
)  # fmt: skip
torch.manual_seed(0)  # the same weights on every rank
model = DeepseekV4ForCausalLM(config, backend=BackendConfig(attn="sdpa"))
model.initialize_weights(buffer_device=torch.device("cpu"))
model = model.float().train()

handle = enable_cp(model, dist.group.WORLD)  # hp_cp owns every attention layer
input_ids = torch.randint(0, 64, (1, 301))  # any length; the full sequence on every rank
batch = cp_nemo_batch(handle, input_ids, seq_lens=[[120, 181]])  # NeMo packing, optional
labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
loss = cp_causal_lm_loss(model(**batch).logits, labels, n_tokens)
loss.backward()
cp_sum_gradients(model.parameters(), dist.group.WORLD)
dist.all_reduce(total := loss.detach().clone())
print(f"rank {dist.get_rank()}: loss {total.item():.4f}")
dist.barrier()  # every rank done before any tears its process group down
del model, handle, batch, loss  # all that holds the process group (CP state, graph),
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
