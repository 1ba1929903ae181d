"""The prompts verify runs: the built-in set, prompt files, encoding, and admission by the engine's rule."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eagle3_runtime.chat import ChatTemplate
from eagle3_runtime.engine import RequestError, check_request
from eagle3_runtime.tokenizer import BundleTokenizer

from ..errors import VerifyError

# A fixed, varied prompt set: prose, instructions, questions, code, lists, numbers. The first few are
# the most varied, since verify takes the first num_prompts. Short enough for a 64-token prefill bucket.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "The weather this morning was",
    "Here is a list of three fruits:",
    "import numpy as np\n\nx =",
    "Translate to French: Good morning, how are you?",
    "Compilers turn programs into",
    "The meeting is scheduled for",
    "Give me three tips for learning a new language.",
    "She opened the door and",
    "for i in range(10):\n    print(",
    "Summarize the plot of Romeo and Juliet.",
    "The best way to cook rice is",
    "Q: What is 12 times 7?\nA:",
    "A recipe for pancakes:",
    "In the year 2050, cities will",
    "Why do cats purr?",
    "The history of the printing press",
    "SELECT name, age FROM users WHERE",
    "Dear team, I am writing to",
    "How does a rainbow form?",
    "The three primary colors are",
    "My favourite book is",
    "List the planets of the solar system.",
    "Speculative decoding lets a small draft model",
    "The train left the station at",
    "Describe a cat to someone who has never seen one.",
)


def short(s: str, n: int = 40) -> str:
    """A prompt as one line of at most `n` characters, for messages and tables."""
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 1] + "…"


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings (.json), one JSON string or {"prompt": ...} per line
    (.jsonl), or one prompt per non-empty line (anything else; ``\\n`` stays literal)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise VerifyError(f"--prompts {path}: cannot read it ({e.__class__.__name__}: {e})") from e
    prompts: list[str] = []
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise VerifyError(f"--prompts {path}: invalid JSON ({e})") from e
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise VerifyError(f"--prompts {path}: a .json prompt file must hold a list of strings")
        prompts = list(data)
    elif path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                x = json.loads(line)
            except json.JSONDecodeError as e:
                raise VerifyError(f"--prompts {path}:{i}: invalid JSON ({e})") from e
            if isinstance(x, dict):
                x = x.get("prompt")
            if not isinstance(x, str):
                raise VerifyError(f"--prompts {path}:{i}: expected a string or an object with a \"prompt\" string")
            prompts.append(x)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise VerifyError(f"--prompts {path}: no prompts in the file")
    return prompts


def select_prompts(prompts: Sequence[str] | str | Path | None, num_prompts: int) -> list[str]:
    """The first `num_prompts` of a list, a prompt file (``load_prompts``) or, for None, ``BUILTIN_PROMPTS``."""
    if prompts is None:
        texts, source = list(BUILTIN_PROMPTS), "built-in prompts"
    elif isinstance(prompts, (str, Path)):
        texts, source = load_prompts(prompts), str(prompts)
    else:
        texts, source = [str(p) for p in prompts], "given prompts"
        if not texts:
            raise VerifyError("no prompts given")
    if num_prompts > len(texts):
        raise VerifyError(f"num_prompts {num_prompts}: the {source} hold only {len(texts)}; pass a --prompts file "
                          "with more, or ask for fewer")
    return texts[:num_prompts]


def encode_prompts(texts: list[str], root: Path, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt with the bundle's tokenizer; ``chat`` wraps each as one user message in the
    bundle's chat template."""
    try:
        tok = BundleTokenizer(root)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise VerifyError(f"{root}: cannot read tokenizer/tokenizer.json ({e}); the bundle is incomplete") from e
    if not chat:
        return [tok.encode(t) for t in texts]
    template = ChatTemplate.from_bundle(root)
    if template is None:
        raise VerifyError(f"{root}: --chat needs a chat template and the bundle's tokenizer has none")
    with template:
        return [tok.encode(template.render([{"role": "user", "content": t}]), add_special_tokens=False)
                for t in texts]


def admit_prompts(manifest, texts: list[str], encoded: list[list[int]]) -> None:
    """Refuse the first prompt the runtime would refuse, by the engine's own admission rule."""
    largest, max_len = manifest.longest_prompt(), manifest.max_model_len
    for i, ids in enumerate(encoded):
        try:
            check_request(len(ids), 1, largest, max_len)
        except RequestError as e:
            raise VerifyError(f"prompt {i} ({short(texts[i])!r}) has {len(ids)} tokens; this bundle takes 1 to "
                              f"{largest} ({e})") from e
