"""A small decoder-only transformer in plain PyTorch (pre-norm, causal self-attention, GELU MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optim_factory.factory import parse_dtype
from recipes.config import ModelConfig, ModelDtype


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class DecoderLM(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final norm, LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"model.d_model={cfg.d_model} must be divisible by model.n_heads={cfg.n_heads}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device) -> DecoderLM:
    """Deterministic initialisation from ``seed`` (on CPU, then moved), in ``model.dtype``."""
    if cfg.dtype not in ModelDtype.__members__:  # composed configs are checked by the schema already
        raise ValueError(f"model.dtype={cfg.dtype!r}: expected {ModelDtype.spelled()}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    torch.random.set_rng_state(gen_state)
    return model.to(device=device, dtype=parse_dtype(cfg.dtype))
