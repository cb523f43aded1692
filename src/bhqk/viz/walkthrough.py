"""``bhqk explain --html FILE``: one self-contained page that draws every step of attention with its
numbers and its named shapes — Q, K, Kᵀ, S = Q·Kᵀ, scale, mask, P row by row, O = P·V, then the split
and merge of heads — in English and Chinese (a toggle). By default the worked example: n = 4 tokens
with d = 3 (the Q and K below, V = K) and a second head for the split and merge; given sizes, seeded
random matrices of those sizes. Every number is computed by bhqk itself (``attention_weights``,
``attention`` on the reference backend, ``split_heads`` / ``merge_heads``). The HTML, CSS and JS are
package data in ``viz/assets/walkthrough.*``.
"""

from __future__ import annotations

import html as _html
import math
from pathlib import Path

import torch

from .. import masks
from ..functional import attention, attention_weights
from ..nn.heads import merge_heads, split_heads
from .template import asset, fill

# The worked example: n = 4 tokens, d = 3 (one query and one key vector per token).
EXAMPLE_Q = [[1.1, 2.2, 3.3], [4.4, 5.5, 6.6], [7.7, 8.8, 9.9], [1.2, 2.3, 3.4]]
EXAMPLE_K = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]]
LIMITS = {"H": 4, "Q": 12, "K": 12, "d": 8, "dv": 8}  # the page prints every number
STEPS = ("q", "k", "kt", "s", "scale", "mask", "p", "o", "split", "merge")


def t(en: str, zh: str) -> str:
    """Text in both languages; the page shows one (``data-l``), the toggle switches."""
    return f'<span data-l="en">{en}</span><span data-l="zh">{zh}</span>'


def shape(**dims: int) -> str:
    return '<span class="shape">[' + ", ".join(f"{k}={v}" for k, v in dims.items()) + "]</span>"


def matrix(name: str, m: torch.Tensor, rows: list[str], cols: list[str], *, dims: dict[str, int], testid: str,
           mask: torch.Tensor | None = None, col_class: list[str] | None = None, fmt: str = "{:.4f}") -> str:
    """A [rows, cols] table with its name, named shape, row and column labels; masked cells show −∞."""
    classes = col_class or [""] * len(cols)
    out = [f'<table class="m" data-testid="{testid}"><caption><b>{name}</b> {shape(**dims)}</caption><tr><th></th>']
    out += [f'<th class="{classes[j]}">{_html.escape(c)}</th>' for j, c in enumerate(cols)]
    out.append("</tr>")
    for i, r in enumerate(rows):
        out.append(f"<tr><th>{_html.escape(r)}</th>")
        for j in range(len(cols)):
            if mask is not None and not bool(mask[i, j]):
                out.append(f'<td class="masked {classes[j]}">−∞</td>')
            else:
                out.append(f'<td class="{classes[j]}">{fmt.format(float(m[i, j]))}</td>')
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def section(step: str, title: str, text: str, *body: str) -> str:
    return (f'<section class="step" id="step-{step}" data-testid="step-{step}"><h2>{title}</h2><p>{text}</p>'
            f'<div class="row">{"".join(body)}</div></section>')


def example(H: int | None = None, Q: int | None = None, K: int | None = None, d: int | None = None,
            dv: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """q [H, Q, d], k [H, K, d], v [H, K, dv] (float64): the worked example when no size is given
    (head 0 = the 4×3 Q and K, V = K; head 1 = the same rows in reverse order), else seeded random
    numbers with one decimal."""
    if all(x is None for x in (H, Q, K, d, dv)):
        q0, k0 = torch.tensor(EXAMPLE_Q, dtype=torch.float64), torch.tensor(EXAMPLE_K, dtype=torch.float64)  # [4, 3]
        q = torch.stack([q0, q0.flip(0)])  # [H=2, Q=4, d=3]
        k = torch.stack([k0, k0.flip(0)])  # [H=2, K=4, d=3]
        return {"q": q, "k": k, "v": k.clone()}
    H, Q, d = H or 2, Q or 4, d or 3
    K, dv = K or Q, dv or d
    for name, val in (("H", H), ("Q", Q), ("K", K), ("d", d), ("dv", dv)):
        if not 1 <= val <= LIMITS[name]:
            raise ValueError(f"explain --html draws every number: {name}={val} must be 1 … {LIMITS[name]}.")
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 10).round() / 10  # noqa: E731
    return {"q": r(H, Q, d), "k": r(H, K, d), "v": r(H, K, dv)}


def build(H: int | None = None, Q: int | None = None, K: int | None = None, d: int | None = None,
          dv: int | None = None, seed: int = 0, lang: str = "en") -> str:
    """The walkthrough page as one HTML string (see the module docstring), opening in ``lang``."""
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}.")
    x = example(H, Q, K, d, dv, seed)
    q, k, v = x["q"], x["k"], x["v"]  # [H, Q, d], [H, K, d], [H, K, dv]
    nH, nQ, dd = q.shape
    nK, ddv = k.shape[1], v.shape[2]
    worked = all(a is None for a in (H, Q, K, d, dv))
    align = "top_left" if nQ == nK else "bottom_right"
    mask = masks.causal(align)
    scale = 1 / math.sqrt(dd)
    allowed = mask.materialize(1, 1, nQ, nK)[0, 0].expand(nQ, nK)  # [Q, K] True = may attend
    qb, kb, vb = q[None], k[None], v[None]  # [B=1, H, Q, d], [B=1, H, K, d], [B=1, H, K, dv]
    P = attention_weights(qb, kb, mask, scale=scale)[0]  # [H, Q, K]
    O = attention(qb, kb, vb, mask, scale=scale, backend="reference")[0]  # [H, Q, dv]
    S = q[0] @ k[0].T  # [Q, d] @ [d, K] -> [Q, K], head 0
    qs, ks = [f"q{i + 1}" for i in range(nQ)], [f"k{j + 1}" for j in range(nK)]
    ds, dvs = [f"d{i + 1}" for i in range(dd)], [f"v{i + 1}" for i in range(ddv)]
    QK = {"Q": nQ, "K": nK}
    parts = []
    intro = t(
        f"One batch element and head 0 first (B=1, H={nH}): {nQ} query vectors and {nK} key vectors of d={dd} numbers each.",
        f"先看一个样本、第 0 个头（B=1，H={nH}）：{nQ} 个 Query 向量，{nK} 个 Key 向量，每个向量 d={dd} 维。",
    )
    if worked:
        intro += " " + t("These are the numbers of the worked example: n = 4 tokens, d = 3; V = K.",
                         "这是经典的例子：n = 4 个 token，每个向量 d = 3 维；V = K。")
    parts.append(section("q", t("1. Q: one row per query", "1. Q：每个查询一行"), intro,
                         matrix("Q", q[0], qs, ds, dims={"Q": nQ, "d": dd}, testid="m-q", fmt="{:g}")))
    parts.append(section(
        "k", t("2. K: one row per key", "2. K：每个键一行"),
        t("Each key is a vector of the same width d as the queries.", "每个 Key 向量与 Query 向量同样是 d 维。"),
        matrix("K", k[0], ks, ds, dims={"K": nK, "d": dd}, testid="m-k", fmt="{:g}")))
    parts.append(section(
        "kt", t("3. Kᵀ: transpose the last two dimensions", "3. Kᵀ：转置最后两维"),
        t("[K, d] → [d, K]: now the keys are columns.", "[K, d] → [d, K]：键变成列。"),
        matrix("Kᵀ", k[0].T, ds, ks, dims={"d": dd, "K": nK}, testid="m-kt", fmt="{:g}")))
    parts.append(section(
        "s", t("4. S = Q·Kᵀ: every query against every key", "4. S = Q·Kᵀ：每个查询与每个键两两打分"),
        t(
            f"[Q, d] @ [d, K] → [Q, K] = [{nQ}, {nK}]: "
            "row i, column j is the dot product of q<sub>i</sub> and k<sub>j</sub>. "
            "The inner dimension d must agree; the rows are the queries, the columns the keys.",
            f"[Q, d] @ [d, K] → [Q, K] = [{nQ}, {nK}]：第 i 行第 j 列是 q<sub>i</sub> 与 k<sub>j</sub> 的点积。"
            "内维 d 必须一致；行数 = 查询个数，列数 = 键个数。",
        ),
        matrix("S = Q·Kᵀ", S, qs, ks, dims=QK, testid="m-s")))
    parts.append(section(
        "scale", t("5. Scale by 1/√d", "5. 缩放：乘以 1/√d"),
        t(
            f"scale = 1/√{dd} = {scale:.4f} keeps the scores' spread independent of d "
            "(bhqk's default; pass scale=1 to skip it).",
            f"scale = 1/√{dd} = {scale:.4f}，使分数的大小不随 d 增长（bhqk 的默认值；scale=1 则不缩放）。",
        ),
        matrix("S·scale", S * scale, qs, ks, dims=QK, testid="m-scaled")))
    parts.append(section(
        "mask", t(f"6. Mask: causal ({align})", f"6. 掩码：因果掩码（{align}）"),
        t(
            "True (1) = may attend. A query may not look at later keys: those scores become −∞, so softmax gives them 0. "
            "The mask broadcasts to [B, H, Q, K].",
            "True (1) = 可以关注。查询不能看后面的键：这些分数变成 −∞，softmax 之后为 0。掩码广播到 [B, H, Q, K]。",
        ),
        matrix("mask", allowed.double(), qs, ks, dims=QK, testid="m-mask", fmt="{:.0f}"),
        matrix("S·scale, masked", S * scale, qs, ks, dims=QK, testid="m-masked", mask=allowed)))
    rows = []
    for i in range(nQ):
        s = (S[i] * scale).masked_fill(~allowed[i], float("-inf"))  # [K]
        e = torch.exp(s - s.max())  # [K]
        cells = "".join(f'<td class="{"masked" if not allowed[i, j] else ""}">{float(e[j]):.4f}</td>' for j in range(nK))
        pc = "".join(f"<td>{float(P[0, i, j]):.4f}</td>" for j in range(nK))
        rows.append(
            f'<table class="m prow" data-testid="p-row-{i}"><caption><b>{qs[i]}</b> {shape(K=nK)}</caption>'
            f"<tr><th></th>{''.join(f'<th>{c}</th>' for c in ks)}<th>Σ</th></tr>"
            f"<tr><th>exp(s − max)</th>{cells}<td>{float(e.sum()):.4f}</td></tr>"
            f"<tr><th>P = exp / Σ</th>{pc}<td>{float(P[0, i].sum()):.4f}</td></tr></table>"
        )
    parts.append(section(
        "p", t("7. P = softmax(S) over K, row by row", "7. P = softmax(S)：沿 K 按行归一化"),
        t(
            "Each query's row becomes weights that sum to 1: "
            "exponentiate (minus the row's largest score, for safety), divide by the sum.",
            "每个查询的一行变成和为 1 的权重：先取指数（减去该行最大值以防溢出），再除以总和。",
        ),
        *rows, matrix("P", P[0], qs, ks, dims=QK, testid="m-p")))
    parts.append(section(
        "o", t("8. O = P·V: mix the values", "8. O = P·V：按权重读出内容"),
        t(
            f"[Q, K] @ [K, dv] → [Q, dv] = [{nQ}, {ddv}]: each query gets a weighted sum of the value vectors. "
            "Attention mixes tokens; it never changes a token's width.",
            f"[Q, K] @ [K, dv] → [Q, dv] = [{nQ}, {ddv}]：每个查询得到值向量的加权和。"
            "注意力混合 token，不改变每个 token 的向量维度。",
        ),
        matrix("V", v[0], ks, dvs, dims={"K": nK, "dv": ddv}, testid="m-v", fmt="{:g}"),
        matrix("O = P·V", O[0], qs, dvs, dims={"Q": nQ, "dv": ddv}, testid="m-o")))
    # split and merge: the queries of all heads side by side [Q, H·d] → [H, Q, d] → … → O [H, Q, dv] → [Q, H·dv]
    q_all = merge_heads(qb)[0]  # [B, H, Q, d] -> [B, Q, H·d], b = 0: [Q, H·d]
    q_split = split_heads(q_all[None], nH)[0]  # [1, Q, H·d] -> [1, H, Q, d], b = 0: [H, Q, d]
    o_all = merge_heads(O[None])[0]  # [B, H, Q, dv] -> [B, Q, H·dv], b = 0: [Q, H·dv]
    heads_d = [f"h{h}" for h in range(nH) for _ in range(dd)]
    heads_dv = [f"h{h}" for h in range(nH) for _ in range(ddv)]
    split_tables = [matrix(f"Q, head {h}", q_split[h], qs, ds, dims={"Q": nQ, "d": dd}, testid=f"m-qhead-{h}",
                           col_class=[f"h{h}"] * dd, fmt="{:g}") for h in range(nH)]
    parts.append(section(
        "split", t("9. Split heads: [Q, H·d] → [H, Q, d]", "9. 拆分多头：[Q, H·d] → [H, Q, d]"),
        t(
            f"The projection X·W_Q gives all heads' queries side by side, H·d = {nH}·{dd} = {nH * dd} columns; "
            "'b n (h d) -> b h n d' cuts them into H heads of d columns. "
            "K and V split the same way; each head then runs steps 1–8 on its own.",
            f"投影 X·W_Q 得到所有头的查询并排在一起，共 H·d = {nH}·{dd} = {nH * dd} 列；"
            "'b n (h d) -> b h n d' 把它切成 H 个头，每头 d 列。K、V 同样拆分；每个头各自完成第 1–8 步。",
        ),
        matrix("Q, all heads", q_all, qs, ds * nH, dims={"Q": nQ, "H·d": nH * dd}, testid="m-qall", col_class=heads_d,
               fmt="{:g}"),
        '<span class="arrow">→</span>', *split_tables))
    o_tables = [matrix(f"O, head {h}", O[h], qs, dvs, dims={"Q": nQ, "dv": ddv}, testid=f"m-ohead-{h}",
                       col_class=[f"h{h}"] * ddv) for h in range(nH)]
    parts.append(section(
        "merge", t("10. Merge heads: [H, Q, dv] → [Q, H·dv]", "10. 合并多头：[H, Q, dv] → [Q, H·dv]"),
        t(
            f"'b h n d -> b n (h d)' puts the heads' outputs side by side again: [Q, H·dv] = [{nQ}, {nH * ddv}]. "
            "The output projection W_O then maps H·dv back to the model width D.",
            f"'b h n d -> b n (h d)' 把各头的输出重新拼接：[Q, H·dv] = [{nQ}, {nH * ddv}]。"
            "最后输出投影 W_O 把 H·dv 映射回模型维度 D。",
        ),
        *o_tables, '<span class="arrow">→</span>',
        matrix("O, merged", o_all, qs, dvs * nH, dims={"Q": nQ, "H·dv": nH * ddv}, testid="m-omerged", col_class=heads_dv)))
    sizes = f"B=1, H={nH}, Q={nQ}, K={nK}, d={dd}, dv={ddv}"
    return fill("walkthrough.html", lang=lang, title=_html.escape(f"bhqk · attention step by step · {sizes}"),
                heading=t(f"Attention, step by step ({sizes})", f"注意力，逐步计算（{sizes}）"),
                css=asset("walkthrough.css"), js=asset("walkthrough.js"), body="\n".join(parts))


def write(path: str | Path, **sizes) -> Path:
    """Write :func:`build`'s page to ``path`` and return it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build(**sizes), encoding="utf-8")
    return out


def cmd_explain_html(a) -> str:
    """``bhqk explain --html FILE [-H … -Q … -K … -d … --value-dim …]``: the sizes that were given, else the worked example."""
    if a.kv_heads not in (None, a.heads) or a.model_dim is not None or a.batch != 1:
        raise ValueError("explain --html draws B=1 and H = Hkv with D = H·d: leave out --batch, --kv-heads and --model-dim.")
    path = write(a.html, H=a.heads, Q=a.q_len, K=a.k_len, d=a.head_dim, dv=a.value_dim, lang=a.lang)
    return f"wrote {path} (every step with its numbers and named shapes; English / 中文 toggle; works offline)"
