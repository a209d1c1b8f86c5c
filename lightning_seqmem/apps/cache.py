"""``seqmem-cache`` (also ``python -m lightning_seqmem.apps.cache``): what the cache directory holds, and removing it.

The cache (``$XDG_CACHE_HOME/lightning_seqmem``, or a DataModule's ``cache_dir``) grows with every dataset and
tokenizer trained on and has no eviction of its own. This lists each entry — tokenized splits (dataset, tokenizer,
rows), packing plans, value-check markers, the built-in corpus and tokenizer, and partial files of writers that
crashed — with its size and last use, and removes entries on request::

    seqmem-cache                      # list
    seqmem-cache --older-than 30d     # remove entries not used for 30 days (s, m, h, d, w)
    seqmem-cache --all --dry-run      # what --all would remove
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_seqmem.batching.plan_cache import PLAN_META, PLANS, STAGING_PREFIX
from lightning_seqmem.data.cache_dir import default_cache_dir
from lightning_seqmem.data.corpus import CORPUS_PREFIX
from lightning_seqmem.data.token_cache import MANIFEST, STALE_AFTER_S, TOKENIZED, stale_temporaries
from lightning_seqmem.data.tokenizer import TOKENIZER_PREFIX
from lightning_seqmem.data.value_checks import CHECKED
from lightning_seqmem.memory.stats import format_bytes

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
IN_MEMORY = ("an in-memory dataset", "a list of")  # how messages.describe_source names data with no path


@dataclass(frozen=True)
class CacheEntry:
    """One removable thing in the cache: a directory or a file, with what it holds."""

    kind: str  # tokens | plan | checked | corpus | tokenizer | partial
    path: Path
    dataset: str
    tokenizer: str
    rows: int | None
    size: int  # bytes
    last_use: float  # seconds since the epoch


def _scan(path: Path, skip_suffix: str | None = None) -> tuple[int, float]:
    """Bytes under ``path`` and the newest modification or access of any file there (file systems update access
    times at least daily by default, so this finds a plan or corpus that is read but never rewritten), in one pass;
    files ending in ``skip_suffix`` are left out (listed as entries of their own)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    stats = [p.stat() for p in files if skip_suffix is None or not p.name.endswith(skip_suffix)]
    last = max((max(s.st_mtime, s.st_atime) for s in stats), default=None)
    if last is None:
        st = path.stat()
        last = max(st.st_mtime, st.st_atime)
    return sum(s.st_size for s in stats), last


def _tokens_entry(directory: Path) -> CacheEntry:
    manifest = directory / MANIFEST
    size, last_use = _scan(directory, skip_suffix=".tmp")  # partial files are entries of their own
    try:
        meta = json.loads(manifest.read_text())
        last_use = manifest.stat().st_mtime  # touched on every load
    except (OSError, ValueError):
        meta = {"dataset": "(incomplete: no manifest)"}
    split = f" ({meta['split']})" if meta.get("split") else ""
    dataset = str(meta.get("dataset", "?"))
    if meta.get("made_by") and dataset.startswith(IN_MEMORY):  # data with no path or name: the run that made them
        dataset = f"in memory, {meta.get('rows', '?')} rows, from {meta['made_by']}"
    return CacheEntry(
        "tokens",
        directory,
        f"{dataset}{split}",
        str(meta.get("tokenizer", "?")),
        meta.get("rows"),
        size,
        last_use,
    )


def _plan_entry(directory: Path) -> CacheEntry:
    try:
        meta = json.loads((directory / PLAN_META).read_text())
        what = f"packing plan ({meta['packing']}, max_length {meta['max_length']})"
        rows = meta.get("documents")
    except (OSError, ValueError, KeyError):
        what, rows = "packing plan (incomplete)", None
    return CacheEntry("plan", directory, what, "-", rows, *_scan(directory))


def list_entries(root: str | os.PathLike | None = None) -> list[CacheEntry]:
    """Every entry under ``root`` (default ``default_cache_dir()``), least recently used first."""
    root = Path(root) if root is not None else default_cache_dir()
    entries = [_tokens_entry(d) for d in sorted(root.glob(f"{TOKENIZED}/*")) if d.is_dir()]
    stale_before = time.time() - STALE_AFTER_S
    for path in stale_temporaries(root):
        entries.append(
            CacheEntry(
                "partial",
                path,
                "a crashed writer's temporary file",
                "-",
                None,
                path.stat().st_size,
                path.stat().st_mtime,
            )
        )
    for path in sorted(root.glob(f"{PLANS}/*")):
        if path.name.startswith(STAGING_PREFIX):
            if path.stat().st_mtime < stale_before:
                entries.append(
                    CacheEntry(
                        "partial",
                        path,
                        "a crashed plan writer's directory",
                        "-",
                        None,
                        _scan(path)[0],
                        path.stat().st_mtime,
                    )
                )
        elif path.is_dir():
            entries.append(_plan_entry(path))
    for path in sorted(root.glob(f"{CHECKED}/*")):
        size, _ = _scan(path)
        entries.append(
            CacheEntry("checked", path, "marker: pre-tokenized values checked", "-", None, size, path.stat().st_mtime)
        )
    for path in sorted(root.glob(f"{CORPUS_PREFIX}*")):
        entries.append(CacheEntry("corpus", path, "built-in corpus", "-", None, *_scan(path)))
    for path in sorted(root.glob(f"{TOKENIZER_PREFIX}*")):
        entries.append(CacheEntry("tokenizer", path, "-", "built-in BPE", None, *_scan(path)))
    return sorted(entries, key=lambda e: e.last_use)


def remove_entries(entries: list[CacheEntry]) -> int:
    """Remove ``entries`` from disk; the bytes freed. A running job keeps reading files it has open (they are
    unlinked, not overwritten); a later run tokenizes or plans again."""
    freed = 0
    for entry in entries:
        try:
            if entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink()
            freed += entry.size
        except FileNotFoundError:
            pass
    return freed


def parse_age(text: str) -> float:
    """``"30d"`` -> seconds; units s, m, h, d, w (a bare number is days).

    Raises:
        ValueError: not a number with one of those units.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None:
        raise ValueError(f"--older-than {text!r}: give a number and a unit, e.g. 12h, 30d or 2w (units s m h d w).")
    return float(match[1]) * _UNITS[match[2] or "d"]


def _ago(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit} ago"
    return "just now"


def _short(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return "..." + text[-(width - 3) :]


def format_entries(entries: list[CacheEntry], now: float | None = None) -> str:
    """The listing: one line per entry, least recently used first."""
    now = time.time() if now is None else now
    header = f"{'kind':<9}  {'entry':<12}  {'dataset':<40}  {'tokenizer':<34}  {'rows':>9}  {'size':>10}  last use"
    lines = [header]
    for e in entries:
        tokenizer = Path(e.tokenizer).name if os.sep in e.tokenizer else e.tokenizer
        rows = f"{e.rows:,}" if isinstance(e.rows, int) else "-"
        lines.append(
            f"{e.kind:<9}  {e.path.name[:12]:<12}  {_short(e.dataset, 40):<40}  {_short(tokenizer, 34):<34}  "
            f"{rows:>9}  {format_bytes(e.size):>10}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_use))}"
            f" ({_ago(now - e.last_use)})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``seqmem-cache``)."""
    parser = argparse.ArgumentParser(
        prog="seqmem-cache", description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="the cache's root (default: $XDG_CACHE_HOME/lightning_seqmem, ~/.cache/lightning_seqmem)",
    )
    parser.add_argument(
        "--older-than",
        metavar="AGE",
        default=None,
        help="remove entries last used longer ago than AGE (e.g. 12h, 30d, 2w)",
    )
    parser.add_argument("--all", action="store_true", help="remove every entry")
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = parser.parse_args(argv)
    try:
        max_age = parse_age(args.older_than) if args.older_than is not None else None
    except ValueError as err:
        parser.error(str(err))
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    entries = list_entries(root)
    total = sum(e.size for e in entries)
    print(f"Cache {root}: {len(entries)} entries, {format_bytes(total)}")
    if not entries:
        return 0
    print(format_entries(entries))
    if not args.all and max_age is None:
        print("Remove with --older-than AGE (e.g. 30d) or --all; add --dry-run to see what would go.")
        return 0
    now = time.time()
    chosen = entries if args.all else [e for e in entries if now - e.last_use > max_age]
    size = sum(e.size for e in chosen)
    if args.dry_run:
        print(f"Would remove {len(chosen)} entries ({format_bytes(size)}).")
        return 0
    freed = remove_entries(chosen)
    print(f"Removed {len(chosen)} entries ({format_bytes(freed)}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
