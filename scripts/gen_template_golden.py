#!/usr/bin/env python3
"""Renders the real chat templates in testdata/templates/ as Hugging Face's apply_chat_template
renders them (transformers' chat_template_utils: an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and loop controls, its tojson, raise_exception and strftime_now; the
special tokens and `tools` passed as keyword arguments), for a set of conversations with and
without tools, and writes testdata/templates/golden.json (or, given a folder of templates such
as models/llama.cpp/templates, renders every template there into that folder's golden.json). model/tests/chat_template_hf.rs checks
that Duet's minijinja renders every case byte for byte alike (or fails where this raised).

The templates were copied from llama.cpp's models/templates (vendored in the PyPI source
distribution of llama-cpp-python 0.3.36), which holds them as the models publish them.
Needs only jinja2 (`python3 -m pip install jinja2`). strftime_now's dates are recorded (per
format) so the check can put its own in their place."""

import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / "testdata" / "templates"
# Every format strftime_now was called with, and what it gave.
DATES = {}

# The special tokens each family's tokenizer passes to its template.
TOKENS = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("<|begin_of_text|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("", "<|im_end|>"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("<|end_of_text|>", "<|end_of_text|>"),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. \"Paris\""}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}

CASES = [
    {"name": "user", "messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {
        "name": "multi_turn_system",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And <3 & 'quotes'?\n\tTabs é 中文"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "no_generation_prompt",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        "add_generation_prompt": False,
    },
    {"name": "tools", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "add_generation_prompt": True},
    {
        "name": "tools_round_trip",
        "messages": [
            {"role": "system", "content": "You help with weather."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call12345"},
        ],
        "tools": [WEATHER],
        "add_generation_prompt": True,
    },
    {"name": "bad_roles", "messages": [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}], "add_generation_prompt": True},
]


class Raised(jinja2.exceptions.TemplateError):
    """A template's own raise_exception."""


def environment():
    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    def strftime_now(fmt):
        DATES[fmt] = datetime.now().strftime(fmt)
        return DATES[fmt]

    env.globals["strftime_now"] = strftime_now
    return env


def main():
    # With a folder (e.g. models/llama.cpp/templates, scripts/fetch-llama-cpp-src.sh), every
    # template in it, into its golden.json; without, the committed ones.
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DIR
    names = sorted(p.name for p in folder.glob("*.jinja")) if len(sys.argv) > 1 else list(TOKENS)
    env = environment()
    out = {"dates": DATES, "cases": CASES, "templates": []}
    for name in names:
        bos, eos = TOKENS.get(name, ("<s>", "</s>"))
        try:
            template = env.from_string((folder / name).read_text())
        except Exception as e:  # jinja2 cannot compile it either
            out["templates"].append({"file": name, "bos_token": bos, "eos_token": eos, "compile_error": str(e)})
            continue
        results = {}
        for case in CASES:
            try:
                results[case["name"]] = {
                    "text": template.render(
                        messages=case["messages"],
                        tools=case.get("tools"),
                        add_generation_prompt=case["add_generation_prompt"],
                        bos_token=bos,
                        eos_token=eos,
                    )
                }
            except Raised as e:  # raise_exception: Duet must refuse too, with the message
                results[case["name"]] = {"error": str(e)}
            except jinja2.exceptions.TemplateError as e:  # e.g. an undefined attribute: Duet must refuse too
                results[case["name"]] = {"jinja_error": str(e)}
            except Exception as e:  # Python refusing (e.g. iterating None): Duet may refuse or not
                results[case["name"]] = {"python_error": str(e)}
        out["templates"].append({"file": name, "bos_token": bos, "eos_token": eos, "results": results})
    (folder / "golden.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {folder / 'golden.json'}: {len(names)} templates x {len(CASES)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
