"""Write tests/fixtures/smollm2_tokens.json: Hugging Face transformers' token ids for mixed texts, from its own
GGUF tokenizer loader (16 s to build, so tests compare against this file; rerun after a tokenizer change).

    .venv/bin/python scripts/model_tokenizer_fixture.py
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = [
    "The capital of France is",
    "  leading spaces, digits 12345 and 3.14159!",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé — “quotes” ½ 日本語 🙂\n\n\ttabs and\r\nwindows lines",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "## Heading\n\n- a list item\n- another one\n\nA paragraph with don't, it's, we'll and URLs like https://x.org/a?b=1.",
]


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    from workbench.model.gguf_weights import find_gguf

    p = find_gguf()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    out = {"source": f"transformers {transformers.__version__} AutoTokenizer.from_pretrained(gguf_file={p.name})",
           "cases": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TEXTS]}
    dst = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_tokens.json"
    dst.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {dst} ({len(TEXTS)} texts)")


if __name__ == "__main__":
    main()
