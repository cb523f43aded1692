"""The axis vocabulary: one name per dimension, its meaning in English and in the seeds' Chinese."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dim:
    name: str
    meaning: str
    zh: str


DIMS: dict[str, Dim] = {
    d.name: d
    for d in (
        Dim("B", "batch size", "批次维度"),
        Dim("H", "number of query heads", "注意力头数维度"),
        Dim("Hkv", "number of key/value heads", "键值头数"),
        Dim("Q", "query length", "查询序列长度"),
        Dim("K", "key length", "键序列长度"),
        Dim("N", "sequence length", "序列长度"),
        Dim("d", "head dimension", "每个头的维度"),
        Dim("dv", "value head dimension", "值向量维度"),
        Dim("D", "model width", "模型维度"),
        Dim("Dk", "key input width", "键输入维度"),
        Dim("Dv", "value input width", "值输入维度"),
    )
}

# Why two tensors must agree on a dimension: the sentence that ends a ShapeError.
WHY_AGREE: dict[str, str] = {
    "B": "every input needs the same batch size B",
    "H": "q and the output need the same number of heads H",
    "Hkv": "k and v need the same number of key/value heads Hkv",
    "Q": "there is one query per row of the scores, so Q must agree",
    "K": "v holds one value vector per key, so it needs the same key length K as k",
    "d": "Q·Kᵀ needs the same inner dimension d",
    "dv": "the value head dimension dv must agree",
    "D": "the model width D must agree",
    "Dk": "the key input width must agree",
    "Dv": "the value input width must agree",
}


def meaning(name: str, lang: str = "en") -> str:
    """The words for a dimension name (``"d"`` → ``"head dimension"``)."""
    dim = DIMS.get(name)
    if dim is None:
        return name
    return dim.zh if lang == "zh" else dim.meaning
