"""The built-in engine against transformers, and against itself under re-chunking and re-positioning.

Real models: SmolLM2-135M (Llama), Gemma 3 270M (sliding-window + global layers, per-layer RoPE
base) and Qwen2.5-Coder-0.5B (Qwen2: q/k/v bias, GQA 14/2, RoPE base 1e6), on real text. Tiny random
checkpoints cover Qwen2 (q/k/v bias), Qwen3 (q/k norm) and Llama with llama3 / linear RoPE scaling.
Tolerance: fp32 max |logit diff| <= 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from contextkit.engine.model import Engine

pytestmark = pytest.mark.slow  # the real models against transformers, layer by layer: make test, not test-fast

TOL = 1e-3
REAL = ["smollm2", "gemma3", "qwen2.5"]
REAL_DIRS = {"smollm2": "smol_dir", "gemma3": "gemma_dir", "qwen2.5": "qwen_dir"}
TINY = ["llama3-scaled", "llama-linear", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def family(request, smol_dir, tiny_dirs, passage_text):
    cache = {}

    def get(name: str):
        if name in cache:
            return cache[name]
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if name in REAL:
            d = smol_dir if name == "smollm2" else request.getfixturevalue(REAL_DIRS[name])
            # Gemma: 700 tokens so that sliding-window layers (window 512) actually cut
            n = 700 if name == "gemma3" else 300
            ids = AutoTokenizer.from_pretrained(str(d))(passage_text)["input_ids"][:n]
        else:
            d = tiny_dirs[name]
            ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        cache[name] = (Engine.from_dir(d, "float32"), hf, ids)
        return cache[name]

    return get


def _hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", REAL + TINY)
def test_logits_match_transformers(family, name, record_property):
    engine, hf, ids = family(name)
    cache = engine.new_cache(len(ids))
    ours = engine.forward(cache, ids, logits="all")
    ref = _hf_logits(hf, ids)
    diff = (ours - ref).abs().max().item()
    record_property("max_abs_logit_diff", diff)
    print(f"{name}: {len(ids)} tokens, max |logit diff| vs transformers = {diff:.2e}")
    assert ours.shape == ref.shape
    assert diff <= TOL
    assert diff <= 1e-4 * ref.abs().max().item()  # relative too: tiny random models have small logits
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", REAL + TINY)
def test_chunked_prefill_equals_one_shot(family, name):
    engine, _, ids = family(name)
    one = engine.forward(engine.new_cache(len(ids)), ids, logits="all")
    cache = engine.new_cache(len(ids))
    cuts = [0, 1, 37, len(ids) // 2, len(ids) - 3, len(ids)]
    parts = [engine.forward(cache, ids[a:b], logits="all") for a, b in zip(cuts, cuts[1:])]
    assert cache.length == len(ids)
    assert (torch.cat(parts) - one).abs().max().item() <= TOL


@pytest.mark.parametrize("name", REAL + TINY)
def test_decode_equals_prefill_of_extended_sequence(family, name):
    engine, _, ids = family(name)
    prompt, tail = ids[:-8], ids[-8:]
    full = engine.forward(engine.new_cache(len(ids)), ids, logits="all")[-8:]
    cache = engine.new_cache(len(ids))
    engine.forward(cache, prompt, logits="none")
    steps = torch.cat([engine.forward(cache, [t]) for t in tail])
    assert (steps - full).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_shifted_positions_give_same_logits(family, name):
    # RoPE attention depends only on relative positions: the same tokens at positions 1000.. must
    # give the same logits as at 0.. (float error only). This is what span re-positioning relies on.
    engine, _, ids = family(name)
    ids = ids[:200]
    base = engine.forward(engine.new_cache(len(ids)), ids, logits="all")
    shifted = engine.forward(engine.new_cache(len(ids)), ids, positions=torch.arange(len(ids)) + 1000, logits="all")
    assert (shifted - base).abs().max().item() <= 5e-3


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen2"])
def test_segment_attention_isolates_spans(family, name):
    # Block-attention layout: two spans that attend only within themselves, then a query that sees
    # both. Span B's logits must equal B prefilled alone at the same positions; the query's logits
    # must equal ordinary causal prefill of A + B + query.
    engine, _, ids = family(name)
    a, b, q = ids[:60], ids[60:130], ids[130:150]
    cache = engine.new_cache(150)
    engine.forward(cache, a, segment=0, attend={}, logits="none")
    b_logits = engine.forward(cache, b, positions=torch.arange(60, 130), segment=1, attend={}, logits="all")
    alone = engine.forward(engine.new_cache(70), b, positions=torch.arange(60, 130), logits="all")
    assert (b_logits - alone).abs().max().item() <= TOL

    same_kv = cache.clone()
    q_logits = engine.forward(cache, q, segment=2, attend={2: [0, 1]}, logits="all")
    # seeing all earlier segments fully is causal attention over the same cached K/V
    plain = engine.forward(same_kv, q, logits="all")
    assert (q_logits - plain).abs().max().item() <= TOL
    causal = engine.forward(engine.new_cache(150), ids[:150], logits="all")[130:]
    assert not torch.allclose(q_logits, causal, atol=TOL)  # B really did not see A
    # and the predecessor relation is honoured: declaring B depends on A gives causal prefill again
    cache2 = engine.new_cache(150)
    engine.forward(cache2, a, segment=0, attend={}, logits="none")
    engine.forward(cache2, b, segment=1, attend={1: [0]}, logits="none")
    dep = engine.forward(cache2, q, segment=2, attend={2: [0, 1]}, logits="all")
    assert (dep - causal).abs().max().item() <= TOL


def test_cache_capacity_and_bad_tokens_are_clear_errors(family):
    from contextkit.core.errors import KVCacheError

    engine, _, ids = family("smollm2")
    cache = engine.new_cache(10)
    with pytest.raises(KVCacheError, match="capacity"):
        engine.forward(cache, ids[:11])
    assert cache.length == 0
    with pytest.raises(KVCacheError, match="token ids"):
        engine.forward(cache, [engine.spec.vocab_size])
    engine.forward(cache, ids[:5])
    assert cache.length == 5 and cache.next_position == 5


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_selected_logits_equal_rows_of_all(family, name):
    # The last layer runs only for the rows whose logits are asked for; that must be exact.
    engine, _, ids = family(name)
    m = len(ids)
    full = engine.forward(engine.new_cache(m), ids, logits="all")
    last = engine.forward(engine.new_cache(m), ids, logits="last")
    rows = [0, 17, m - 1, m // 2]
    picked = engine.forward(engine.new_cache(m), ids, logits=torch.tensor(rows))
    assert (last - full[-1:]).abs().max().item() <= TOL
    assert (picked - full[rows]).abs().max().item() <= TOL
    cache = engine.new_cache(m)
    assert engine.forward(cache, ids[:250], logits="none") is None
    chunk = engine.forward(cache, ids[250:], logits=torch.tensor([3, m - 251]))
    assert (chunk - full[[253, m - 1]]).abs().max().item() <= TOL


def test_a_bf16_engine_gives_float32_logits_close_to_the_float32_engine(smol_dir):
    """The output projection of a bf16 engine runs in float32: logits are not rounded to bf16 steps
    (ties of the next token would then be broken by rounding), and stay close to the fp32 engine's."""
    ids = list(range(1000, 1300))
    got = Engine.from_dir(smol_dir, "bfloat16")
    want = Engine.from_dir(smol_dir, "float32")
    a = got.forward(got.new_cache(len(ids)), ids)
    b = want.forward(want.new_cache(len(ids)), ids)
    assert a.dtype == torch.float32
    assert (a - a.bfloat16().float()).abs().max() > 0  # finer than bf16 steps
    p, q = b.log_softmax(-1), a.log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 0.02 and int(a.argmax()) == int(b.argmax())
