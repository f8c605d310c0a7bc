"""Reading slices of tensors from a directory of safetensors files, never whole files.

The files read are the ones transformers reads: the shards that ``model.safetensors.index.json``
names (``weight_map``: tensor name -> file), else ``model.safetensors``, else the shards named by
the usual pattern ``model-00001-of-0000N.safetensors`` (all N of them). Any other ``*.safetensors``
in the directory (inputs and outputs of ``moeshard run`` kept beside the model, say) is ignored,
and said so once through the ``moeshard.checkpoint`` logger at INFO level; a tensor stored twice
among the files read is refused, naming both. A directory with none of these, but other
``*.safetensors`` files, is refused with their names (transformers would not load it either).
Pickle-based weights (``*.bin``, ``*.pt``, ``*.pth``) are refused: unpickling a file can run
arbitrary code, so moeshard never does it.

How reading stays small: ``safe_open(...).get_slice(name)[index]`` returns a *view* into the
file's memory map, and only the pages that view touches become resident. ``read`` copies the
view into memory the caller owns and then closes the file, which unmaps it, so the resident set
grows by the copies plus, transiently, the pages of one batch of reads. A rank that reads its
experts one at a time therefore peaks at about its own share plus one expert, not at the file
size (``scripts/checkpoint_memory.py`` measures it).

Every failure is a ValueError naming the file: a missing file, a missing tensor (with the files
looked in), a malformed or truncated header (safetensors checks that the header covers the
whole file when it opens it, so a truncated file is refused before any read), a wrong index.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from moeshard.outputs import check_input_dir, check_input_file
from moeshard.quant import from_wire, to_wire

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# transformers' shard names without an index: model-00001-of-00003.safetensors ...
SHARD_PATTERN = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")

log = logging.getLogger("moeshard.checkpoint")

# safetensors dtype strings -> torch dtypes (the ones a model's weights or scales can have);
# F8_E8M0 (UE8M0 scales) through ``torch_dtype``: torch has it from 2.7 on.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def torch_dtype(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype string; None where moeshard (or this torch) has none."""
    if code == "F8_E8M0":
        return getattr(torch, "float8_e8m0fnu", None)
    return DTYPES.get(code)


Index = tuple[slice | int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """shape and dtype of one stored tensor, and the file it lives in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


def _owned_copy(view: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous copy of a memory-mapped view (optionally converted), owning its storage."""
    if dtype is not None and dtype != view.dtype:
        return view.to(dtype=dtype, memory_format=torch.contiguous_format)
    # 1-byte floats are copied as bytes: not every build implements clone for them.
    return from_wire(to_wire(view).clone(memory_format=torch.contiguous_format), view.dtype)


# A vision-language checkpoint keeps its text model under a ``language_model`` part (Qwen3.5-MoE:
# ``model.language_model.layers.*``, Llama 4: ``language_model.model.layers.*`` and
# ``language_model.lm_head.*``); transformers' causal LM of it reads those tensors without that part.
# DeepSeek-V4's release keeps its decoder layers in a flat namespace (``layers.{L}.*``), which
# transformers' causal LM reads as ``model.layers.{L}.*`` (the release's other top-level names are
# its family's ``dense_renames``). (stored prefix, the causal LM's prefix)
TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("layers.", "model.layers."))


def text_model_name(stored: str) -> str:
    """The causal LM's name of a vision-language checkpoint's tensor ``stored`` (itself outside the
    text model)."""
    for prefix, plain in TEXT_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return plain + stored[len(prefix):]
    return stored


class SafetensorsCheckpoint:
    """The tensors of one model directory: which file holds which name; slice reads.

    ``model_dir``: the directory. Construction reads only ``model.safetensors.index.json`` or, without
    one, the headers of the ``*.safetensors`` files; no tensor data.

    Names are the causal LM's: in a checkpoint that holds no ``model.layers.*`` (a vision-language
    one, whose text model is stored under a ``language_model`` part, or one whose decoder layers are
    ``layers.*``: ``TEXT_MODEL_PREFIXES``), each text-model tensor is known by the name transformers'
    causal LM gives it (``model.layers.0...`` for ``model.language_model.layers.0...`` or
    ``layers.0...``), as transformers' ``AutoModelForCausalLM`` loads it; the vision tower's tensors
    keep their names and are read by nothing.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = check_input_dir(model_dir, "model directory")
        try:
            self._discover()
        except OSError as exc:  # a file of the directory that cannot be listed or read
            raise ValueError(f"model directory {str(self.model_dir)!r}: {exc.strerror or exc}"
                             + (f" ({exc.filename})" if exc.filename else "")) from None

    def _discover(self) -> None:
        self._where: dict[str, Path] = {}
        self._info: dict[str, TensorInfo] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            self._read_index(index)
        else:
            for path in self._weight_files():
                with self._open(path) as f:
                    for name in f.keys():
                        if name in self._where:
                            # Without an index nothing says which copy is meant: refuse rather
                            # than let the file that sorts last win.
                            raise ValueError(f"tensor {name!r} is stored twice, in {self._where[name].name!r} and "
                                             f"{path.name!r} under {str(self.model_dir)!r}, and there is no "
                                             f"{INDEX_FILE} to say which one is meant")
                        self._where[name] = path
        self._stored: dict[str, str] = {}  # a text-model tensor's causal-LM name -> its stored name
        if not any(n.startswith("model.layers.") for n in self._where):
            self._as_text_model()
        read = set(self._where.values())
        self.ignored = sorted(p.name for p in self.model_dir.glob("*.safetensors") if p not in read)
        if self.ignored:
            log.info("%s: not model weights, ignored (as transformers ignores them): %s", self.model_dir,
                     ", ".join(self.ignored))

    def _as_text_model(self) -> None:
        """Names a vision-language checkpoint's text-model tensors as the causal LM does."""
        renamed = {name: text_model_name(name) for name in self._where}
        for stored, plain in renamed.items():
            if plain != stored and plain in self._where:
                raise ValueError(f"model directory {str(self.model_dir)!r} holds both {stored!r} and {plain!r}, the "
                                 f"causal LM's name of the first; which one is the text model's is not clear")
        self._where = {renamed[name]: path for name, path in self._where.items()}
        self._stored = {plain: stored for stored, plain in renamed.items() if plain != stored}

    def stored_name(self, name: str) -> str:
        """The name the files keep the tensor ``name`` under."""
        return self._stored.get(name, name)

    # -- discovery ------------------------------------------------------------------------
    def _weight_files(self) -> list[Path]:
        """Without an index: ``model.safetensors``, else every ``model-i-of-N`` shard (all N)."""
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            return [single]
        present = sorted(p for p in self.model_dir.glob("*.safetensors") if p.is_file())
        shards = [(p, SHARD_PATTERN.match(p.name)) for p in present]
        matched = [(p, int(m.group(1)), int(m.group(2))) for p, m in shards if m is not None]
        if not matched:
            if present:
                raise ValueError(f"model directory {str(self.model_dir)!r} has no {SINGLE_FILE}, no {INDEX_FILE} and "
                                 f"no model-00001-of-0000N.safetensors shards; its other *.safetensors files "
                                 f"{[p.name for p in present][:5]} are not read as model weights (transformers "
                                 f"reads only those names either)")
            self._refuse_empty()
        totals = sorted({n for _, _, n in matched})
        if len(totals) > 1:
            raise ValueError(f"model directory {str(self.model_dir)!r}: shards of different sets "
                             f"{[p.name for p, _, _ in matched][:6]} (of {totals}); which set is the model?")
        total = totals[0]
        have = {i for _, i, _ in matched}
        missing = [i for i in range(1, total + 1) if i not in have]
        if missing or any(i < 1 or i > total for i in have):
            raise ValueError(f"model directory {str(self.model_dir)!r}: shard set of {total} files is incomplete or "
                             f"misnumbered: missing shard numbers {missing[:10]}, found "
                             f"{sorted(p.name for p, _, _ in matched)[:6]}")
        return [p for p, _, _ in sorted(matched, key=lambda t: t[1])]

    def _refuse_empty(self) -> NoReturn:
        pickled = sorted(p.name for p in self.model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(f"model directory {str(self.model_dir)!r} has no *.safetensors weights, only pickle-based "
                             f"files {pickled[:5]}; moeshard never unpickles .bin/.pt files (unpickling can run "
                             f"arbitrary code). Convert them to safetensors first.")
        raise ValueError(f"model directory {str(self.model_dir)!r} has no *.safetensors files and no {INDEX_FILE}")

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index (need a JSON object with 'weight_map'): "
                             f"{type(exc).__name__}: {exc}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
                raise ValueError(f"{index}: tensor {name!r} maps to {file!r}, not a *.safetensors file name in "
                                 f"this directory")
            self._where[name] = self.model_dir / file

    def _open(self, path: Path):
        return open_safetensors(path)

    @property
    def files(self) -> list[Path]:
        """The files holding tensors, in name order."""
        return sorted(set(self._where.values()))

    def has(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        """How many tensors the checkpoint holds (bounds every loop over names from a config)."""
        return len(self._where)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self._where if n.startswith(prefix))

    def _missing(self, name: str, hint: str = "") -> ValueError:
        where = self._where.get(name)
        looked = [str(where)] if where else [p.name for p in self.files]
        return ValueError(f"tensor {name!r} is missing{hint}; looked in {looked} under {str(self.model_dir)!r}")

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and file of ``name`` (reads the header of its file once)."""
        if name in self._info:
            return self._info[name]
        if name not in self._where:
            raise self._missing(name)
        path = self._where[name]
        with self._open(path) as f:
            if self.stored_name(name) not in set(f.keys()):
                raise ValueError(f"tensor {self.stored_name(name)!r} is missing from {str(path)!r}, the file the index "
                                 f"names for it")
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = torch_dtype(sl.get_dtype())
                if dtype is None:
                    continue
                known = text_model_name(key) if self._stored else key
                self._info[known] = TensorInfo(known, tuple(sl.get_shape()), dtype, path)
        if name not in self._info:
            raise ValueError(f"tensor {name!r} in {str(path)!r} has a dtype moeshard cannot use")
        return self._info[name]

    def expect(self, name: str, shape: Sequence[int], dtypes: Iterable[torch.dtype] | None = None) -> TensorInfo:
        """``info(name)`` after checking its shape (and dtype); ValueError names tensor, file, both values."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise ValueError(f"tensor {name!r} in {str(info.file)!r} has shape {list(info.shape)}, expected "
                             f"{list(shape)} from the model config")
        if dtypes is not None:
            dtypes = tuple(dtypes)
            if info.dtype not in dtypes:
                raise ValueError(f"tensor {name!r} in {str(info.file)!r} has dtype {info.dtype}, expected one of "
                                 f"{[str(d) for d in dtypes]}")
        return info

    # -- reading --------------------------------------------------------------------------
    def read_many(self, requests: Sequence[tuple[str, Index]], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Reads ``tensor[index]`` for each ``(name, index)``; each file is opened once per call.

        index: a tuple of slices/ints over the leading dimensions (``()`` = the whole tensor).
        dtype: convert floating tensors to it (1-byte floats and integers keep their dtype).
        Returns owned, contiguous CPU tensors in request order; the files are closed (unmapped)
        before returning.
        """
        by_file: dict[Path, list[int]] = {}
        for i, (name, _) in enumerate(requests):
            self.info(name)
            by_file.setdefault(self._where[name], []).append(i)
        out: list[torch.Tensor | None] = [None] * len(requests)
        for path, which in by_file.items():
            with self._open(path) as f:
                for i in which:
                    name, index = requests[i]
                    view = self._view(f, name, index, path)
                    target = dtype if dtype is not None and view.is_floating_point() and view.element_size() > 1 else None
                    out[i] = _owned_copy(view, target)
                    del view
        return out  # type: ignore[return-value]

    def _view(self, f: Any, name: str, index: Index, path: Path) -> torch.Tensor:
        """``tensor[index]`` of ``name`` from the open file ``f`` (a mapped view; a 0-dim tensor,
        such as a per-tensor scale, which a slice cannot take, read whole)."""
        try:
            sl = f.get_slice(self.stored_name(name))
            if index:
                return sl[index]
            return sl[:] if sl.get_shape() else f.get_tensor(self.stored_name(name))
        except SafetensorError as exc:
            raise ValueError(f"tensor {name!r} in {str(path)!r} cannot be read: {exc}") from None

    def read_into(self, requests: Sequence[tuple[str, Index]], destinations: Sequence[torch.Tensor]) -> None:
        """Copies ``tensor[index]`` of each request straight into the matching destination (a
        preallocated tensor or a view of one, its shape the slice's; floating values are converted
        to its dtype, 1-byte floats are copied as bytes and must match). No intermediate copy is
        made, so a rank's memory holds its share plus the mapped pages of this one batch.
        Each destination is checked for NaN/Inf after the copy."""
        by_file: dict[Path, list[int]] = {}
        for i, (name, _) in enumerate(requests):
            self.info(name)
            by_file.setdefault(self._where[name], []).append(i)
        for path, which in by_file.items():
            with self._open(path) as f:
                for i in which:
                    (name, index), dst = requests[i], destinations[i]
                    view = self._view(f, name, index, path)
                    if tuple(view.shape) != tuple(dst.shape):
                        raise ValueError(f"tensor {name!r} in {str(path)!r}: slice {index} has shape {list(view.shape)}, "
                                         f"the destination {list(dst.shape)}")
                    if dst.element_size() == 1:
                        if view.dtype != dst.dtype:
                            raise ValueError(f"tensor {name!r} in {str(path)!r} has dtype {view.dtype}, expected {dst.dtype}")
                        to_wire(dst).copy_(to_wire(view))  # bytes: float8 has no copy_ on every build
                    elif view.element_size() == 1:
                        dst.copy_(view.float())  # e.g. UE8M0 scales; small tensors
                    else:
                        dst.copy_(view)
                    del view
                    check_finite(dst, name, path)

    def read(self, name: str, index: Index = (), dtype: torch.dtype | None = None) -> torch.Tensor:
        """One slice; see ``read_many``."""
        return self.read_many([(name, index)], dtype)[0]


FINITE_CHUNK = 1 << 18  # elements per step of check_finite


def check_finite(t: torch.Tensor, name: str, file: Path | str) -> None:
    """ValueError if ``t`` holds NaN or Inf (float8_e4m3fn: its NaN code, it has no Inf).

    Checked in chunks: ``isfinite`` on a whole expert would allocate temporaries the size of the
    expert, which the allocator may keep, defeating the point of reading slice by slice."""
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start:start + FINITE_CHUNK]
        if t.dtype == torch.float8_e4m3fn:
            bad += int(((chunk.view(torch.uint8) & 0x7F) == 0x7F).sum())
        else:
            bad += chunk.numel() - int(torch.isfinite(chunk).sum())
    if bad:
        raise ValueError(f"tensor {name!r} in {str(file)!r} holds {bad} NaN/Inf value(s)")


def open_safetensors(path: Path | str, what: str = "safetensors file"):
    """``safe_open`` with refusals that name the file: missing, malformed/truncated, unreadable."""
    path = check_input_file(path, what)
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{what} {str(path)!r} is malformed or truncated: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be opened: {exc}") from None
