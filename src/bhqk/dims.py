"""The axis vocabulary: one name per dimension, its meaning in English and in the seeds' Chinese."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dim:
    name: str
    meaning: str
    zh: str
    agree: str = ""  # why two tensors must agree on it: the sentence that ends a ShapeError


DIMS: dict[str, Dim] = {
    d.name: d
    for d in (
        Dim("B", "batch size", "批次维度", "every input needs the same batch size B"),
        Dim("H", "number of query heads", "注意力头数维度", "q and the output need the same number of heads H"),
        Dim("Hkv", "number of key/value heads", "键值头数", "k and v need the same number of key/value heads Hkv"),
        Dim("Q", "query length", "查询序列长度", "there is one query per row of the scores, so Q must agree"),
        Dim("K", "key length", "键序列长度", "v holds one value vector per key, so it needs the same key length K as k"),
        Dim("N", "sequence length", "序列长度"),
        Dim("d", "head dimension", "每个头的维度", "Q·Kᵀ needs the same inner dimension d"),
        Dim("dv", "value head dimension", "值向量维度", "the value head dimension dv must agree"),
        Dim("D", "model width", "模型维度", "the model width D must agree"),
        Dim("Dk", "key input width", "键输入维度", "the key input width must agree"),
        Dim("Dv", "value input width", "值输入维度", "the value input width must agree"),
    )
}


def meaning(name: str, lang: str = "en") -> str:
    """The words for a dimension name (``"d"`` → ``"head dimension"``)."""
    dim = DIMS.get(name)
    if dim is None:
        return name
    return dim.zh if lang == "zh" else dim.meaning


def why_agree(name: str) -> str:
    """Why two tensors must agree on the dimension ``name`` (the end of a ShapeError)."""
    dim = DIMS.get(name)
    return dim.agree if dim is not None and dim.agree else f"{name} must agree"
