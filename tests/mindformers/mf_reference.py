"""Single-device MindSpore reference of mindformers 2.1.0's pynative DeepSeek-V4 CSA cell.

This module mirrors, name for name, the classes in the mindformers 2.1.0 wheel

    mindformers/pynative/transformers/experimental_attention_variant/csa.py
        CompressedSparseAttention, unfused_compressed_sparse_attn, parse_cu_seqlens,
        get_window_topk_idxs, get_compress_topk_idxs, get_doc_window_topk_idxs,
        build_grid_valid_blocks, get_doc_compress_topk_idxs, build_doc_block_mask
    .../compressor.py   Compressor
    .../indexer.py      CSAIndexer, UnfusedCSAIndexerLoss, _IndexerLossAutoScaler
    .../utils.py        Hadamard

so that an adapter written against this cell also drives the real one. It is a test fixture
(the cell the MindFormers tests and the contract driver run where mindformers is not installed),
not part of hp-cp-mindformers: the adapter takes the cell's helpers from the cell's own module.

It is not a second definition of the cell: with the same weights it computes exactly what the
real cell computes on MindSpore CPU in training mode (output, logged indexer loss, every
gradient), which ``tests/mindformers/test_real_mindformers.py`` checks whenever mindformers is
installed. The interface:

* ``CompressedSparseAttention(config, submodules, layer_number, softmax_scale=None,
  rotary_pos_emb=None, compress_ratio=0)``; ``construct(query, key, x, qr, actual_seq_len=None)``
  and ``_construct_naive(query, key, x, qr, actual_seq_len=None)``.  ``query`` is
  ``[sq, b, np, d]``, ``key`` is ``[sq, b, 1, d]`` (already RoPE'd by the caller, like
  ``DSv4HybridSelfAttention`` does), ``x`` is ``[sq, b, hidden]``, ``qr`` is
  ``[sq, b, q_lora_rank]``; the output is ``[sq, b, np, d]``.
* ``compressor(x, rope_pos_offset=0)`` -> ``[sq // r, b, 1, head_dim]`` or ``None`` if ``sq < r``.
* ``indexer.forward_before_topk(x, qr, query_pos_offset=0)`` and
  ``indexer(q, k, weights, mask=None, ...) -> (topk_indices, topk_scores)``;
  ``indexer.compressor`` is the rotate=True compressor.
* attributes ``attn_sink``, ``squeeze``, ``window_size``, ``compress_ratio``,
  ``enable_compress``, ``enable_indexer``, ``softmax_scale``, ``apply_dsa_kernel_fusion``,
  ``force_unfused`` (the last one does NOT exist on the real 2.1.0 class; it is provided
  because hyper-parallel's CP patch reads it with ``getattr(..., True)``).
* parameter names match the real cell (``attn_sink``, ``compressor.ape``,
  ``compressor.linear_wkv.weight``, ``indexer.compressor.norm.weight`` ...).

Packed input (``actual_seq_len`` given) follows MindFormers' *global grid* convention
(docs/semantics.md section 6, the "global" grid): the compressor runs over the whole
packed stream (blocks ``[g*r, g*r+r)``, slot ``g`` RoPE'd at ``g*r``), a block is valid only if
it lies inside one document (END-based rule), a query sees the valid same-document blocks
with ``(g+1)*r <= p+1``, and the window is clipped at the document start.

Differences from the real cell, all deliberate:

* Only kernels that run on MindSpore 2.10 CPU in PyNative are used, and ``mint.split`` is
  avoided: on 2.10 CPU its backward ignores the storage offset of view gradients (e.g. the
  slices ``cat``'s backward hands back), so ``cat(split(x))`` gets wrong gradients.  Plain
  slicing is used instead.  ``mint.arange``,
  ``mint.full``, ``mint.roll``, ``mint.topk``, ``mint.stack``, ``mint.outer`` and
  ``ops.rms_norm`` have no CPU kernel, so index arrays are built with numpy on the host,
  the overlap shift is a concat, RMSNorm is written out, and top-k runs on the host.
* Top-k is deterministic: descending score, ties broken by the LOWER compressed index
  (numpy stable argsort).  The selected scores are gathered back on device, so they keep
  their gradient (the indices need none).
* The fused NPU path does not exist; ``construct`` always takes ``_construct_naive``.
* RoPE is a plain (non-YaRN) rotary table with the real cell's call convention
  ``rotary_pos_emb(n, offset=...) -> (freqs[n, 1, 1, rd], mscale)`` and MindFormers' MLA
  lane layout (interleaved pairs in, interleaved pairs out).  Pass any cell with that
  convention as ``rotary_pos_emb`` to use another table.
* Parameters get a small seeded random init (fp32) instead of ``mint.empty``/zeros.
* The indexer KL loss is computed only in training mode and only when
  ``config.dsa_indexer_loss_coeff`` is a positive number (the real cell requires the
  coefficient to be set in training); it is attached with the same auto-scaler and the
  last value is kept in ``self.last_indexer_loss`` instead of a global tracker.
"""

from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore import dtype as mstype
from mindspore.common._grad_function import _Function

__all__ = [
    "ReferenceCSAConfig",
    "ReferenceRotaryEmbedding",
    "apply_mla_rope",
    "Linear",
    "RMSNorm",
    "Hadamard",
    "Compressor",
    "CSAIndexer",
    "UnfusedCSAIndexerLoss",
    "CompressedSparseAttention",
    "unfused_compressed_sparse_attn",
    "parse_cu_seqlens",
    "get_window_topk_idxs",
    "get_compress_topk_idxs",
    "get_doc_window_topk_idxs",
    "build_grid_valid_blocks",
    "get_doc_compress_topk_idxs",
    "build_doc_block_mask",
    "stable_topk_indices",
]

_BF16_MIN = -3.3895313892515355e38


# --------------------------------------------------------------------------------------
# configuration (field names are those of mindformers' MLATransformerConfig)
# --------------------------------------------------------------------------------------
@dataclass
class ReferenceCSAConfig:
    """Subset of ``MLATransformerConfig`` read by the CSA cell, with small test defaults.

    A real ``MLATransformerConfig`` can be passed instead; ``seed`` and ``init_std`` are
    then looked up with ``getattr`` defaults.
    """

    hidden_size: int = 64
    num_attention_heads: int = 4
    v_head_dim: int = 32
    qk_pos_emb_head_dim: int = 8
    q_lora_rank: int = 48
    dsa_indexer_n_heads: int = 4
    dsa_indexer_head_dim: int = 16
    dsa_indexer_topk: int = 4
    csa_window_size: int = 8
    layernorm_epsilon: float = 1e-6
    csa_dense_mode: bool = False
    apply_dsa_kernel_fusion: bool = False
    rotary_interleaved: bool = False
    rotary_base: float = 10000.0
    csa_compress_rotary_base: float = 40000.0
    dsa_indexer_loss_coeff: float | None = 0.0
    dsa_indexer_use_sparse_loss: bool = True
    input_layout: str = "BSND"
    num_layers: int = 1
    mtp_num_layers: int = 0
    seed: int = 0
    init_std: float | None = None  # None: fan_in ** -0.5


def _rng_for(config, salt):
    seed = int(getattr(config, "seed", 0) or 0)
    return np.random.default_rng([seed, salt])


def _normal(rng, shape, std):
    return Tensor(rng.standard_normal(shape).astype(np.float32) * np.float32(std))


def _salt(name):
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ len(name)


# --------------------------------------------------------------------------------------
# small building blocks
# --------------------------------------------------------------------------------------
class Linear(nn.Cell):
    """``y = x @ weight.T``, ``weight: [output_size, input_size]`` (mindformers Linear, no bias)."""

    def __init__(self, input_size, output_size, rng, init_std=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        std = init_std if init_std is not None else input_size**-0.5
        self.weight = Parameter(_normal(rng, (output_size, input_size), std), name="weight")

    def construct(self, input_):
        return ops.matmul(input_, ops.transpose(self.weight, (1, 0)))


class RMSNorm(nn.Cell):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` in fp32 (same math as ``ops.rms_norm``)."""

    def __init__(self, dim, eps, rng):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(
            Tensor(1.0 + 0.1 * rng.standard_normal((dim,)).astype(np.float32)), name="weight"
        )

    def construct(self, x):
        x32 = ops.cast(x, mstype.float32)
        out = x32 * ops.rsqrt(mint.mean(x32 * x32, dim=-1, keepdim=True) + self.eps) * self.weight
        return ops.cast(out, x.dtype)


def _hadamard_matrix(n):
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


class Hadamard(nn.Cell):
    """``x @ H.T * head_dim**-0.5`` (scipy's Sylvester Hadamard, as mindformers' ``Hadamard``)."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.hadamard_mat = Tensor(_hadamard_matrix(head_dim), mstype.float32)

    def construct(self, x):
        x = ops.matmul(x, ops.transpose(self.hadamard_mat.astype(x.dtype), (1, 0)))
        return x * self.scale


class _Identity(nn.Cell):
    def construct(self, x):
        return x


class ReferenceRotaryEmbedding(nn.Cell):
    """Plain RoPE table with mindformers' ``RotaryEmbedding`` call convention.

    ``construct(max_seq_len, offset=0) -> (freqs, 1.0)`` with ``freqs: [max_seq_len, 1, 1, dim]``
    holding ``cat([pos * inv_freq, pos * inv_freq])`` for ``pos = offset .. offset+max_seq_len-1``.
    Built on the host (``mint.arange``/``mint.outer`` have no CPU kernel).
    """

    def __init__(self, kv_channels, rotary_base=10000.0):
        super().__init__()
        self.dim = kv_channels
        self.rotary_base = rotary_base
        self.inv_freq_np = (
            1.0 / (rotary_base ** (np.arange(0, kv_channels, 2, dtype=np.float32) / kv_channels))
        ).astype(np.float32)

    def construct(self, max_seq_len, offset=0, position_ids=None):
        if position_ids is not None:
            pos = np.asarray(
                position_ids.asnumpy() if isinstance(position_ids, Tensor) else position_ids,
                np.float32,
            ).reshape(-1) + np.float32(offset)
        else:
            pos = np.arange(int(max_seq_len), dtype=np.float32) + np.float32(offset)
        freqs = np.outer(pos, self.inv_freq_np).astype(np.float32)
        emb = np.concatenate([freqs, freqs], axis=-1)
        return Tensor(emb.reshape(-1, 1, 1, self.dim)), 1.0


def apply_mla_rope(t, freqs, mscale=1.0, inverse=False):
    """mindformers ``ApplyRotaryPosEmb`` with ``rotary_interleaved=False,
    multi_latent_attention=True, mla_output_remove_interleaving=True`` (no fusion).

    ``t: [s, b, n, rd]`` (the RoPE lanes only), ``freqs: [s, 1, 1, rd]`` NeoX-duplicated.
    Pairs ``(t[2i], t[2i+1])`` are rotated by ``freqs[i]`` and written back interleaved.
    """
    s, b, n, rd = t.shape
    origin = t.dtype
    t5 = mint.reshape(t, (s, b, n, rd // 2, 2))
    t_1 = t5[..., 0]
    t_2 = t5[..., 1]
    t = ops.cast(mint.cat((t_1, t_2), dim=-1), mstype.float32)
    cos_ = ops.cos(freqs * mscale)
    sin_ = ops.sin(freqs * mscale)
    if inverse:
        sin_ = -sin_
    half = rd // 2
    h1, h2 = t[..., :half], t[..., half:]
    t_rot = mint.cat((-h2, h1), dim=-1)
    out = t * cos_ + t_rot * sin_
    o_1, o_2 = out[..., :half], out[..., half:]
    out = mint.reshape(
        mint.cat((mint.unsqueeze(o_1, -1), mint.unsqueeze(o_2, -1)), dim=-1), (s, b, n, rd)
    )
    return ops.cast(out, origin)


def stable_topk_indices(scores_np, k):
    """Host top-k: descending score, ties -> lower index first (numpy stable sort)."""
    return np.argsort(-scores_np, axis=-1, kind="stable")[..., :k].astype(np.int32)


# --------------------------------------------------------------------------------------
# Compressor (compressor.py)
# --------------------------------------------------------------------------------------
class Compressor(nn.Cell):
    """Gated pooling compressor; ``construct(x[sq, b, hidden], rope_pos_offset=0)``
    -> ``[sq // r, b, 1, head_dim]`` or ``None`` when ``sq < r``.

    Slot ``j`` pools tokens ``[j*r, j*r + r)`` (plus, for r == 4, the previous block through
    the first ``head_dim`` channels), is RMS-normalised, RoPE'd at position
    ``rope_pos_offset + j*r`` and (indexer branch) Hadamard-rotated.
    """

    def __init__(
        self,
        config,
        submodules=None,
        compress_ratio: int = 4,
        head_dim: int = 32,
        rotate: bool = False,
        rotary_pos_emb: nn.Cell | None = None,
        _salt_name="compressor",
    ):
        super().__init__()
        del submodules
        self.config = config
        self.compress_ratio = compress_ratio
        self.head_dim = head_dim
        self.overlap = compress_ratio == 4
        self.coff = 1 + int(self.overlap)
        self.rotate = rotate
        self.rotary_pos_emb = rotary_pos_emb
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        proj_out_dim = self.coff * head_dim
        rng = _rng_for(config, _salt(_salt_name))
        init_std = getattr(config, "init_std", None)
        self.linear_wkv = Linear(config.hidden_size, proj_out_dim, rng, init_std)
        self.linear_wgate = Linear(config.hidden_size, proj_out_dim, rng, init_std)
        self.ape = Parameter(_normal(rng, (compress_ratio, proj_out_dim), 0.1), name="ape")
        self.norm = RMSNorm(head_dim, config.layernorm_epsilon, rng)
        self.hadamard = Hadamard(head_dim) if rotate else _Identity()

        self.reshape = mint.reshape
        self.softmax = mint.softmax
        self.unsqueeze = mint.unsqueeze
        self.chunk = mint.chunk
        self.split = mint.split
        self.cat = mint.cat
        self.squeeze = mint.squeeze
        self.permute = mint.permute

    def reset_parameter(self):
        self.ape.set_data(_normal(np.random.default_rng(0), tuple(self.ape.shape), 0.01))

    def _overlap_transform(self, tensor, fill_value: float = 0.0):
        """``[n, r, b, 2d] -> [n, 2r, b, d]``: rows ``0..r-1`` of group ``j`` are group ``j-1``'s
        first-half channels (``fill_value`` for ``j == 0``), rows ``r..2r-1`` group ``j``'s
        second half.  Same result as the real ``roll`` + ``[0] = fill`` (``Roll`` has no CPU
        kernel)."""
        half = tensor.shape[-1] // 2
        tensor_prev, tensor_next = tensor[..., :half], tensor[..., half:]
        first = ops.full((1,) + tuple(tensor_prev.shape[1:]), fill_value, dtype=tensor_prev.dtype)
        n = tensor_prev.shape[0]
        # one block: no predecessor to shift in (``tensor_prev[:-1]`` would be a ``[0:0]`` slice,
        # whose CPU backward fails on MindSpore 2.10)
        tensor_prev = first if n == 1 else self.cat([first, tensor_prev[: n - 1]], 0)
        return self.cat([tensor_prev, tensor_next], 1)

    def construct(self, x, rope_pos_offset: int = 0):
        sq, b, _ = x.shape
        ratio = self.compress_ratio
        if sq < ratio:
            return None
        kv = self.linear_wkv(x)
        score = self.linear_wgate(x)
        cutoff = (sq // ratio) * ratio
        if cutoff < sq:
            kv = kv[:cutoff]
            score = score[:cutoff]
        n_compressed = cutoff // ratio
        kv = self.reshape(kv, (n_compressed, ratio, b, -1))
        score = self.reshape(score, (n_compressed, ratio, b, -1))
        score_f32 = ops.cast(score, mstype.float32) + self.reshape(self.ape, (1, ratio, 1, -1))
        if self.overlap:
            kv = self._overlap_transform(kv, fill_value=0.0)
            score_f32 = self._overlap_transform(score_f32, fill_value=float("-inf"))
        weights = self.softmax(score_f32, dim=1)
        pooled = (ops.cast(kv, mstype.float32) * weights).sum(axis=1)
        pooled = self.norm(ops.cast(pooled, x.dtype))
        if self.rotary_pos_emb is not None:
            pooled = self._apply_rope(pooled, rope_pos_offset=rope_pos_offset)
        pooled = self.hadamard(pooled)
        return self.unsqueeze(pooled, -2)

    def _apply_rope(self, kv, rope_pos_offset: int = 0):
        n_compressed, _, d = kv.shape
        total_seq_len = n_compressed * self.compress_ratio
        freqs, _ = self.rotary_pos_emb(total_seq_len, offset=rope_pos_offset)
        if self.compress_ratio > 1:
            freqs = freqs[: total_seq_len : self.compress_ratio][:n_compressed]
        kv_4d = self.unsqueeze(kv, -2)
        nope = d - self.qk_pos_emb_head_dim
        kv_nope, kv_pe = kv_4d[..., :nope], kv_4d[..., nope:]
        kv_pe = apply_mla_rope(kv_pe, freqs, 1.0)
        out = self.cat([kv_nope, kv_pe], dim=-1)
        return self.squeeze(out, -2)


# --------------------------------------------------------------------------------------
# Lightning indexer (indexer.py)
# --------------------------------------------------------------------------------------
class CSAIndexer(nn.Cell):
    """CSA lightning indexer (unfused path only)."""

    def __init__(
        self, config, submodules=None, compress_ratio: int = 4, rotary_pos_emb: nn.Cell = None
    ):
        super().__init__()
        del submodules
        self.config = config
        self.sparse_mode = 3
        self.compress_ratio = compress_ratio
        self.rotary_pos_emb = rotary_pos_emb
        self.input_layout = getattr(config, "input_layout", "BSND")
        self.is_tnd = False  # only true on the fused path
        self.hidden_size = config.hidden_size
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        self.q_lora_rank = (
            config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        )
        self.index_n_heads = config.dsa_indexer_n_heads
        self.index_head_dim = config.dsa_indexer_head_dim
        self.index_topk = config.dsa_indexer_topk
        self.sparse_loss = config.dsa_indexer_use_sparse_loss
        self.softmax_scale = self.index_head_dim**-0.5
        self.compute_dtype = mstype.float32
        self.apply_dsa_kernel_fusion = False
        self.index_head_scale = self.index_n_heads**-0.5
        rng = _rng_for(config, _salt("indexer"))
        init_std = getattr(config, "init_std", None)
        self.linear_wq_b = Linear(
            self.q_lora_rank, self.index_n_heads * self.index_head_dim, rng, init_std
        )
        self.compressor = Compressor(
            config,
            None,
            compress_ratio=compress_ratio,
            head_dim=self.index_head_dim,
            rotate=True,
            rotary_pos_emb=rotary_pos_emb,
            _salt_name="indexer.compressor",
        )
        self.linear_weights_proj = Linear(self.hidden_size, self.index_n_heads, rng, init_std)
        self.hadamard = Hadamard(self.index_head_dim)

        self.cast = ops.cast
        self.reshape = mint.reshape
        self.split = mint.split
        self.cat = mint.concat
        self.permute = mint.permute
        self.bmm = mint.matmul
        self.relu = mint.nn.functional.relu
        self.unsqueeze = mint.unsqueeze
        self.sum = mint.sum

    def forward_before_topk(self, x, qr, query_pos_offset: int = 0):
        """-> ``q [b, s, n_idx, Di]``, ``k [b, s//r, 1, Di]``, ``weights [b, s, n_idx]``."""
        seqlen, bsz, _ = x.shape
        freqs, _ = self.rotary_pos_emb(seqlen, offset=query_pos_offset)
        q = self.linear_wq_b(qr)
        q = self.reshape(q, (seqlen, bsz, self.index_n_heads, self.index_head_dim))
        nope = self.index_head_dim - self.qk_pos_emb_head_dim
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        q_pe = apply_mla_rope(q_pe, freqs, 1)
        q = self.cat([q_nope, q_pe], dim=-1)
        q = self.hadamard(q)
        k = self.compressor(x)
        weights = self.linear_weights_proj(x)
        weights = weights * self.index_head_scale
        weights = weights * self.softmax_scale
        weights = self.permute(weights, (1, 0, 2))
        q = self.permute(q, (1, 0, 2, 3))
        k = self.permute(k, (1, 0, 2, 3))
        return q, k, weights

    def construct(self, q, k, weights, mask=None, actual_seq_qlen=None, actual_seq_klen=None):
        """-> ``(topk_indices int32 [b, sq, k_eff], topk_scores [b, sq, k_eff])``,
        ``k_eff = min(index_topk, n_compressed)``; masked entries score ``-inf``."""
        del actual_seq_qlen, actual_seq_klen
        effective_topk = min(self.index_topk, int(k.shape[1]))
        q = self.cast(q, mstype.float32)
        k = self.cast(k, mstype.float32)
        weights = self.cast(weights, mstype.float32)
        b, sq, n, d = q.shape
        sk = k.shape[1]
        q = self.reshape(q, (b, sq * n, d))
        k = self.permute(self.reshape(k, (b, sk, d)), (0, 2, 1))
        index_scores = self.bmm(q, k)
        index_scores = self.reshape(index_scores, (b, sq, n, sk))
        index_scores = self.relu(index_scores)
        index_scores = index_scores * self.unsqueeze(weights, -1)
        index_scores = self.sum(index_scores, dim=2)
        if mask is not None:
            index_scores = index_scores + self.cast(mask, mstype.float32)
        # deterministic host top-k (mint.topk has no CPU kernel; ops.topk is not stable)
        idx_np = stable_topk_indices(index_scores.asnumpy(), effective_topk)
        topk_indices = Tensor(idx_np, mstype.int32)
        topk_scores = mint.gather(index_scores, -1, Tensor(idx_np.astype(np.int64)))
        return topk_indices, topk_scores


class _IndexerLossAutoScaler(_Function):
    """Identity on ``output``; backward seeds ``indexer_loss`` with ``main_loss_backward_scale``."""

    main_loss_backward_scale: Tensor = Tensor(1.0)

    @staticmethod
    def forward(ctx, output, indexer_loss):
        ctx.indexer_loss = ops.stop_gradient(indexer_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        scale = _IndexerLossAutoScaler.main_loss_backward_scale
        return grad_output, ops.ones_like(ctx.indexer_loss) * scale

    @staticmethod
    def set_loss_scale(scale):
        _IndexerLossAutoScaler.main_loss_backward_scale = scale


class UnfusedCSAIndexerLoss(nn.Cell):
    """Indexer KL loss of the unfused CSA path (same formula as mindformers 2.1.0)."""

    def __init__(self, softmax_scale, loss_coeff=1.0, sparse_loss=True):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.loss_coeff = loss_coeff
        self.sparse_loss = sparse_loss

    def construct(self, index_scores, topk_indices, query, key, mask=None):
        eps = 1.0e-9
        sq, b, _, _ = query.shape
        sk = key.shape[0]
        query = mint.permute(query, (1, 2, 0, 3))  # [b, np, sq, d]
        key = mint.permute(key, (1, 2, 3, 0))  # [b, 1, d, sk]
        attention_scores = mint.matmul(query, key) * self.softmax_scale
        if mask is None:
            causal_mask = Tensor(
                np.triu(np.full((sq, sk), -np.inf, np.float32), k=1).reshape(1, 1, sq, sk)
            )
        else:
            causal_mask = mint.reshape(ops.cast(mask, mstype.float32), (-1, 1, sq, sk))
        max_valid_idx = sk - 1
        replacement = ops.full(topk_indices.shape, max_valid_idx, dtype=topk_indices.dtype)
        clean_indices = mint.where(topk_indices == -1, replacement, topk_indices)
        clean_indices = ops.cast(mint.clamp(clean_indices, 0, max_valid_idx), mstype.int64)
        selection_mask = ops.full((b, sq, sk), float("-inf"), dtype=mstype.float32)
        selection_mask = mint.scatter(selection_mask, -1, clean_indices, 0.0)
        invalid = (causal_mask < 0) | (mint.unsqueeze(selection_mask, 1) < 0)
        bf16_min = ops.full(attention_scores.shape, _BF16_MIN, dtype=attention_scores.dtype)
        attention_scores = mint.where(invalid, bf16_min, attention_scores)
        attention_scores = mint.softmax(ops.cast(attention_scores, mstype.float32), dim=-1)
        attention_scores = mint.sum(attention_scores, dim=1)
        attention_scores = attention_scores / mint.maximum(
            mint.sum(attention_scores, -1, keepdim=True), Tensor(1.0e-12, mstype.float32)
        )
        selected_target = mint.gather(attention_scores, -1, clean_indices)
        finite_min = ops.full(index_scores.shape, _BF16_MIN, dtype=index_scores.dtype)
        index_scores = mint.where(mint.isfinite(index_scores), index_scores, finite_min)
        predicted = mint.softmax(ops.cast(index_scores, mstype.float32), dim=-1)
        target_sum = mint.sum(selected_target, dim=-1, keepdim=True)
        normalized_target = selected_target / (target_sum + eps)
        log_target = mint.log(mint.maximum(normalized_target, Tensor(eps, mstype.float32)))
        log_predicted = mint.log(predicted + eps)
        kl_div = mint.mean(mint.sum((log_target - log_predicted) * selected_target, dim=-1))
        return kl_div * self.loss_coeff


# --------------------------------------------------------------------------------------
# index helpers (csa.py) -- host numpy, identical values to the real helpers
# --------------------------------------------------------------------------------------
def _bcast(idx_np, batch_size):
    t = Tensor(np.ascontiguousarray(idx_np), mstype.int32)
    seqlen, width = idx_np.shape
    return mint.unsqueeze(t, 0).broadcast_to((batch_size, seqlen, width))


def parse_cu_seqlens(actual_seq_len, t_global):
    """Reduce a padded cumulative doc-end vector to host cu_seqlens (ends only, no leading 0)."""
    if actual_seq_len is None:
        return None
    arr = (
        actual_seq_len.asnumpy()
        if isinstance(actual_seq_len, Tensor)
        else np.asarray(actual_seq_len)
    )
    ends = np.unique(arr.reshape(-1)).tolist()
    ends = [int(e) for e in ends if 0 < int(e) <= t_global]
    if not ends or ends[-1] != t_global:
        ends.append(t_global)
    return ends if len(ends) > 1 else None


def get_window_topk_idxs(window_size, batch_size, seqlen):
    """``[b, s, W]``: row t = ``max(0, t-W+1) + 0..W-1``, entries ``> t`` set to -1."""
    base = np.arange(seqlen, dtype=np.int32)[:, None]
    matrix = np.maximum(base - window_size + 1, 0) + np.arange(window_size, dtype=np.int32)[None, :]
    matrix = np.where(matrix > base, -1, matrix).astype(np.int32)
    return _bcast(matrix, batch_size)


def get_compress_topk_idxs(ratio, batch_size, seqlen, offset):
    """``[b, s, s//r]``: ``j + offset`` if ``j < (t+1)//r`` else -1."""
    n_compressed = seqlen // ratio
    matrix = np.tile(np.arange(n_compressed, dtype=np.int32)[None, :], (seqlen, 1))
    visible = (np.arange(1, seqlen + 1, dtype=np.int32) // ratio)[:, None]
    matrix = np.where(matrix >= visible, -1, matrix + offset).astype(np.int32)
    return _bcast(matrix, batch_size)


def get_doc_window_topk_idxs(
    window_size, batch_size, seqlen, cu_seqlens, pos_offset=0, ori_halo_len=0
):
    """Doc-aware sliding-window indices (window clipped at the document start)."""
    ends = list(cu_seqlens)
    starts = [0] + ends[:-1]

    def doc_start(p):
        for st, en in zip(starts, ends):
            if st <= p < en:
                return st
        return p

    idx = np.full((seqlen, window_size), -1, np.int32)
    for i in range(seqlen):
        p = pos_offset + i
        lo = max(doc_start(p), p - window_size + 1)
        n = p - lo + 1
        idx[i, :n] = np.arange(lo, p + 1, dtype=np.int32) - pos_offset + ori_halo_len
    return _bcast(idx, batch_size)


def build_grid_valid_blocks(ratio, cu_seqlens):
    """Global grid block ``g`` (tokens ``[g*r, g*r+r)``) is valid iff it ends inside the
    document that contains its first token (END-based rule)."""
    ends = list(cu_seqlens)
    starts = [0] + ends[:-1]
    nblocks = ends[-1] // ratio
    valid = np.zeros(nblocks, bool)
    block_doc = np.full(nblocks, -1, np.int32)
    for g in range(nblocks):
        g0 = g * ratio
        for d, (st, en) in enumerate(zip(starts, ends)):
            if st <= g0 < en:
                block_doc[g] = d
                valid[g] = g0 + ratio <= en
                break
    return valid, block_doc


def _doc_of_fn(cu_seqlens):
    ends = list(cu_seqlens)
    starts = [0] + ends[:-1]

    def doc_of(p):
        for d, (st, en) in enumerate(zip(starts, ends)):
            if st <= p < en:
                return d
        return -1

    return doc_of


def get_doc_compress_topk_idxs(
    ratio, batch_size, seqlen, offset, cu_seqlens, pos_offset=0, compact=False, n_compressed=None
):
    """Doc-aware dense compressed indices (global-grid path)."""
    valid, block_doc = build_grid_valid_blocks(ratio, cu_seqlens)
    doc_of = _doc_of_fn(cu_seqlens)
    nblocks = len(valid)
    width = n_compressed if n_compressed is not None else nblocks
    slot = np.cumsum(valid) - 1 if compact else np.arange(nblocks)
    idx = np.full((seqlen, width), -1, np.int32)
    anchors = (np.arange(nblocks, dtype=np.int32) + 1) * ratio
    for i in range(seqlen):
        p = pos_offset + i
        vis = valid & (block_doc == doc_of(p)) & (anchors <= p + 1)
        idx[i, :nblocks][vis] = slot[vis].astype(np.int32) + offset
    return _bcast(idx, batch_size)


def build_doc_block_mask(ratio, seqlen, cu_seqlens, pos_offset=0, n_compressed=None, compact=False):
    """Doc-aware additive mask ``[s, n_compressed]`` (0 visible, -inf otherwise)."""
    valid, block_doc = build_grid_valid_blocks(ratio, cu_seqlens)
    nblocks = len(valid)
    n_compressed = nblocks if n_compressed is None else n_compressed
    doc_of = _doc_of_fn(cu_seqlens)
    anchors = (np.arange(nblocks, dtype=np.int64) + 1) * ratio
    grid = np.full((seqlen, nblocks), -np.inf, np.float32)
    for i in range(seqlen):
        p = pos_offset + i
        vis = valid & (block_doc == doc_of(p)) & (anchors <= p + 1)
        grid[i][vis] = 0.0
    mask = np.full((seqlen, n_compressed), -np.inf, np.float32)
    if compact:
        nvalid = int(valid.sum())
        mask[:, :nvalid] = grid[:, valid]
    else:
        mask[:, :nblocks] = grid
    return Tensor(mask, mstype.float32)


# --------------------------------------------------------------------------------------
# sparse attention with sink (csa.py: unfused_compressed_sparse_attn)
# --------------------------------------------------------------------------------------
def unfused_compressed_sparse_attn(query, kv_full, attn_sink, topk_indices, softmax_scale):
    """``query [sq, b, n, d]``, ``kv_full [sk, b, 1, d]``, ``topk_indices [b, sq, K]`` (-1 = empty)
    -> ``[sq, b, n, d]``.  Softmax over the K gathered keys plus a value-less sink logit
    ``attn_sink[h]``, with ``m = max(max_i s_i, sink)``; invalid keys get ``-1e30`` added."""
    sq, b, n, d = query.shape
    kv_t = mint.permute(kv_full, (1, 2, 0, 3))
    safe_indices = ops.cast(mint.clamp(topk_indices, min=0), mstype.int64)
    topk = safe_indices.shape[-1]
    sk = kv_full.shape[0]
    kv_flat = mint.reshape(kv_t, (b * sk, d))
    batch_offset = Tensor((np.arange(b, dtype=np.int64) * sk).reshape(b, 1, 1))
    flat_indices = mint.reshape(safe_indices + batch_offset, (-1,))
    kv_gathered = mint.reshape(kv_flat[flat_indices], (b, sq, topk, d))

    q = ops.cast(mint.permute(query, (1, 2, 0, 3)), mstype.float32)
    kv_g = ops.cast(kv_gathered, mstype.float32)
    q_bm = mint.reshape(mint.permute(q, (0, 2, 1, 3)), (b * sq, n, d))
    kv_bm = mint.reshape(mint.permute(kv_g, (0, 1, 3, 2)), (b * sq, d, topk))
    scores = mint.reshape(mint.bmm(q_bm, kv_bm), (b, sq, n, topk))
    scores = mint.permute(scores, (0, 2, 1, 3)) * softmax_scale

    invalid_mask = mint.unsqueeze(topk_indices < 0, 1)
    scores = scores + ops.cast(invalid_mask, scores.dtype) * -1e30

    sink = ops.cast(mint.reshape(attn_sink, (1, n, 1, 1)), mstype.float32)
    scores_max, _ = mint.max(scores, dim=-1, keepdim=True)
    scores_max = mint.maximum(scores_max, sink)
    exp_scores = mint.exp(scores - scores_max)
    exp_sink = mint.exp(sink - scores_max)
    sum_exp = mint.sum(exp_scores, dim=-1, keepdim=True) + exp_sink
    attn_weights = exp_scores / sum_exp

    aw_bm = mint.reshape(mint.permute(attn_weights, (0, 2, 1, 3)), (b * sq, n, topk))
    kvo_bm = mint.reshape(kv_g, (b * sq, topk, d))
    output = mint.reshape(mint.bmm(aw_bm, kvo_bm), (b, sq, n, d))
    output = mint.permute(output, (0, 2, 1, 3))
    output = ops.cast(output, query.dtype)
    return mint.permute(output, (2, 0, 1, 3))


# --------------------------------------------------------------------------------------
# the cell
# --------------------------------------------------------------------------------------
class CompressedSparseAttention(nn.Cell):
    """DeepSeek-V4 hybrid core attention (window + compressed + attention sink), reference.

    Args mirror mindformers 2.1.0: ``(config, submodules, layer_number, softmax_scale=None,
    rotary_pos_emb=None, compress_ratio=0)``.  ``submodules`` is ignored (may be ``None``);
    if ``rotary_pos_emb`` is ``None`` a ``ReferenceRotaryEmbedding`` is built with base
    ``csa_compress_rotary_base`` (ratio > 1) or ``rotary_base``.
    """

    def __init__(
        self,
        config=None,
        submodules=None,
        layer_number: int = 1,
        softmax_scale: float | None = None,
        rotary_pos_emb: nn.Cell | None = None,
        compress_ratio: int = 0,
    ) -> None:
        super().__init__()
        if config is None:
            config = ReferenceCSAConfig()
        if compress_ratio not in (0, 4, 128):
            raise ValueError(f"compress_ratio must be one of 0, 4, 128, got {compress_ratio}")
        if getattr(config, "apply_dsa_kernel_fusion", False):
            raise ValueError("reference cell has no fused path; set apply_dsa_kernel_fusion=False")
        del submodules
        self.config = config
        self.layer_number = layer_number
        self.compress_ratio = compress_ratio
        if rotary_pos_emb is None:
            base = config.csa_compress_rotary_base if compress_ratio > 1 else config.rotary_base
            rotary_pos_emb = ReferenceRotaryEmbedding(config.qk_pos_emb_head_dim, base)
        self.rotary_pos_emb = rotary_pos_emb
        self.layout = getattr(config, "input_layout", "BSND")
        self.is_tnd = self.layout == "TND"
        self.dsa_indexer_loss_coeff = getattr(config, "dsa_indexer_loss_coeff", 0.0)
        self.sparse_loss = getattr(config, "dsa_indexer_use_sparse_loss", True)

        self.softmax_scale = softmax_scale or config.v_head_dim**-0.5
        self.ori_mask_mode = 4
        self.cmp_mask_mode = 3
        self.ori_win_left = config.csa_window_size - 1
        self.ori_win_right = 0
        self.window_size = config.csa_window_size
        self.apply_dsa_kernel_fusion = False
        self.force_unfused = True  # not on the real 2.1.0 class; read by hyper-parallel's CP patch

        rng = _rng_for(config, _salt("attn_sink") + layer_number)
        self.attn_sink = Parameter(
            _normal(rng, (config.num_attention_heads,), 0.5), name="attn_sink"
        )

        if compress_ratio > 0:
            self.enable_compress = True
            self.compressor = Compressor(
                config,
                None,
                compress_ratio=compress_ratio,
                head_dim=config.v_head_dim,
                rotate=False,
                rotary_pos_emb=self.rotary_pos_emb,
            )
        else:
            self.enable_compress = False
            self.compressor = None

        if compress_ratio == 4 and not config.csa_dense_mode:
            self.enable_indexer = True
            self.indexer = CSAIndexer(
                config, None, compress_ratio=compress_ratio, rotary_pos_emb=self.rotary_pos_emb
            )
            self.indexer_loss_auto_scaler = _IndexerLossAutoScaler()
            self.unfused_indexer_loss = UnfusedCSAIndexerLoss(
                softmax_scale=self.softmax_scale,
                loss_coeff=self.dsa_indexer_loss_coeff,
                sparse_loss=self.sparse_loss,
            )
        else:
            self.enable_indexer = False
            self.indexer = None
            self.indexer_loss_auto_scaler = None
            self.unfused_indexer_loss = None
        self.last_indexer_loss = None

        self.squeeze = mint.squeeze
        self.reshape = mint.reshape
        self.unsqueeze = mint.unsqueeze
        self.cat = mint.cat
        self.permute = mint.permute
        self.where = mint.where

    def reset_parameter(self):
        self.attn_sink.set_data(ops.zeros(self.attn_sink.shape, mstype.float32))

    def bsnd_to_tnd(self, x):
        b, s, n, d = x.shape
        return self.reshape(x, (b * s, n, d))

    def construct(self, query, key, x, qr, actual_seq_len=None):
        """``query [sq, b, np, d]``, ``key [sq, b, 1, d]``, ``x [sq, b, hidden]``,
        ``qr [sq, b, q_lora_rank]``, optional ``actual_seq_len`` (cumulative document ends of
        the packed stream) -> ``[sq, b, np, d]``."""
        return self._construct_naive(query, key, x, qr, actual_seq_len)

    def _construct_naive(self, query, key, x, qr, actual_seq_len=None):
        sq, b, _, _ = query.shape
        ratio = self.compress_ratio
        cu_seqlens = parse_cu_seqlens(actual_seq_len, sq * b)
        # --- Step 1: compression -> concatenated KV space
        compressed_kv = self.compressor(x) if self.enable_compress else None
        if compressed_kv is not None:
            kv_full = self.cat([key, compressed_kv], dim=0)
            n_compressed = int(compressed_kv.shape[0])
        else:
            kv_full = key
            n_compressed = 0
        offset = sq

        # --- Step 2: sliding-window indices (into ori_kv)
        if cu_seqlens is not None:
            window_idxs = get_doc_window_topk_idxs(self.window_size, b, sq, cu_seqlens)
        else:
            window_idxs = get_window_topk_idxs(self.window_size, b, sq)

        # --- Step 3: compressed indices (+ indexer KL loss in training)
        indexer_loss = None
        if ratio > 1 and n_compressed > 0:
            if self.enable_indexer:
                x_detach = ops.stop_gradient(x)
                qr_detach = ops.stop_gradient(qr)
                query_index, key_index, weights = self.indexer.forward_before_topk(
                    x_detach, qr_detach
                )
                positions_np = np.arange(1, sq + 1, dtype=np.int32)[:, None]
                if cu_seqlens is not None:
                    causal_mask = build_doc_block_mask(ratio, sq, cu_seqlens)
                else:
                    future = np.arange(n_compressed, dtype=np.int32)[None, :] >= (
                        positions_np // ratio
                    )
                    causal_mask = Tensor(np.where(future, -np.inf, 0.0).astype(np.float32))
                causal_mask = self.reshape(causal_mask, (1, sq, n_compressed))

                topk_indices_compressed, index_scores = self.indexer(
                    query_index, key_index, weights, mask=causal_mask
                )
                coeff = self.dsa_indexer_loss_coeff
                if self.training and coeff is not None and coeff > 0:
                    indexer_loss = self.unfused_indexer_loss(
                        index_scores,
                        topk_indices_compressed,
                        ops.stop_gradient(query),
                        ops.stop_gradient(compressed_kv),
                        mask=causal_mask,
                    )
                    self.last_indexer_loss = ops.stop_gradient(indexer_loss)

                if cu_seqlens is not None:
                    valid = mint.isfinite(index_scores)
                else:
                    n_valid = Tensor((positions_np // ratio)[None], mstype.int32)  # [1, sq, 1]
                    valid = topk_indices_compressed < n_valid
                neg_one = ops.full(topk_indices_compressed.shape, -1, dtype=mstype.int32)
                compress_topk_idxs = self.where(valid, topk_indices_compressed + offset, neg_one)
            elif cu_seqlens is not None:
                compress_topk_idxs = get_doc_compress_topk_idxs(ratio, b, sq, offset, cu_seqlens)
            else:
                compress_topk_idxs = get_compress_topk_idxs(ratio, b, sq, offset)
            topk_idxs = self.cat([window_idxs, compress_topk_idxs], dim=-1)
        else:
            topk_idxs = window_idxs

        # --- Step 4: differentiable sparse attention
        output = unfused_compressed_sparse_attn(
            query, kv_full, self.attn_sink, topk_idxs, self.softmax_scale
        )

        # --- Step 5: attach the KL loss (training, ratio == 4)
        if indexer_loss is not None and self.training:
            output = self.indexer_loss_auto_scaler.apply(output, indexer_loss)
        return output
