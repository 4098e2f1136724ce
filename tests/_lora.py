"""A PEFT-style LoRA model and the per-rank measurement of its trainable state, for raggedfsdp and torch.

``LoRALinear`` is a frozen ``nn.Linear`` plus trainable adapters ``lora_A`` ``(r, in)`` and ``lora_B``
``(out, r)`` (Hu et al., arXiv 2106.09685: ``y = base(x) + (alpha / r) * x A^T B^T``; written here, no
``peft`` dependency; ``B`` starts small and random instead of zero so that both adapters get gradients
from the first step). ``LoraNet``: ``n`` blocks of six LoRA linears (q, k, v, o of ``d x d``, up
``d -> 2d``, down ``2d -> d``), one FSDP unit each, a LoRA head (a unit of one LoRA linear) and a
frozen input projection in the root unit.

:func:`measure` (``fn(rank, ws, ...)`` for ``tests/_dist.run_distributed``) trains the same model from
the same init with ``raggedfsdp.fully_shard`` and torch's ``fully_shard`` (AdamW, a few steps) and
returns, per backend, per unit and in all, what this rank holds of the trainable state: elements of the
trainable sharded params, the bytes of their sharded ``.grad`` (the pieces, and the distinct storages
behind them), and the bytes of the AdamW state; plus every step's loss. Used by
``tests/dist/test_lora_balance.py`` and ``benchmarks/lora_balance.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class LoRALinear(nn.Module):
    """PEFT's ``lora.Linear`` layout: ``base_layer`` (frozen), then ``lora_A`` ``Linear(in, r)`` and
    ``lora_B`` ``Linear(r, out)``, both without bias; ``y = base(x) + (alpha / r) * lora_B(lora_A(x))``."""

    def __init__(self, d_in: int, d_out: int, r: int, alpha: float = 16.0):
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out)
        self.base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoraBlock(nn.Module):
    def __init__(self, d: int, r: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.norm.requires_grad_(False)
        self.q, self.k, self.v, self.o = (LoRALinear(d, d, r) for _ in range(4))
        self.up = LoRALinear(d, 2 * d, r)
        self.down = LoRALinear(2 * d, d, r)

    def forward(self, x):
        h = self.norm(x)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5, dim=-1) @ self.v(h)
        x = x + self.o(att)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LoraNet(nn.Module):
    """``n`` blocks (one FSDP unit each), a LoRA head ``d -> 2d`` (a unit of one LoRA linear), a frozen
    input projection (the root unit)."""

    def __init__(self, d: int = 48, r: int = 8, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.inp.requires_grad_(False)
        self.blocks = nn.ModuleList(LoraBlock(d, r) for _ in range(n))
        self.head = LoRALinear(d, 2 * d, r)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        """The submodules ``measure`` shards as units (the root follows them)."""
        return [*self.blocks, self.head]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def trainable_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """This rank's share of the trainable state, per FSDP unit (``blocks.0``, ..., ``head``) and
    ``"all"`` (after a step, before ``zero_grad``). Local."""
    units = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            unit = ".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0]
            units.setdefault(unit, []).append(p)
    units["all"] = [p for ps in units.values() for p in ps]
    out = {}
    for unit, params in units.items():
        grads = [_local(p.grad) for p in params if p.grad is not None]
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads if g.numel()}
        state = [
            _local(v) for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.ndim
        ]
        out[unit] = {
            "param_elems": sum(_local(p).numel() for p in params),
            "grad_bytes": sum(map(_nbytes, grads)),
            "grad_storage_bytes": sum(storages.values()),
            "adamw_state_bytes": sum(map(_nbytes, state)),
        }
    return out


def measure(
    rank: int, ws: int, r: int = 8, steps: int = 4, d: int = 48, n: int = 2, param_dtype=None, raf=True
) -> dict:
    """Train ``LoraNet(d, r, n)`` ``steps`` AdamW steps with each backend on a ``(ws,)`` mesh; return
    ``{backend: {"state": trainable_state after the first step, "losses": [per step], "full":
    {name: full param after the last step}}}``. ``param_dtype``, ``raf``: the ``MixedPrecisionPolicy``
    ``param_dtype`` and the ``reshard_after_forward`` of both backends. Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    ref = LoraNet(d, r, n)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(ws * 2, 5, d, generator=g) for _ in range(steps)]
    out = {}
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    backends = (
        ("ragged", raggedfsdp.fully_shard, raggedfsdp.MixedPrecisionPolicy),
        ("torch", torch_fully_shard, TorchMP),
    )
    for name, fs, mp in backends:
        model = copy.deepcopy(ref)
        kw = dict(mesh=mesh, mp_policy=mp(param_dtype=param_dtype), reshard_after_forward=raf)
        for u in model.units():
            fs(u, **kw)
        fs(model, **kw)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        losses, state = [], None
        for step in range(steps):
            x = data[step][rank * 2 : rank * 2 + 2]
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            if step == 0:
                state = trainable_state(model, opt)
            opt.zero_grad()
            losses.append(loss.item())
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()
        }
        out[name] = {"state": state, "losses": losses, "full": full}
    return out
