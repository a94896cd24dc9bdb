"""Sessions (`--save-session` / `--load-session`, docs/FORMAT.md): a saved conversation is safetensors inside zstd, and a restored one continues with
bit-identical logits; every bad session file is one line naming it."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zstandard
from PIL import Image, ImageDraw

from streamoe.convert.convert import convert
from streamoe.convert.synth import synth
from streamoe.formats.manifest import load_manifest
from streamoe.formats.session import write_session
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.models.cache import KVCache
from streamoe.runtime.sampling import Sampler
from streamoe.runtime.session import load_session, save_session
from streamoe.runtime.text import TextIO

from .conftest import RUNTIME, cli, one_error_line

FIRST, SECOND = [5, 17, 300, 41, 9, 77, 120, 3, 64, 250, 11], [40, 41, 42, 500, 7]


def engine(conv, **kw) -> Engine:
    return Engine(conv, Options(cap_gib=8, ctx=256, prefill_chunk=4, runtime_bytes=RUNTIME, **kw))


def turn(eng: Engine, ids: list[int], n: int = 6) -> tuple[list[int], bytes]:
    out = list(eng.generate(ids, n, Sampler()))
    return [t for t, _ in out], np.stack([lg for _, lg in out]).tobytes()


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_restored_session_continues_bit_identical(tiny_conv, tmp_path, kv):
    eng = engine(tiny_conv, kv=kv)
    first, _ = turn(eng, FIRST)
    save_session(eng, tmp_path / "s.zst", {"note": "kept"})
    expect = turn(eng, SECOND)
    eng.close()

    eng = engine(tiny_conv, kv=kv, tier="lru", prefetch_width=0)  # the tier and prefetch are not state
    assert load_session(eng, tmp_path / "s.zst") == {"note": "kept"}
    assert eng.offset == len(FIRST) + len(first)
    got = turn(eng, SECOND)
    eng.close()
    assert got == expect


def test_a_session_refused_by_what_it_keeps_leaves_the_conversation_as_it_was(tiny_conv, tmp_path):
    """A history longer than the state it goes with is refused, naming it, before anything of the file is read
    into the engine: its conversation goes on as if no load was tried (the delta rule's states included)."""
    from streamoe.formats.errors import StreamoeError

    eng = engine(tiny_conv)
    turn(eng, FIRST, 4)
    save_session(eng, tmp_path / "long.zst", {"raw": True, "messages": [], "tokens": FIRST * 2})
    eng.reset()
    turn(eng, SECOND, 3)
    want = turn(eng, FIRST)
    eng.reset()
    turn(eng, SECOND, 3)
    with pytest.raises(StreamoeError, match=f"long.zst: session 'tokens' must be a list of at most {len(FIRST) + 4} "):
        load_session(eng, tmp_path / "long.zst")
    got = turn(eng, FIRST)
    eng.close()
    assert got == want


def test_a_loaded_session_saves_back_to_the_same_bytes(tiny_conv, tmp_path):
    eng = engine(tiny_conv, kv="float16")
    turn(eng, FIRST)
    save_session(eng, tmp_path / "a.zst", {"k": [1, 2]})
    eng.close()
    eng = engine(tiny_conv, kv="float16")
    extra = load_session(eng, tmp_path / "a.zst")
    save_session(eng, tmp_path / "b.zst", extra)
    eng.close()
    assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes()


def test_session_file_is_safetensors_in_zstd(tiny_conv, tmp_path):
    from safetensors.numpy import load

    eng = engine(tiny_conv, kv="float16")
    turn(eng, FIRST, 3)
    save_session(eng, tmp_path / "s.zst", {})
    raw = zstandard.ZstdDecompressor().stream_reader(open(tmp_path / "s.zst", "rb")).read()
    tensors = load(raw)  # the safetensors library reads the decompressed file as is
    n = eng.offset
    assert n == len(FIRST) + 3
    for i, c in enumerate(eng.conversation.caches):
        if isinstance(c, KVCache):
            for field in ("keys", "values"):
                saved = tensors[f"layers.{i}.{field}"]
                assert saved.dtype == np.float16 and saved.shape[2] == n
                assert saved.tobytes() == np.array(getattr(c, field)[:, :, :n]).tobytes()
        else:
            assert tensors[f"layers.{i}.state"].tobytes() == np.array(c.state).tobytes()
            assert tensors[f"layers.{i}.conv"].tobytes() == np.array(c.conv).tobytes()
    eng.close()
    assert len(tensors) == 2 * len(eng.conversation.caches)


def test_cli_chat_split_by_a_saved_session_is_the_same_chat(trained_conv, tmp_path):
    """An image turn, saved; the next turn in a new process gives the logits an unbroken --chat gives."""
    pic = tmp_path / "shape.png"
    im = Image.new("RGB", (160, 128), "white")
    ImageDraw.Draw(im).polygon([(112, 22), (129.1, 53.5), (94.9, 53.5)], fill=(245, 130, 15))
    im.save(pic)
    common = ["run", trained_conv, "--cap", "1", "--ctx", "512", "--kv", "float16", "--no-think", "-n", "8", "--temp", "0"]
    a = cli(*common, "--image", pic, "-p", "What shape is in the image?", "--save-session", tmp_path / "s.zst",
            "--logits-out", tmp_path / "a.npz", check=True)
    assert a.stdout.strip() == "triangle" and "saved" in a.stderr
    b = cli(*common, "-p", "What colour is the shape?", "--load-session", tmp_path / "s.zst",
            "--logits-out", tmp_path / "b.npz", check=True)
    whole = subprocess.run([sys.executable, "-m", "streamoe.cli", *map(str, common), "--chat", "--logits-out",
                            tmp_path / "c.npz"], input=f"/image {pic}\nWhat shape is in the image?\nWhat colour is the shape?\n",
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    la, lb, lc = (np.load(tmp_path / f"{k}.npz")["logits"] for k in "abc")
    assert lc.shape[0] == la.shape[0] + lb.shape[0]
    assert lc[:len(la)].tobytes() == la.tobytes() and lc[len(la):].tobytes() == lb.tobytes()
    assert b.stdout.strip() == "orange"
    # the second turn fed only itself (the close of the answer, then the new turn): the cache kept the first
    text = TextIO(trained_conv, load_manifest(trained_conv).config)
    new = text.encode(text.turn_close() + text.chat_prompt([{"role": "user", "content": "What colour is the shape?"}],
                                                           think=False))
    assert f"prefill {len(new)} tokens" in b.stderr
    second = [ln for ln in whole.stderr.splitlines() if "tok/s" in ln][1]  # and so does an unbroken --chat
    assert f"prefill {len(new)} tokens" in second


def test_a_chat_turn_too_long_for_the_context_or_not_utf8_is_refused_and_the_chat_goes_on(trained_conv, tmp_path):
    """Each refused turn is said in one line and sent nowhere: the turns around them give the logits and the saved
    session a chat without them gives. A turn longer than the context by its tokens is refused once tokenized; one
    longer at any token length before it is tokenized (a tokenizer holds hundreds of bytes a token); one whose
    bytes are not UTF-8 whatever stdin's error handling (a strict locale's too)."""
    common = [sys.executable, "-m", "streamoe.cli", "run", str(trained_conv), "--cap", "1", "--ctx", "64", "--no-think",
              "-n", "4", "--temp", "0", "-q", "--chat"]
    long, huge = b" ".join([b"shape"] * 80), b"ab " * 20000
    runs = {}
    for name, turns in (("with", [b"What shape?", long, b"caf\xe9 \xff?", huge, b"What colour?"]),
                        ("without", [b"What shape?", b"What colour?"])):
        p = subprocess.run([*common, "--logits-out", tmp_path / f"{name}.npz", "--save-session", tmp_path / f"{name}.zst"],
                           input=b"\n".join(turns) + b"\n", capture_output=True, timeout=300,
                           env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
        assert p.returncode == 0, p.stderr.decode()
        runs[name] = p.stderr.decode()
    refused = [ln for ln in runs["with"].splitlines() if ln.startswith("streamoe: error:")]
    assert len(refused) == 3, runs["with"]
    assert re.match(r"streamoe: error: prompt of \d+ tokens .* longer than the planned context", refused[0])
    assert refused[0].endswith("(not sent; the chat goes on; /clear empties the conversation)")
    assert refused[1] == "streamoe: error: <stdin>: the turn is not valid UTF-8 text (not sent; the chat goes on)"
    assert re.match(r"streamoe: error: prompt of at least \d+ tokens .* longer than the planned context", refused[2])
    la, lb = (np.load(tmp_path / f"{k}.npz")["logits"] for k in ("with", "without"))
    assert la.tobytes() == lb.tobytes()
    assert (tmp_path / "with.zst").read_bytes() == (tmp_path / "without.zst").read_bytes()


def test_a_session_goes_on_with_the_thinking_it_was_saved_with(tiny_conv, tmp_path):
    """A conversation saved with --no-think renders its next turn so only: loaded without it (or one saved
    without it loaded with it) is refused in one line naming the file, and loaded the same way it goes on."""
    common = ["run", tiny_conv, "--cap", "1", "-n", "2", "--temp", "0", "-q"]
    for flags, other in (([], ["--no-think"]), (["--no-think"], [])):
        saved = tmp_path / f"s{len(flags)}.zst"
        cli(*common, *flags, "-p", "Hi", "--save-session", saved, check=True)
        one_error_line(cli(*common, *other, "-p", "And?", "--load-session", saved), str(saved), "--no-think",
                       "run it the same way")
        cli(*common, *flags, "-p", "And?", "--load-session", saved, check=True)


def test_ctrl_c_stops_a_chats_answer_and_the_chat_goes_on_from_what_was_shown(tiny_conv, tmp_path):
    """Ctrl-C mid-answer ends that answer after K tokens; the next turn's logits are those of a chat whose
    answers are cut at K by -n (random weights: an answer seldom ends on its own within them; where the next one
    does, before 400 tokens, the cut chat's equals the reference's as far as both go)."""
    common = [sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--ctx", "1024", "--chat",
              "--temp", "0"]
    p = subprocess.Popen([*common, "-n", "400", "--logits-out", tmp_path / "cut.npz"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(b"Tell me a long story.\n")
    p.stdin.flush()
    shown = b""
    while len(shown) < 200 and (more := os.read(p.stdout.fileno(), 256)):
        shown += more
    assert len(shown) >= 200, (shown, p.stderr.read() if p.poll() is not None else "")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(b"And then?\n", timeout=300)
    assert p.returncode == 0 and "(stopped)" in err.decode(), err.decode()
    k = int(re.search(r"\[(\d+) tokens", err.decode()).group(1))
    assert 0 < k < 400
    ref = subprocess.run([*common, "-n", str(k), "--logits-out", tmp_path / "ref.npz"],
                         input=b"Tell me a long story.\nAnd then?\n", capture_output=True, timeout=300)
    assert ref.returncode == 0, ref.stderr.decode()
    cut, want = (np.load(tmp_path / f"{name}.npz")["logits"] for name in ("cut", "ref"))
    second = cut.shape[0] - k  # the next answer: 400 tokens, or fewer where the model ended it (as -n k cuts it)
    assert 0 < second <= 400 and want.shape[0] == k + min(k, second)
    assert cut[:want.shape[0]].tobytes() == want.tobytes()


def test_a_sampled_chat_split_by_a_saved_session_draws_the_same_tokens(tiny_conv, tmp_path):
    """Sampling (random weights: every draw matters) with a presence penalty: the second turn, loaded from the
    first's session in a new process, draws what the unbroken chat draws (seed and draws counted are saved)."""
    common = ["run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "-n", "12", "--temp", "1", "--top-k", "20",
              "--seed", "5", "--presence-penalty", "1.0"]
    turns = ["one two three", "four five"]
    a = cli(*common, "-p", turns[0], "--save-session", tmp_path / "s.zst", check=True)
    b = cli(*common, "-p", turns[1], "--load-session", tmp_path / "s.zst", check=True)
    whole = subprocess.run([sys.executable, "-m", "streamoe.cli", *map(str, common), "--chat"],
                           input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == a.stdout + b.stdout
    c = cli(*common[:-2], "-p", turns[0], check=True)  # the penalty is honoured: without it the draws differ
    assert c.stdout != a.stdout


@pytest.mark.parametrize("draw", [["--temp", "0"], ["--temp", "1", "--top-k", "20", "--seed", "5"]])
def test_a_session_saved_with_its_context_full_continues_as_one_saved_with_room(tiny_conv, tmp_path, draw):
    """The answer's last token, shown but left out of a full context, is fed when the session is loaded with room
    for it: the next turn's logits are those of the same answer saved where the context had room."""
    first = "one two three"
    p = len(TextIO(tiny_conv, load_manifest(tiny_conv).config).encode_prompt(first))
    common = ["run", tiny_conv, "--cap", "1", "--raw", *draw]
    full = cli(*common, "--ctx", p + 3, "-n", "8", "-p", first, "--save-session", tmp_path / "full.zst", check=True)
    assert "cut by the context" in full.stderr
    room = cli(*common, "--ctx", 256, "-n", 4, "-p", first, "--save-session", tmp_path / "room.zst", check=True)
    assert full.stdout == room.stdout  # the same 4 tokens: 3 fed, the last shown
    after = {}
    for name in ("full", "room"):
        cli(*common, "--ctx", 256, "-n", 6, "-p", " four five", "--load-session", tmp_path / f"{name}.zst",
            "--logits-out", tmp_path / f"{name}.npz", "--save-session", tmp_path / f"{name}-2.zst", check=True)
        after[name] = np.load(tmp_path / f"{name}.npz")["logits"].tobytes()
    assert after["full"] == after["room"]
    assert (tmp_path / "full-2.zst").read_bytes() == (tmp_path / "room-2.zst").read_bytes()
    # a chat whose next turn the full context refuses keeps that token for its session; one emptied by /clear does not
    chat = [sys.executable, "-m", "streamoe.cli", *map(str, common), "--ctx", str(p + 3), "-n", "8", "--chat"]
    for name, turns in (("refused", [first, " four"]), ("cleared", [first, "/clear", "x"])):
        done = subprocess.run([*chat, "--save-session", tmp_path / f"{name}.zst"], input="\n".join(turns) + "\n",
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        on = cli(*common, "--ctx", 256, "-n", 6, "-p", " four five", "--load-session", tmp_path / f"{name}.zst",
                 "--logits-out", tmp_path / f"{name}.npz", check=True)
        assert (np.load(tmp_path / f"{name}.npz")["logits"].tobytes() == after["room"]) == (name == "refused"), on.stderr
    again = one_error_line(cli(*common, "--ctx", p + 3, "-p", " four", "--load-session", tmp_path / "full.zst"))
    assert str(tmp_path / "full.zst") in again and "--ctx" in again


def test_a_run_draws_with_a_new_seed_unless_given_and_shows_it(tiny_conv, tmp_path):
    """Sampled, `run` seeds its draws anew each time (as mlx-lm and llama.cpp do) and shows the seed on its summary
    line; given back as --seed, the run draws the same tokens. A greedy run shows none. A loaded session goes on with
    the seed it was saved with: a --seed that differs is refused in one line naming the session."""
    common = ["run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "-n", "12", "--temp", "1", "--top-k", "50"]

    def seed(p: subprocess.CompletedProcess) -> int:
        return int(re.search(r"; seed (\d+)\]$", p.stderr.strip()).group(1))

    a, b = (cli(*common, "-p", "one two three", check=True) for _ in range(2))
    assert seed(a) != seed(b)
    again = cli(*common, "-p", "one two three", "--seed", seed(a), check=True)
    assert again.stdout == a.stdout and seed(again) == seed(a)
    assert "seed" not in cli(*common, "-p", "one", "--temp", "0", check=True).stderr
    cli(*common, "-p", "one two three", "--seed", 5, "--save-session", tmp_path / "s.zst", check=True)
    on = cli(*common, "-p", "four", "--load-session", tmp_path / "s.zst", check=True)
    assert seed(on) == 5
    one_error_line(cli(*common, "-p", "four", "--load-session", tmp_path / "s.zst", "--seed", 6),
                   str(tmp_path / "s.zst"), "draws with seed 5, not --seed 6")
    # a greedy conversation drew nothing: its session holds no seed, and a sampled run on it seeds anew
    cli(*common, "-p", "one two three", "--temp", "0", "--save-session", tmp_path / "g.zst", check=True)
    on = [cli(*common, "-p", "four", "--load-session", tmp_path / "g.zst", check=True) for _ in range(2)]
    assert seed(on[0]) != seed(on[1])
    assert seed(cli(*common, "-p", "four", "--load-session", tmp_path / "g.zst", "--seed", 6, check=True)) == 6


def bad_sessions(good, d, small_conv) -> list[tuple[list, str]]:
    blob = good.read_bytes()
    (d / "plain").write_bytes(b"hello, not zstd at all" * 10)
    (d / "cut").write_bytes(blob[: len(blob) // 2])
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    (d / "flipped").write_bytes(bytes(flipped))
    (d / "notsession").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(b"\x02\x00\x00\x00\x00\x00\x00\x00{}"))
    (d / "empty").write_bytes(b"")
    inner = zstandard.ZstdDecompressor().decompress(blob)
    (d / "unchecked").write_bytes(zstandard.ZstdCompressor(write_checksum=False).compress(inner))
    write_session(d / "v2", {"version": 2}, [], [])
    write_session(d / "v-text", {"version": "1"}, [], [])
    base = {"version": 1, "model": "m", "experts": "q4", "dtype": "F32", "kv": "float32", "tokens": 0, "rope_delta": 0}
    write_session(d / "no-extra", base, [], [])
    write_session(d / "text-tokens", {**base, "tokens": "5", "extra": {}}, [], [])
    eng = Engine(small_conv, Options(cap_gib=8, ctx=64, runtime_bytes=RUNTIME))
    turn(eng, [1, 2, 3], 2)
    save_session(eng, d / "other-model", {"raw": True, "messages": [], "tokens": [1, 2, 3]})
    eng.close()
    return [
        ([d / "missing"], "not found"),
        ([d / "plain"], "not a streamoe session"),
        ([d / "cut"], "truncated"),
        ([d / "flipped"], "damaged"),
        ([d / "notsession"], "session metadata"),
        ([d / "empty"], "is empty: not a streamoe session"),
        ([d / "unchecked"], "carries no checksum"),
        ([d / "v2"], "session format version 2 is not supported (this streamoe reads version 1)"),
        ([d / "v-text"], 'version "1" (not an integer) is not supported'),
        ([d / "no-extra"], "session metadata 'extra' must be an object, it is missing"),
        ([d / "text-tokens"], "session metadata 'tokens' must be an integer, got string"),
        ([d / "other-model"], "different model"),
        ([good, "--kv", "float16"], "(--kv): the session's float32, this run's float16"),
        ([good, "--dtype", "bfloat16"], "(--dtype): the session's float32, this run's bfloat16"),  # the flag's words
        ([good, "--ctx", "8"], "--ctx 8"),
        ([good, "--experts", "q3"], "--experts"),
    ]


def test_bad_session_files_are_one_line_each(tiny_conv, small_conv, tmp_path):
    eng = engine(tiny_conv)
    turn(eng, FIRST, 4)
    save_session(eng, tmp_path / "good.zst", {"raw": True, "messages": [], "tokens": FIRST})
    vocab = eng.args.vocab_size  # a history token is counted by the penalties, an unfed one fed: each a real id
    save_session(eng, tmp_path / "big-id.zst", {"raw": True, "messages": [], "tokens": [*FIRST[:-1], vocab]})
    save_session(eng, tmp_path / "unfed.zst", {"raw": True, "messages": [], "tokens": FIRST, "unfed": [FIRST[0]]})
    eng.close()
    for args, needle in [*bad_sessions(tmp_path / "good.zst", tmp_path, small_conv),
                         ([tmp_path / "big-id.zst"], f"below the model's vocabulary of {vocab}"),
                         ([tmp_path / "unfed.zst"], "'unfed' must be the last of its 'tokens'")]:
        p = cli("run", tiny_conv, "--cap", "1", "--raw", "-p", "x", "-n", "2", "--load-session", *args)
        line = one_error_line(p, needle)
        assert str(args[0]) in line
    p = cli("run", tiny_conv, "--cap", "1", "-p", "x", "-n", "2", "--load-session", tmp_path / "good.zst")
    one_error_line(p, "--raw")
    # the same config with other weights (another seed): not the state of this model
    synth(tmp_path / "reseeded", size="tiny", variant="qwen3.6", text_only=False, seed=5, shard_bytes=None, dry_run=False)
    convert(tmp_path / "reseeded", tmp_path / "reseeded-conv", formats=["q4"], progress=False)
    p = cli("run", tmp_path / "reseeded-conv", "--cap", "1", "--raw", "-p", "x", "--load-session", tmp_path / "good.zst")
    one_error_line(p, "different model or weights")
    p = cli("run", tiny_conv, "--cap", "1", "-p", "x", "--system", "s", "--load-session", tmp_path / "good.zst")
    assert p.returncode == 2 and "--system" in p.stderr


def test_failed_save_names_the_file_and_leaves_nothing(tiny_conv, tmp_path):
    target = tmp_path / "no-such-dir" / "s.zst"
    p = cli("run", tiny_conv, "--cap", "1", "--raw", "-p", "x", "-n", "2", "-q", "--save-session", target)
    one_error_line(p, str(target), "cannot write")
    assert not (tmp_path / "no-such-dir").exists()
    (tmp_path / "s.zst").write_bytes(b"old")

    def dies_midway():
        yield b"\0" * 4096
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_session(tmp_path / "s.zst", {}, [("a", "F32", (2048,))], dies_midway())
    assert (tmp_path / "s.zst").read_bytes() == b"old" and [f.name for f in tmp_path.iterdir()] == ["s.zst"]


def test_a_run_saving_a_session_holds_its_lock_from_the_start(tiny_conv, tmp_path):
    """Two runs saving one session file do not interleave: while a chat that will save it waits for its next turn, a
    second run saving the same file fails at once, before its model opens, naming the lock; the chat then saves. A
    lock that cannot be made (a path under /proc) is refused before the answer too."""
    target = tmp_path / "s.zst"
    common = [sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--raw", "-n", "3", "--temp", "0"]
    chat = subprocess.Popen([*common, "--chat", "--save-session", target], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / ".s.zst.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run([*common, "-p", "one", "--save-session", target], capture_output=True, text=True,
                                timeout=300)
        line = one_error_line(second, "another streamoe command is writing this session file", ".s.zst.lock")
        assert second.stdout == "" and str(target) in line
        out, err = chat.communicate("one two\n", timeout=300)
    finally:
        chat.kill()
    assert chat.returncode == 0 and "saved" in err and target.exists()
    assert not (tmp_path / ".s.zst.lock").exists()
    unmakeable = subprocess.run([*common, "-p", "one", "--save-session", "/proc/streamoe-s.zst"], capture_output=True,
                                text=True, timeout=300)
    assert one_error_line(unmakeable, "/proc/") and unmakeable.stdout == ""


def test_session_of_an_empty_conversation_round_trips(tiny_conv, tmp_path):
    eng = engine(tiny_conv)
    save_session(eng, tmp_path / "s.zst", {})
    expect = turn(eng, FIRST)
    eng.close()
    eng = engine(tiny_conv)
    load_session(eng, tmp_path / "s.zst")
    assert turn(eng, FIRST) == expect
    eng.close()


def test_ctrl_c_at_the_chats_prompt_saves_its_session(tiny_conv, tmp_path):
    """Ctrl-C while the chat waits for a turn ends it as Ctrl-D does, its session saved (it was lost), then exits as
    any Ctrl-C does: 130, one line; the saved session is the one an ended chat saves. Also where the chat started
    with SIGINT ignored (a shell's background job, a test runner's worker): Python then installs no handler."""
    common = [sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--ctx", "256", "--chat",
              "--temp", "0", "-n", "6"]
    ignored = ["sh", "-c", f"trap '' INT; exec {shlex.join(map(str, [*common, '--save-session', tmp_path / 'cut.zst']))}"]
    p = subprocess.Popen(ignored, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(b"Hello\n")
    p.stdin.flush()
    err = b""
    while b" tokens, " not in err and (more := os.read(p.stderr.fileno(), 4096)):  # the answer's summary line
        err += more
    time.sleep(0.5)  # at the prompt, reading the next turn
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    err = (err + rest).decode()
    assert p.returncode == 130 and err.strip().endswith("streamoe: interrupted") and "Traceback" not in err, err
    assert "(saved " in err
    ended = subprocess.run([*common, "--save-session", tmp_path / "ended.zst"], input=b"Hello\n", capture_output=True,
                           timeout=300)
    assert ended.returncode == 0, ended.stderr.decode()
    assert (tmp_path / "cut.zst").read_bytes() == (tmp_path / "ended.zst").read_bytes()
