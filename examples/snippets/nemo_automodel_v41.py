# PYTHONSAFEPATH=1 TORCHDYNAMO_DISABLE=1 torchrun --nproc-per-node 2 <this file>
import gc

import torch
import torch.distributed as dist
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.models.qwen3_8_flash_next.engram import (
    Qwen3_8_FlashNextEngramTableConfig,
)
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from hp_cp_core import enable_cp
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_nemo_batch,
    cp_sum_gradients,
)

dist.init_process_group("gloo")
vocab = {f"t{i}": i for i in range(64)}  # Engram hashes need the model's (fast) tokenizer
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")))
text = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=7,
    num_attention_heads=4, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
    o_groups=2, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 4],  # Full layers
    index_source_layer_ids=[1, 3, 4, 5], candidate_source_layer_id=4,  # Reindex 3, 5
    index_n_heads=4, index_head_dim=16, index_topk=4, candidate_topk_blocks=3,
    candidate_block_size=4, hc_mult=2, hc_sinkhorn_iters=3, engram_layer_ids=[1],
    engram_num_embeddings=[500], engram_max_ngram_size=3, engram_vocab_size=50,
    engram_n_heads=2, engram_head_dim=8, engram_compressed_vocab_size=64,
    num_nextn_predict_layers=0, dtype="float32",
)  # fmt: skip
config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
backend = BackendConfig(attn="sdpa", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
torch.manual_seed(0)  # the same weights on every rank
model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer)
engram = model.model.layers["1"].engram  # this tiny table whole on every rank (no row owners)
engram.embed = Qwen3_8_FlashNextEngramTableConfig(500, 8).build(process_group=None)
model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
model = model.float().train()

handle = enable_cp(model, dist.group.WORLD)  # hp_cp owns every attention layer and the hash
input_ids = torch.randint(0, 64, (1, 301))  # any length; the full sequence on every rank
batch = cp_nemo_batch(handle, input_ids, seq_lens=[[120, 181]])  # NeMo packing, optional
labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
loss = cp_causal_lm_loss(model(**batch).logits, labels, n_tokens)
loss.backward()
cp_sum_gradients(model.parameters(), dist.group.WORLD)
dist.all_reduce(total := loss.detach().clone())
print(f"rank {dist.get_rank()}: loss {total.item():.4f} {handle.stats()['bytes_recv']} B")
dist.barrier()  # every rank done before any tears its process group down
del model, handle, batch, loss  # all that holds the process group (CP state, graph),
gc.collect()  # cycles too: its threads end in destroy_process_group, not at exit
dist.destroy_process_group()
