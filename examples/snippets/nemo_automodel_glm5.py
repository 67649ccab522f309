# PYTHONSAFEPATH=1 TORCHDYNAMO_DISABLE=1 torchrun --nproc-per-node 2 <this file>
import copy
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.glm_moe_dsa.config import GlmMoeDsaConfig
from nemo_automodel.components.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

from hp_cp_core import enable_cp
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_nemo_batch,
    cp_sum_gradients,
)

dist.init_process_group("gloo")
config = GlmMoeDsaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
    index_head_dim=16, index_topk=4, indexer_types=["full", "shared"],  # layer 1 reuses 0's
    mlp_layer_types=["dense", "sparse"], torch_dtype="float32",
)  # fmt: skip
torch.manual_seed(0)  # the same weights on every rank
backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch")
model = GlmMoeDsaForCausalLM(config, backend=backend)
model.initialize_weights(buffer_device=torch.device("cpu"))
model = model.float().train()
input_ids = torch.randint(0, 64, (2, 61), generator=torch.Generator().manual_seed(1))

with torch.no_grad():  # one process, for comparison: the same model on the full sequence
    logits = copy.deepcopy(model)(input_ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 64), input_ids[:, 1:].reshape(-1))

handle = enable_cp(model, dist.group.WORLD)  # hp_cp owns every GlmMoeDsaMLA
batch = cp_nemo_batch(handle, input_ids)  # any length; padded, shifted, this rank's rows
labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
loss = cp_causal_lm_loss(model(**batch).logits, labels, n_tokens)
loss.backward()
cp_sum_gradients(model.parameters(), dist.group.WORLD)
dist.all_reduce(total := loss.detach().clone())
assert abs(total.item() - ref.item()) < 1e-5, (total.item(), ref.item())
print(f"rank {dist.get_rank()}: loss {total.item():.6f}, one process {ref.item():.6f}")
dist.barrier()  # every rank done before any tears its process group down
del model, handle, batch, loss  # all that holds the process group (CP state, graph),
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
