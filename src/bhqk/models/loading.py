"""Loading Hugging Face checkpoint folders: key tables, strict load, per-key shape checks.

A key table is a pure ``remap(state_dict) -> state_dict`` from the checkpoint's names to bhqk's.
Keys that the table does not know pass through unchanged, so the strict load names them as
unexpected. Every error is a ``LoadError`` that names the key (and the checkpoint key it came from).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import LoadError

StateDict = dict[str, torch.Tensor]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


# --- reading a folder ------------------------------------------------------------------------------

def read_config(folder: str | Path, expect: str | tuple[str, ...] | None = None) -> dict:
    """``config.json`` as a dict; with ``expect``, a LoadError unless its model_type is one of them."""
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise LoadError(f"{folder} is not a folder; give a local Hugging Face model folder (config.json + weights).")
    if not path.is_file():
        raise LoadError(f"{folder} has no config.json; a Hugging Face model folder needs one.")
    config = read_json(path, "config.json")
    if expect is not None:
        expect = (expect,) if isinstance(expect, str) else expect
        kind = config.get("model_type")
        if kind not in expect:
            raise LoadError(f"unknown architecture: {path} has model_type={kind!r} (architectures="
                            f"{config.get('architectures')}); this loader takes model_type {' or '.join(map(repr, expect))}.")
    return config


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; a LoadError naming the file when it is not one."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path} is not valid JSON ({what}): {e}.") from None
    if not isinstance(obj, dict):
        raise LoadError(f"{path} must hold a JSON object {{...}} ({what}), got a JSON {type(obj).__name__}.")
    return obj


def read_weights(folder: str | Path) -> StateDict:
    """The folder's tensors: model.safetensors (or its sharded index), else pytorch_model.bin."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            out: StateDict = {}
            for shard in _shards(path):
                out.update(_read_file(folder / shard))
            return out
        return _read_file(path)
    raise LoadError(f"{folder} has no weights: expected one of {', '.join(WEIGHT_FILES)}.")


def _shards(index: Path) -> list[str]:
    """The shard file names of a sharded checkpoint's index (its ``weight_map`` values)."""
    weight_map = read_json(index, "a sharded checkpoint's index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoadError(f"{index} has no weight_map (an object from each tensor name to its shard file).")
    shards = set(weight_map.values())
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise LoadError(f"{index}: weight_map names shard {shard!r}; it must be a file name in the same folder.")
    return sorted(shards)


LFS_POINTER = b"version https://git-lfs"


def _read_file(path: Path) -> StateDict:
    """One weight file's tensors; a LoadError naming the file when it is empty, a Git LFS pointer,
    truncated or not a checkpoint at all."""
    if not path.is_file():
        raise LoadError(f"missing weight file {path}.")
    with open(path, "rb") as f:
        head = f.read(len(LFS_POINTER))
    if not head:
        raise LoadError(f"{path} is empty (0 bytes); download the weights again.")
    if head == LFS_POINTER:
        raise LoadError(f"{path} is a Git LFS pointer, not the weights: run `git lfs pull` in {path.parent} "
                        f"(or download the file itself).")
    obj: object  # checked below: a dict of str -> Tensor
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise LoadError("reading .safetensors needs the safetensors package: pip install 'bhqk[models]'.") from None
        try:
            obj = load_file(str(path))
        except Exception as e:  # safetensors raises SafetensorError (and others) for corrupt files
            raise LoadError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    else:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # pickle/zip errors, EOFError, RuntimeError for truncated files
            raise LoadError(f"{path} is not a readable PyTorch checkpoint (truncated or corrupt?): "
                            f"{type(e).__name__}: {e}") from None
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
            obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise LoadError(f"{path} does not hold a state dict (a mapping from names to tensors), got {type(obj).__name__}.")
    return obj


# --- config fields -----------------------------------------------------------------------------------

_MISSING = object()


def config_int(config: dict, key: str, where: str, *, minimum: int = 1, default: object = _MISSING) -> int:
    """An integer field of config.json (>= ``minimum``); a LoadError naming the file and the field."""
    value = config.get(key, default)
    if value is _MISSING:
        raise LoadError(f"{where} lacks {key!r}.")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LoadError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}.")
    return value


def config_heads(config: dict, width_key: str, heads_key: str, where: str) -> tuple[int, int]:
    """(D, H): the model width and the head count of config.json, D = H·d with a whole d."""
    D, H = config_int(config, width_key, where), config_int(config, heads_key, where)
    if D % H:
        raise LoadError(f"{where}: {width_key}={D} is not divisible by {heads_key}={H}; D = H·d needs a whole head dimension.")
    return D, H


def config_float(config: dict, key: str, where: str, default: float) -> float:
    """A positive finite number field of config.json (e.g. a LayerNorm epsilon)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise LoadError(f"{where}: {key} must be a positive number, got {value!r}.")
    return float(value)


def config_str(config: dict, key: str, where: str, default: str) -> str:
    value = config.get(key, default)
    if not isinstance(value, str):
        raise LoadError(f"{where}: {key} must be a string, got {value!r}.")
    return value


# --- key tables ------------------------------------------------------------------------------------

Rule = tuple[str, str]  # (regex on the checkpoint key, replacement); groups used in order
_GROUP = re.compile(r"\((?:[^()])*\)")


def rename(state_dict: StateDict, rules: list[Rule], ignore: list[str],
           prefixes: tuple[str, ...] = ()) -> tuple[StateDict, dict[str, str]]:
    """Apply the first matching rule to each key; drop ``ignore`` matches; strip ``prefixes``.
    Returns the new dict and, for messages, each new key's checkpoint key."""
    out: StateDict = {}
    source: dict[str, str] = {}
    for key, value in state_dict.items():
        name = key
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        if any(re.fullmatch(pat, name) for pat in ignore):
            continue
        for pat, rep in rules:
            if re.fullmatch(pat, name):
                name = re.sub(pat, rep, name)
                break
        out[name] = value
        source[name] = key
    return out, source


def checkpoint_key(name: str, rules: list[Rule], prefix: str = "") -> str:
    """The checkpoint key a bhqk key comes from: the table read backwards (for error messages)."""
    for pat, rep in rules:
        groups = _GROUP.findall(pat)
        parts = re.split(r"\\(\d)", rep)  # literal, group number, literal, ...
        rx = "".join(re.escape(x) if i % 2 == 0 else groups[int(x) - 1] for i, x in enumerate(parts))
        m = re.fullmatch(rx, name)
        if m:
            literals = _GROUP.split(pat)  # the pattern's text around its groups; the groups get the matched values
            key = literals[0] + "".join(g + lit for g, lit in zip(m.groups(), literals[1:], strict=True))
            return prefix + key.replace("\\.", ".")
    return prefix + name


BERT_PREFIXES = ("bert.",)
BERT_IGNORE = [r"pooler\..*", r"cls\..*", r"embeddings\.position_ids", r"embeddings\.token_type_ids", r"classifier\..*",
               r"qa_outputs\..*"]
BERT_RULES: list[Rule] = [(r"(.*)\.gamma", r"\1.weight"), (r"(.*)\.beta", r"\1.bias")]  # old TF-converted LayerNorm names
BERT_TABLE: list[Rule] = [
    (r"embeddings\.word_embeddings\.(weight)", r"embeddings.word.\1"),
    (r"embeddings\.position_embeddings\.(weight)", r"embeddings.position.\1"),
    (r"embeddings\.token_type_embeddings\.(weight)", r"embeddings.token_type.\1"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"embeddings.norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"layers.\1.attn.q_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"layers.\1.attn.k_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"layers.\1.attn.v_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"layers.\1.attn.out_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.ff_in.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.ff_out.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.ff_norm.\2"),
]


def remap_bert(state_dict: StateDict) -> StateDict:
    """Hugging Face BERT names (BertModel, or ``bert.``-prefixed task models) → bhqk BertEncoder names.
    The pooler and task heads are dropped (bhqk's encoder is pooler-free)."""
    return _remap_bert(state_dict)[0]


def _remap_bert(state_dict: StateDict) -> tuple[StateDict, dict[str, str]]:
    sd, src = rename(state_dict, BERT_RULES, [], ())
    sd2, src2 = rename(sd, BERT_TABLE, BERT_IGNORE, BERT_PREFIXES)
    return sd2, {k: src[v] for k, v in src2.items()}


GPT2_PREFIXES = ("transformer.",)
GPT2_IGNORE = [r"h\.\d+\.attn\.bias", r"h\.\d+\.attn\.masked_bias"]  # causal-mask buffers of old checkpoints
GPT2_TABLE: list[Rule] = [
    (r"wte\.weight", r"tokens.weight"),
    (r"wpe\.weight", r"positions.weight"),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", r"blocks.\1.attn_norm.\2"),
    (r"h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"blocks.\1.attn.out_proj.\2"),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", r"blocks.\1.ff_norm.\2"),
    (r"h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"blocks.\1.ff_in.\2"),
    (r"h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"blocks.\1.ff_out.\2"),
    (r"ln_f\.(weight|bias)", r"final_norm.\1"),
]
GPT2_REVERSE = GPT2_TABLE + [(r"h\.(\d+)\.attn\.c_attn\.(weight|bias)", r"blocks.\1.attn.qkv.\2")]  # q/k/v_proj come from c_attn
_C_ATTN = re.compile(r"h\.(\d+)\.attn\.c_attn\.(weight|bias)")
_CONV1D = re.compile(r"blocks\.\d+\.(attn\.out_proj|ff_in|ff_out)\.weight")


def remap_gpt2(state_dict: StateDict) -> StateDict:
    """Hugging Face GPT-2 names → bhqk GPT2 names. Conv1D weights are [in, out]: transposed to
    nn.Linear's [out, in]; the fused ``c_attn`` [D, 3D] is split into q/k/v projections. The LM head
    is tied to the token embedding, so ``lm_head.weight`` is dropped when it equals it."""
    return _remap_gpt2(state_dict)[0]


def _remap_gpt2(state_dict: StateDict) -> tuple[StateDict, dict[str, str]]:
    head = state_dict.get("lm_head.weight")
    wte = state_dict.get("transformer.wte.weight", state_dict.get("wte.weight"))
    sd = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    if head is not None and not (wte is not None and head.shape == wte.shape and torch.equal(head, wte)):
        sd["lm_head.weight"] = head  # an untied head: left for the strict load to report as unexpected
    out: StateDict = {}
    source: dict[str, str] = {}
    renamed, src = rename(sd, GPT2_TABLE, GPT2_IGNORE, GPT2_PREFIXES)
    for name, value in renamed.items():
        m = _C_ATTN.fullmatch(name)
        if m:
            layer, kind = m.groups()
            if value.shape[-1] % 3:
                raise LoadError(f"wrong shape for checkpoint key {src[name]!r}: {list(value.shape)}; c_attn must be "
                                f"[D, 3·D] (weight) or [3·D] (bias) to split into query, key and value.")
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=-1)):  # [D, 3D] -> 3 × [D, D]
                new = f"blocks.{layer}.attn.{proj}.{kind}"
                out[new] = part.t().contiguous() if kind == "weight" else part.contiguous()  # [in, out] -> [out, in]
                source[new] = src[name]
            continue
        if _CONV1D.fullmatch(name):
            value = value.t().contiguous()  # Conv1D [in, out] -> Linear [out, in]
        out[name] = value
        source[name] = src[name]
    return out, source


# --- strict load ---------------------------------------------------------------------------------

def load_checked(model: nn.Module, state_dict: StateDict, source: dict[str, str] | None = None, *, folder=None,
                 origin: Callable[[str], str] | None = None, raw_shapes: dict[str, torch.Size] | None = None) -> None:
    """Copy ``state_dict`` into ``model``: every key present, none unexpected, every shape equal.
    Otherwise one LoadError listing what is wrong. ``source`` maps each key to its checkpoint key and
    ``origin`` names the checkpoint key a missing one should have come from; ``raw_shapes`` are the
    checkpoint's own shapes (before transposes) for the message."""
    source = source or {}
    origin = origin or (lambda k: k)
    where = f" in {folder}" if folder is not None else ""
    own = model.state_dict()
    missing = sorted({origin(k) for k in own if k not in state_dict})
    unexpected = sorted(k for k in state_dict if k not in own)
    raw_shapes = raw_shapes or {}
    wrong, named = [], set()
    for k in own:
        if k in state_dict and tuple(state_dict[k].shape) != tuple(own[k].shape) and source.get(k, k) not in named:
            src = source.get(k, k)
            named.add(src)  # c_attn feeds three keys: one line
            got = list(state_dict[k].shape)
            raw = raw_shapes.get(src)
            note = f" (after the key table: {got})" if raw is not None and list(raw) != got else ""
            wrong.append(f"  {src}: checkpoint has {list(raw) if raw is not None else got}{note}, "
                         f"the model's {k} needs {list(own[k].shape)}")
    problems = []
    if missing:
        problems.append("missing keys (the model needs them, the checkpoint lacks them): " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected keys (in the checkpoint, unknown to the model): "
                        + ", ".join(f"{source.get(k, k)}" for k in unexpected))
    if wrong:
        problems.append("wrong shapes:\n" + "\n".join(wrong))
    if problems:
        raise LoadError(f"checkpoint{where} does not fit {type(model).__name__}: " + "; ".join(problems))
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state_dict[k])


def load_bert(model: nn.Module, folder: str | Path) -> None:
    """Strict load of a Hugging Face BERT folder's weights into a bhqk BertEncoder."""
    raw = read_weights(folder)
    prefix = "bert." if any(k.startswith("bert.") for k in raw) else ""
    sd, source = _remap_bert(raw)
    load_checked(model, sd, source, folder=folder, origin=lambda k: checkpoint_key(k, BERT_TABLE, prefix),
                 raw_shapes={k: v.shape for k, v in raw.items()})


def load_gpt2(model: nn.Module, folder: str | Path) -> None:
    """Strict load of a Hugging Face GPT-2 folder's weights into a bhqk GPT2."""
    raw = read_weights(folder)
    prefix = "transformer." if any(k.startswith("transformer.") for k in raw) else ""
    sd, source = _remap_gpt2(raw)
    def origin(k: str) -> str:
        return checkpoint_key(re.sub(r"\.attn\.[qkv]_proj\.", ".attn.qkv.", k), GPT2_REVERSE, prefix)

    load_checked(model, sd, source, folder=folder, origin=origin, raw_shapes={k: v.shape for k, v in raw.items()})
