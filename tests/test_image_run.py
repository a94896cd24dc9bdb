"""Image questions end to end: the engine against mlx-vlm, across caps, under a cgroup, and bad images."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image, ImageDraw

from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.image import MAX_PIPED_IMAGE_BYTES, load_image, preprocess
from streamoe.runtime.image_prompt import image_config, prefill_images
from streamoe.runtime.mrope import expand_image_tokens
from streamoe.runtime.sampling import Sampler

from .conftest import LOGIT_ATOL, RUNTIME, cli, one_error_line, run_capped


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("img") / "shape.png"
    im = Image.new("RGB", (160, 96), "white")
    ImageDraw.Draw(im).ellipse((40, 10, 120, 86), fill=(30, 120, 220))
    im.save(p)
    return p


def question(eng: Engine) -> list[int]:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    return eng.text.encode(eng.text.chat_prompt(msgs, think=False))


def engine(conv: Path, slots: int | None) -> Engine:
    base = plan_for(conv, Options(cap_gib=64, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME, images=True))
    cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
    return Engine(conv, Options(cap_gib=cap, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME, images=True))


def test_image_question_matches_mlx_vlm_and_is_identical_across_caps(tiny_ckpt, tiny_conv, picture):
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    ref = load_model(tiny_ckpt)
    ref.set_dtype(mx.float32)
    runs = []
    for slots in (0, 12, None):  # barely fitting, a fraction, everything resident
        eng = engine(tiny_conv, slots)
        cfg = eng.manifest.config
        ids = question(eng)
        patches, grid = preprocess(load_image(picture), image_config(eng))
        full = mx.array([expand_image_tokens(ids, [grid], cfg["image_token_id"], cfg["vision_config"]["spatial_merge_size"])])
        assert full.shape[1] > 3 * 16  # several prefill chunks, image tokens among them
        feat = ref.get_input_embeddings(full, mx.array(patches), image_grid_thw=mx.array([grid]))
        cache = make_prompt_cache(ref.language_model)
        lr = ref.language_model(full, inputs_embeds=feat.inputs_embeds, cache=cache, position_ids=feat.position_ids,
                                rope_deltas=feat.rope_deltas).logits[0, -1]
        le = prefill_images(eng, ids, [picture])
        ours, theirs, logits = [], [], []
        for _ in range(16):
            a, b = np.array(lr), np.array(le)
            assert np.abs(a - b).max() < LOGIT_ATOL
            t = int(a.argmax())
            theirs.append(t)
            top2 = np.sort(a)[-2:]
            ours.append(int(b.argmax()) if top2[1] - top2[0] > 2 * LOGIT_ATOL else t)
            logits.append(b)
            lr = ref.language_model(mx.array([[t]]), cache=cache).logits[0, -1]
            le = eng.forward([t], "decode")
        assert ours == theirs
        runs.append(np.stack(logits).tobytes())
        eng.close()
    assert runs[0] == runs[1] == runs[2]


def summaries(stderr: str) -> int:
    """How many answers `run` summarised (one `[N tokens, ... tok/s ...]` line each)."""
    return sum(ln.startswith("[") and "tok/s" in ln for ln in stderr.splitlines())


def test_image_prompt_in_auto_chunks_equals_steps(tiny_conv, picture, monkeypatch):
    """An image prompt in the plan's chunks runs its layers in steps, each with its slice of the M-RoPE positions:
    the same bits as chunks of one step."""
    from streamoe.runtime import plan as plan_mod

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 16)
    out = []
    for chunk in (16, "auto"):
        base = plan_for(tiny_conv, Options(cap_gib=64, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME, images=True))
        cap = (base.fixed + 12 * base.slot_bytes + 1) / 2**30
        eng = Engine(tiny_conv, Options(cap_gib=cap, ctx=512, prefill_chunk=chunk, runtime_bytes=RUNTIME, images=True))
        out.append((np.array(prefill_images(eng, question(eng), [picture])).tobytes(), eng.plan.prefill_chunk,
                    eng.steps[0].n_tokens))
        eng.close()
    assert out[1][1] > 16 and out[1][2] > 16  # a chunk of several steps
    assert out[0][0] == out[1][0]


def test_image_prompt_progress_counts_the_prompt_its_images_expand(tiny_conv, picture):
    """`Engine.generate`'s prefill progress for a prompt with an image: over the prompt the image expands (its
    patches' tokens), every call giving that total, never going back, ending at it; the same answer as without."""
    answers, calls = [], []
    for progress in (None, lambda done, total: calls.append((done, total))):
        eng = Engine(tiny_conv, Options(cap_gib=64, ctx=512, runtime_bytes=RUNTIME, images=True))
        ids = question(eng)
        answers.append([t for t, _ in eng.generate(ids, 4, Sampler(), images=[picture], progress=progress)])
        eng.close()
    total = calls[-1][1]
    assert total > len(ids) + 16 and all(t == total for _, t in calls)  # the image's tokens counted
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and calls[-1][0] == total
    assert answers[0] == answers[1] and len(answers[0]) == 4


def test_plan_with_runs_options_is_the_plan_run_opens(tiny_conv, tiny_ckpt, picture):
    """`plan` takes every option of `run` that sizes an account (--prefetch-width and --io-threads: the read staging,
    --max-pixels: the vision account, the prompt: its tokenizing): given the same ones, at a cap 2 KiB below its need it refuses in the very line
    `run` refuses with, the need to the KiB. A bare config.json plans the same vision account."""
    opts = ["--ctx", "512", "--runtime-mib", "64", "--prefetch-width", "30", "--io-threads", "3", "--max-pixels", "40000"]
    planned = json.loads(cli("plan", tiny_conv, *opts, "--images", "--json", "-p", "What colour?", check=True).stdout)
    default = json.loads(cli("plan", tiny_conv, "--ctx", "512", "--runtime-mib", "64", "--images", "--json", check=True).stdout)
    for name in ("read staging", "vision"):
        assert planned["accounts"][name] != default["accounts"][name], name
    cap = f"{(planned['fixed'] - 2048) / 2**30:.9f}"
    refused = one_error_line(cli("plan", tiny_conv, "--cap", cap, *opts, "--images", "-p", "What colour?"), "too small",
                             "fixed accounts need")
    ran = one_error_line(cli("run", tiny_conv, "--cap", cap, *opts, "--image", picture, "-p", "What colour?"), "too small")
    assert ran == refused
    need = re.search(r"need (\d+\.(\d+)) GiB", ran)
    assert need.group(1) == f"{planned['fixed'] / 2**30:.{len(need.group(2))}f}" and len(need.group(2)) >= 5
    bare = json.loads(cli("plan", tiny_ckpt / "config.json", *opts, "--images", "--json", check=True).stdout)
    assert bare["accounts"]["vision"] == planned["accounts"]["vision"] > 0
    assert bare["accounts"]["read staging"] == planned["accounts"]["read staging"]


@pytest.mark.parametrize("args, needle", [(["--max-pixels", "40000"], "--max-pixels sizes the vision account"),
                                          (["--max-queue", "2"], "--max-queue sizes what `serve` plans: add --serve"),
                                          (["--images", "--no-images", "--serve"], "not both")])
def test_plan_refuses_an_option_that_would_size_nothing(tiny_conv, args, needle):
    one_error_line(cli("plan", tiny_conv, *args), needle)


@pytest.mark.parametrize("args, needle", [
    (["run", "-p", "hi", "--max-pixels", "40000"], "this run plans none (no --image)"),
    (["run", "--raw", "-p", "hi", "--max-pixels", "40000"], "this run plans none (no --image)"),
    (["serve", "--no-images", "--max-pixels", "40000"], "this server plans none (--no-images)"),
])
def test_run_and_serve_refuse_max_pixels_with_no_vision_account(tiny_conv, picture, args, needle):
    """--max-pixels sizes the vision account; where none is planned it would change nothing: refused before the
    model opens, as `plan` refuses it (a run with an image, and a server with images, take it)."""
    one_error_line(cli(args[0], tiny_conv, "--cap", "1", *args[1:]), needle)
    cli("run", tiny_conv, "--cap", "1", "-p", "hi", "-n", "2", "--max-pixels", "40000", "--image", picture, check=True)


def run_piped(conv: Path, image: bytes, *args, stdin: str = "/dev/stdin") -> subprocess.CompletedProcess:
    """`streamoe run CONV --image /dev/stdin ARGS` (or `--image -`), the image's bytes written into its stdin, a pipe."""
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(conv), "--image", stdin, *map(str, args)],
                       input=image, capture_output=True, timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())


def test_an_image_from_a_pipe_is_planned_and_answered_as_its_file(tiny_conv, picture):
    """`--image <(curl -s URL)`, `--image /dev/stdin`: a pipe reads once and an image is read twice (checked, then
    encoded), so its bytes are read before the model opens and held in an account of their own: at a cap 2 KiB below
    the plan with them, `run` refuses naming that need to the byte's GiB digits. The answer is the file's."""
    opts = ["--ctx", "512", "--runtime-mib", "64", "--temp", "0", "-n", "6", "--no-think", "-p", "What colour is it?"]
    data = picture.read_bytes()
    by_file = cli("run", tiny_conv, "--cap", "1", *opts, "--image", picture, check=True)
    by_pipe = run_piped(tiny_conv, data, "--cap", "1", *opts)
    assert by_pipe.returncode == 0, by_pipe.stderr
    assert by_pipe.stdout == by_file.stdout and by_file.stdout.strip()
    assert run_piped(tiny_conv, data, "--cap", "1", *opts, stdin="-").stdout == by_file.stdout  # `--image -`, as `-p -`
    planned = json.loads(cli("plan", tiny_conv, "--ctx", "512", "--runtime-mib", "64", "--images", "--json",
                             "-p", "What colour is it?", check=True).stdout)
    held = planned["fixed"] + len(data)
    line = one_error_line(run_piped(tiny_conv, data, "--cap", f"{(held - 2048) / 2**30:.9f}", *opts), "too small")
    need = re.search(r"need (\d+\.(\d+)) GiB", line)
    assert need.group(1) == f"{held / 2**30:.{len(need.group(2))}f}" != f"{planned['fixed'] / 2**30:.{len(need.group(2))}f}"


def test_a_bad_image_pipe_is_one_line(tiny_conv, picture):
    one_error_line(run_piped(tiny_conv, b"", "--cap", "1", "-p", "hi"), "/dev/stdin", "a pipe that gave nothing")
    one_error_line(run_piped(tiny_conv, bytes(MAX_PIPED_IMAGE_BYTES + 1), "--cap", "1", "-p", "hi"), "/dev/stdin",
                   f"gave more than {MAX_PIPED_IMAGE_BYTES} bytes")
    one_error_line(run_piped(tiny_conv, b"not an image", "--cap", "1", "-p", "hi"), "/dev/stdin", "not an image")
    one_error_line(run_piped(tiny_conv, picture.read_bytes(), "--cap", "1", "-p", "-"), "--image and -p - both read stdin")
    one_error_line(run_piped(tiny_conv, picture.read_bytes(), "--cap", "1", "--chat"), "--image and --chat both read stdin")
    one_error_line(run_piped(tiny_conv, picture.read_bytes(), "--cap", "1", "-f", "/dev/stdin"),
                   "--image and --prompt-file both read stdin")


def test_chat_turns_and_cli_image(tiny_conv, picture):
    p = cli("run", tiny_conv, "--cap", "1", "--image", picture, "-p", "What is it?", "-n", "4", check=True)
    assert "tok/s" in p.stderr
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--chat", "-n", "3"],
                       input=f"/image {picture}\nWhat is it?\nAnd now?\n/quit\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert summaries(p.stderr) == 2 and "attached" in p.stderr


def test_chat_image_lines_as_terminals_write_them(tiny_conv, picture, tmp_path):
    """`/image` of a path a terminal's drag and drop writes (quoted, spaces escaped, or under `~`) attaches it; a
    bare `/image` says what it needs; `/clear` drops an image attached to the next turn, and says so."""
    spaced = tmp_path / "my pic.png"
    spaced.write_bytes(picture.read_bytes())
    home = tmp_path / "home"
    home.mkdir()
    (home / "p.png").write_bytes(picture.read_bytes())
    lines = (f"/image '{spaced}'\n/image {str(spaced).replace(' ', chr(92) + ' ')}\n/image ~/p.png\nWhat is it?\n"
             f"/image\n/image {picture}\n/clear\nAnd now?\n/quit\n")
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--chat", "-n", "3",
                        "--stats", str(tmp_path / "s.jsonl")], input=lines, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HOME": str(home)})
    assert p.returncode == 0 and "streamoe: error" not in p.stderr, p.stderr
    assert p.stderr.count("(attached ") == 4 and f"(attached {home / 'p.png'} to the next turn)" in p.stderr
    assert "(/image needs a file: /image PATH)" in p.stderr
    assert "(the conversation is cleared and the 1 image(s) attached to the next turn dropped)" in p.stderr
    prefills = [json.loads(ln)["n_tokens"] for ln in (tmp_path / "s.jsonl").read_text().splitlines() if '"prefill"' in ln]
    text_only = cli("run", tiny_conv, "--cap", "1", "-p", "And now?", "-n", "1", "--stats", tmp_path / "t.jsonl", check=True)
    assert text_only and prefills[-1] == json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["n_tokens"]


def test_chat_refuses_a_bad_image_in_one_line_and_goes_on(tiny_conv, picture, tmp_path):
    """`/image` of a missing, unreadable or non-image file: one line on stderr naming it, nothing attached, and
    the next turns (one with a good picture) are answered."""
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    locked = tmp_path / "locked.png"
    locked.write_bytes(picture.read_bytes())
    locked.chmod(0)
    bad = [(tmp_path / "missing.png", "no such file"), (text, "not an image"), (tmp_path, "not a regular file")]
    if not os.access(locked, os.R_OK):  # root reads any file: there the mode cannot make it unreadable
        bad.append((locked, "cannot read"))
    lines = "".join(f"/image {p}\n" for p, _ in bad) + f"What is it?\n/image {picture}\nAnd this?\n/quit\n"
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--chat", "-n", "3"],
                       input=lines, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("streamoe: error:")]
    assert len(errors) == len(bad), p.stderr
    for line, (path, needle) in zip(errors, bad, strict=True):
        assert str(path) in line and needle in line and "the chat goes on" in line, line
    assert p.stderr.count("(attached") == 1 and f"(attached {picture}" in p.stderr
    assert summaries(p.stderr) == 2  # both turns answered


def test_chat_turn_refused_keeps_its_images_for_the_next(tiny_conv, picture, tmp_path):
    """A turn refused as too long for the context leaves the images attached to it for the next turn (said in its
    line): the next turn's prompt is the one `-p ... --image` gives. An image attached when the chat ends is said
    not to be sent."""
    turns = f"/image {picture}\n{'ab ' * 3000}\nWhat is it?\n/image {picture}\n/quit\n"
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--chat", "-n", "1",
                        "--stats", str(tmp_path / "s.jsonl")], input=turns, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("streamoe: error:")]
    assert len(errors) == 1 and errors[0].endswith("its 1 image(s) stay attached to the next turn)"), p.stderr
    assert p.stderr.endswith("(the chat ends: the 1 image(s) attached to a next turn are not sent)\n"), p.stderr
    prefill = [json.loads(ln)["n_tokens"] for ln in (tmp_path / "s.jsonl").read_text().splitlines() if '"prefill"' in ln]
    cli("run", tiny_conv, "--cap", "1", "-p", "What is it?", "--image", picture, "-n", "1", "--stats",
        tmp_path / "t.jsonl", check=True)
    alone = [json.loads(ln)["n_tokens"] for ln in (tmp_path / "t.jsonl").read_text().splitlines() if '"prefill"' in ln]
    assert prefill == alone and alone[0] > 100  # the image's pads in it


def test_image_run_inside_cgroup(small_conv, picture, tmp_path):
    plan = plan_for(small_conv, Options(cap_gib=8, ctx=512, images=True, runtime_bytes=160 << 20))
    cap = round((plan.fixed + 100 * plan.slot_bytes) / 2**30, 3)
    stats = tmp_path / "s.jsonl"
    p, failcnt, peak = run_capped(["run", small_conv, "--cap", cap, "--ctx", 512, "--image", picture, "-p", "Describe it.",
                                   "-n", 12, "--stats", stats], cap)
    assert p.returncode == 0, p.stderr
    assert failcnt == 0 and peak <= cap * 2**30
    dec = [json.loads(ln) for ln in stats.read_text().splitlines() if '"decode"' in ln]
    assert sum(ly["misses"] for r in dec for ly in r["layers"]) > 0


def bad_images(d: Path) -> list[tuple[Path, str]]:
    (d / "text.png").write_text("hello, not a picture")
    (d / "empty.png").write_bytes(b"")
    good = d / "good.png"
    Image.new("RGB", (64, 64), "red").save(good)
    data = good.read_bytes()
    (d / "trunc.png").write_bytes(data[: len(data) // 2])
    huge = d / "huge.png"  # a 60000x60000 header over a few pixels: refused before any pixel is decoded
    ihdr = data[12:29]  # b"IHDR" + width, height, depth, colour, ... as the good file has them
    ihdr = ihdr[:4] + struct.pack(">II", 60000, 60000) + ihdr[12:]
    huge.write_bytes(data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:])
    return [(d / "text.png", "not"), (d / "empty.png", "empty"), (d / "trunc.png", "truncated"), (huge, "pixels"),
            (d / "missing.png", "no such file")]


def test_bad_images_one_line_each(tiny_conv, tmp_path):
    for path, needle in bad_images(tmp_path):
        line = one_error_line(cli("run", tiny_conv, "--cap", "1", "--image", path, "-p", "hi"), str(path))
        assert needle in line.lower(), line


def test_text_only_model_refuses_images(tmp_path):
    from streamoe.convert.convert import convert
    from streamoe.convert.synth import synth

    ck, out = tmp_path / "ck", tmp_path / "out"
    synth(ck, size="tiny", variant="qwen3.6", text_only=True, seed=2, shard_bytes=None, dry_run=False)
    convert(ck, out, progress=False)
    one_error_line(cli("plan", out, "--images"), "no vision tower")
