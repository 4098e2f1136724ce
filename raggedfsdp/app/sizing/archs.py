"""Parameter shapes of whole models, by FSDP unit, without allocating anything.

A model is described by a Hugging Face-style config dict (the keys of ``config.json``); the same
builder serves the built-in tables and any ``config.json`` path (best effort: llama / mistral /
qwen2 / qwen3 dense, mixtral, qwen2/3-moe, deepseek-v2/v3 / kimi-k2 (MLA), gpt-oss, and
qwen3-next-style hybrids of Gated DeltaNet and full attention). Parameter names and order follow
the Hugging Face ``transformers`` modules (registration order = the planner's default order).

Units: one per decoder layer (``unit="layer"``), one per hybrid super-block of
``full_attention_interval`` layers (``unit="superblock"``) or one per ``K`` layers
(``unit="layers:K"``), plus an ``embed`` unit (token
embedding) and a ``head`` unit (final norm + untied LM head). Multi-token-prediction heads and
vision towers are not included.

Built-in tables (shapes from the public configs unless marked *assumed*):

- ``llama3-8b`` / ``llama3-70b``: LLaMA-3 (GQA, 8 KV heads, vocab 128,256).
- ``qwen3-moe-30b``: Qwen3-30B-A3B (48 layers, hidden 2,048, 128 experts of 768 per layer, top-8,
  q/k norms, vocab 151,936, untied). About 30.5B parameters.
- ``gpt-oss-120b``: 36 layers, hidden 2,880, 128 experts fused per layer as released
  (``gate_up_proj`` (128, 2880, 5760), ``down_proj`` (128, 2880, 2880) + biases), attention sinks.
- ``deepseek-v3-671b``: 61 layers (3 dense, 58 MoE), MLA (q_lora 1,536, kv_lora 512, 128 heads),
  256 routed experts as separate (2048, 7168) / (7168, 2048) tensors + 1 shared expert.
- ``hybrid-27b`` (*assumed*, Qwen3.x-27B-style): 64 layers, hidden 5,120, 16 super-blocks of 3 Gated
  DeltaNet + 1 gated full-attention layer; attention 24 heads x 256 (4 KV heads, output gate
  doubles q_proj); DeltaNet 16 key heads x 128, 48 value heads x 128, conv kernel 4; dense MLP
  17,408; vocab 248,320, untied. About 26.9B parameters.
- ``moe-2.4t`` (*assumed*): DeepSeek-V3-style, hidden 8,192, 95 layers (3 dense with MLP 32,768,
  92 MoE), MLA (128 heads, q_lora 2,048, kv_lora 512), 512 routed experts (2048 x 8192) + 1
  shared expert, vocab 163,840, untied. About 2.40T parameters; a MoE unit holds 1,550 tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: a name and its ``(param_name, shape)`` list in module order."""

    name: str
    params: tuple[tuple[str, Shape], ...]
    global_shapes: tuple[Shape, ...] = ()
    """Tensor parallel (``raggedfsdp.app.sizing.tp``): the global shape of each of ``params``, whose shapes
    are
    then the TP-local ones; ``()``: the shapes are global (no TP)."""

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.params)


_LLAMA3 = dict(
    model_type="llama", vocab_size=128256, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False
)

BUILTIN: dict[str, dict] = {
    "llama3-8b": dict(
        _LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336
    ),
    "llama3-70b": dict(
        _LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672
    ),
    "qwen3-4b": dict(  # Qwen/Qwen3-4B config.json (tied embeddings, q/k norms)
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        tie_word_embeddings=True,
    ),
    "gpt-oss-120b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=128,
        tie_word_embeddings=False,
    ),
    "deepseek-v3-671b": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3-moe-30b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    "hybrid-27b": dict(
        model_type="qwen3_next",
        vocab_size=248320,
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=0,
        tie_word_embeddings=False,
    ),
    "moe-2.4t": dict(
        model_type="deepseek_v3",
        vocab_size=163840,
        hidden_size=8192,
        num_hidden_layers=95,
        num_attention_heads=128,
        intermediate_size=32768,
        moe_intermediate_size=2048,
        n_routed_experts=512,
        n_shared_experts=1,
        first_k_dense_replace=3,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        tie_word_embeddings=False,
    ),
}

_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def load_config(model: str) -> dict:
    """A built-in name, a path to a Hugging Face ``config.json``, or a folder holding one (a model
    checkpoint folder); ``text_config`` is unwrapped.

    Raises:
        ValueError: naming ``model`` and the fix, for an unknown name, a folder without
            ``config.json``, or a file that is unreadable, not UTF-8 text, not JSON or not a JSON object.
    """
    if model in BUILTIN:
        return dict(BUILTIN[model])
    use = f"use a built-in model ({', '.join(BUILTIN)}) or the path of a Hugging Face config.json"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {model!r} is a folder without a config.json; {use}")
        path = path / "config.json"
    try:
        text = path.read_bytes().decode("utf-8")
        cfg = json.loads(text)
    except FileNotFoundError:
        raise ValueError(
            f"unknown model {model!r}: not one of {sorted(BUILTIN)} and no such config.json"
        ) from None
    except OSError as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e.strerror or e}; {use}") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"model config {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start}); {use}"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {str(path)!r} is not valid JSON ({e}); {use}") from None
    if not isinstance(cfg, dict):
        raise ValueError(  # noqa: TRY004 (bad user input, reported by the CLI)
            f"model config {str(path)!r} must be a JSON object, got a {type(cfg).__name__}; {use}"
        )
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
        cfg = dict(cfg["text_config"], model_type=cfg["text_config"].get("model_type", cfg.get("model_type")))
    return cfg


def _req(cfg: dict, key: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"model config lacks {key!r} (model_type={cfg.get('model_type')!r})")
    try:
        return int(cfg[key])
    except (TypeError, ValueError):
        raise ValueError(f"model config key {key!r} must be an integer, got {cfg[key]!r}") from None


def _lin(p: str, out: int, inp: int, bias: bool = False) -> list[tuple[str, Shape]]:
    r = [(f"{p}.weight", (out, inp))]
    if bias:
        r.append((f"{p}.bias", (out,)))
    return r


def _attention(cfg: dict, p: str, H: int, mt: str) -> list[tuple[str, Shape]]:
    nh = _req(cfg, "num_attention_heads")
    if mt in _MLA_TYPES:
        nope, rope, vd = _req(cfg, "qk_nope_head_dim"), _req(cfg, "qk_rope_head_dim"), _req(cfg, "v_head_dim")
        ql, kvl = cfg.get("q_lora_rank"), _req(cfg, "kv_lora_rank")
        out: list[tuple[str, Shape]] = []
        if ql:
            out += _lin(f"{p}.q_a_proj", ql, H) + [(f"{p}.q_a_layernorm.weight", (ql,))]
            out += _lin(f"{p}.q_b_proj", nh * (nope + rope), ql)
        else:
            out += _lin(f"{p}.q_proj", nh * (nope + rope), H)
        out += _lin(f"{p}.kv_a_proj_with_mqa", kvl + rope, H) + [(f"{p}.kv_a_layernorm.weight", (kvl,))]
        out += _lin(f"{p}.kv_b_proj", nh * (nope + vd), kvl) + _lin(f"{p}.o_proj", H, nh * vd)
        return out
    hd = int(cfg.get("head_dim") or H // nh)
    nkv = int(cfg.get("num_key_value_heads") or nh)
    gpt_oss = mt == "gpt_oss"
    qkv_bias = bool(cfg.get("attention_bias")) or gpt_oss or mt in ("qwen2", "qwen2_moe")
    q_out = nh * hd * (2 if mt in _HYBRID_TYPES else 1)  # qwen3-next: output gate packed in q_proj
    out = _lin(f"{p}.q_proj", q_out, H, qkv_bias) + _lin(f"{p}.k_proj", nkv * hd, H, qkv_bias)
    out += _lin(f"{p}.v_proj", nkv * hd, H, qkv_bias)
    out += _lin(f"{p}.o_proj", H, nh * hd, bool(cfg.get("attention_bias")) or gpt_oss)
    if gpt_oss:
        out.append((f"{p}.sinks", (nh,)))
    if mt in ("qwen3", "qwen3_moe") + _HYBRID_TYPES:
        out += [(f"{p}.q_norm.weight", (hd,)), (f"{p}.k_norm.weight", (hd,))]
    return out


def _gated_deltanet(cfg: dict, p: str, H: int) -> list[tuple[str, Shape]]:
    nk, nv = _req(cfg, "linear_num_key_heads"), _req(cfg, "linear_num_value_heads")
    dk, dv = _req(cfg, "linear_key_head_dim"), _req(cfg, "linear_value_head_dim")
    kern = int(cfg.get("linear_conv_kernel_dim", 4))
    key, val = nk * dk, nv * dv
    return (
        _lin(f"{p}.in_proj_qkvz", 2 * key + 2 * val, H)
        + _lin(f"{p}.in_proj_ba", 2 * nv, H)
        + [
            (f"{p}.conv1d.weight", (2 * key + val, 1, kern)),
            (f"{p}.dt_bias", (nv,)),
            (f"{p}.A_log", (nv,)),
            (f"{p}.norm.weight", (dv,)),
        ]
        + _lin(f"{p}.out_proj", H, val)
    )


def _mlp(p: str, H: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> list[tuple[str, Shape]]:
    g, u, d = names
    return _lin(f"{p}.{g}", inter, H) + _lin(f"{p}.{u}", inter, H) + _lin(f"{p}.{d}", H, inter)


def _experts(p: str, H: int, inter: int, E: int, names=("gate_proj", "up_proj", "down_proj")):
    """``E`` separate experts (one comprehension: MoE tables hold ~10^5 tensors)."""
    up, down = (inter, H), (H, inter)
    trio = tuple(zip(names, (up, up, down)))
    return [(f"{p}.{j}.{n}.weight", s) for j in range(E) for n, s in trio]


def _is_moe_layer(cfg: dict, mt: str, i: int) -> bool:
    if mt == "gpt_oss" or mt == "mixtral":
        return True
    if mt in _MLA_TYPES:
        n = cfg.get("n_routed_experts") or 0
        return (
            bool(n)
            and i >= int(cfg.get("first_k_dense_replace", 0))
            and i % int(cfg.get("moe_layer_freq", 1)) == 0
        )
    n = cfg.get("num_experts") or 0
    if not n or i in (cfg.get("mlp_only_layers") or []):
        return False
    return (i + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0


def _ffn(cfg: dict, p: str, H: int, mt: str, i: int) -> list[tuple[str, Shape]]:
    if not _is_moe_layer(cfg, mt, i):
        return _mlp(p, H, _req(cfg, "intermediate_size"))
    if mt == "gpt_oss":
        E, inter = _req(cfg, "num_local_experts"), _req(cfg, "intermediate_size")
        e = f"{p}.experts"
        return _lin(f"{p}.router", E, H, True) + [
            (f"{e}.gate_up_proj", (E, H, 2 * inter)),
            (f"{e}.gate_up_proj_bias", (E, 2 * inter)),
            (f"{e}.down_proj", (E, inter, H)),
            (f"{e}.down_proj_bias", (E, H)),
        ]
    if mt == "mixtral":
        E, inter = _req(cfg, "num_local_experts"), _req(cfg, "intermediate_size")
        return _lin(f"{p}.gate", E, H) + _experts(f"{p}.experts", H, inter, E, ("w1", "w3", "w2"))
    inter = _req(cfg, "moe_intermediate_size")
    if mt in _MLA_TYPES:
        E = _req(cfg, "n_routed_experts")
        out = _lin(f"{p}.gate", E, H)
        if mt != "deepseek_v2":
            out.append((f"{p}.gate.e_score_correction_bias", (E,)))
        out += _experts(f"{p}.experts", H, inter, E)
        if cfg.get("n_shared_experts"):
            out += _mlp(f"{p}.shared_experts", H, inter * int(cfg["n_shared_experts"]))
        return out
    E = _req(cfg, "num_experts")  # qwen2_moe / qwen3_moe / qwen3-next MoE
    out = _lin(f"{p}.gate", E, H) + _experts(f"{p}.experts", H, inter, E)
    if cfg.get("shared_expert_intermediate_size"):
        out += _mlp(f"{p}.shared_expert", H, int(cfg["shared_expert_intermediate_size"]))
        out += _lin(f"{p}.shared_expert_gate", 1, H)
    return out


def _layer_is_full_attention(cfg: dict, mt: str, i: int) -> bool:
    types = cfg.get("layer_types")
    if types:
        return types[i] != "linear_attention"
    if mt in _HYBRID_TYPES:
        return (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0
    return True


def layer_params(cfg: dict, i: int) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of decoder layer ``i`` in ``transformers`` registration order."""
    mt = str(cfg.get("model_type", "llama"))
    H = _req(cfg, "hidden_size")
    p = f"model.layers.{i}"
    if _layer_is_full_attention(cfg, mt, i):
        mixer = _attention(cfg, f"{p}.self_attn", H, mt)
    else:
        mixer = _gated_deltanet(cfg, f"{p}.linear_attn", H)
    ffn_name = "block_sparse_moe" if mt == "mixtral" else "mlp"
    return (
        mixer
        + _ffn(cfg, f"{p}.{ffn_name}", H, mt, i)
        + [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,))]
    )


def layers_per_unit(cfg: dict, unit: str) -> int:
    """Decoder layers per FSDP unit for ``unit`` = ``layer`` | ``superblock`` | ``layers:K`` (the one
    vocabulary of :func:`raggedfsdp.app.models.parallelize.parse_unit`)."""
    from raggedfsdp.app.models.parallelize import parse_unit

    k = parse_unit(unit)
    if k is not None:
        return k
    mt = str(cfg.get("model_type", "llama"))
    # transformers 5 writes layer_types for dense models too: hybrid only with linear-attention layers
    if mt not in _HYBRID_TYPES and "linear_attention" not in (cfg.get("layer_types") or ()):
        raise ValueError(f"unit='superblock' needs a hybrid model; model_type={mt!r} has plain layers")
    return int(cfg.get("full_attention_interval", 4))


def model_units(model: str | dict, unit: str = "layer") -> list[Unit]:
    """The FSDP units of ``model`` (built-in name, ``config.json`` path or config dict); shapes only.

    Raises:
        ValueError: unknown model, missing config keys, or ``unit="superblock"`` on a non-hybrid model.
    """
    cfg = load_config(model) if isinstance(model, str) else dict(model)
    H, V, L = _req(cfg, "hidden_size"), _req(cfg, "vocab_size"), _req(cfg, "num_hidden_layers")
    per = layers_per_unit(cfg, unit)
    units = [Unit("embed", (("model.embed_tokens.weight", (V, H)),))]
    for start in range(0, L, per):
        params: list[tuple[str, Shape]] = []
        for i in range(start, min(start + per, L)):
            params += layer_params(cfg, i)
        name = f"layers.{start}" if per == 1 else f"layers.{start}-{min(start + per, L) - 1}"
        units.append(Unit(name, tuple(params)))
    head = [("model.norm.weight", (H,))]
    if not cfg.get("tie_word_embeddings", False):
        head.append(("lm_head.weight", (V, H)))
    units.append(Unit("head", tuple(head)))
    return units
