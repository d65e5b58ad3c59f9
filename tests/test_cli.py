"""The `nq` command end to end on the NumPy backend: pack, info, generate (plain, chat, FIM).

Greedy ids from `nq generate --json` must equal a greedy loop written here directly over the
reference model, so the CLI's plumbing (prompt building, stop ids, JSON) is what is tested.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nq.cli import main
from nq.loader.format import NanoqwenFile
from nq.loader.weights import load_host_weights
from nq.ref import RefModel
from nq.text import Tokenizer


def run_json(capsys, *argv) -> dict:
    assert main(["generate", "--backend", "numpy", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def greedy_reference(nf, prompt_ids, n, stop=()):
    model = RefModel(nf.config, load_host_weights(nf))
    logits = model.forward(np.array(prompt_ids))[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        if t in stop:
            break
        logits = model.forward(np.array([t]))[-1]
    return out


def test_pack_and_info_verify(tmp_path, tiny_snapshot, capsys):
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(tiny_snapshot), str(out)]) == 0
    assert out.exists() and not list(tmp_path.glob("*.tmp*"))
    capsys.readouterr()
    assert main(["info", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "NANOQWEN" in text or "nanoqwen" in text.lower()
    assert "layers.0.q_proj.qweight" in text
    assert "verify: every payload checksum" in text


def test_generate_greedy_matches_reference(tiny_nanoqwen, capsys):
    # --repeat-penalty 1: generation_config.json sets repetition_penalty, which applies by default.
    res = run_json(capsys, "-m", str(tiny_nanoqwen), "-p", "def fibonacci(n):", "-n", "12",
                   "--temp", "0", "--repeat-penalty", "1", "--ignore-eos")
    nf = NanoqwenFile(tiny_nanoqwen)
    tok = Tokenizer.from_nanoqwen(nf)
    assert res["prompt_ids"] == tok.encode("def fibonacci(n):")
    assert res["ids"] == greedy_reference(nf, res["prompt_ids"], 12)
    assert res["text"] == tok.decode(res["ids"])
    assert res["stats"]["generated_tokens"] == 12
    assert res["stats"]["prompt_tokens"] == len(res["prompt_ids"])


def test_generate_chat_and_fim_prompts(tiny_nanoqwen, capsys):
    nf = NanoqwenFile(tiny_nanoqwen)
    tok = Tokenizer.from_nanoqwen(nf)
    res = run_json(capsys, "-m", str(tiny_nanoqwen), "--system", "Be brief.", "-p", "Hello",
                   "-n", "3", "--temp", "0")
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello"}])
    assert res["prompt_ids"] == tok.encode(want)
    assert want.endswith("<|im_start|>assistant\n")

    res = run_json(capsys, "-m", str(tiny_nanoqwen), "--fim-prefix", "def f(x):\n    return ",
                   "--fim-suffix", "\n", "-n", "3", "--temp", "0")
    assert res["prompt_ids"] == tok.encode("<|fim_prefix|>def f(x):\n    return "
                                           "<|fim_suffix|>\n<|fim_middle|>")


def test_generate_stops_on_eos(tiny_nanoqwen, capsys, monkeypatch):
    """Stop ids come from generation_config.json; make the first greedy token one of them."""
    nf = NanoqwenFile(tiny_nanoqwen)
    tok = Tokenizer.from_nanoqwen(nf)
    prompt = tok.encode("Hello, world!")
    first = greedy_reference(nf, prompt, 1)[0]
    monkeypatch.setattr(Tokenizer, "eos_ids", property(lambda self: (first,)))
    res = run_json(capsys, "-m", str(tiny_nanoqwen), "-p", "Hello, world!", "-n", "8", "--temp", "0",
                   "--repeat-penalty", "1")
    assert res["ids"] == [first]
    assert res["stats"]["stop_reason"] == "eos"
    assert res["text"] == ""


def test_generate_seeded_sampling_is_reproducible(tiny_nanoqwen, capsys):
    args = ["-m", str(tiny_nanoqwen), "-p", "Hello", "-n", "6", "--temp", "1.5", "--top-k", "50",
            "--ignore-eos"]
    a = run_json(capsys, *args, "--seed", "3")
    b = run_json(capsys, *args, "--seed", "3")
    assert a["ids"] == b["ids"] and len(a["ids"]) == 6


def test_generate_text_to_stdout_stats_to_stderr(tiny_nanoqwen):
    r = subprocess.run([sys.executable, "-m", "nq", "generate", "--backend", "numpy", "-m",
                        str(tiny_nanoqwen), "-p", "Hello", "-n", "4", "--temp", "0",
                        "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "TTFT" in r.stderr
    assert "tok/s" not in r.stdout


@pytest.mark.parametrize("argv, message", [
    (["-m", "missing.nanoqwen", "-p", "x"], "pack one with `nq pack"),
    (["-p", "x", "-n", "10", "-c", "4"], "exceeds the context"),
    ([], "no prompt"),
])
def test_generate_refusals(tiny_nanoqwen, capsys, monkeypatch, argv, message):
    if "-m" not in argv:
        argv = ["-m", str(tiny_nanoqwen), *argv]
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    assert main(["generate", "--backend", "numpy", *argv]) == 2
    assert message in capsys.readouterr().err


def test_info_refuses_a_damaged_file(tmp_path, tiny_nanoqwen, capsys):
    bad = tmp_path / "bad.nanoqwen"
    data = bytearray(tiny_nanoqwen.read_bytes())
    data[:8] = b"NOTQWEN!"
    bad.write_bytes(bytes(data))
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.nanoqwen" in err and "nq pack" in err


def test_gpu_backend_without_a_gpu_says_what_to_do(tiny_nanoqwen, capsys):
    from numba import cuda
    if cuda.is_available():
        pytest.skip("a GPU is present: tests/test_engine_gpu.py covers the GPU backend")
    assert main(["generate", "-m", str(tiny_nanoqwen), "-p", "x", "-n", "2"]) == 2
    assert "--backend numpy" in capsys.readouterr().err


def test_pack_refuses_to_overwrite_without_force(tmp_path, tiny_snapshot, capsys):
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"a file the user had")
    assert main(["pack", str(tiny_snapshot), str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"a file the user had"
    assert main(["pack", str(tiny_snapshot), str(out), "--force"]) == 0
    assert out.read_bytes()[:8] == b"NANOQWEN"


def test_pack_embeds_chat_template_jinja(tmp_path, tiny_snapshot):
    import shutil
    snap = tmp_path / "snap"
    shutil.copytree(tiny_snapshot, snap)
    (snap / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(snap), str(out)]) == 0
    tok = Tokenizer.from_nanoqwen(NanoqwenFile(out))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=False) == "[hi]"


def _args(**kw):
    import argparse
    base = dict(temp=None, top_k=None, top_p=None, min_p=None, repeat_penalty=None, seed=-1)
    base.update(kw)
    return argparse.Namespace(**base)


QWEN_GEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.05}


def test_sampling_defaults_follow_generation_config_and_temp0_is_plain_greedy():
    from nq.cli import sampling_params
    p = sampling_params(_args(), QWEN_GEN)
    assert (p.temperature, p.top_k, p.top_p, p.repeat_penalty) == (0.7, 20, 0.8, 1.05)
    assert p.repeat_last_n == -1 and p.seed is None  # transformers' penalty span; random seed
    g = sampling_params(_args(temp=0.0, seed=4), QWEN_GEN)
    assert g.temperature == 0 and g.repeat_penalty == 1.0 and g.seed == 4  # the device path
    e = sampling_params(_args(temp=0.0, repeat_penalty=1.1), QWEN_GEN)
    assert e.repeat_penalty == 1.1 and e.repeat_last_n == 64  # an explicit flag: llama.cpp's
    assert sampling_params(_args(), {}).temperature == 0.0  # no do_sample: greedy


def test_n_minus_one_generates_until_the_context_is_full(tiny_nanoqwen, capsys):
    res = run_json(capsys, "-m", str(tiny_nanoqwen), "-p", "Hello", "-n", "-1", "-c", "12",
                   "--temp", "0", "--ignore-eos")
    assert len(res["prompt_ids"]) + len(res["ids"]) == 12


def test_a_repo_id_packed_before_needs_no_hub(tmp_path, monkeypatch, tiny_nanoqwen):
    import shutil

    from nq import cli
    monkeypatch.setenv("NQ_CACHE", str(tmp_path))
    key = "Org--Model"
    shutil.copy(tiny_nanoqwen, tmp_path / f"{key}--{'a' * 40}.nanoqwen")
    monkeypatch.setattr("nq.loader.hf.resolve_snapshot",
                        lambda *a, **k: pytest.fail("the hub was asked for a packed model"))
    assert cli.resolve_model("Org/Model") == tmp_path / f"{key}--{'a' * 40}.nanoqwen"
    assert cli.resolve_model("Org/Model", "a" * 40).name.endswith("a" * 40 + ".nanoqwen")


def test_a_cached_fp16_pack_is_repacked_once_with_the_default_head(tmp_path, monkeypatch,
                                                                     tiny_snapshot, capsys):
    """A pack the cache holds from when fp16 was the default head gets today's int4+fp16 head
    once, in place, from its own rows (byte for byte `nq pack FILE OUT`'s); the next start
    finds nothing to do; NQ_KEEP_CACHED_HEAD=1 or a failure keeps the file as it is."""
    from nq import cli
    from nq.loader.format import NanoqwenFile
    from nq.loader.hf import LoadError, pack
    from nq.loader.repack import repack
    monkeypatch.setenv("NQ_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / f"Org--Model--{'b' * 40}.nanoqwen"
    old = pack(tiny_snapshot, tmp_path / "old.nanoqwen", progress=False, lm_head="fp16")
    want = repack(old, tmp_path / "want.nanoqwen", progress=False)
    monkeypatch.setattr("nq.loader.hf.resolve_snapshot",
                        lambda *a, **k: pytest.fail("the hub was asked for a packed model"))
    cached.parent.mkdir()
    import shutil
    shutil.copy(old, cached)
    monkeypatch.setenv("NQ_KEEP_CACHED_HEAD", "1")
    assert cli.resolve_model("Org/Model") == cached
    assert NanoqwenFile(cached).lm_head == "fp16" and "re-packing" not in capsys.readouterr().err
    monkeypatch.delenv("NQ_KEEP_CACHED_HEAD")
    real = repack
    monkeypatch.setattr("nq.loader.repack.repack", lambda *a, **k: (_ for _ in ()).throw(
        LoadError("the packed model needs 1 GiB; free some space")))
    assert cli.resolve_model("Org/Model") == cached
    err = capsys.readouterr().err
    assert "kept" in err and "with its fp16 lm_head: the packed model needs" in err
    assert NanoqwenFile(cached).lm_head == "fp16"
    monkeypatch.setattr("nq.loader.repack.repack", real)
    assert cli.resolve_model("Org/Model") == cached
    assert "re-packing" in capsys.readouterr().err
    got, ref = NanoqwenFile(cached, verify=True), NanoqwenFile(want)
    assert got.lm_head == "int4+fp16" and sorted(got.names()) == sorted(ref.names())
    for name in ref.names():
        assert np.array_equal(got.array(name), ref.array(name)), name
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]   # no tmp left
    assert cli.resolve_model("Org/Model") == cached
    assert "re-packing" not in capsys.readouterr().err


def test_a_prompt_that_fills_the_context_is_refused(tiny_nanoqwen, capsys):
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p",
                 "Hello, world! " * 10, "-n", "-1", "-c", "8"]) == 2
    assert "tokens, the context -c is 8: no room to generate" in capsys.readouterr().err


def test_generate_verbose_reports_the_start_and_the_run(tiny_nanoqwen, capsys):
    import time
    t = time.perf_counter()
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p", "def f(x):",
                 "-n", "5", "--temp", "0", "--ignore-eos", "--verbose"]) == 0
    wall = time.perf_counter() - t
    err = capsys.readouterr().err
    for part in ("process start (python, nq.cli import):", "file open:", "tokenizer:",
                 "first token:", "sum of the parts:", "process start to the first token:",
                 "prompt eval count:", "time to first token:", "eval count:", "eval rate:",
                 "ITL p50 / p90:"):
        assert part in err, f"--verbose lacks {part!r}:\n{err}"
    # the parts after the process's age are laps of this call: they add up to its wall time
    lines = err.split("process start (python, nq.cli import):")[1].split("sum of the parts:")[0]
    laps = [float(line.rsplit(":", 1)[1].split()[0]) / 1e3
            for line in lines.strip().splitlines()[1:]]
    assert len(laps) >= 6 and 0.9 * wall - 0.02 <= sum(laps) <= wall, (laps, wall)
    assert "eval count:           5 token(s) (length)" in err
    p50, p90 = (float(v) for v in err.split("ITL p50 / p90:")[1].split("ms")[0].split("/"))
    assert 0 < p50 <= p90


@pytest.mark.parametrize("argv, message", [
    (["generate", "-p", "x", "--top-p", "2"], "outside (0, 1]"),
    (["generate", "-p", "x", "--top-k", "-3"], "outside [0, inf]"),
    (["generate", "-p", "x", "--min-p", "1.5"], "outside [0, 1]"),
    (["generate", "-p", "x", "--repeat-penalty", "0"], "outside (0, inf]"),
    (["generate", "-p", "x", "--temp", "-1"], "outside [0, inf]"),
    (["generate", "-p", "x", "--bogus"], "usage: nq generate"),
    (["chat", "--bogus"], "usage: nq chat"),
])
def test_flags_out_of_range_are_refused_by_their_subcommand(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["-p", "x", "-n", "-5"], "-n -5"),
    (["-p", "x", "-c", "-3"], "-c -3"),
    (["-p", "x", "-f", "other.txt"], "not both"),
    (["--fim-prefix", "a", "-p", "x"], "drop -p"),
    (["--fim-prefix", "a", "--chat"], "drop -p"),
])
def test_generate_refuses_contradictory_input(tiny_nanoqwen, capsys, argv, message):
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-5"])
def test_chat_refuses_meaningless_n(tiny_nanoqwen, capsys, n):
    assert main(["chat", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-n", n]) == 2
    assert f"-n {n}" in capsys.readouterr().err


def test_prompt_from_stdin_with_dash_and_the_seed_is_shown(tiny_nanoqwen):
    r = subprocess.run([sys.executable, "-m", "nq", "generate", "--backend", "numpy", "-m",
                        str(tiny_nanoqwen), "-f", "-", "-n", "3", "--temp", "0.8", "--json"],
                       input="def f(x):", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    seed = out["stats"]["seed"]
    assert f"nq: seed {seed}" in r.stderr and out["prompt_ids"]
    again = subprocess.run([sys.executable, "-m", "nq", "generate", "--backend", "numpy", "-m",
                            str(tiny_nanoqwen), "-p", "def f(x):", "-n", "3", "--temp", "0.8",
                            "--json", "--seed", str(seed)], capture_output=True, text=True,
                           timeout=120)
    assert json.loads(again.stdout)["ids"] == out["ids"]   # the printed seed repeats the run


def test_context_above_the_trained_length_warns(tiny_nanoqwen, capsys):
    from nq.loader.format import NanoqwenFile
    trained = NanoqwenFile(tiny_nanoqwen).config.max_position_embeddings
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p", "x", "-n", "1",
                 "-c", str(trained + 16)]) == 0
    assert "beyond the" in capsys.readouterr().err


def test_version_and_help_show_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("nq ")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "(default: 128)" in text and "--backend" in text and "numpy: the reference" in text
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "(default: 100)" in capsys.readouterr().out


def test_stop_strings_split_across_pieces():
    from nq.generate import StopStrings
    s = StopStrings(["END", "\n\n"])
    got = [s.feed(p) for p in ["abc E", "N", "x E", "ND tail"]]
    # "E" and "EN" are held back until they cannot start "END"; the stop string is not shown
    assert got == [("abc ", False), ("", False), ("ENx ", False), ("", True)]
    assert s.flush() == "" and s.feed("more") == ("", True)
    s = StopStrings(["\n\n"])
    assert s.feed("a\n") == ("a", False) and s.flush() == "\n"
    assert StopStrings([]).feed("x") == ("x", False)


def test_generate_stop_string_cuts_the_reply(tiny_nanoqwen, capsys):
    base = run_json(capsys, "-m", str(tiny_nanoqwen), "-p", "def f(x):", "-n", "24", "--temp", "0",
                    "--ignore-eos")
    text = base["text"]
    stop = text[7:10]                       # three characters from inside the greedy reply
    assert len(stop) == 3
    res = run_json(capsys, "-m", str(tiny_nanoqwen), "-p", "def f(x):", "-n", "24", "--temp", "0",
                   "--ignore-eos", "--stop", stop, "--stop", "never appears")
    assert res["text"] == text[:text.find(stop)] and stop not in res["text"]
    assert res["stats"]["stop_reason"] == "stop" and len(res["ids"]) < len(base["ids"])


def test_generate_says_what_ended_the_reply(tiny_nanoqwen, capsys):
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p", "x", "-n", "3",
                 "--temp", "0", "--ignore-eos"]) == 0
    assert "ended by -n 3 reached" in capsys.readouterr().err
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p", "x", "-n", "-1",
                 "-c", "12", "--temp", "0", "--ignore-eos"]) == 0
    assert "ended by the context (-c 12) is full" in capsys.readouterr().err


def test_fp32_accurate_is_accepted_and_changes_nothing():
    """--fp32-accurate (NQ_MMA_QKV=1 once, retired) is still accepted by every subcommand that
    runs the engine, so old command lines run; it sets no switch and says on stderr that the
    default step is already fp32-accurate."""
    script = (
        "import os, sys\n"
        "from nq import cli\n"
        "from nq.cli_args import apply_precision\n"
        "p = cli.build_parser()\n"
        "for cmd in (['generate'], ['chat'], ['serve'], ['bench', '--random', '7b'], ['verify']):\n"
        "    a, _ = p.parse_known_args(cmd + ['--fp32-accurate'])\n"
        "    assert a.fp32_accurate, cmd\n"
        "    b, _ = p.parse_known_args(cmd)\n"
        "    assert not b.fp32_accurate, cmd\n"
        "env = dict(os.environ)\n"
        "apply_precision(b)\n"
        "print('--', file=sys.stderr)\n"
        "apply_precision(a)\n"
        "assert dict(os.environ) == env\n")
    env = {k: v for k, v in os.environ.items() if k != "NQ_MMA_QKV"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, check=True)
    quiet, said = out.stderr.split("--\n")
    assert quiet == "" and said.count("\n") == 1, out.stderr
    assert "already fp32-accurate" in said and "old command lines" in said, said
    for cmd in ("generate", "bench"):
        h = subprocess.run([sys.executable, "-m", "nq", cmd, "--help"], capture_output=True,
                           text=True, env=env, check=True).stdout
        assert "alreadyfp32-accurate" in "".join(h.split()), cmd   # however it wraps
