"""The families beside Qwen3.5/3.6-MoE on a GPU (MLX's CUDA or Metal backend): logits bit-identical across
caps, guess widths and tiers with every filled slot checked against its file, and teacher-forced greedy
tokens and float32 logits against mlx-lm's on the CPU (on an H200, MLX's CUDA `qmm_sm90` kernel gives the tiny
models' projections wrong outputs through mlx-lm, which streamoe's `kernels.quantized_matmul` avoids). Skipped
where MLX has no GPU; run on the H200 with the rest of the GPU tests (`bash bench/h200.sh gputest`)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import synth
from streamoe.runtime import experts as experts_mod
from streamoe.runtime.engine import Engine, Options

from .conftest import RUNTIME
from .test_runtime import PROMPTS, reference, run_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(mx.default_device() != mx.gpu, reason="MLX has no GPU here (CPU backend only)"),
]
FAMILIES = {"qwen3_moe": "qwen3", "gpt_oss": "mxfp4-q8", "mixtral": "mixtral", "qwen3_next": "qwen3-next"}  # model_type -> variant
MARGIN = 1e-3  # float32 on a GPU: kernels sum in other orders than mlx-lm's; a closer top two is no verdict


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, conversion) of the family's tiny synthetic export."""
    d = tmp_path_factory.mktemp(request.param)
    synth(d / "ck", size="tiny", variant=FAMILIES[request.param], text_only=False, seed=3, shard_bytes=None,
          dry_run=False, family=request.param)
    convert(d / "ck", d / "conv", progress=False)
    return d / "ck", d / "conv"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_family_logits_bit_identical_across_caps(family, dtype, monkeypatch):
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    runs = {key: run_logits(family[1], key[0], steps=12, prefetch_width=key[1], tier=key[2], dtype=dtype)
            for key in [(0, 4, "freq"), (0, 0, "lru"), (3, 4, "lru"), (None, 4, "freq")]}
    first = runs[(0, 4, "freq")][0]
    assert runs[(None, 4, "freq")][1].experts.resident and not runs[(0, 0, "lru")][1].experts.resident
    for key, (data, _) in runs.items():
        assert data == first, f"logits differ at {key}"


def test_gpu_family_matches_mlx_lm(family):
    """float32, the reference's tokens fed to both: the same greedy token wherever the top two are MARGIN apart,
    and every logit within MARGIN."""
    from mlx_lm.models.cache import make_prompt_cache

    ckpt, conv = family
    ref = reference(ckpt)
    eng = Engine(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME, dtype="float32"))
    ids = eng.text.encode(PROMPTS[2])
    cache = make_prompt_cache(ref)

    def ref_logits(tokens: list[int]) -> mx.array:
        with mx.stream(mx.cpu):
            out = ref(mx.array([tokens]), cache=cache)[0, -1]
            mx.eval(out)
        return out

    lr, le = ref_logits(ids), eng.prefill(ids)
    worst = 0.0
    for _ in range(16):
        a, b = np.array(lr.astype(mx.float32)), np.array(le.astype(mx.float32))
        worst = max(worst, float(np.abs(a - b).max()))
        t = int(a.argmax())
        if np.diff(np.sort(a)[-2:])[0] > MARGIN:
            assert int(b.argmax()) == t
        lr, le = ref_logits([t]), eng.forward([t], "decode")
    eng.close()
    assert worst < MARGIN, worst
