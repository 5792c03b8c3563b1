"""Write tests/fixtures/smollm2_hf_greedy.json: Hugging Face transformers' greedy continuation of the real-model
test's two chat prompts, from its own GGUF reader and dequantization (fp32), with the top logits of every step.

Loading the GGUF in transformers takes ~35 s of a 2-core machine, a twentieth of the 10-minute test command, so
``tests/test_model.py`` compares against this file (as it does for the tokenizer: ``model_tokenizer_fixture.py``);
``WORKBENCH_HF_LIVE=1`` makes the test run transformers itself instead. Rerun after a change to the prompts, the
weights or transformers:

    .venv/bin/python scripts/model_hf_fixture.py
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain why the sky is blue, in detail."]
NEW_TOKENS = 16
TOP = 64  # logits kept per step: the head of the distribution, where greedy decoding and sampling look


def hf_greedy(prompt_ids: list[list[int]], new_tokens: int) -> list[tuple]:
    """transformers' ``LlamaForCausalLM`` on the package's GGUF: each prompt's greedy tokens and logits [steps, V]."""
    import torch
    from transformers import LlamaForCausalLM

    from workbench.model.gguf_weights import find_gguf

    p = find_gguf()
    m = LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    m.generation_config.eos_token_id = None  # N tokens whatever the text says (our runner does not stop either)
    m.generation_config.pad_token_id = 2
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            # the mask must be given: pad id 2 is also <|im_end|>, which transformers would otherwise mask out
            g = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
            out.append((g.sequences[0, len(ids):].tolist(), torch.stack(g.logits)[:, 0].float()))
    return out


def main() -> None:
    import torch
    import transformers

    from workbench.model import load_smollm2

    torch.set_num_threads(1)
    _, tok = load_smollm2()
    ids = [tok.chat(p) for p in PROMPTS]
    cases = []
    for prompt, prompt_ids, (tokens, logits) in zip(PROMPTS, ids, hf_greedy(ids, NEW_TOKENS), strict=True):
        top = logits.topk(TOP, dim=-1)
        cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "tokens": tokens, "top_ids": top.indices.tolist(),
                      "top_logits": [[round(v, 6) for v in r] for r in top.values.tolist()]})
    out = {"source": f"transformers {transformers.__version__} LlamaForCausalLM.from_pretrained(gguf_file=...), fp32, "
                     f"greedy generate of {NEW_TOKENS} tokens; the top {TOP} logits of every step",
           "new_tokens": NEW_TOKENS, "cases": cases}
    dst = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_hf_greedy.json"
    dst.write_text(json.dumps(out) + "\n", encoding="utf-8")
    print(f"wrote {dst} ({len(cases)} prompts x {NEW_TOKENS} steps)")


if __name__ == "__main__":
    main()
