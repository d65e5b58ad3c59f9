"""No code runs on load: nq never unpickles, evaluates or imports anything a checkpoint brings.

Weights come from safetensors (our reader: a JSON header and raw bytes) and .nanoqwen files,
configs from JSON, the tokenizer from tokenizer.json (the Rust `tokenizers` library, data
only), the chat template through Jinja's immutable sandbox.  This holds the source to it:
no pickle, torch.load, eval/exec or trust_remote_code anywhere in nq/, and a download that
fetches data file patterns only.
"""
import fnmatch
import io
import re
import tokenize
from pathlib import Path

import pytest

import nq
from nq.loader import hf

ROOT = Path(nq.__file__).parent
# what would run code from a file: unpickling (pickle, torch.load, numpy's allow_pickle,
# joblib, dill...), builtin eval/exec/compile on text, yaml's full loader, remote code
FORBIDDEN = [r"\bpickle\b", r"\bcPickle\b", r"\bdill\b", r"\bcloudpickle\b", r"\bjoblib\b",
             r"\bshelve\b", r"\bmarshal\b", r"torch\.load\b", r"allow_pickle", r"\bnp\.load\(",
             r"(?<![\w.])eval\(", r"(?<![\w.])exec\(", r"(?<![\w.])compile\(",
             r"(?<![\w.])__import__\(", r"yaml\.(unsafe_)?load\(", r"trust_remote_code",
             r"from_pretrained\("]


def _code_only(path: Path) -> str:
    """The file's tokens without comments and strings (a docstring may say "no pickle")."""
    text = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}  # 3.12
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in text:
            out.append(tok.string)
    return " ".join(out)


def test_no_code_execution_in_nq_source():
    hits = []
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 50
    for f in files:
        code = _code_only(f)
        for pat in FORBIDDEN:
            for m in re.finditer(pat, code):
                hits.append(f"{f.relative_to(ROOT.parent)}: {m.group(0)}")
    # nq verify builds the transformers reference from a config and our own weights, never
    # with from_pretrained (which could fetch and run remote code)
    assert hits == [], hits


def test_download_fetches_data_patterns_only(monkeypatch, tmp_path):
    import huggingface_hub
    calls = []

    def fake_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert hf.resolve_snapshot("SomeOrg/Some-Model", progress=False) == tmp_path
    (repo, kw), = calls
    assert repo == "SomeOrg/Some-Model"
    assert kw["allow_patterns"] == hf.ALLOW_PATTERNS
    assert set(kw) <= {"revision", "cache_dir", "allow_patterns", "local_files_only"}
    code = ["modeling_qwen2.py", "tokenization_qwen.py", "tokenizer.py", "configuration.py",
            "pytorch_model.bin", "model.pt", "model.pth", "model.ckpt", "training_args.bin",
            "optimizer.pt", "rng_state.pth", "x.pkl", "x.pickle", "x.npy", "x.npz", "x.h5",
            "x.msgpack", "x.gguf", "x.so", "setup.sh", "tokenizer.model", "model.onnx"]
    for name in code:
        assert not any(fnmatch.fnmatch(name, p) for p in hf.ALLOW_PATTERNS), name
    needed = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "model.safetensors", "model-00001-of-00004.safetensors",
              "model.safetensors.index.json"]
    for name in needed:
        assert any(fnmatch.fnmatch(name, p) for p in hf.ALLOW_PATTERNS), name


def test_chat_template_is_sandboxed():
    """A chat template is the one piece of checkpoint text that is interpreted: Jinja's
    sandbox refuses the attribute walk that reaches Python's internals."""
    import jinja2.sandbox
    from nq.text import compile_chat_template
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.sandbox.SecurityError):
        compile_chat_template(evil).render(messages=[])
    with pytest.raises(jinja2.sandbox.SecurityError):
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])
