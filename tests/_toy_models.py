"""Small models with awkward shapes for FSDP parity tests (sizes 7, 13, 101 make shards ragged)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HID = 101, 13, 7


class Block(nn.Module):
    def __init__(self, d: int = DIM, h: int = HID):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    """Embedding -> n blocks -> norm -> head; every parameter size is awkward for 2..5 ranks."""

    def __init__(self, n_layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batches(n_steps: int, global_batch: int, seq: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        tok = torch.randint(0, VOCAB, (global_batch, seq), generator=g)
        tgt = torch.randint(0, VOCAB, (global_batch, seq), generator=g)
        out.append((tok, tgt))
    return out


def shard_model(model, fully_shard, mesh, **kw):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full_params(model) -> dict[str, torch.Tensor]:
    """Gather every parameter to a plain full tensor (collective for DTensor params)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        out[n] = p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
    return out


class Boom(torch.autograd.Function):
    """Identity whose backward raises while ``Boom.armed`` (a failure injected mid-backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("injected failure in backward")
        return g
