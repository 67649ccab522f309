# OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 <this file>
import copy
import gc

import torch
import torch.distributed as dist
from torch.distributed import pipelining as pl
from torch.distributed.device_mesh import init_device_mesh
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.masking_utils import create_causal_mask

from hp_cp_core import CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss, cp_sum_gradients


class Stage(torch.nn.Module):
    """Layers lo:hi of a GLM-5 causal LM: the embedding first, the norm and head last."""

    def __init__(self, model: GlmMoeDsaForCausalLM, lo: int, hi: int) -> None:
        super().__init__()
        m = model.model
        self.embed = m.embed_tokens if lo == 0 else None
        self.layers = torch.nn.ModuleList(m.layers[lo:hi])
        self.rotary, self.config, self.position_ids = m.rotary_emb, m.config, None
        last = hi == len(m.layers)
        self.norm, self.head = (m.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = self.position_ids.expand(h.shape[0], -1)  # this rank's global positions
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
            position_ids=pos, allow_is_causal_skip=False,
        )  # fmt: skip
        pe, topk = self.rotary(h, position_ids=pos), None
        for layer in self.layers:
            h, topk = layer(
                h, attention_mask=mask, position_embeddings=pe, position_ids=pos,
                prev_topk_indices=topk,
            )  # fmt: skip
        return self.head(self.norm(h)) if self.head is not None else h


dist.init_process_group("gloo")
pp, cp = 2, 2
mesh = init_device_mesh("cpu", (pp, cp), mesh_dim_names=("pp", "cp"))
pp_rank = mesh.get_local_rank("pp")
torch.manual_seed(0)  # the same weights on every rank
config = GlmMoeDsaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16,
    index_n_heads=4, first_k_dense_replace=1, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    indexer_types=["full", "shared", "full", "shared"],  # a stage holds whole groups
)  # fmt: skip
config._attn_implementation = "eager"
model = GlmMoeDsaForCausalLM(config).float()
model.gradient_checkpointing_enable({"use_reentrant": False})  # every layer recomputed
ids = torch.randint(0, 64, (4, 37), generator=torch.Generator().manual_seed(1))  # any S

one = copy.deepcopy(model)  # one process, for comparison: HF's own loss and gradients
one(input_ids=ids, labels=ids, use_cache=False).loss.backward()

stage_module = Stage(model, 2 * pp_rank, 2 * pp_rank + 2)
handle = enable_cp(stage_module, mesh["cp"], CPConfig(layout="load_balanced"))
batch = handle.batch(ids)  # on every stage: the step's padding, positions and labels
stage_module.position_ids = batch.position_ids
n_tokens = batch.n_tokens  # targets of the whole batch (every micro-batch, every rank)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cp_causal_lm_loss(logits, labels, n_tokens)


pp_group = mesh["pp"].get_group()
stage = pl.PipelineStage(stage_module, pp_rank, pp, torch.device("cpu"), group=pp_group)
# the loss is already divided by the global batch's targets: no scaling by micro-batches
schedule = pl.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
if pp_rank == 0:
    schedule.step(batch.input_ids)
else:
    schedule.step(target=batch.labels)
cp_sum_gradients(stage_module.parameters(), mesh["cp"].get_group())
reference = dict(one.named_parameters())
for name, p in model.named_parameters():
    if any(p is q for q in stage_module.parameters()) and reference[name].grad is not None:
        want = reference[name].grad
        assert (p.grad - want).abs().max() <= 1e-4 * want.abs().max() + 1e-7, name
print(f"rank {dist.get_rank()}: stage {pp_rank} gradients == one process")
disable_cp(handle)
dist.barrier()  # every rank done before any tears its process group down
del model, one, handle, batch, stage, schedule, stage_module
gc.collect()
dist.destroy_process_group()
