"""`streamoe convert`: mlx-community checkpoint → streamoe directory (docs/FORMAT.md).

Streams tensor by tensor with explicit byte-range reads (never `mx.load`, which reads a whole stacked
tensor to give one expert), keeps the page cache clean, and is crash-safe: everything is written into
a hidden `.NAME.partial` sibling with a journal of finished files, the manifest is written last, and
the directory is renamed into place only when complete. A rerun resumes from the journal when the
source is unchanged, else starts clean.

The journal is the mark of an unfinished run and is removed last, after the rename and the lock: wherever a kill -9
lands, the partial directory (or OUT itself, killed just after the rename) still carries it or a streamoe
manifest, so the same command run again resumes or finishes the publication; nothing needs a person.
Directories are removed marker last (`remove_ours`), so a kill during a removal leaves one still marked.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..formats import quant
from ..formats.blobs import BlobTensor, plan_blob
from ..formats.checks import source_problem
from ..formats.config import is_expert_tensor, quant_for
from ..formats.direct import RangeReader, UncachedWriter, aligned_buffer, file_checksum
from ..formats.errors import StreamoeError, fail
from ..formats.files import check_writable_dir, exclusive_lock, kind, os_fail, read_json
from ..formats.layout import FORMATS, derived_formats, format_layout, layer_file
from ..formats.manifest import MANIFEST, format_json, load_manifest, write_manifest
from ..formats.record import PARTS, PROJS, RecordLayout
from .source import Checkpoint, open_checkpoint

FREE_MARGIN = 64 << 20  # left free on the disk beyond what the conversion writes
CHUNK_BYTES = 32 << 20  # source bytes handled per step; bounds the converter's working memory
JOURNAL = "journal.json"
COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model")
NOT_COPIED = {"model.safetensors.index.json"}


def classify(name: str, expert_prefix: str, model_type: str = "qwen3_5_moe") -> str:
    """Where a source tensor goes: expert, nonexpert, vision, or skip (mtp.* and anything unknown)."""
    if name.startswith(expert_prefix) and is_expert_tensor(name, model_type):
        return "expert"
    if name.startswith("vision_tower."):
        return "vision"
    if name.startswith(("language_model.", "model.", "lm_head.")):
        return "nonexpert"
    return "skip"


def blob_entries(ckpt: Checkpoint, names: list[str]) -> list[tuple]:
    """(name, dtype, shape, nbytes, bits, group) per tensor; quantized triples carry bits/group."""
    out = []
    for name in names:
        t = ckpt.tensors[name]
        bits = group = None
        module, _, part = name.rpartition(".")
        if part in PARTS and f"{module}.scales" in ckpt.tensors and f"{module}.weight" in ckpt.tensors:
            qg = quant_for(ckpt.quant, module)
            if qg is not None:
                w, s = ckpt.tensors[f"{module}.weight"], ckpt.tensors[f"{module}.scales"]
                group = qg[1]
                if not w.shape or not s.shape or not s.shape[-1] or w.shape[:-1] != s.shape[:-1]:
                    raise fail(s.file, f"tensor {module}.scales shape {list(s.shape)} does not match "
                                       f"{module}.weight {list(w.shape)}")
                bits = 32 * w.shape[-1] // (s.shape[-1] * group)
                if bits not in (2, 3, 4, 5, 6, 8) or bits * s.shape[-1] * group != 32 * w.shape[-1]:
                    raise fail(
                        w.file,
                        f"tensor {module}.weight shape {list(w.shape)} fits no bit width at group {group}",
                    )
        out.append((name, t.dtype, t.shape, t.nbytes, bits, group))
    return out


def fingerprint(ckpt: Checkpoint, formats: list[str]) -> str:
    h = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for hd in ckpt.shards:
        st = hd.path.stat()
        h.update(f"{hd.path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(",".join(formats).encode())
    return h.hexdigest()


class Readers:
    """One page-cache-free reader per shard, opened on demand."""

    def __init__(self) -> None:
        self.open: dict[Path, RangeReader] = {}

    def read(self, path: Path, offset: int, nbytes: int) -> memoryview:
        r = self.open.get(path)
        if r is None:
            r = self.open[path] = RangeReader(path, CHUNK_BYTES)
        return r.read(offset, nbytes)

    def close(self) -> None:
        for r in self.open.values():
            r.close()
        self.open.clear()


def write_blob(readers: Readers, ckpt: Checkpoint, path: Path, table: list[BlobTensor], size: int, bar: tqdm) -> dict:
    """Copy each tensor's bytes verbatim to its planned offset; returns the file record."""
    w = UncachedWriter(path)
    for t in table:
        src = ckpt.tensors[t.name]
        w.pad_to(t.offset)
        for off in range(0, t.nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, t.nbytes - off)
            w.write(readers.read(src.file, src.offset + off, n))
            bar.update(n)
    w.pad_to(size)
    return w.close()


def record_arrays(lay: RecordLayout, source: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One projection's arrays of a `lay` record (one row per expert) from the source's (`source`: part -> its
    bytes, a uint8 row per expert): as stored for q4 and mxfp4; for q3 the exact shift of the 4-bit codes, scales and
    biases, an expert's own bias as it is."""
    if lay.bits != 3:
        return {part: source[part] for part in lay.parts}
    out = dict(source)
    out["weight"] = quant.shift_words_4_to_3(source["weight"].view(np.uint32))
    out["scales"], out["biases"] = quant.shift_scales_bf16(source["scales"].view(np.uint16), source["biases"].view(np.uint16))
    return out


def write_layer(
    readers: Readers,
    ckpt: Checkpoint,
    tensors: dict,
    lay4: RecordLayout,
    lays: dict[str, RecordLayout],
    outs: dict[str, Path],
    n_experts: int,
    bar: tqdm,
) -> dict[str, dict]:
    """Every asked format of one layer's expert file from one pass over its stacked source tensors (`lay4`: their
    record as stored; `lays`: each format's).

    Three stages overlap (read the next chunk / assemble records / hash and write the previous chunk); the
    reads, the hashing and the (O_DIRECT) writes release the GIL, so two cores keep the disk busy.
    """
    per_chunk = max(1, CHUNK_BYTES // lay4.stride)
    writers = {fmt: UncachedWriter(p, direct=True) for fmt, p in outs.items()}

    # one reader per source range, so the nine reads of a chunk can be in flight together
    range_readers = {k: RangeReader(t.file, per_chunk * lay4.segment(*k).nbytes) for k, t in tensors.items()}
    # two of everything: chunk i is assembled while chunk i+1 is read and chunk i-1 is written
    src_bufs = [{k: np.empty(per_chunk * lay4.segment(*k).nbytes, np.uint8) for k in tensors} for _ in range(2)]
    rec_bufs = [{fmt: np.frombuffer(aligned_buffer(per_chunk * lays[fmt].stride), np.uint8).reshape(per_chunk, -1)
                 for fmt in outs} for _ in range(2)]  # page-aligned for O_DIRECT; padding stays zero

    def read_one(i: int, e0: int, n: int, key: tuple[str, str]) -> np.ndarray:
        t, seg = tensors[key], lay4.segment(*key)
        dst = src_bufs[i % 2][key][: n * seg.nbytes]
        dst[:] = np.frombuffer(range_readers[key].read(t.offset + e0 * seg.nbytes, n * seg.nbytes), np.uint8)
        return dst.reshape(n, seg.nbytes)

    def read_chunk(i: int, e0: int) -> dict:
        """The nine source ranges of experts [e0, e0 + n), read concurrently (the disk wants several in flight)."""
        n = min(per_chunk, n_experts - e0)
        futs = {key: io.submit(read_one, i, e0, n, key) for key in tensors}
        return {key: f.result() for key, f in futs.items()}

    def assemble(i: int, parts: dict) -> dict[str, np.ndarray]:
        n = next(iter(parts.values())).shape[0]
        recs = {fmt: b[:n] for fmt, b in rec_bufs[i % 2].items()}
        for fmt, rec in recs.items():
            lay = lays[fmt]
            for proj in PROJS:
                for part, arr in record_arrays(lay, {part: parts[(proj, part)] for part in lay4.parts}).items():
                    seg = lay.segment(proj, part)
                    rec[:, seg.offset : seg.offset + seg.nbytes] = arr.view(np.uint8).reshape(n, -1)
        return recs

    def write(recs: dict[str, np.ndarray], nbytes: int) -> None:
        for fmt, r in recs.items():
            writers[fmt].write(memoryview(r).cast("B"))
        bar.update(nbytes)

    starts = list(range(0, n_experts, per_chunk))
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="convert") as pool, \
            ThreadPoolExecutor(max_workers=3, thread_name_prefix="convert-io") as io:
        nxt = pool.submit(read_chunk, 0, starts[0])
        writing = None
        for i in range(len(starts)):
            parts = nxt.result()
            if i + 1 < len(starts):
                nxt = pool.submit(read_chunk, i + 1, starts[i + 1])
            recs = assemble(i, parts)
            if writing is not None:
                writing.result()
            writing = pool.submit(write, recs, sum(a.nbytes for a in parts.values()))
        writing.result()
    for r in range_readers.values():
        r.close()
    return {fmt: w.close() for fmt, w in writers.items()}


def human(n: int) -> str:
    """A byte count for a message: MiB below 1 GiB, so small numbers never read as 0.00."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_space_check(parent: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(parent).free
    except OSError as e:
        raise os_fail(parent, e, "cannot check free space") from None
    need += FREE_MARGIN
    if free < need:
        raise fail(parent, f"not enough free disk space: conversion needs {human(need)} "
                           f"(with a {human(FREE_MARGIN)} margin), {human(free)} free")


def is_ours(tmp: Path) -> bool:
    """A partial directory this converter made: empty (killed right after mkdir), holding only the first
    journal's temporary (killed before its rename), or holding its journal or a streamoe manifest. Anything
    else under that name is the user's and is never removed."""
    try:
        names = set(os.listdir(tmp))
    except OSError:
        return False
    return names <= {JOURNAL + ".tmp"} or JOURNAL in names or (MANIFEST in names and is_conversion(tmp))


def remove_ours(d: Path) -> None:
    """Remove a directory of ours with its markers (journal, manifest) last, so that a kill during the removal
    leaves a directory `is_ours` still recognises (or an empty one) rather than unmarked leftovers."""
    markers = (JOURNAL, MANIFEST)
    for root, dirs, names in os.walk(d, topdown=False):
        for n in names:
            if root != str(d) or n not in markers:
                os.unlink(os.path.join(root, n))
        for n in dirs:
            p = os.path.join(root, n)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    for n in markers:
        try:
            os.unlink(d / n)
        except FileNotFoundError:
            pass
    os.rmdir(d)


def load_journal(tmp: Path, fp: str) -> dict:
    """Finished files of an interrupted run with the same source, or {} (and a clean directory). A file is kept
    only where its size and checksum are the journal's (read whole once: a file changed since, even in place,
    is written again rather than published under a checksum it does not have)."""
    j = tmp / JOURNAL
    if j.is_file():
        try:
            doc = read_json(j, "conversion journal")
            if doc.get("fingerprint") == fp:
                return {
                    k: v
                    for k, v in doc["done"].items()
                    if (tmp / k).is_file() and (tmp / k).stat().st_size == v["size"]
                    and file_checksum(tmp / k) == v["checksum"]
                }
        except (StreamoeError, KeyError, TypeError, AttributeError):
            pass
    if os.path.lexists(tmp):
        if not tmp.is_dir() or tmp.is_symlink() or not is_ours(tmp):
            raise fail(tmp, "exists and was not made by streamoe convert; remove it or choose another OUT")
        remove_ours(tmp)
    return {}


def save_journal(tmp: Path, fp: str, done: dict) -> None:
    p = tmp / (JOURNAL + ".tmp")
    p.write_text(json.dumps({"fingerprint": fp, "done": done}))
    os.replace(p, tmp / JOURNAL)


def is_conversion(d: Path) -> bool:
    """Whether `d` holds a streamoe conversion: its manifest parses and says `"format": "streamoe"`."""
    try:
        return read_json(d / MANIFEST, "streamoe manifest").get("format") == "streamoe"
    except StreamoeError:  # missing, a special file, too large, not JSON: not a conversion
        return False


def check_not_source(ckpt_path: Path, out: Path) -> None:
    """OUT is never the source checkpoint or a directory above it."""
    src, dst = Path(os.path.abspath(ckpt_path)), Path(os.path.abspath(out))
    try:
        src, dst = src.resolve(), dst.resolve()
    except (OSError, RuntimeError):
        pass
    if src == dst or src.is_relative_to(dst):
        raise fail(out, f"is the source checkpoint {ckpt_path} or a directory above it; choose another OUT")


def check_out(ckpt_path: Path, out: Path, force: bool) -> bool:
    """Whether OUT may be written, before any work: True when it holds a conversion `--force` will replace.

    OUT may be missing or an empty directory; with `--force` it may hold a streamoe conversion. It is never
    the source, a directory above the source, a file or a special file (those are the user's, not ours)."""
    check_not_source(ckpt_path, out)
    if not os.path.lexists(out):
        check_writable_dir(out.parent, out)
        return False
    try:
        st = os.stat(out)
    except OSError as e:
        raise os_fail(out, e, "cannot use as OUT") from None
    if not stat.S_ISDIR(st.st_mode):
        raise fail(out, f"exists and is {kind(st.st_mode)}, not a directory (will not replace it)")
    check_writable_dir(out.parent, out)
    try:
        empty = not os.listdir(out)
    except OSError as e:
        raise os_fail(out, e, "cannot list OUT") from None
    if empty:
        return False
    ours = is_conversion(out)
    if ours:  # its manifest is what tells the conversion's files from the user's: without it, none are ours
        try:
            owned = {f["path"] for f in load_manifest(out).all_files()} | {MANIFEST, JOURNAL}
        except StreamoeError as e:
            raise fail(out / MANIFEST, f"does not load ({str(e).removeprefix(f'{out / MANIFEST}: ')}), so "
                                       f"{'--force' if force else 'convert'} cannot tell the conversion's files in "
                                       f"{out} from others; remove the conversion yourself or choose another OUT") from None
    if not force:
        raise fail(out, f"already exists ({'a converted model' if ours else 'not empty'}); "
                        + ("use --force to replace it" if ours else "choose an empty or new OUT"))
    if not ours:
        why = "its manifest.json is not a streamoe manifest" if os.path.lexists(out / MANIFEST) else "no manifest.json"
        raise fail(out, f"is not a streamoe conversion ({why}): --force only replaces an earlier conversion, never "
                        "other files")
    others = not_ours(out, owned)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise fail(out, f"holds files its conversion does not ({shown}): --force replaces only an earlier conversion, "
                        "never other files; move them out first")
    return True


def not_ours(out: Path, owned: set[str]) -> list[str]:
    """The files in conversion OUT that are not `owned` (what its manifest lists: a user's notes, runs...), sorted
    (`.DS_Store` aside: Finder's, not the user's)."""
    found = []
    for top, _dirs, files in os.walk(out):
        for name in files:
            rel = Path(top, name).relative_to(out).as_posix()
            if rel not in owned and name != ".DS_Store":
                found.append(rel)
    return sorted(found)


def convert(
    ckpt_path: Path, out: Path, formats: list[str] | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Convert; see the module docstring. Holds a lock on OUT throughout, so a second convert into the same
    OUT fails at once instead of sharing the partial directory."""
    bad = [f for f in formats or () if f not in FORMATS]
    if bad:
        raise fail(out, f"unknown expert format(s) {bad}: choose from {', '.join(FORMATS)}")
    out = Path(out)
    check_not_source(ckpt_path, out)
    if out.is_symlink():  # `~/models/q -> /mnt/nvme/q`: the conversion goes where the link points, the link stays
        out = Path(os.path.realpath(out))
        print(f"(OUT is a link: converting into {out})", file=sys.stderr, flush=True)
    unfinished = os.path.lexists(out / JOURNAL)  # a run killed after publishing: finished below, under the lock
    if not unfinished:
        check_out(ckpt_path, out, force)
    ckpt = open_checkpoint(ckpt_path)
    if not formats:  # the format the checkpoint holds
        formats = [ckpt.args.expert_format]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_fail(out.parent, e, "cannot create the output directory") from None
    with exclusive_lock(out.parent / f".{out.name}.lock", out, "this OUT"):
        try:
            finished = unfinished and finish_interrupted(out, fingerprint(ckpt, formats))
            replacing = not finished and check_out(ckpt_path, out, force)  # again, now that no one else can change OUT
            if not finished:
                _convert_locked(ckpt, out, formats, progress)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                try:
                    free = human(shutil.disk_usage(out.parent).free)
                except OSError:
                    free = "unknown"
                raise fail(e.filename or out, f"no space left on device while converting ({free} free now on "
                                              f"{out.parent}; free some and rerun to resume)") from None
            raise os_fail(out, e, "conversion failed (rerun to resume)") from None
    try:  # the last step, after the lock: a kill at any earlier one leaves the journal, and a rerun finishes
        (out / JOURNAL).unlink(missing_ok=True)
    except OSError as e:
        raise os_fail(out / JOURNAL, e, "cannot remove the finished conversion's journal") from None
    if finished:
        sys.stderr.write(f"finished publishing the conversion in {out} (an earlier run was interrupted)\n")
    if replacing:
        sys.stderr.write(f"replaced the earlier streamoe conversion in {out}\n")
    return out


def _convert_locked(ckpt: Checkpoint, out: Path, formats: list[str], progress: bool) -> None:
    lay4 = ckpt.layer_layout()
    problem = source_problem(ckpt.config, ckpt.tensors, ckpt.root / "config.json")
    if problem:
        raise fail(ckpt.root / "config.json", f"the checkpoint does not match its config: {problem}")
    lays: dict[str, RecordLayout] = {}
    for f in formats:
        if f not in derived_formats(lay4):
            raise fail(ckpt.root / "config.json", f"expert format {f} cannot be made from this checkpoint's "
                                                  f"{lay4.mode} experts (it can write {', '.join(derived_formats(lay4))})")
        try:
            lays[f] = format_layout(f, lay4)
        except StreamoeError as e:
            raise fail(ckpt.root / "config.json", f"the expert dims cannot hold {f} records ({e})") from None
    prefix, layers = ckpt.expert_keys()
    a = ckpt.args
    n_exp, n_layers = a.num_experts, a.num_hidden_layers
    tmp = out.parent / f".{out.name}.partial"

    groups: dict[str, list[str]] = {"nonexpert": [], "vision": [], "skip": []}
    for name in sorted(ckpt.tensors):
        kind = classify(name, prefix, a.model_type)
        if kind != "expert":
            groups[kind].append(name)
    blob_plans = {k: plan_blob(blob_entries(ckpt, groups[k])) for k in ("nonexpert", "vision") if groups[k]}
    sizes = {k: size for k, (_, size) in blob_plans.items()}
    need = sum(sizes.values()) + sum(n_layers * n_exp * lays[f].stride for f in formats)
    fp = fingerprint(ckpt, formats)
    done = load_journal(tmp, fp)
    free_space_check(out.parent, need - sum(v["size"] for v in done.values()))
    tmp.mkdir(exist_ok=True)
    save_journal(tmp, fp, done)  # first thing inside: marks the partial directory as ours
    for f in formats:
        (tmp / "experts" / f).mkdir(parents=True, exist_ok=True)

    work = sum(
        t.nbytes
        for t in ckpt.tensors.values()
        if classify(t.name, prefix, a.model_type) in ("expert", "nonexpert", "vision")
    )
    readers = Readers()
    bar = tqdm(
        total=work,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="convert",
        disable=None if progress else True,  # drawn on a terminal, not into a log
        dynamic_ncols=True,
    )
    try:
        blobs = {}
        for kind, (table, size) in blob_plans.items():
            rel = f"{kind}.bin"
            if rel in done:
                bar.update(sum(t.nbytes for t in table))
            else:
                done[rel] = write_blob(readers, ckpt, tmp / rel, table, size, bar)
                save_journal(tmp, fp, done)
            blobs[kind] = {"file": {"path": rel, **done[rel]}, "tensors": [t.to_json() for t in table]}
        for li in range(n_layers):
            rels = {f: layer_file(f, li) for f in formats}
            todo = {f: tmp / r for f, r in rels.items() if r not in done}
            if todo:
                recs = write_layer(readers, ckpt, layers[li], lay4, lays, todo, n_exp, bar)
                done.update({rels[f]: rec for f, rec in recs.items()})
                save_journal(tmp, fp, done)
            else:
                bar.update(sum(t.nbytes for t in layers[li].values()))
        files = []
        for p in sorted(ckpt.root.iterdir()):
            if p.is_file() and p.suffix in COPY_SUFFIXES and p.name not in NOT_COPIED:
                w = UncachedWriter(tmp / p.name)
                w.write(p.read_bytes())
                files.append({"path": p.name, **w.close()})
    finally:
        readers.close()
        bar.close()

    experts = {}
    for f in formats:
        lay = lays[f]
        experts[f] = {
            **format_json(lay),
            "derivation": "shift" if f == "q3" else "source",
            "files": [
                {
                    "path": layer_file(f, li),
                    "layer": li,
                    **done[layer_file(f, li)],
                }
                for li in range(n_layers)
            ],
        }
    doc = {
        "format": "streamoe",
        "version": 1,
        "source": {
            "model_type": ckpt.config["model_type"],
            "total_size": ckpt.total_size,
            "shards": [{"file": h.path.name, "size": h.file_size} for h in ckpt.shards],
        },
        "config": ckpt.config,
        "model": {
            "num_layers": n_layers,
            "num_experts": n_exp,
            "top_k": a.num_experts_per_tok,
            "hidden_size": lay4.hidden,
            "moe_intermediate_size": lay4.intermediate,
            "expert_prefix": prefix,
        },
        "experts": experts,
        "blobs": blobs,
        "files": files,
        "skipped": groups["skip"],
    }
    write_manifest(tmp, doc)  # the journal stays: a kill from here on resumes, or finishes, the publication
    publish(tmp, out)


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an existing `out` (checked: empty or a conversion) is moved aside
    under a name only this process uses, then removed. The journal leaves OUT after the lock (`convert`)."""
    if os.path.lexists(out):
        os.replace(out, out.parent / f".{out.name}.old-{os.getpid()}")
    os.replace(tmp, out)
    remove_old(out)


def remove_old(out: Path) -> None:
    """Remove the earlier conversions of OUT moved aside by `publish` (`.OUT.old-PID`), also those of a run
    killed before it could: ours only (a link to one, or a directory `is_ours` recognises). Called under OUT's
    lock, so no other run owns them."""
    for old in out.parent.glob(f".{glob.escape(out.name)}.old-*"):
        if not old.name.removeprefix(f".{out.name}.old-").isdigit():
            continue
        if old.is_dir() and not old.is_symlink() and is_ours(old):
            try:
                remove_ours(old)
            except OSError as e:  # the new conversion is in place: a leftover is not its failure, but it is said
                sys.stderr.write(f"streamoe: could not remove the earlier conversion moved aside to {old} "
                                 f"({e.strerror or e}); remove it yourself\n")


def finish_interrupted(out: Path, fp: str) -> bool:
    """OUT holds a journal. When OUT is a complete conversion (a run killed after its rename), do what that run
    left undone under the lock (remove the conversions it moved aside; the journal itself when it is another
    source's, as OUT is then an ordinary conversion) and say whether OUT is this very conversion."""
    if not (out.is_dir() and is_conversion(out)):
        return False
    try:
        same = read_json(out / JOURNAL, "conversion journal").get("fingerprint") == fp
    except StreamoeError:
        same = False
    remove_old(out)
    if not same:
        (out / JOURNAL).unlink(missing_ok=True)
    return same
