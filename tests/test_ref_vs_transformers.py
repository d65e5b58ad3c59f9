"""The oracle: nq.ref against Hugging Face's Qwen2ForCausalLM on the same weights.

transformers runs on CPU torch in fp32 with eager attention, built from `cfg.to_hf()`, so the
config translation is checked too.  The weights go through the pack's rounding first (INT4
projections, fp16 for the rest), so they are ones a .nanoqwen file holds exactly.

Relative error is max|ours - theirs| / max|theirs| over a whole logits block.  Both sides
compute in fp32 with the same formulas and differ only in summation order and libm, which
gives ~1e-6; 1e-4 leaves room for that and still catches any wrong convention (RoPE pairing,
GQA head mapping, a missing bias or norm), each of which moves logits by O(1).
"""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nq.config import tiny_config  # noqa: E402
from nq.loader.hf import hf_name, host_names  # noqa: E402
from nq.loader.weights import fake_quantize  # noqa: E402
from nq.ref import RefModel, random_weights  # noqa: E402

REL_TOL = 1e-4
PROMPT_LEN = 10
DECODE_STEPS = 32

CONFIGS = {
    "d64-gqa2": tiny_config(head_dim=64, num_heads=4, num_kv_heads=2),
    "d128-gqa7": tiny_config(head_dim=128, num_heads=7, num_kv_heads=1),
    "d64-tied": tiny_config(head_dim=64, num_heads=2, num_kv_heads=2, tie=True),
}


def quantized_weights(cfg, seed):
    """Random weights as a .nanoqwen holds them: INT4 projections, fp16 everything else."""
    return fake_quantize(random_weights(cfg, seed))


def hf_state_dict(cfg, w):
    """nq host names -> Qwen2ForCausalLM parameter names (the loader's map, checked here by
    transformers' own load_state_dict)."""
    return {hf_name(n): torch.from_numpy(np.ascontiguousarray(w[n])) for n in host_names(cfg)}


def hf_model(cfg, w):
    hcfg = transformers.Qwen2Config(**cfg.to_hf())
    hcfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(hcfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(cfg, w), strict=False)
    # with tied embeddings lm_head.weight is the embedding itself, so it may be listed missing
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# transformers 5.x renamed the KV-cache argument and output from past_key_values to cache
_CACHE_KW = ("cache" if "cache" in inspect.signature(transformers.Qwen2ForCausalLM.forward).parameters
             else "past_key_values")


def hf_forward(model, ids, kv=None):
    """ids (T,) -> (logits (T, vocab) fp32, the model's KV cache after them)."""
    out = model(torch.as_tensor(np.asarray(ids))[None], use_cache=True, **{_CACHE_KW: kv})
    return out.logits[0].numpy(), getattr(out, _CACHE_KW)


def rel_err(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_decode_match_transformers(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    w = quantized_weights(cfg, seed=11)
    ours = RefModel(cfg, w)
    theirs = hf_model(cfg, w)
    prompt = np.random.default_rng(12).integers(0, cfg.vocab_size, PROMPT_LEN)

    with torch.no_grad():
        hf_logits, kv = hf_forward(theirs, prompt)
        our_logits = ours.forward(prompt)
        assert rel_err(our_logits, hf_logits) < REL_TOL
        # both sides decode from their own KV cache, each feeding back its own greedy token
        ours_tok, hf_tok = int(our_logits[-1].argmax()), int(hf_logits[-1].argmax())
        ours_seq, hf_seq = [], []
        for _ in range(DECODE_STEPS):
            assert ours_tok == hf_tok, (ours_seq, hf_seq)
            ours_seq.append(ours_tok)
            hf_seq.append(hf_tok)
            our_step = ours.forward(np.array([ours_tok]))[0]
            hf_step, kv = hf_forward(theirs, [hf_tok], kv)
            hf_step = hf_step[-1]
            assert rel_err(our_step, hf_step) < REL_TOL
            ours_tok, hf_tok = int(our_step.argmax()), int(hf_step.argmax())
    assert ours.cache.length == PROMPT_LEN + DECODE_STEPS
    # the decoded sequence must not be a single repeated token, or the check says little
    assert len(set(ours_seq)) > 1, ours_seq


def test_hf_config_round_trip_reaches_transformers():
    cfg = CONFIGS["d128-gqa7"]
    hcfg = transformers.Qwen2Config(**cfg.to_hf())
    assert (hcfg.num_attention_heads, hcfg.num_key_value_heads, hcfg.head_dim) == (7, 1, 128)
    theta = getattr(hcfg, "rope_theta", None)
    if theta is None:  # transformers 5 moved it into rope_parameters
        theta = hcfg.rope_parameters["rope_theta"]
    assert theta == cfg.rope_theta
