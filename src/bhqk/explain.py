"""``explain``: the shape walk-through of the whole multi-head computation, in English or Chinese."""

from __future__ import annotations

from .dims import meaning
from .errors import ShapeError

_WORDS = {
    "en": {
        "title": "Multi-head attention, step by step",
        "names": "Dimension names",
        "self": "self-attention (Q = K)",
        "cross": "cross-attention (Q ≠ K: keys and values come from a context)",
        "x": "X, the queries' input",
        "ctx": "C, the keys' and values' input",
        "proj": "projections",
        "split": "split heads",
        "scores": "scores S = Q·Kᵀ·scale (one row per query, one column per key)",
        "mask": "mask / bias: broadcast to [B, H, Q, K]; mask True = may attend",
        "softmax": "P = softmax(S) over K, row by row (each row sums to 1)",
        "out": "O = P·V (attention mixes tokens; it never changes a token's width)",
        "merge": "merge heads (concatenate)",
        "wo": "output projection",
        "check": "30-second self-check",
        "inner": "inner dimension of Q·Kᵀ agrees",
        "perhead": "output per head is [Q, dv]",
        "merged": "after merging, [Q, H·dv]",
        "groups": "query heads per key/value head",
        "memory": "memory of S and P (each, fp32; the reference builds them, the tiled path never does)",
        "gqa": "query head h reads key/value head h // {g}",
        "worked": "the worked example's sizes: 4 tokens of width 3, 2 heads (give H, Q, d for others)",
    },
    "zh": {
        "title": "多头注意力，逐步的形状",
        "names": "维度名称",
        "self": "自注意力（Q = K）",
        "cross": "交叉注意力（Q ≠ K：键和值来自上下文）",
        "x": "X，查询侧的输入",
        "ctx": "C，键和值的输入",
        "proj": "线性投影",
        "split": "拆分多头",
        "scores": "注意力分数 S = Q·Kᵀ·scale（每行一个查询，每列一个键）",
        "mask": "掩码 / 偏置：广播到 [B, H, Q, K]；掩码 True = 可以关注",
        "softmax": "P = softmax(S)，沿 K 按行归一化（每行之和为 1）",
        "out": "O = P·V（注意力混合 token，不改变每个 token 的向量维度）",
        "merge": "合并多头（拼接）",
        "wo": "输出投影",
        "check": "30 秒自检",
        "inner": "Q·Kᵀ 的内维一致",
        "perhead": "每个头的输出是 [Q, dv]",
        "merged": "合并后是 [Q, H·dv]",
        "groups": "每个键值头服务的查询头数",
        "memory": "S 与 P 的内存（各一份，fp32；参考实现会构建，分块实现从不构建）",
        "gqa": "查询头 h 读取键值头 h // {g}",
        "worked": "示例的尺寸：4 个 token，宽度 3，2 个头（给出 H、Q、d 可换成其他尺寸）",
    },
}


def _mib(n: int) -> str:
    return f"{n * 4 / 2**20:,.1f} MiB"


# The worked example's sizes (``bhqk demo``, ``bhqk explain --html``): 4 tokens of width 3, 2 heads.
WORKED = {"H": 2, "Q": 4, "d": 3}


def explain(*, B: int = 1, H: int | None = None, Q: int | None = None, K: int | None = None, d: int | None = None,
            dv: int | None = None, Hkv: int | None = None, D: int | None = None, lang: str = "en") -> str:
    """The named shape of every step of multi-head attention, and the self-check lines. A size left
    out is the worked example's (H=2, Q=4, d=3; K = Q, dv = d, Hkv = H, D = H·d)."""
    if lang not in _WORDS:
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}.")
    worked = all(x is None for x in (H, Q, K, d, dv, Hkv, D))
    H = WORKED["H"] if H is None else H
    Q = WORKED["Q"] if Q is None else Q
    K = Q if K is None else K
    d = WORKED["d"] if d is None else d
    dv = d if dv is None else dv
    Hkv = H if Hkv is None else Hkv
    D = H * d if D is None else D
    sizes = dict(B=B, H=H, Hkv=Hkv, Q=Q, K=K, d=d, dv=dv, D=D)
    for name, val in sizes.items():
        if int(val) < 1:
            raise ShapeError(f"{name} must be >= 1, got {val}.")
    if H % Hkv:
        raise ShapeError(f"H={H} is not divisible by Hkv={Hkv}; each key/value head serves H/Hkv query heads.")
    w = _WORDS[lang]
    g = H // Hkv
    out = [f"{w['title']} ({', '.join(f'{k}={v}' for k, v in sizes.items())})",
           *([w["worked"]] if worked else []), w["self"] if Q == K else w["cross"], "", w["names"] + ":"]
    for name in sizes:
        out.append(f"  {name:<4}= {sizes[name]:<6} {meaning(name, lang)}")
    steps = [
        (w["x"], "[B, Q, D]", [B, Q, D]),
        (w["ctx"], "[B, K, D]", [B, K, D]),
        (f"{w['proj']}: Q = X·W_Q  (W_Q: D → H·d)", "[B, Q, H·d]", [B, Q, H * d]),
        (f"{w['proj']}: K = C·W_K  (W_K: D → Hkv·d)", "[B, K, Hkv·d]", [B, K, Hkv * d]),
        (f"{w['proj']}: V = C·W_V  (W_V: D → Hkv·dv)", "[B, K, Hkv·dv]", [B, K, Hkv * dv]),
        (f"{w['split']} 'b n (h d) -> b h n d': Q", "[B, H, Q, d]", [B, H, Q, d]),
        (f"{w['split']}: K", "[B, Hkv, K, d]", [B, Hkv, K, d]),
        (f"{w['split']}: V", "[B, Hkv, K, dv]", [B, Hkv, K, dv]),
        (f"{w['scores']}: [B,H,Q,d] @ [B,H,d,K]", "[B, H, Q, K]", [B, H, Q, K]),
        (w["mask"], "[B, H, Q, K]", [B, H, Q, K]),
        (w["softmax"], "[B, H, Q, K]", [B, H, Q, K]),
        (f"{w['out']}: [B,H,Q,K] @ [B,H,K,dv]", "[B, H, Q, dv]", [B, H, Q, dv]),
        (f"{w['merge']} 'b h n d -> b n (h d)'", "[B, Q, H·dv]", [B, Q, H * dv]),
        (f"{w['wo']}: Y = O·W_O  (W_O: H·dv → D)", "[B, Q, D]", [B, Q, D]),
    ]
    out.append("")
    for i, (label, names, shape) in enumerate(steps, 1):
        out.append(f"{i:>2}. {label}")
        out.append(f"      {names:<16} = {shape}")
    if g > 1:
        out.append("    " + w["gqa"].format(g=g))
    ok = lambda c: "✓" if c else "✗"  # noqa: E731
    merged_ok = H * dv == D
    merged_note = " = [Q, D]" if merged_ok else f" ≠ [Q, D] = [{Q}, {D}]: W_O maps H·dv={H * dv} → D={D}"
    out += ["", w["check"] + ":",
            f"  ✓ {w['inner']}: q d={d}, k d={d}",
            f"  ✓ {w['perhead']} = [{Q}, {dv}]",
            f"  {ok(merged_ok)} {w['merged']} = [{Q}, {H * dv}]{merged_note}",
            f"  ✓ H % Hkv == 0: {g} {w['groups']}",
            f"  {w['memory']}: B·H·Q·K = {B * H * Q * K:,} → {_mib(B * H * Q * K)}"]
    return "\n".join(out)
