"""Option values the subcommands share, parsed one way: comma-separated ints, names, layouts,
case ids, timeouts, seeds; and the layout options of the commands that run a model
(``add_layout_arguments``), and ``--allow-nonfinite`` (``add_allow_nonfinite``).

Each parser raises ValueError naming the flag and the text it could not read (the CLI prints
it as one line, exit code 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from moeshard import validate
from moeshard.parallel.config import ParallelConfig


def add_layout_arguments(parser: argparse.ArgumentParser, dtype_help: str, timeout_help: str) -> None:
    """The "layout and numerics" options of ``run`` and ``generate``: --dp, --tp, --ep, --backend,
    --quant, --defer-input-quant, --shared-quant, --dtype, --device, --timeout (the two commands
    word the defaults of --dtype and --timeout their own way)."""
    from moeshard.config import MODEL_DTYPES, shared_schemes
    from moeshard.dispatch.registry import BACKENDS
    from moeshard.quant.schemes import BUILTIN_SCHEMES

    lay = parser.add_argument_group("layout and numerics")
    lay.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per DP rank (default 1)")
    lay.add_argument("--ep", action="store_true", help="expert parallelism over all dp*tp ranks")
    lay.add_argument("--backend", choices=sorted(BACKENDS), help="dispatch backend (default: local, all2all with --ep)")
    lay.add_argument("--quant", choices=BUILTIN_SCHEMES, help="expert quantization (default: the checkpoint's own)")
    lay.add_argument("--defer-input-quant", action="store_true", help="dispatch unquantized activations")
    lay.add_argument("--shared-quant", choices=("none", *shared_schemes()), default="none",
                     help="quantize the shared experts too, with this per-row or per-block scheme (default: the "
                          "model dtype)")
    lay.add_argument("--dtype", choices=sorted(MODEL_DTYPES) + ["bf16", "fp16", "fp32"], help=dtype_help)
    lay.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    lay.add_argument("--timeout", type=float, default=600.0, help=timeout_help)


def add_allow_nonfinite(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--allow-nonfinite``: accept (and write) ``what`` (a result holding NaN/Inf); by default
    such a result is refused with exit code 7 and nothing is written."""
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help=f"accept and write {what} (default: refused, exit code 7, nothing written)")


def ints(text: str, flag: str, maximum: int = validate.MAX_DIM) -> tuple[int, ...]:
    """``"1,16, 64"`` -> ``(1, 16, 64)``; empty entries are skipped; values above ``maximum`` are refused."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    for v in values:
        if v > maximum:
            raise ValueError(f"{flag}: {v} is larger than {maximum}")
    return values


def case_ids(values: Iterable[str] | None, flag: str = "--only") -> tuple[str, ...] | None:
    """Case ids exactly as ``moeshard check --list`` prints them, from one or more ``--only`` values.

    A value holds one id or several, separated by commas or whitespace. Ids contain commas of
    their own (the token counts, ``.../t0,5``, which a load-balancing id follows with
    ``/eplb-...``), so a comma starts a new id only where the text after it holds a ``/`` and
    does not begin with a token count (every id begins with its layout):
    ``"a/b/t0,5,c/d/t1,2/eplb-r1"`` -> ``("a/b/t0,5", "c/d/t1,2/eplb-r1")``. None (the option
    not given) stays None.
    """
    if values is None:
        return None
    ids: list[str] = []
    for value in values:
        for chunk in value.split():
            first = True
            for part in chunk.split(","):
                if not part:
                    continue
                if first or ("/" in part and not part.split("/", 1)[0].isdigit()):
                    ids.append(part)
                else:
                    ids[-1] += "," + part
                first = False
    if not ids:
        raise ValueError(f"{flag}: no case id given")
    return tuple(dict.fromkeys(ids))  # an id given twice runs (and counts) once


def timeout(value: float, flag: str = "--timeout") -> float:
    """A finite timeout in seconds, > 0 and at most ``validate.MAX_TIMEOUT_S`` (``inf`` is refused)."""
    return validate.timeout("", flag, value)


def seed(value: int, flag: str = "--seed") -> int:
    """A seed in ``[0, validate.MAX_SEED]``."""
    return validate.seed("", flag, value)


def names(text: str | None) -> tuple[str, ...] | None:
    """``"a, b"`` -> ``("a", "b")``; None (the option not given) stays None."""
    return None if text is None else tuple(v.strip() for v in text.split(",") if v.strip())


def layouts(text: str, flag: str = "--layouts") -> tuple[ParallelConfig, ...]:
    """``"dp2-tp2-ep,dp1-tp2-noep"`` (commas) or ``"2,2,on;1,2,off"`` (semicolons) -> layouts,
    each read by ``ParallelConfig.parse``."""
    named = text.strip().lower().startswith("dp") and ";" not in text
    try:
        return tuple(ParallelConfig.parse(t) for t in text.split("," if named else ";") if t.strip())
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def refuse_unread_flags(args: argparse.Namespace, mode: str,
                        flags: tuple[tuple[str, str, object, tuple[str, ...]], ...], mode_names: dict[str, str]) -> None:
    """For a command with modes that read different flags: ValueError naming each flag given
    (its value is not its default) that ``mode`` does not read, and the modes that do. flags:
    (flag, its attribute in ``args``, its default, the modes that read it); mode_names: how the
    message names each mode. A flag silently ignored would let a command line claim what the
    run did not do."""
    unread = [flag for flag, attr, default, modes in flags if mode not in modes and getattr(args, attr) != default]
    if unread:
        where = {flag: " or ".join(mode_names[m] for m in modes) for flag, _, _, modes in flags}
        raise ValueError(f"{mode_names[mode]} does not read {', '.join(unread)}; "
                         + "; ".join(f"{flag} is for {where[flag]}" for flag in unread))
