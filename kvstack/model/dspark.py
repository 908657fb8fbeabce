"""DSpark, DeepSeek-V4.1's draft model for speculative decoding: the `mtp.*` stages of
the published checkpoint, computed as DeepSeek's V4.1 code computes them.

At decode position p the target has run token p and chosen token p+1. The draft proposes
the block after it in one pass:
- stage 0 projects the target layers' attention inputs (`dspark_target_layer_ids`, each the
  mean of the residual copies) at the last `window` positions: `main_norm(main_proj(h))`;
- every stage is a window-only V4.1 layer (single-pass hyper-connections, a MoE with the
  draft's own expert counts) whose attention reads two things: its own window keys made
  from that projection at positions p-W+1..p, and the draft block itself, the token p+1
  then `dspark_block_size - 1` noise tokens at positions p+1.., every query seeing the
  whole window and the whole block;
- the last stage's norm and the target's head give the block's logits; a low-rank Markov
  head adds the previous token's bias to each position's logits, so the block's tokens are
  chosen one after another, and a confidence head scores each position from its state and
  that Markov embedding.

The draft shares the target's embedding and head. It is not on the decode path: the
engine's draft-verify loop is what would call it.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvstack import native
from kvstack.config import LayerSpec, ModelConfig
from kvstack.formats import straight_through
from kvstack.model.model import (
    Attention,
    DenseFFN,
    HyperConnection,
    MoE,
    RMSNorm,
    StepContext,
    c_matrix,
    fused_ffn,
    rotate,
    token_positions,
)
from kvstack.model.packed import PackedLinear

if TYPE_CHECKING:
    from kvstack.model.model import Model


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of logits [B, vocab]: [B]."""
    return logits.argmax(-1)


# The most the Markov head's kept rows hold (`Draft.markov_bias`): all of a small
# vocabulary's, the last 64 tokens' of V4.1's 129,280.
MARKOV_ROWS_BYTES = 32 << 20

# What the draft's projections ask of a step: nothing (no instruments); only read.
PLAIN_STEP = StepContext()


class DraftAttention(Attention):
    """A draft stage's attention: window-only, its window keys made from the target's
    projected states, its queries the draft block's, attending the window and the whole
    block (no causal mask inside the block)."""

    def entries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys (and values) of states x [B, n, dim] at positions [P, n]: [B, n, D], rounded
        to the window format as the ring holds them."""
        kv = rotate(self.kv_norm(self.wkv(x)), positions, self.freqs)
        fmt = self.config.window_format
        if native.fuses(kv) and native.decodes(fmt):  # the same values, in one C pass
            return native.quantize(kv, fmt, rows=False)[1]
        return straight_through(kv, fmt)  # (a draft in training learns through the rounding)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                window: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Block states x [B, K, dim] at positions [P, K]; window [B, W, D] (`entries` of
        the target's projected states); padding [B, W]: True at window slots no entry
        fills (a shorter window, left-padded to W), which no query reads: [B, K, dim]."""
        c = self.config
        matrices = self._c_matrices(x)
        if matrices is not None:  # the projections in (and out, below) as one C call each
            _, q, block_kv = native.attention_in(
                x, positions, matrices[0], self.q_norm.weight, matrices[1], matrices[2],
                self.kv_norm.weight, c.norm_eps, self.freqs, self.n_local_heads)
            block_kv = native.quantize(block_kv, c.window_format, rows=False)[1]
        else:
            qr = self.q_norm(self.wq_a(x))
            q = rotate(self.wq_b(qr).unflatten(-1, (self.n_local_heads, c.head_dim)),
                       positions, self.freqs)  # [B, K, H, D]
            block_kv = self.entries(x, positions)
        if native.fuses(q, window, block_kv):  # an engine step's: one C call
            pad = (padding.sum(1) if padding is not None
                   else torch.zeros(x.shape[0], dtype=torch.int64))
            out = native.draft_attention(q, window, block_kv, pad, self.sink,
                                         c.head_dim**-0.5)
        else:
            out = self._attend(q, window, block_kv, padding)
        if matrices is not None:
            return native.attention_out(out, positions, self.freqs, matrices[3],
                                        self.local_groups, matrices[4], None, self.c_calls,
                                        spent=True)
        return self.project_out(out, positions)

    def _attend(self, q: torch.Tensor, window: torch.Tensor, block_kv: torch.Tensor,
                padding: torch.Tensor | None) -> torch.Tensor:
        """The block's queries q [B, K, H, D] over the window [B, W, D] (padding as
        `forward`'s) and the block's entries [B, K, D], by torch's ops: [B, K, H, D]."""
        c = self.config
        kv = torch.cat((window, block_kv), dim=1).float()  # [B, W + K, D]
        logits = torch.einsum("bqhd,bkd->bhqk", q.float(), kv) * c.head_dim**-0.5
        if padding is not None:
            unread = torch.cat((padding, padding.new_zeros(padding.shape[0], q.shape[1])), 1)
            logits = logits.masked_fill(unread[:, None, None, :], float("-inf"))
        sink = self.sink.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("bhqk,bkd->bqhd", probs, kv)  # [B, K, H, D]

    def _c_matrices(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The projections' matrices where they run in C, as the trunk's
        (`Attention._c_projections_for`: an engine step with the C kernels, a few rows),
        and the window format has a C coding; else None."""
        if not native.decodes(self.config.window_format):
            return None
        return self._c_projections_for(x, PLAIN_STEP)


class DraftStage(nn.Module):
    """One `mtp.<s>` stage: a window-only V4.1 layer with `DraftAttention`, built as the
    trunk's layers are: a MoE or a dense feed-forward, single-pass hyper-connections or
    (one residual copy) a plain pre-norm residual."""

    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        """config: the draft's (its expert counts in the trunk's keys)."""
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = DraftAttention(config, spec)
        self.ffn = (MoE(config) if config.uses_moe
                    else DenseFFN(config.dim, config.inter_dim, config.swiglu_limit))
        self.hc_attn = HyperConnection(config) if config.hc_mult > 1 else None
        self.hc_ffn = HyperConnection(config) if config.hc_mult > 1 else None
        self.c_calls: dict = {}  # the feed-forward half's kept C call (`fused_ffn`)

    def forward(self, x: torch.Tensor, mix: torch.Tensor | None, positions: torch.Tensor,
                window: torch.Tensor, padding: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, K, h, dim] and the `pre` mix [B, K, h] that collapses it (single-pass, as
        the trunk's layers): the stage's output and the mix for the next sub-layer. One
        residual copy: x [B, K, dim], no mix. window, padding: `DraftAttention`'s."""
        if self.hc_attn is None or self.hc_ffn is None:
            staged = self._in_c(x, positions, window, padding)
            if staged is not None:
                return staged, None
            x = x + self.attn(self.attn_norm(x), positions, window, padding)
            fused = fused_ffn(self, x, None, self.c_calls)
            return (fused[0] if fused is not None else x + self.ffn(self.ffn_norm(x))), None
        attn_pre, post, comb = self.hc_attn.mixes(x)
        y = HyperConnection.collapse(x, mix)
        x = self.hc_attn.post(self.attn(self.attn_norm(y), positions, window, padding), x,
                              post, comb)
        fused = fused_ffn(self, x, attn_pre, self.c_calls)
        if fused is not None:
            return fused
        ffn_pre, post, comb = self.hc_ffn.mixes(x)
        y = HyperConnection.collapse(x, attn_pre)
        return self.hc_ffn.post(self.ffn(self.ffn_norm(y)), x, post, comb), ffn_pre

    def _in_c(self, x: torch.Tensor, positions: torch.Tensor, window: torch.Tensor,
              padding: torch.Tensor | None) -> torch.Tensor | None:
        """The stage (one residual copy) as one C call (`native.draft_stage`: the kernels
        the modules' own calls run, in their order) where its attention's projections and
        its feed-forward half would each run in C; else None."""
        attn, ffn = self.attn, self.ffn
        matrices = attn._c_matrices(x)
        parts = ffn.fused_parts(x) if matrices is not None else None
        norms = (self.attn_norm.weight, attn.q_norm.weight, attn.kv_norm.weight,
                 self.ffn_norm.weight)
        if parts is None or not native.fuses(window, *norms):
            return None
        c = attn.config
        pad = (padding.sum(1) if padding is not None
               else torch.zeros(x.shape[0], dtype=torch.int64))
        return native.draft_stage(
            x, positions, norms[0], self.attn_norm.eps, matrices, norms[1], norms[2],
            attn.freqs, attn.n_local_heads, attn.local_groups, c.window_format, window,
            max(c.window_size, window.shape[1]), pad, attn.sink, c.head_dim**-0.5,
            native.DraftFFN(norms[3], self.ffn_norm.eps, *parts, ffn.limit), self.c_calls)


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [B, K + 1]: the given token, then the K proposed
    logits: torch.Tensor  # [B, K, vocab]: position i's, Markov bias included (float32)
    confidence: torch.Tensor  # [B, K]: the confidence head's logit for each position


class Draft(nn.Module):
    """DSpark's stages and heads (`mtp.0.main_*` on the first stage, `mtp.<last>.norm`,
    `markov_head`, `confidence_head` on the last, in the published layout)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = self.config = config
        routed, active = c.draft_experts
        stage_config = c.replace(n_routed_experts=routed, n_activated_experts=active)
        self.main_proj = nn.Linear(len(c.dspark_target_layer_ids) * c.dim, c.dim, bias=False)
        self.main_norm = RMSNorm(c.dim, c.norm_eps)
        self.stages = nn.ModuleList(DraftStage(stage_config, spec) for spec in c.draft_layers)
        self.norm = RMSNorm(c.dim, c.norm_eps)
        r = c.dspark_markov_rank
        self.markov_embed = nn.Embedding(c.vocab_size, r)
        self.markov_head: nn.Linear | PackedLinear = nn.Linear(r, c.vocab_size, bias=False)
        self.confidence = nn.Linear(c.dim + r, 1, bias=False)
        # The Markov head's rows kept by token (`markov_bias`), and the weights they are of.
        self._markov_rows: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._markov_stamp: tuple = ()
        # The Markov head transposed, float32 [rank, vocab] (`_kept_markov_columns`).
        self._markov_columns: torch.Tensor | None = None

    def forward(self, model: "Model", target_hidden: torch.Tensor, token: torch.Tensor,
                position: int | torch.Tensor,
                sample: Callable[[torch.Tensor], torch.Tensor] = greedy) -> DraftBlock:
        """One draft block at decode position p = `position` (an int, or [B] per sequence),
        as DeepSeek's `forward_spec` makes it:
        target_hidden [B, W, len(targets) * dim]: the target layers' attention inputs
          (`ModelOutput.target_hidden`) at positions p-W+1..p, W = min(window, p + 1);
        token [B]: the token at position p+1, the target's choice at p;
        sample: picks a position's token from its logits [B, vocab] (greedy by default),
          which the next position's Markov bias depends on."""
        c = self.config
        w = target_hidden.shape[1]
        first = int(torch.as_tensor(position).min())
        if not 0 < w <= min(c.window_size, first + 1):
            raise ValueError(f"target_hidden holds {w} positions; at position {first} the "
                             f"draft reads 1..{min(c.window_size, first + 1)} (its window)")
        return self.block(model, self.window(target_hidden, position), token, position,
                          sample)

    def window(self, target_hidden: torch.Tensor,
               position: int | torch.Tensor) -> torch.Tensor:
        """Every stage's window entries of target states [B, n, len(targets) * dim] at
        positions p-n+1..p (p = `position`, an int or [B]): [S, B, n, D]. An entry depends
        on its own position's states alone, so a sequence's entries can be made as its
        tokens are kept and reused by every later draft (the engine's `draft_context`)."""
        n = target_hidden.shape[1]
        context = self.main_norm(self.main_proj(target_hidden))  # [B, n, dim]
        at = token_positions(position - n + 1, n, target_hidden.device)  # [P, n]
        return torch.stack([stage.attn.entries(context, at) for stage in self.stages])

    def block(self, model: "Model", window: torch.Tensor, token: torch.Tensor,
              position: int | torch.Tensor,
              sample: Callable[[torch.Tensor], torch.Tensor] = greedy,
              padding: torch.Tensor | None = None) -> DraftBlock:
        """`forward` from the window entries [S, B, W, D] (`window`) of the states it
        reads; padding [B, W]: True at slots of a sequence's shorter window, left-padded
        to W, that hold no entry (sequences of several window lengths in one call)."""
        c = self.config
        b, k = window.shape[1], c.dspark_block_size
        device = window.device
        block_at = token_positions(position + 1, k, device)  # [P, K]
        ids = torch.full((b, k), c.dspark_noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = token
        x = model.embed(ids).float()  # [B, K, dim]
        mix = None
        if c.hc_mult > 1:
            x = x.unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()  # [B, K, h, dim]
            mix = x.new_zeros(x.shape[:3])  # a one-hot collapse on copy 0, as the trunk's
            mix[..., 0] = 1.0
        for stage, entries in zip(self.stages, window, strict=True):
            x, mix = stage(x, mix, block_at, entries, padding)
        if mix is not None:
            x = HyperConnection.collapse(x, mix)  # [B, K, dim]
        if sample is greedy:
            made = self._head_in_c(model, x, token)
            if made is not None:
                return made
        logits = model.head_logits(self.norm(x))  # [B, K, vocab]
        tokens = [token.long()]
        kept = self._kept_markov_rows()
        for i in range(k):
            logits[:, i] += (self.markov_bias(tokens[-1]) if kept is None
                             else self._kept_markov_bias(kept, tokens[-1]))
            tokens.append(sample(logits[:, i]))
        chosen = torch.stack(tokens, dim=1)  # [B, K + 1]
        embeds = self.markov_embed(chosen[:, :-1]).float()  # [B, K, rank]
        features = torch.cat((x.float(), embeds), dim=-1)
        confidence = self.confidence(features).float().squeeze(-1)
        return DraftBlock(chosen, logits, confidence)

    def _head_in_c(self, model: "Model", x: torch.Tensor,
                   token: torch.Tensor) -> DraftBlock | None:
        """A greedy block's head, Markov choices and confidence from the last stage's x
        [B, K, dim] as one C call (`native.draft_head`) where the head is float32 or bf16
        on this rank, the confidence float32 and the Markov head's columns are kept;
        else None."""
        head, confidence = c_matrix(model.head), c_matrix(self.confidence)
        embed = self.markov_embed.weight
        if (head is None or confidence is None or confidence.dtype is not torch.float32
                or model.shard is not None
                or not native.fuses(x, self.norm.weight, embed, confidence)):
            return None
        columns = self._kept_markov_columns()
        if columns is None:
            return None
        logits, tokens, scores = native.draft_head(
            x, token, self.norm.weight, self.norm.eps, head, columns, embed, confidence[0])
        return DraftBlock(tokens, logits, scores)

    def _kept_markov_columns(self) -> torch.Tensor | None:
        """The Markov head transposed, float32 [rank, vocab], made once and kept with the
        rows (`_kept_markov_rows`: dropped when the weights change) where it holds at most
        MARKOV_ROWS_BYTES; else None."""
        kept = self._kept_markov_rows()
        rank = self.markov_embed.weight.shape[1]
        if kept is None or rank * self.config.vocab_size * 4 > MARKOV_ROWS_BYTES:
            return None
        if self._markov_columns is None:
            eye = torch.eye(rank, device=self.markov_embed.weight.device)
            self._markov_columns = self.markov_head(eye).float().contiguous()
        return self._markov_columns

    def markov_bias(self, tokens: torch.Tensor) -> torch.Tensor:
        """The Markov head's logit bias after each of tokens [B]: [B, vocab] float32.
        Outside training a token's row is computed once and kept (the last
        MARKOV_ROWS_BYTES of them): a block asks for one a position, and computing it
        reads the whole head (vocab x rank) where a kept row is vocab floats."""
        kept = self._kept_markov_rows()
        if kept is None:
            return self.markov_head(self.markov_embed(tokens).float()).float()
        return self._kept_markov_bias(kept, tokens)

    def _kept_markov_rows(self) -> OrderedDict[int, torch.Tensor] | None:
        """The Markov head's kept rows by token, emptied where the head's or the
        embedding's tensors moved or changed since they were made; None in training
        (nothing kept). A block asks once for its positions' rows."""
        if torch.is_grad_enabled() or self.training:
            return None
        weights = (*self.markov_head.parameters(), *self.markov_head.buffers(),
                   self.markov_embed.weight)
        stamp = tuple((t.data_ptr(), t._version) for t in weights)
        if stamp != self._markov_stamp:
            self._markov_rows.clear()
            self._markov_columns = None
            self._markov_stamp = stamp
        return self._markov_rows

    def _kept_markov_bias(self, kept: OrderedDict[int, torch.Tensor],
                          tokens: torch.Tensor) -> torch.Tensor:
        """`markov_bias` of tokens [B] from the rows kept (`_kept_markov_rows`), each
        row missing computed and kept: [B, vocab]."""
        rows = []
        for t in tokens.tolist():
            row = kept.get(t)
            if row is None:
                row = self.markov_head(self.markov_embed.weight[t : t + 1].float()).float()[0]
                kept[t] = row
                if len(kept) * row.numel() * 4 > MARKOV_ROWS_BYTES:
                    kept.popitem(last=False)
            else:
                kept.move_to_end(t)
            rows.append(row)
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)
