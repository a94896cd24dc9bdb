"""convert/ and validate: bytes equal the source, mlx-lm agrees, crash safety, and every bad input's one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import synth
from streamoe.convert.validate import validate
from streamoe.formats.manifest import load_manifest, safe_path
from streamoe.runtime.weights import record_views

from .conftest import cli, one_error_line


def test_tiny_validates_against_source_every_expert(tiny_conv, tiny_ckpt):
    rep = validate(tiny_conv, source=tiny_ckpt, samples=10**6)
    assert rep["ok"], [c for c in rep["checks"] if not c["ok"]]
    names = {c["name"] for c in rep["checks"]}
    assert {"source-experts-q4", "source-experts-q3", "source-nonexpert", "source-vision"} <= names


def test_small_cli_validate_json(small_conv, small_ckpt):
    p = cli("validate", small_conv, "--source", small_ckpt, "--json", check=True)
    rep = json.loads(p.stdout)
    assert rep["ok"] and len(rep["checks"]) > 20


def test_records_equal_what_mlx_lm_loads(small_conv, small_ckpt):
    """Expert records read back through formats/ equal mlx-lm's own QuantizedSwitchLinear tensors."""
    from mlx_lm.utils import load_model

    ref, _ = load_model(small_ckpt)
    m = load_manifest(small_conv)
    ef = m.expert_formats()["q4"]
    layers = ref.language_model.model.layers
    for f in ef.files[:: max(1, len(ef.files) // 3)]:
        data = mx.array(np.fromfile(safe_path(small_conv, f["path"]), np.uint8))
        sw = layers[f["layer"]].mlp.switch_mlp
        for e in (0, 17, m.model["num_experts"] - 1):
            ew = record_views(data, e * ef.layout.stride, ef.layout)
            for proj, (w, s, b) in {"gate_proj": ew[0:3], "up_proj": ew[3:6], "down_proj": ew[6:9]}.items():
                lin = getattr(sw, proj)
                assert mx.array_equal(w, lin.weight[e]).item()
                assert mx.array_equal(s, lin.scales[e]).item() and s.dtype == lin.scales.dtype
                assert mx.array_equal(b, lin.biases[e]).item()


def test_blob_tensors_equal_what_mlx_lm_loads(small_conv, small_ckpt):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from streamoe.formats.direct import RangeReader
    from streamoe.runtime.weights import read_tensor

    ref, _ = load_model(small_ckpt)
    params = dict(tree_flatten(ref.parameters()))
    file, table = load_manifest(small_conv).blob("nonexpert")
    checked = 0
    with RangeReader(small_conv / file["path"], 16 << 20) as r:
        for t in table:
            if t.name in params and "conv1d" not in t.name:
                assert mx.array_equal(read_tensor(r, t), params[t.name]).item(), t.name
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("variant,text_only", [("qwen3.5", False), ("qwen3.6", True)])
def test_variants_convert_and_validate(tmp_path, variant, text_only):
    ck, out = tmp_path / "ck", tmp_path / "out"
    synth(ck, size="tiny", variant=variant, text_only=text_only, seed=3, shard_bytes=200_000, dry_run=False)
    convert(ck, out, formats=["q4", "q3"], progress=False)
    rep = validate(out, source=ck, samples=4)
    assert rep["ok"]
    m = load_manifest(out)
    assert (m.blob("vision") is None) == text_only
    a_log = next(t for t in m.blob("nonexpert")[1] if t.name.endswith("layers.0.linear_attn.A_log"))
    assert a_log.dtype == ("F32" if variant == "qwen3.5" else "BF16")
    gate = next(t for t in m.blob("nonexpert")[1] if t.name.endswith("layers.0.mlp.gate.weight"))
    assert gate.bits == (4 if variant == "qwen3.5" else 8)


def test_layer_straddling_shards_converts(tiny_ckpt, tiny_conv):
    idx = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    by_layer: dict[str, set] = {}
    for k, f in idx.items():
        if ".layers." in k:
            by_layer.setdefault(k.split(".layers.")[1].split(".")[0], set()).add(f)
    assert any(len(v) > 1 for v in by_layer.values()), "fixture should have a layer split across shards"
    assert validate(tiny_conv, source=tiny_ckpt, samples=2)["ok"]


def test_rerun_refuses_existing_and_force_replaces(tiny_ckpt, tmp_path):
    out = tmp_path / "o"
    cli("convert", tiny_ckpt, out, check=True)
    one_error_line(cli("convert", tiny_ckpt, out), str(out), "--force")
    cli("convert", tiny_ckpt, out, "--force", "--experts", "q3", check=True)
    assert set(load_manifest(out).expert_formats()) == {"q3"}


def test_force_over_a_conversion_whose_manifest_does_not_load_names_the_manifest_and_removes_nothing(tiny_ckpt, tiny_conv,
                                                                                                      tmp_path):
    """A conversion's manifest is what tells its files from the user's: where it claims to be streamoe's but does not
    load, convert says so (not "not a conversion", not "holds files its conversion does not") and touches nothing;
    a manifest.json of something else is still not a conversion."""
    out = tmp_path / "o"
    shutil.copytree(tiny_conv, out)
    files = sorted(p.relative_to(out) for p in out.rglob("*"))
    doc = json.loads((out / "manifest.json").read_text())
    del doc["source"]
    broken = ("manifest.json: does not load", "remove the conversion yourself")
    for text, plain, forced in [
            (json.dumps(doc), broken, (*broken, "--force cannot tell", "'source' is a required property")),
            ('{"format": "streamoe", "files": [{"path": "../x"}]}', broken, broken),
            ('{"name": "an app"}', ("already exists (not empty)",), ("is not a streamoe conversion", "not a streamoe manifest"))]:
        (out / "manifest.json").write_text(text)
        for force, needles in (([], plain), (["--force"], forced)):
            line = one_error_line(cli("convert", tiny_ckpt, out, *force), str(out), *needles)
            assert "holds files" not in line, line
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == files
        assert (out / "manifest.json").read_text() == text


def test_an_out_whose_manifest_is_a_device_or_a_fifo_is_refused_at_once(tiny_ckpt, tmp_path):
    """OUT's manifest.json is read only as a bounded regular file: /dev/zero (it was read until memory ran out) or a
    FIFO nobody writes is "not a conversion", in one line, within seconds, and OUT keeps its files."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for make in (lambda m: m.symlink_to("/dev/zero"), os.mkfifo):
        make(out / "manifest.json")
        one_error_line(cli("convert", tiny_ckpt, out, "--force", timeout=60), str(out), "is not a streamoe conversion")
        assert (out / "notes.txt").read_text() == "mine" and os.path.lexists(out / "manifest.json")
        (out / "manifest.json").unlink()


def test_a_conversion_whose_journal_is_a_fifo_is_an_ordinary_conversion(tiny_ckpt, tiny_conv, tmp_path):
    """A journal left in OUT is read only as a bounded regular file: a FIFO there (it blocked for ever) is no
    journal of this run's, so OUT is a finished conversion, refused without --force as any is."""
    out = tmp_path / "o"
    shutil.copytree(tiny_conv, out)
    os.mkfifo(out / "journal.json")
    one_error_line(cli("convert", tiny_ckpt, out, timeout=60), str(out), "already exists", "--force")
    assert validate(out)["ok"]


def test_kill_9_mid_conversion_then_rerun_validates(small_ckpt, tmp_path):
    out = tmp_path / "killed"
    tmp = tmp_path / ".killed.partial"
    p = subprocess.Popen([sys.executable, "-m", "streamoe.cli", "convert", str(small_ckpt), str(out), "--experts", "q4,q3"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60

    def blob_done() -> bool:  # the journal exists from the start; wait until it records a finished file
        try:
            return "nonexpert.bin" in (tmp / "journal.json").read_text()
        except OSError:
            return False

    while not blob_done() and p.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists(), "an interrupted conversion must not leave a complete-looking OUT"
    assert tmp.exists()
    done_before = json.loads((tmp / "journal.json").read_text())["done"]
    assert "nonexpert.bin" in done_before
    with open(tmp / "nonexpert.bin", "r+b") as f:  # changed in place since the journal said it was done
        f.seek(100)
        f.write(bytes(b ^ 0xFF for b in f.read(4)))
    cli("convert", small_ckpt, out, "--experts", "q4,q3", check=True)
    assert validate(out, source=small_ckpt, samples=3)["ok"]
    assert not tmp.exists()


# Runs `streamoe convert` with a SIGKILL at the KILL_AT-th rename/unlink/rmdir from the manifest's writing on
# (KILL_AT=0: never; the count of such steps is printed on stderr at exit).
KILL_DRIVER = """
import atexit, os, signal, sys
from streamoe import cli
from streamoe.convert import convert as c
at, steps, armed = int(os.environ["KILL_AT"]), [0], [False]
def counted(f):
    def step(*a, **k):
        if armed[0]:
            steps[0] += 1
            if steps[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return f(*a, **k)
    return step
for name in ("replace", "rename", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
write_manifest = c.write_manifest
def arm(*a, **k):
    armed[0] = True
    return write_manifest(*a, **k)
c.write_manifest = arm
atexit.register(lambda: sys.stderr.write(f"steps={steps[0]}\\n"))
sys.argv[0] = "streamoe"
cli.main()
"""


def convert_killed_at(step: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_DRIVER, "convert", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "KILL_AT": str(step)})


@pytest.mark.parametrize("force", [False, True], ids=["new-out", "force-replace"])
def test_kill_9_at_each_publish_step_then_the_same_command_recovers(tiny_ckpt, tiny_conv, tmp_path, force):
    """Steps from the manifest's write to the end (the manifest's rename, OUT moved aside, the rename into place,
    the old conversion's removal file by file, the lock's removal, the journal's): a kill there, then the same
    command succeeds, OUT validates against the source and nothing is left beside it."""
    def prepare(n: int) -> tuple[Path, list]:
        out = tmp_path / f"run{n}" / "out"
        out.parent.mkdir()
        if force:
            shutil.copytree(tiny_conv, out)  # q4 and q3: replaced by a q4-only conversion
        return out, [tiny_ckpt, out, *(["--force"] if force else [])]

    out, args = prepare(0)
    whole = convert_killed_at(0, *args)
    assert whole.returncode == 0, whole.stderr
    total = int(whole.stderr.rsplit("steps=", 1)[1])
    assert total >= (20 if force else 4)  # the old conversion goes file by file
    # every step up to the old conversion's removal, then its first, middle and last file, the lock, the journal
    for n in sorted({*range(1, min(6, total)), total // 2, total - 2, total - 1, total}):
        out, args = prepare(n)
        p = convert_killed_at(n, *args)
        assert p.returncode == -signal.SIGKILL, (n, p.stderr)
        again = cli("convert", *args)
        assert again.returncode == 0, (n, again.stderr)
        assert "Traceback" not in again.stderr
        assert validate(out, source=tiny_ckpt, samples=2)["ok"], n
        assert set(load_manifest(out).expert_formats()) == {"q4"}, n
        assert not (out / "journal.json").exists(), n
        assert [x.name for x in out.parent.iterdir()] == ["out"], (n, sorted(x.name for x in out.parent.iterdir()))


def test_killed_after_publishing_then_another_command_sees_an_ordinary_conversion(tiny_ckpt, tmp_path):
    """Killed before the journal left OUT, then a different command (other formats): OUT is a finished
    conversion of something else, refused without --force as any is, and replaced with it."""
    out = tmp_path / "out"
    total = int(convert_killed_at(0, tiny_ckpt, tmp_path / "probe").stderr.rsplit("steps=", 1)[1])
    assert convert_killed_at(total, tiny_ckpt, out).returncode == -signal.SIGKILL  # at the journal's removal
    assert (out / "journal.json").exists() and validate(out)["ok"]
    one_error_line(cli("convert", tiny_ckpt, out, "--experts", "q4,q3"), str(out), "already exists", "--force")
    assert not (out / "journal.json").exists()
    cli("convert", tiny_ckpt, out, "--experts", "q4,q3", "--force", check=True)
    assert set(load_manifest(out).expert_formats()) == {"q4", "q3"} and validate(out, source=tiny_ckpt)["ok"]


def test_a_partial_dir_of_only_a_journal_temporary_is_ours(tiny_ckpt, tmp_path):
    """Killed inside the first journal write: the partial directory holds only `journal.json.tmp`."""
    (tmp_path / ".out.partial").mkdir()
    (tmp_path / ".out.partial" / "journal.json.tmp").write_text('{"fingerp')
    cli("convert", tiny_ckpt, tmp_path / "out", check=True)
    assert validate(tmp_path / "out")["ok"] and sorted(x.name for x in tmp_path.iterdir()) == ["out"]


# ---- bad input → one line naming the file, non-zero exit, no traceback, nothing half-written

def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shards(ck: Path) -> list[Path]:
    return [ck / f for f in sorted(set(json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"].values()))]


def test_missing_shard(tiny_ckpt, tmp_path):
    ck = broken_copy(tiny_ckpt, tmp_path / "ck")
    gone = shards(ck)[1]
    gone.unlink()
    one_error_line(cli("convert", ck, tmp_path / "o"), str(gone), "missing")
    assert not (tmp_path / "o").exists()


def test_truncated_shard(tiny_ckpt, tmp_path):
    ck = broken_copy(tiny_ckpt, tmp_path / "ck")
    p = shards(ck)[2]
    os.truncate(p, p.stat().st_size - 1000)
    one_error_line(cli("convert", ck, tmp_path / "o"), str(p), "truncated")


def test_unparsable_header(tiny_ckpt, tmp_path):
    ck = broken_copy(tiny_ckpt, tmp_path / "ck")
    p = shards(ck)[0]
    data = bytearray(p.read_bytes())
    data[8:12] = b"\xff{{{"
    p.write_bytes(bytes(data))
    one_error_line(cli("convert", ck, tmp_path / "o"), str(p), "header does not parse")


def test_index_names_missing_tensor(tiny_ckpt, tmp_path):
    ck = broken_copy(tiny_ckpt, tmp_path / "ck")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"]["language_model.model.layers.0.mlp.gate.extra"] = shards(ck)[0].name
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    one_error_line(cli("convert", ck, tmp_path / "o"), "mlp.gate.extra", "not in this shard")


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(model_type="llama"), "unsupported model_type 'llama'"),
    (lambda c: c["quantization"].update(mode="mxfp4"), "unsupported quantization mode"),
    (lambda c: c["quantization"].update(bits=8), "unsupported expert quantization"),
    (lambda c: c["text_config"].update(moe_intermediate_size=128), "but the config implies"),
    (lambda c: c.pop("model_type"), "config.json: has no model_type (supported: "),
    (lambda c: c["vision_config"].pop("depth"), "config.json: not a config this version can check the weights against: it has no 'depth'"),
])
def test_bad_config(tiny_ckpt, tmp_path, edit, needle):
    ck = broken_copy(tiny_ckpt, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(cli("convert", ck, tmp_path / "o"), needle)
    assert not needle.startswith("config.json") or line.startswith(f"streamoe: error: {ck / 'config.json'}: "), line
    assert not (tmp_path / "o").exists()


def _edit_table(conv: Path, dst: Path, kind: str, edit) -> Path:
    """A copy of a conversion whose manifest's `kind` blob table is edited by `edit(tensors)` (the bytes unchanged)."""
    out = broken_copy(conv, dst)
    doc = json.loads((out / "manifest.json").read_text())
    edit(doc["blobs"][kind]["tensors"])
    (out / "manifest.json").write_text(json.dumps(doc))
    return out


def _named(tensors: list, suffix: str) -> dict:
    return next(t for t in tensors if t["name"].endswith(suffix))


@pytest.mark.parametrize("kind,edit,detail", [
    ("nonexpert", lambda ts: ts.remove(_named(ts, "layers.1.input_layernorm.weight")),
     "tensor language_model.model.layers.1.input_layernorm.weight is missing from the nonexpert blob"),
    ("nonexpert", lambda ts: _named(ts, "model.norm.weight").update(shape=[2, 32]),
     "tensor language_model.model.norm.weight has shape [2, 32], the config implies [64]"),
    ("nonexpert", lambda ts: _named(ts, "layers.0.mlp.gate.weight").update(bits=4),
     "mlp.gate.weight is U32 at 4 bits, group 64; the config says U32 at 8 bits, group 64"),
    ("nonexpert", lambda ts: _named(ts, "model.norm.weight").update(dtype="I16"),
     "tensor language_model.model.norm.weight is I16, expected a float dtype"),
    ("vision", lambda ts: ts.remove(_named(ts, "vision_tower.patch_embed.proj.weight")),
     "vision_tower.patch_embed.proj.weight is missing from the vision blob"),
])
def test_validate_names_a_blob_table_the_config_does_not_imply(tiny_conv, tmp_path, kind, edit, detail):
    rep = validate(_edit_table(tiny_conv, tmp_path / "c", kind, edit))
    bad = [c for c in rep["checks"] if not c["ok"]]
    assert [c["name"] for c in bad] == [f"tensors:{kind}"] and detail in bad[0]["detail"], bad


def test_validate_catches_size_checksum_and_schema(tiny_conv, tmp_path):
    out = broken_copy(tiny_conv, tmp_path / "c")
    layer = out / "experts" / "q4" / "layer-03.bin"
    data = bytearray(layer.read_bytes())
    data[100] ^= 0xFF
    layer.write_bytes(bytes(data))
    one_error_line(cli("validate", out), str(layer), "checksum mismatch")
    with open(layer, "ab") as f:
        f.write(b"\0" * 4096)
    line = one_error_line(cli("validate", out), str(layer))
    assert "size" in line
    doc = json.loads((out / "manifest.json").read_text())
    doc["files"][0]["path"] = "/etc/passwd"
    (out / "manifest.json").write_text(json.dumps(doc))
    one_error_line(cli("validate", out), "manifest.json", "schema")
    (out / "manifest.json").write_text("{not json")
    one_error_line(cli("validate", out), "manifest.json", "does not parse")
