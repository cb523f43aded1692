"""A two-layer Llama with weights set by hand, whose one long-range head is known by construction
(for the head scores of bhqk.budget): tokens are random unit codes; layer 0 has a previous-token
head and a same-token head (both local), layer 1 an induction head — it attends from a token to the
position after that token's earlier occurrences and copies what it finds there into the logits.
Every other head is inert (its output projection is zero).

K/V heads (layer, head), flat index = layer · 2 + head:

    (0, 0) 0  previous-token head: writes the previous token's code into PREV      local
    (0, 1) 1  same-token head: writes a little of the token's own code into OUT    local
    (1, 0) 2  inert: zero keys, values and output                                   inert
    (1, 1) 3  induction head: query = the token's code, key = PREV, value = the     long range
              token's code, written into OUT, which the logits read

The induction head is K/V head 3: the last by index, so no score can put it first by a tie. The
two query heads of each K/V head are: the head above (query head 2·j) and an inert one (2·j + 1).

Residual stream (hidden 256): CUR [0, 80) the token's code, PREV [80, 160), OUT [160, 240), BIAS 240
(a constant 1, from which the positional heads build their queries and keys). RoPE with
rope_theta = 1e30 on head_dim 96: pair p turns 10^(−0.625 p) rad per position, so pairs 0–7 (1 …
4e-5 rad) tell positions apart — a positional head's score Σ_p 80 cos(θ_p (Δ − offset)) is 640 at
its offset and at most 601 elsewhere within 4,096 positions — and pairs 8–47 turn by less than 1e-5
rad per position: the content heads compare codes in those 80 dims as if there were no rotation.
"""

from __future__ import annotations

import math

import torch
import transformers

V = 2048  # vocabulary (the retrieval probe draws tokens from [100, V))
HIDDEN, D, HEAD_DIM = 256, 80, 96
CUR, PREV, OUT, BIAS = 0, 80, 160, 240
FAST = tuple(range(8))  # rotary pairs the positional heads use
SLOW = list(range(8, 48))  # rotary pairs of the content: dims p and p + 48
INDUCTION = (1, 1)  # the long-range K/V head (layer, head)


def _content_dims() -> list[int]:
    return SLOW + [p + HEAD_DIM // 2 for p in SLOW]  # 80 head dims that do not turn


def codes(seed: int = 0) -> torch.Tensor:
    """[V, D] random unit vectors: token t's code."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(V, D, generator=g, dtype=torch.float64)
    return (c / c.norm(dim=-1, keepdim=True)).float()


def induction_llama(attn_implementation: str = "bhqk") -> transformers.LlamaForCausalLM:
    """The model of the module doc (fp32, eval mode)."""
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e30}, tie_word_embeddings=False,
        attn_implementation=attn_implementation)
    model = transformers.LlamaForCausalLM(cfg).eval()
    C = codes()
    inv = 1.0 / (1e30 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))  # [48] rad per position
    content = _content_dims()
    # after the first RMSNorm a token's vector is x · √(HIDDEN / |x|²); |x|² = 2 (a unit code and BIAS = 1)
    n0 = math.sqrt(HIDDEN / 2)
    alpha, gamma = 1.0, 0.3  # PREV and OUT (same-token) scales written by layer 0
    n1 = math.sqrt(HIDDEN / (2 + alpha**2 + gamma**2))  # layer 1's input: CUR, PREV, OUT (same-token), BIAS
    amp = 80.0  # positional score per fast pair
    s_ind = 45.0  # induction score of a matching code
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for m in model.modules():
            if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm):
                m.weight.fill_(1.0)
        E = model.model.embed_tokens.weight  # [V, HIDDEN]
        E[:, CUR:CUR + D] = C
        E[:, BIAS] = 1.0
        scale = HEAD_DIM ** 0.5  # transformers' score scale is head_dim^-0.5
        a0, a1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn

        def positional(attn, qh: int, kvh: int, offset: int) -> None:
            """Query head qh (K/V head kvh) peaks at key = query − offset, from the BIAS input."""
            for p in FAST:
                th = float(inv[p]) * offset
                q = torch.tensor([math.cos(th), -math.sin(th)]) * amp * scale / n0  # R(−offset·θ) e1
                attn.q_proj.weight[[qh * HEAD_DIM + p, qh * HEAD_DIM + p + HEAD_DIM // 2], BIAS] = q
                attn.k_proj.weight[kvh * HEAD_DIM + p, BIAS] = 1.0 / n0

        def copy_value(attn, kvh: int, src: int, n: float) -> None:
            """K/V head kvh's value = the code at ``src`` (head dims 0 … D−1)."""
            attn.v_proj.weight[kvh * HEAD_DIM:kvh * HEAD_DIM + D, src:src + D] = torch.eye(D) / n

        def write(attn, qh: int, dst: int, w: float) -> None:
            """Query head qh's output (dims 0 … D−1) goes to the residual at ``dst`` × w."""
            attn.o_proj.weight[dst:dst + D, qh * HEAD_DIM:qh * HEAD_DIM + D] = torch.eye(D) * w

        positional(a0, 0, 0, 1)  # (0, 0): previous token
        copy_value(a0, 0, CUR, n0)
        write(a0, 0, PREV, alpha)
        positional(a0, 2, 1, 0)  # (0, 1): same token
        copy_value(a0, 1, CUR, n0)
        write(a0, 2, OUT, gamma)
        # (1, 1): induction — query the token's code (CUR), key the previous token's code (PREV)
        qi = [2 * HEAD_DIM + c for c in content]
        ki = [1 * HEAD_DIM + c for c in content]
        a1.q_proj.weight[qi, CUR:CUR + D] = torch.eye(D) * s_ind * scale / n1
        a1.k_proj.weight[ki, PREV:PREV + D] = torch.eye(D) / (n1 * alpha)
        copy_value(a1, 1, CUR, n1)
        write(a1, 2, OUT, 1.0)
        model.lm_head.weight[:, OUT:OUT + D] = C * 2.0
    return model


class CharTokenizer:
    """Characters as token ids 1 + ord(c) % (vocab − 1) (default V), for the scores that read text."""

    def __init__(self, vocab: int = V):
        self.vocab = vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [1 + ord(c) % (self.vocab - 1) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids) -> str:
        return "".join(chr(i - 1) for i in ids)
