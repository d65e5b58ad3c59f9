"""The references `nq verify`'s prefill, decode and graph tiers compare the engine against:
transformers' Qwen2ForCausalLM in fp32 with the file's dequantised weights (batched on the GPU
when torch is importable: the fast path for a 7B), or nq.ref's NumPy engine.  Each gives the
last position's logits of a prompt, every position's logits of one sequence, and greedy runs
with the top-2 gap and the spread at every step (what the graph tier's near-tie rule reads)."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np


@dataclasses.dataclass
class Greedy:
    """One prompt's reference greedy run: ids, and per step the top-2 gap and the spread."""
    ids: list
    gaps: list
    spreads: list


def top2(logits: np.ndarray) -> tuple[int, float, float]:
    order = np.argsort(logits)[::-1][:2]
    return int(order[0]), float(logits[order[0]] - logits[order[1]]), float(logits.max() - logits.min())


class NumpyReference:
    """nq.ref, one prompt at a time (small models; a 7B takes hours this way)."""
    name = "numpy"

    def __init__(self, nf):
        from nq.loader.weights import load_host_weights
        from nq.ref import RefModel
        self.model = RefModel(nf.config, load_host_weights(nf))

    def last_logits(self, prompt) -> np.ndarray:
        self.model.reset()
        return np.asarray(self.model.forward(np.asarray(prompt))[-1], np.float64)

    def all_logits(self, ids) -> np.ndarray:
        """(len(ids), vocab) float64: the logits after each position of one forward."""
        self.model.reset()
        return np.asarray(self.model.forward(np.asarray(ids)), np.float64)

    def all_logits_pair(self, ids, band: float) -> tuple[np.ndarray, np.ndarray]:
        """all_logits and its alternatives (nq.ref.rescore_alternatives; band: a fraction of
        each position's spread): what a rescored INT4 head may give at ids on the candidates'
        edge.  Without a rescored head the two are the same."""
        self.model.reset()
        out, alt = self.model.forward(np.asarray(ids), alt_band=band)
        return np.asarray(out, np.float64), np.asarray(alt, np.float64)

    def last_logits_pair(self, prompt, band: float) -> tuple[np.ndarray, np.ndarray]:
        self.model.reset()
        out, alt = self.model.forward(np.asarray(prompt), last_only=True, alt_band=band)
        return np.asarray(out[-1], np.float64), np.asarray(alt[-1], np.float64)

    def greedy(self, prompts, n) -> list[Greedy]:
        out = []
        for prompt in prompts:
            self.model.reset()
            logits = self.model.forward(np.asarray(prompt))[-1]
            g = Greedy([], [], [])
            for _ in range(n):
                tok, gap, spread = top2(logits)
                g.ids.append(tok), g.gaps.append(gap), g.spreads.append(spread)
                logits = self.model.forward(np.array([tok]))[-1]
            out.append(g)
        return out


class TorchReference:
    """transformers' Qwen2ForCausalLM in fp32 with the file's dequantised weights, all prompts
    in one batch (they have equal lengths, so no padding enters the comparison)."""
    name = "transformers"

    def __init__(self, nf, device: str = "cuda"):
        import torch
        import transformers

        from nq.loader.hf import hf_name, host_names
        from nq.loader.quant import row_bounds
        from nq.loader.weights import host_tensor, rescore_rows_of

        cfg = nf.config
        hcfg = transformers.Qwen2Config(**cfg.to_hf())
        hcfg._attn_implementation = "eager"
        self.torch, self.device = torch, device
        with torch.device(device):
            self.model = transformers.Qwen2ForCausalLM(hcfg).to(torch.float32).eval()
        params = dict(self.model.named_parameters())
        for name in host_names(cfg):  # one tensor at a time: host memory stays one tensor
            dst = params[hf_name(name)].data
            if name.endswith("_proj.weight"):  # dequantised where it lands (the host is slow)
                base = name[:-len(".weight")]
                dst.copy_(dequantize_packed_torch(torch, nf.array(base + ".qweight"),
                                                  nf.array(base + ".scales"), device))
            else:
                dst.copy_(torch.from_numpy(host_tensor(nf, name)))
        if nf.lm_head != "fp16" and cfg.tie_word_embeddings:   # its own head, untied
            self.model.lm_head.weight = torch.nn.Parameter(
                torch.from_numpy(host_tensor(nf, "lm_head")).to(device), requires_grad=False)
        # an INT4 head the GPU step rescores: its candidates get the fp16 rows here too, by
        # nq.ref's own rule (rescore_rows), from the file's rows as they are
        self.rescore = None
        rows = rescore_rows_of(nf)
        if rows is not None:
            self.rescore = (nf.array(rows), row_bounds(nf.array("lm_head.scales")))
        import inspect
        fwd = inspect.signature(transformers.Qwen2ForCausalLM.forward).parameters
        self.cache_kw = "cache" if "cache" in fwd else "past_key_values"

    def _rescored(self, out, band=None, last=False):
        """The model output's logits (B, T, V), or (B, 1, V) of the last position, an INT4
        head's candidates rescored by the fp16 rows through nq.ref.rescore_rows itself, a
        position at a time; with band, (logits, alternatives) from nq.ref.rescore_alternatives
        (band: a fraction of each position's spread)."""
        from nq.ref import rescore_alternatives, rescore_rows
        lo = out.logits[:, -1:] if last else out.logits
        lo = lo.float()
        if self.rescore is None:
            return lo if band is None else (lo, lo)
        exact, bound = self.rescore
        h = out.hidden_states[-1]                             # after the final norm
        h = (h[:, -1:] if last else h).float().cpu().numpy()
        res, alt = lo.cpu().numpy(), None
        if band is not None:
            alt = res.copy()
        for i in np.ndindex(res.shape[:2]):                   # (prompt, position)
            if band is None:
                res[i] = rescore_rows(res[i], bound, h[i], exact)[0]
            else:
                spread = float(res[i].max() - res[i].min())
                res[i], alt[i] = rescore_alternatives(res[i], bound, h[i], exact,
                                                      band * spread)
        res = self.torch.from_numpy(res).to(lo.device)
        return res if band is None else (res, self.torch.from_numpy(alt).to(lo.device))

    def _run(self, ids, **kw):
        return self.model(ids, output_hidden_states=self.rescore is not None, **kw)

    def last_logits(self, prompt) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            ids = torch.as_tensor(np.asarray(prompt, np.int64)[None], device=self.device)
            return self._rescored(self._run(ids), last=True)[0, -1].double().cpu().numpy()

    def all_logits(self, ids) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            t = torch.as_tensor(np.asarray(ids, np.int64)[None], device=self.device)
            return self._rescored(self._run(t))[0].double().cpu().numpy()

    def all_logits_pair(self, ids, band: float, last: bool = False):
        """NumpyReference.all_logits_pair's (last: the last position's, (1, V) each)."""
        torch = self.torch
        with torch.no_grad():
            t = torch.as_tensor(np.asarray(ids, np.int64)[None], device=self.device)
            out, alt = self._rescored(self._run(t), band, last=last)
            return out[0].double().cpu().numpy(), alt[0].double().cpu().numpy()

    def last_logits_pair(self, prompt, band: float) -> tuple[np.ndarray, np.ndarray]:
        out, alt = self.all_logits_pair(prompt, band, last=True)
        return out[-1], alt[-1]

    def greedy(self, prompts, n) -> list[Greedy]:
        torch = self.torch
        with torch.no_grad():
            ids = torch.as_tensor(np.asarray(prompts, np.int64), device=self.device)
            out = self._run(ids, use_cache=True)
            logits = self._rescored(out, last=True)[:, -1]
            runs = [Greedy([], [], []) for _ in prompts]
            for _ in range(n):
                top = torch.topk(logits, 2, dim=-1)
                spread = (logits.max(-1).values - logits.min(-1).values).cpu().numpy()
                tok = top.indices[:, 0]
                gap = (top.values[:, 0] - top.values[:, 1]).cpu().numpy()
                for r, t, gp, sp in zip(runs, tok.cpu().numpy(), gap, spread):
                    r.ids.append(int(t)), r.gaps.append(float(gp)), r.spreads.append(float(sp))
                out = self._run(tok[:, None], use_cache=True,
                                **{self.cache_kw: getattr(out, self.cache_kw)})
                logits = self._rescored(out, last=True)[:, -1]
        return runs


def dequantize_packed_torch(torch, packed, scales, device):
    """nq.loader.quant.dequantize_packed in torch on `device`: ValueShuffle uint32 (N, K/8) +
    fp16 scales (N, K/128) -> fp32 (N, K).  On the GPU a 7B dequantises in about a second;
    NumPy on the host took ~100 s of `nq verify`'s 142 s."""
    from nq.loader.quant import SHUFFLE
    with warnings.catch_warnings():   # an mmap'd file's read-only pages: torch only reads them
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        q = torch.from_numpy(np.ascontiguousarray(packed).view(np.int32)).to(device)  # (N, K/8)
    n, k8 = q.shape
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int32)
    nib = (q[:, :, None] >> shifts) & 0xF                 # (N, K/8, 8 slots)
    nib = nib - ((nib & 0x8) << 1)                        # sign-extend 4 bits
    w = torch.empty_like(nib)
    w[:, :, list(SHUFFLE)] = nib                          # slot s holds column SHUFFLE[s]
    sc = torch.from_numpy(np.asarray(scales)).to(device).float()                # (N, K/128)
    return (w.reshape(n, -1, 128).float() * sc[:, :, None]).reshape(n, k8 * 8)


def make_reference(nf, kind: str = "auto"):
    """transformers on the GPU when torch is importable (kind auto/torch), else NumPy."""
    if kind in ("auto", "torch"):
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
            return TorchReference(nf, "cuda" if torch.cuda.is_available() else "cpu")
        except ImportError:
            if kind == "torch":
                raise RuntimeError("--reference torch needs torch and transformers installed") from None
    return NumpyReference(nf)
