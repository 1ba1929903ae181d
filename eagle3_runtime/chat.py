"""The bundle's chat template, rendered with jinja2 the way transformers' apply_chat_template does
(sandboxed environment, trim_blocks/lstrip_blocks, add_generation_prompt, bos/eos tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        self.template = env.from_string(source)
        self.special = special

    @classmethod
    def from_bundle(cls, root: Path) -> "ChatTemplate | None":
        tok_dir = Path(root) / "tokenizer"
        cfg_path = tok_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: use "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_file = tok_dir / "chat_template.jinja"
        if source is None and jinja_file.exists():
            source = jinja_file.read_text()
        if not source:
            return None
        special = {k: v if isinstance(v, str) else (v or {}).get("content", "")
                   for k, v in cfg.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
